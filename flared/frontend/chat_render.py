"""Chat-template rendering with message endpoints and the history-rewrite report.

Rendering reproduces Transformers' `apply_chat_template` byte for byte (jinja_env.py). The
prompt is rendered once, marked (marks.py); the caller tokenizes it.

Message endpoints. The end of completed message i is the length of world (i, False) =
render(messages[:i+1]) without a generation prompt, when that text is a prefix of the prompt.
The caller keeps only exact token cuts (no token spans the mark).

History rewrites. For every assistant message j the model once saw world (j-1, True) followed
by its own output, which the template renders as world (j, False). When either is not a prefix
of this prompt, the template rewrote an earlier turn (Qwen3 drops past reasoning): reported with
the first differing character, for the earliest such j.

Cost. Worlds come from worlds.py (window renders, linear) or, when its checks fail for a
template, from full renders of each prefix (quadratic, exact by definition). Both are cached
across requests by a digest chained over the messages (plus tools, template kwargs, and the date
for templates that read the clock), so a conversation's next turn only computes its new worlds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any

from flared.engine.errors import InvalidRequest
from flared.frontend.jinja_env import (
    call_template,
    compile_template,
    cut_at_tag,
    render_template,
    tag_final_message,
)
from flared.frontend.marks import MarkedRender, compile_marked, render_marked
from flared.frontend.worlds import WindowsFailed, WindowWorlds, World, WorldCache

MAX_CACHED_WORLD_CHARS = 16 << 20
MAX_CACHED_PROMPTS = 32


@dataclass(frozen=True)
class Report:
    """Char-level endpoints and rewrite of one prompt (the caller maps them to tokens)."""

    ends: list[int]  # lengths of the worlds (i, False) that are prefixes of the prompt
    rewrite_char: int | None = None
    rewrite_message: int | None = None


class ChatRenderer:
    def __init__(self, chat_template: str, special: dict[str, str]) -> None:
        self._template = compile_template(chat_template)
        self._marked = compile_marked(chat_template)
        self._special = special
        self._reads_clock = "strftime_now" in chat_template
        self.use_windows = self._marked is not None  # off for good once a check fails
        self._worlds = WorldCache(MAX_CACHED_WORLD_CHARS)
        self._prompts: OrderedDict[bytes, MarkedRender] = OrderedDict()
        self._lock = threading.Lock()  # the frontend pool renders from several threads

    def render(
        self, messages: list[Any], tools: Any, gen: bool, cont: bool, kw: Any
    ) -> MarkedRender:
        """The prompt, marked when the template can be; raises InvalidRequest."""
        if cont and gen:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt exclude each other"
            )
        final = ""
        if cont:
            messages, final = tag_final_message(messages)
        context = {**self._special, **kw}  # request kwargs override the special tokens
        args = {"tools": tools or None, "documents": None, "add_generation_prompt": gen}
        if self._marked is None:
            r = MarkedRender(render_template(self._template, messages=messages, **args, **context),
                             None, len(messages))  # fmt: skip
        else:
            r = call_template(render_marked, self._marked, messages, **args, **context)
        return MarkedRender(cut_at_tag(r.text, final), r.starts, r.first_marked) if cont else r

    def chain(self, messages: list[Any], tools: Any, kw: Any) -> list[bytes]:
        """keys[i]: digest of (tools, kwargs, date if read, messages[:i]), chained."""
        seed = json.dumps([tools, kw], sort_keys=True, ensure_ascii=False, default=repr)
        if self._reads_clock:
            seed += date.today().isoformat()
        h = hashlib.blake2b(seed.encode(), digest_size=16).digest()
        keys = [h]
        for m in messages:
            body = json.dumps(m, sort_keys=True, ensure_ascii=False, default=repr).encode()
            h = hashlib.blake2b(h + body, digest_size=16).digest()
            keys.append(h)
        return keys

    def prompt(self, messages: list[Any], tools: Any, gen: bool, cont: bool, kw: Any,
               key: bytes) -> MarkedRender:  # fmt: skip
        k = key + bytes([gen, cont])
        with self._lock:
            hit = self._prompts.get(k)
            if hit is not None:
                self._prompts.move_to_end(k)
                return hit
        r = self.render(messages, tools, gen, cont, kw)
        with self._lock:
            self._prompts[k] = r
            while len(self._prompts) > MAX_CACHED_PROMPTS:
                self._prompts.popitem(last=False)
        return r

    def report(self, messages: list[Any], tools: Any, kw: Any, keys: list[bytes],
               full: MarkedRender, flags: tuple[bool, bool]) -> Report:  # fmt: skip
        """Endpoints and rewrite of the prompt `full` (rendered with flags = (gen, cont))."""

        def direct(k: int, gen: bool) -> World | None:
            try:
                t = self.render(messages[: k + 1], tools, gen, False, kw).text
            except InvalidRequest:
                return None  # a template may refuse a partial conversation; it marks nothing
            return World(t, len(t), "")

        windows: WindowWorlds | None = None
        if self.use_windows:
            with contextlib.suppress(WindowsFailed):
                windows = WindowWorlds(messages, full, self._window_render(tools, kw), *flags)
        try:
            return self._report(messages, keys, full.text, flags[1], direct, windows)
        except WindowsFailed:
            self.use_windows = False
            return self._report(messages, keys, full.text, flags[1], direct, None)

    def _window_render(
        self, tools: Any, kw: Any
    ) -> Callable[[list[Any], bool, bool], MarkedRender]:
        return lambda msgs, gen, cont: self.render(msgs, tools, gen, cont, kw)

    def _report(self, messages: list[Any], keys: list[bytes], text: str, cont: bool,
                direct: Callable[[int, bool], World | None],
                windows: WindowWorlds | None) -> Report:  # fmt: skip
        fresh: dict[bytes, World | None] = {}

        def world(k: int, gen: bool) -> World | None:
            key = keys[k + 1] + (b"g" if gen else b"c")
            with self._lock:
                hit, w = self._worlds.get(key)
            if hit:
                return w
            if key not in fresh:
                w = windows.world(k, gen) if windows is not None else None
                fresh[key] = w if w is not None else direct(k, gen)
            return fresh[key]

        memo: dict[int, int] = {}  # common prefix lengths with `text` of shared parents
        ends: list[int] = []
        rewrite_char: int | None = None
        rewrite_msg: int | None = None
        for i in range(len(messages) - (1 if cont else 0)):
            w = world(i, False)
            stable = w is not None and w.is_prefix_of(text, memo)
            if w is not None and stable:
                ends.append(w.length)
            if messages[i].get("role") != "assistant" or rewrite_msg is not None:
                continue
            before = world(i - 1, True) if i else None
            for seen in (before, None if stable else w):
                if seen is not None and not seen.is_prefix_of(text, memo):
                    at = seen.agreement(text, memo)
                    rewrite_char = at if rewrite_char is None else min(rewrite_char, at)
                    rewrite_msg = i
        spot = windows.spot_index() if windows is not None else None
        # a conversation seen before had its spot world checked then (its turn start is cached)
        if (
            windows is not None
            and spot is not None
            and keys[windows.turn_start(spot) + 1] + b"c" in fresh
        ):
            derived, real = fresh[keys[spot + 1] + b"c"], direct(spot, False)
            if derived is None or real is None or derived.text() != real.text():
                raise WindowsFailed(f"the window world {spot} differs from its full render")
        with self._lock:
            for key, w in fresh.items():
                self._worlds.put(key, w)
        return Report(ends, rewrite_char, rewrite_msg)
