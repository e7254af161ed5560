"""Tokenizer, chat-template rendering with message endpoints, and the history-rewrite report.

Rendering reproduces Transformers' `apply_chat_template` byte for byte (see jinja_env.py) and
tokenizes the prompt with `add_special_tokens=False`, as Transformers does (by segments, with
the same ids: see Cost below).

Message endpoints. The end of completed message i is the length of the render of
messages[:i+1] without a generation prompt, when that text is a prefix of the full prompt. A
mark is an exact token endpoint only when every token before it ends at or before it and every
token after starts at or after it (offsets of the full encoding), so no endpoint cuts through a
BPE token or a multi-token Unicode character. Endpoints are sorted, unique and strictly inside
the prompt; the final open assistant header (and a continued final message) never yields one.

Cost. Endpoints need the render of every prefix of the conversation; a new turn repeats the
previous turn's prefixes, so prefix renders are cached (LRU bounded by characters), keyed by a
digest chained over the messages (plus tools, template kwargs, and the date for templates that
read the clock), and the prompt is tokenized by segments between added tokens with cached
segment encodings (segments.py, exact by construction). Only new messages cost anything.

History rewrites. For every assistant message j the model once saw the prompt
render(messages[:j], add_generation_prompt=True) followed by its own output, which the template
renders as render(messages[:j+1]). When either is not a prefix of this prompt, the template
rewrote an earlier turn (Qwen3 drops past reasoning), so cached state for the old tokens cannot
be reused past `first_rewritten_token`. That is reported, not hidden.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from flared.engine.errors import InvalidRequest
from flared.frontend.detok import IncrementalDetokenizer
from flared.frontend.jinja_env import (
    compile_template,
    cut_at_tag,
    render_template,
    tag_final_message,
)
from flared.frontend.segments import SegmentEncoder

__all__ = ["IncrementalDetokenizer", "Rendered", "TextFrontend", "common_prefix_length"]

MAX_CACHED_PREFIX_CHARS = 16 << 20

_SPECIAL_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


@dataclass(frozen=True)
class Rendered:
    text: str
    token_ids: list[int]
    message_end_token_offsets: list[int]
    # True when the template renders an earlier assistant turn differently from how the model
    # produced it (its prompt + output are no longer a prefix of this prompt).
    rewrites_history: bool = False
    # Tokens of this prompt before the first rewritten character (None without a rewrite).
    first_rewritten_token: int | None = None
    # Index of the earliest assistant message whose history was rewritten.
    rewritten_message_index: int | None = None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common token prefix (what a cache keyed on tokens can reuse)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
    """The special-token strings Transformers passes to templates (its special_tokens_map)."""
    out: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on prefix equality: strings here are long and mostly equal
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Cuts:
    """Exact token cuts of one encoding: char offset -> token count, or None if inexact."""

    def __init__(self, offsets: Sequence[tuple[int, int]]) -> None:
        n = len(offsets)
        self.num_tokens = n
        # max_end[k]: max end over tokens [0, k); min_start[k]: min start over tokens [k, n)
        self.max_end = [0] * (n + 1)
        for k, (_s, e) in enumerate(offsets):
            self.max_end[k + 1] = max(self.max_end[k], e)
        self.min_start = [1 << 62] * (n + 1)
        for k in range(n - 1, -1, -1):
            self.min_start[k] = min(self.min_start[k + 1], offsets[k][0])

    def exact(self, mark: int) -> int | None:
        lo, hi = 0, self.num_tokens  # largest k with max_end[k] <= mark (max_end is monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.max_end[mid] <= mark:
                lo = mid
            else:
                hi = mid - 1
        return lo if self.min_start[lo] >= mark else None

    def tokens_before(self, char_pos: int) -> int:
        """Tokens that end at or before char_pos (those untouched by a change at char_pos)."""
        k = 0
        while k < self.num_tokens and self.max_end[k + 1] <= char_pos:
            k += 1
        return k


class TextFrontend:
    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        eos_token_ids: list[int],
        tokenizer_config: dict[str, Any] | None = None,
        *,
        reasoning_parser: Any = None,
        tool_parser: Any = None,
        model_vocab_size: int | None = None,
    ) -> None:
        from prep.bundle import ReasoningParser, ToolParser

        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        self._template = compile_template(chat_template) if chat_template else None
        self._special = _special_tokens(tokenizer_config or {})
        # output parsers: the bundle's typed enums (the recipe's declaration), never a name
        self.reasoning_parser: ReasoningParser = reasoning_parser or ReasoningParser.NONE
        self.tool_parser: ToolParser = tool_parser or ToolParser.NONE
        self.model_vocab_size = model_vocab_size or self.vocab_size
        self._special_ids = {
            i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self._grammar_lock = threading.Lock()
        self._grammar_compiler: Any = None
        self._segments = SegmentEncoder.build(tokenizer)
        self._reads_clock = bool(chat_template and "strftime_now" in chat_template)
        self._prefixes: OrderedDict[bytes, str | None] = OrderedDict()
        self._prefix_chars = 0
        self._prefix_lock = threading.Lock()

    @staticmethod
    def from_bundle(bundle_dir: Path | str) -> TextFrontend:
        from prep.bundle import read_manifest

        b = Path(bundle_dir)
        m = read_manifest(b)
        return TextFrontend.from_files(
            b / m.frontend.tokenizer_file,
            b / m.frontend.tokenizer_config_file,
            m.frontend.chat_template,
            m.frontend.eos_token_ids,
            reasoning_parser=m.frontend.reasoning_parser,
            tool_parser=m.frontend.tool_parser,
            model_vocab_size=m.geometry.vocab_size,
        )

    @staticmethod
    def from_files(
        tokenizer_file: Path,
        tokenizer_config_file: Path,
        chat_template: str | None,
        eos_token_ids: list[int],
        **options: Any,
    ) -> TextFrontend:
        """`options`: reasoning_parser, tool_parser, model_vocab_size (see __init__)."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        cfg = json.loads(Path(tokenizer_config_file).read_text())
        return TextFrontend(tok, chat_template, eos_token_ids, cfg, **options)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt as Transformers' `tokenizer(text)` encodes it (special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens)

    def output_detokenizer(self, keep: Sequence[str] = ()) -> IncrementalDetokenizer:
        """Skips special tokens except those whose text is in `keep` (the parsers' tags, which
        some tokenizers mark special): the parsers must see them, the client never sees EOS."""
        if not any(c in keep for c in self._special_ids.values()):
            return IncrementalDetokenizer(self.tokenizer, True)
        skip = [i for i, c in self._special_ids.items() if c not in keep]
        return IncrementalDetokenizer(self.tokenizer, False, skip)

    def grammar_compiler(self) -> Any:
        """The bundle's xgrammar compiler (flared.frontend.grammar), built on first use."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from flared.frontend.grammar import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_vocab_size, self.eos_token_ids
                )
            return self._grammar_compiler

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        if self._template is None:
            raise InvalidRequest("this bundle has no chat template; send prompt_token_ids")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt exclude each other"
            )
        final_text = ""
        if continue_final_message:
            messages, final_text = tag_final_message(messages)
        context = {**self._special, **template_kwargs}  # request kwargs override special tokens
        text = render_template(
            self._template, messages=messages, tools=tools or None, documents=None,
            add_generation_prompt=add_generation_prompt, **context,
        )  # fmt: skip
        return cut_at_tag(text, final_text) if continue_final_message else text

    def _prefix(self, messages: list[dict[str, Any]], tools: Any, gen: bool, kw: Any) -> str | None:
        try:
            return self.render_text(messages, tools, gen, **kw)
        except InvalidRequest:
            return None  # a template may refuse a partial conversation; it then marks nothing

    def _chain(self, messages: list[dict[str, Any]], tools: Any, kw: Any) -> list[bytes]:
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

    def _cached_prefix(
        self, key: bytes, gen: bool, messages: list[dict[str, Any]], tools: Any, kw: Any
    ) -> str | None:
        k = key + (b"g" if gen else b"c")
        with self._prefix_lock:
            if k in self._prefixes:
                self._prefixes.move_to_end(k)
                return self._prefixes[k]
        text = self._prefix(messages, tools, gen, kw)
        with self._prefix_lock:
            if k not in self._prefixes:
                self._prefixes[k] = text
                self._prefix_chars += len(text or "")
                while self._prefix_chars > MAX_CACHED_PREFIX_CHARS and self._prefixes:
                    _old, dropped = self._prefixes.popitem(last=False)
                    self._prefix_chars -= len(dropped or "")
        return text

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> Rendered:
        keys = self._chain(messages, tools, template_kwargs)
        text: str | None = None
        if not continue_final_message:  # the next turn asks for this very render again
            text = self._cached_prefix(
                keys[-1], add_generation_prompt, messages, tools, template_kwargs
            )
        if text is None:  # not cacheable, or the template raised: raise it here
            text = self.render_text(
                messages, tools, add_generation_prompt,
                continue_final_message=continue_final_message, **template_kwargs,
            )  # fmt: skip
        if self._segments is not None:
            seg = self._segments.encode(text)
            ids, exact, tokens_before = seg.ids, seg.exact_cut, seg.tokens_before
        else:
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            cuts = _Cuts(enc.offsets)
            ids, exact, tokens_before = list(enc.ids), cuts.exact, cuts.tokens_before
        num_completed = len(messages) - (1 if continue_final_message else 0)
        offsets: list[int] = []
        rewrite_char: int | None = None
        rewrite_msg: int | None = None
        for i in range(num_completed):
            prefix = self._cached_prefix(keys[i + 1], False, messages[: i + 1], tools,
                                         template_kwargs)  # fmt: skip
            stable = prefix is not None and text.startswith(prefix)
            if stable and prefix is not None:
                n = exact(len(prefix))
                if n is not None and 0 < n < len(ids) and (not offsets or offsets[-1] < n):
                    offsets.append(n)
            if messages[i].get("role") != "assistant" or rewrite_msg is not None:
                continue
            before = (
                self._cached_prefix(keys[i], True, messages[:i], tools, template_kwargs)
                if i
                else ""
            )
            for seen in (before, None if stable else prefix):
                if seen is not None and not text.startswith(seen):
                    at = _first_difference(seen, text)
                    rewrite_char = at if rewrite_char is None else min(rewrite_char, at)
                    rewrite_msg = i
        return Rendered(
            text=text,
            token_ids=ids,
            message_end_token_offsets=offsets,
            rewrites_history=rewrite_msg is not None,
            first_rewritten_token=None if rewrite_char is None else tokens_before(rewrite_char),
            rewritten_message_index=rewrite_msg,
        )
