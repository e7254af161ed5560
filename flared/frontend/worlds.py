"""Prefix renders of a conversation ("worlds") without rendering every prefix in full.

World (k, gen) is render(messages[:k+1], add_generation_prompt=gen): the prompt a conversation
ending at message k produces. Message endpoints and the history-rewrite report compare worlds
with the request's prompt (text.py). Rendering each world costs O(k), so all of them cost
O(n^2); this module derives them from the request's marked render (marks.py: where each
message's iteration starts) and short window renders, in O(n) for turns of bounded length.

Windows. Turn t runs from user message u to the message before the next user message (e).
For k in turn t, let a be the latest assistant message in (u, k], or u if there is none.
  - a == u:  world = text[:s_u] + W[w_u:]           W = render(ctx + messages[u..k])
  - a > u:   world = T[:t_a] + W[w_a:]              W = render(ctx + [u] + messages[a..k])
where T is the turn's own last world (k = e, the first form) and ctx holds the messages before
the template's message loop plus its first loop message (the template's head and `loop.first`).
Offsets come from the marks of each render. This assumes what chat templates do: a message's
rendering depends on the message, its neighbours, whether it is the last one, and the latest
user message (the "last query" that decides whether reasoning is kept), not on absolute indices
or messages farther back. Checked per request:
  - a turn whose window has no gap (ctx + messages[u..e] is messages[:e+1]) needs no check;
    otherwise its window followed by the next user message must reproduce the prompt's text of
    that turn (the last turn's window, with the request's own flags, the prompt's end);
  - in every window from an assistant a to k, messages a..k-1 (not the last one there) must
    render as in the turn's last world;
  - for a conversation not seen before, the world just before the last user message is also
    rendered in full when it was derived from a window with a gap.
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


class _Positions(dict[int, int]):
    """Message index -> start in a window's render; a message the window did not mark (the
    template took it into its head there) fails the windows, not the request."""

    def __missing__(self, key: int) -> int:
        raise WindowsFailed(f"message {key} is not marked in its window")


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
    """The string parent[:p] + tail; parent is a prompt or another world (shared, not copied)."""

    parent: str | World
    p: int
    tail: str

    def text(self) -> str:
        base = self.parent if isinstance(self.parent, str) else self.parent.text()
        return base[: self.p] + self.tail

    @property
    def length(self) -> int:
        return self.p + len(self.tail)

    def agreement(self, text: str, memo: dict[int, int]) -> int:
        """Length of the common prefix with `text` (memo: per text, by id of parent)."""
        parent = self.parent
        if parent is not text:
            shared = memo.get(id(parent))
            if shared is None:
                if isinstance(parent, str):
                    shared = first_difference(text, 0, parent)
                else:
                    shared = parent.agreement(text, memo)
                memo[id(parent)] = shared
            if shared < self.p:
                return shared
        return self.p + first_difference(text, self.p, self.tail)

    def is_prefix_of(self, text: str, memo: dict[int, int]) -> bool:
        return self.length <= len(text) and self.agreement(text, memo) == self.length


class WorldCache:
    """LRU of worlds by key, bounded by characters; a shared parent is charged once."""

    def __init__(self, max_chars: int) -> None:
        self._max = max_chars
        self._items: OrderedDict[bytes, World | None] = OrderedDict()
        self._refs: dict[int, int] = {}  # id(parent) -> entries whose chain holds it
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
        total = 64 + len(world.tail)
        node: str | World = world.parent
        while True:
            refs = self._refs.get(id(node), 0) + step
            if refs:
                self._refs[id(node)] = refs
            else:
                del self._refs[id(node)]
            if (step > 0 and refs == 1) or (step < 0 and refs == 0):
                total += len(node) if isinstance(node, str) else 64 + len(node.tail)
            if isinstance(node, str):
                return total
            node = node.parent


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
        self._turns: dict[int, tuple[World, str, dict[int, int]]] = {}
        self._ends_at_user: dict[int, World] = {}  # world (u, False) from the previous turn's check

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
        return r.text, _Positions((i, r.starts[w]) for w, i in enumerate(idx) if w in r.starts)

    def _gapless(self, u: int) -> bool:
        return self._ctx(u) == list(range(u))

    def _turn_world(self, u: int, e: int) -> tuple[World, str, dict[int, int]]:
        """The turn's last world (k = e), its text and where its messages start in it. Without
        a gap the window is messages[:e+1] itself; with one it is first checked: the window
        followed by the next user message reproduces the prompt's text of the turn."""
        hit = self._turns.get(u)
        if hit is not None:
            return hit
        w, pos = self._window([*self._ctx(u), *range(u, e + 1)])
        if self._gapless(u):
            world, shift = World(w, len(w), ""), 0
        else:
            nxt = e + 1
            if nxt < len(self._m):
                v, vpos = self._window([*self._ctx(u), *range(u, nxt + 1)])
                ok = v[vpos[u] : vpos[nxt]] == self._text[self._s[u] : self._s[nxt]]
                # the same window, ending at the next user message, is that message's world
                self._ends_at_user[nxt] = World(self._text, self._s[nxt], v[vpos[nxt] :])
            else:
                v, vpos = self._window([*self._ctx(u), *range(u, nxt)], *self._flags)
                ok = v[vpos[u] :] == self._text[self._s[u] :]
            if not ok:
                raise WindowsFailed(f"the window of the turn at message {u} differs")
            world, shift = World(self._text, self._s[u], w[pos[u] :]), self._s[u] - pos[u]
        starts = {j: pos[j] + shift for j in range(u, e + 1)}
        self._turns[u] = (world, world.text(), starts)
        return self._turns[u]

    def world(self, k: int, gen: bool) -> World | None:
        """World (k, gen), or None when it lies before the first user message (render it)."""
        turn = self._turn(k)
        if turn is None or k < self._h:
            return None
        u, e = turn
        t_world, t_text, t_starts = self._turn_world(u, e)
        if k == e and not gen:
            return t_world
        a = self._anchor[k]
        if a == u:
            if k == u and not gen and k in self._ends_at_user:
                return self._ends_at_user[k]
            w, pos = self._window([*self._ctx(u), *range(u, k + 1)], gen)
            if self._gapless(u):
                return World(w, len(w), "")
            return World(self._text, self._s[u], w[pos[u] :])
        w, pos = self._window([*self._ctx(u), u, *range(a, k + 1)], gen)
        # messages a..k-1 are not the last one here: the window must render them as the turn does
        if w[pos[a] : pos[k]] != t_text[t_starts[a] : t_starts[k]]:
            raise WindowsFailed(f"the window of message {k} from message {a} differs")
        return World(t_world, t_starts[a], w[pos[a] :])

    def turn_start(self, k: int) -> int:
        turn = self._turn(k)
        return turn[0] if turn is not None else k

    def spot_index(self) -> int | None:
        """A world to compare with its full render: the one before the last user message, when
        it is derived (its turn's window has a gap)."""
        if len(self._users) < 2 or self._gapless(self._users[-2]):
            return None
        return self._users[-1] - 1
