"""Prefix renders of a conversation ("worlds") without rendering every prefix in full.

World (k, gen) is render(messages[:k+1], add_generation_prompt=gen): the prompt a conversation
ending at message k produces. Message endpoints and the history-rewrite report compare worlds
with the request's prompt (text.py). Rendering each world costs O(k), so all of them cost
O(n^2); this module derives them from the request's marked render (marks.py: where each
message's iteration starts) and short window renders, in O(n) for turns of bounded length.

Windows. Turn t runs from user message u to the message before the next user message (e).
For k in turn t, let a be the latest assistant message in (u, k], or u if there is none.
  - a == u:  world = text[:s_u] + W[w_u:]           W = render(ctx + messages[u..k])
  - a > u:   world = T[:t_u..t_a] + W[w_a:]         W = render(ctx + [u] + messages[a..k])
where T is the turn's own last world (k = e, the first form) and ctx holds the messages before
the template's message loop plus its first loop message (the template's head and `loop.first`).
Offsets come from the marks of each render. This assumes what chat templates do: a message's
rendering depends on the message, its neighbours, whether it is the last one, and the latest
user message (the "last query" that decides whether reasoning is kept), not on absolute indices
or messages farther back. Checked per request, each with one render of a window:
  - every turn's window followed by the next user message reproduces the prompt's text of that
    turn; the last turn's window, with the request's own flags, reproduces the prompt's end;
  - every assistant's window up to the next assistant reproduces the turn's text between them;
  - one world is also rendered in full: the one just before the last user message.
Any mismatch, an unmarked message or a window the template refuses raises `WindowsFailed`;
the caller then renders every world in full (exact by definition) and stops using windows.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flared.engine.errors import InvalidRequest
from flared.frontend.marks import MarkedRender

# (messages, add_generation_prompt, continue_final_message) -> marked render
RenderFn = Callable[[list[Any], bool, bool], MarkedRender]


class WindowsFailed(Exception):
    """The window assumptions did not hold for this conversation (see the module docstring)."""


def first_difference(text: str, start: int, s: str) -> int:
    """Smallest i with s[i] != text[start + i] (or i == len(s) / text's end); in len(s) steps
    at most, by halving (the strings here are long and mostly equal)."""
    lo, hi = 0, min(len(s), max(0, len(text) - start))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(s[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class World:
    """The string base[:p] + tail (base is shared by the worlds of one request)."""

    base: str
    p: int
    tail: str

    def text(self) -> str:
        return self.base[: self.p] + self.tail

    @property
    def length(self) -> int:
        return self.p + len(self.tail)

    def _head_matches(self, text: str) -> bool:
        return self.base is text or (len(text) >= self.p and text[: self.p] == self.base[: self.p])

    def is_prefix_of(self, text: str) -> bool:
        if self.length > len(text) or not self._head_matches(text):
            return False
        return text.startswith(self.tail, self.p)

    def first_difference(self, text: str) -> int:
        if not self._head_matches(text):
            return first_difference(text, 0, self.base[: self.p])
        return self.p + first_difference(text, self.p, self.tail)


class WorldCache:
    """LRU of worlds by key, bounded by characters; a base is charged once while referenced."""

    def __init__(self, max_chars: int) -> None:
        self._max = max_chars
        self._items: OrderedDict[bytes, World | None] = OrderedDict()
        self._bases: dict[int, int] = {}  # id(base) -> entries that reference it
        self.chars = 0

    def get(self, key: bytes) -> tuple[bool, World | None]:
        if key not in self._items:
            return False, None
        self._items.move_to_end(key)
        return True, self._items[key]

    def put(self, key: bytes, world: World | None) -> None:
        if key in self._items:
            return
        self._items[key] = world
        self.chars += self._charge(world, +1)
        while self.chars > self._max and self._items:
            _k, old = self._items.popitem(last=False)
            self.chars -= self._charge(old, -1)

    def _charge(self, world: World | None, step: int) -> int:
        if world is None:
            return 64
        refs = self._bases.get(id(world.base), 0) + step
        if refs:
            self._bases[id(world.base)] = refs
        else:
            del self._bases[id(world.base)]
        first = (step > 0 and refs == 1) or (step < 0 and refs == 0)
        return 64 + len(world.tail) + (len(world.base) if first else 0)


class WindowWorlds:
    """Worlds of one request, derived from its marked render by window renders."""

    def __init__(
        self, messages: list[Any], full: MarkedRender, render: RenderFn, gen: bool, cont: bool
    ) -> None:
        if full.starts is None:
            raise WindowsFailed("the prompt's messages are not marked")
        self._m = messages
        self._text = full.text
        self._s = full.starts
        self._h = full.first_marked
        self._render = render
        self._flags = (gen, cont)
        roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
        self._users = [j for j in range(self._h, len(messages)) if roles[j] == "user"]
        self._anchor: list[int] = []  # latest assistant in (u, k] of k's turn, else u (or -1)
        for k, role in enumerate(roles):
            turn = self._turn(k)
            turn_start = turn[0] if turn is not None else -1
            prev = self._anchor[-1] if k and self._anchor[-1] > turn_start else turn_start
            self._anchor.append(k if role == "assistant" and turn_start >= 0 else prev)
        self._memo: dict[tuple[tuple[int, ...], bool, bool], MarkedRender] = {}
        self._checked: set[tuple[int, int]] = set()

    def _turn(self, k: int) -> tuple[int, int] | None:
        t = bisect.bisect_right(self._users, k) - 1
        if t < 0:
            return None
        end = self._users[t + 1] - 1 if t + 1 < len(self._users) else len(self._m) - 1
        return self._users[t], end

    def _ctx(self, u: int) -> list[int]:
        return list(range(self._h)) + ([self._h] if self._h < u else [])

    def _window(
        self, idx: list[int], gen: bool = False, cont: bool = False
    ) -> tuple[str, dict[int, int]]:
        key = (tuple(idx), gen, cont)
        r = self._memo.get(key)
        if r is None:
            try:
                r = self._render([self._m[i] for i in idx], gen, cont)
            except InvalidRequest as exc:
                raise WindowsFailed(f"the template refuses a window: {exc}") from exc
            self._memo[key] = r
        if r.starts is None:
            raise WindowsFailed("a window's messages are not marked")
        return r.text, {i: r.starts[w] for w, i in enumerate(idx) if w in r.starts}

    def _turn_ref(self, u: int, e: int) -> tuple[str, dict[int, int]]:
        """The turn's last world (k = e), checked against the prompt first."""
        if (u, u) not in self._checked:
            nxt = e + 1
            if nxt < len(self._m):
                v, pos = self._window([*self._ctx(u), *range(u, nxt + 1)])
                ok = v[pos[u] : pos[nxt]] == self._text[self._s[u] : self._s[nxt]]
            else:
                v, pos = self._window([*self._ctx(u), *range(u, nxt)], *self._flags)
                ok = v[pos[u] :] == self._text[self._s[u] :]
            if not ok:
                raise WindowsFailed(f"the window of the turn at message {u} differs")
            self._checked.add((u, u))
        return self._window([*self._ctx(u), *range(u, e + 1)])

    def _check_anchor(self, u: int, a: int, e: int, turn: tuple[str, dict[int, int]]) -> None:
        if (u, a) in self._checked:
            return
        t, tpos = turn
        nxt = next((j for j in range(a + 1, e + 1) if self._anchor[j] == j), None)
        v, pos = self._window([*self._ctx(u), u, *range(a, (nxt if nxt is not None else e) + 1)])
        if nxt is not None:
            ok = v[pos[a] : pos[nxt]] == t[tpos[a] : tpos[nxt]]
        else:
            ok = v[pos[a] :] == t[tpos[a] :]
        if not ok:
            raise WindowsFailed(f"the window of the assistant message {a} differs")
        self._checked.add((u, a))

    def world(self, k: int, gen: bool) -> World | None:
        """World (k, gen), or None when it lies before the first user message (render it)."""
        turn = self._turn(k)
        if turn is None or k < self._h:
            return None
        u, e = turn
        t, tpos = self._turn_ref(u, e)
        a = self._anchor[k]
        if k == e and not gen:
            return World(self._text, self._s[u], t[tpos[u] :])
        if a == u:
            w, pos = self._window([*self._ctx(u), *range(u, k + 1)], gen)
            return World(self._text, self._s[u], w[pos[u] :])
        self._check_anchor(u, a, e, (t, tpos))
        w, pos = self._window([*self._ctx(u), u, *range(a, k + 1)], gen)
        return World(self._text, self._s[u], t[tpos[u] : tpos[a]] + w[pos[a] :])

    def spot_index(self) -> int | None:
        """The world to compare with its full render: the one before the last user message."""
        return self._users[-1] - 1 if len(self._users) >= 2 else None
