"""Tokenization by segments between added tokens, with a cache of segment encodings.

Why it is exact. `tokenizers` splits its input at added-token occurrences first and then
normalizes, pre-tokenizes and runs the model on every piece between them independently. So when
this module splits at the same occurrences, encode(text) == concat(encode(piece)) with each
added token mapped to its id. Preconditions, checked once per tokenizer (`SegmentEncoder.build`
returns None otherwise and callers encode whole texts): every added token has lstrip, rstrip,
single_word and normalized all false (matched on raw text, absorbing nothing), and no Metaspace
step uses prepend_scheme "first" (the one place where a piece's position matters). A probe of
texts around every added token is compared against the whole-text encoding as a second guard.

Why it is fast. A chat prompt is a sequence of messages separated by added tokens; a new turn
repeats every earlier segment, so only the new ones are tokenized (cache keyed by segment text,
bounded by characters, LRU). New segments go to `encode_batch_fast` in one call (parallel, no
offsets); a segment's offsets are computed only when a cut or a rewrite falls inside it. When
they are many (a conversation not seen before), `begin` runs that call on a helper thread:
`tokenizers` releases the GIL while it encodes, so the caller renders its window worlds
meanwhile (chat_render.py) instead of waiting for the tokenizer first.

Cut invariant: `exact_cut(mark)` is the token count before char offset `mark` iff no token spans
it (segment boundaries never do; inside a segment, the segment's offsets decide).
"""

from __future__ import annotations

import bisect
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

MAX_CACHED_CHARS = 8 << 20  # about 12 bytes per cached token besides the text
# new segment chars from which `begin` encodes on a helper thread (a few ms of tokenizer work;
# below it, starting the thread costs more than the overlap saves)
MIN_BACKGROUND_CHARS = 16 << 10


class _Piece:
    """One segment's ids; its offsets are computed on first use (most cuts fall on segment
    boundaries, which need none), by encoding the segment again with offsets."""

    __slots__ = ("_ends", "_starts", "_text", "_tok", "ids")

    def __init__(self, ids: array[int], text: str = "", tok: Any = None) -> None:
        self.ids = ids
        self._text, self._tok = text, tok  # tok None: an added token (no offsets inside)
        self._ends: array[int] | None = None
        self._starts: array[int] | None = None

    @property
    def is_added(self) -> bool:
        return self._tok is None

    def _offsets(self) -> None:
        if self._tok is None:
            self._ends = self._starts = _NONE
            return
        e = self._tok.encode(self._text, add_special_tokens=False)
        if list(e.ids) != list(self.ids):
            raise RuntimeError("the tokenizer encodes a segment differently with offsets")
        offs = e.offsets
        self._ends = array("i", accumulate([b for _a, b in offs], max))
        self._starts = array("i", list(accumulate([a for a, _b in reversed(offs)], min))[::-1])

    @property
    def ends(self) -> array[int]:
        """ends[k] = max end of tokens 0..k (monotone), over local char offsets."""
        if self._ends is None:
            self._offsets()
        assert self._ends is not None
        return self._ends

    @property
    def starts(self) -> array[int]:
        """starts[k] = min start of tokens k.. (monotone)."""
        if self._starts is None:
            self._offsets()
        assert self._starts is not None
        return self._starts


@dataclass
class SegmentedEncoding:
    ids: list[int]
    starts: list[int]  # char start of each segment
    token_starts: list[int]  # token index of each segment's first token
    pieces: list[_Piece]
    num_chars: int

    def exact_cut(self, mark: int) -> int | None:
        """Tokens before char offset `mark` when no token spans it, else None."""
        if mark >= self.num_chars:
            return len(self.ids) if mark == self.num_chars else None
        j = bisect.bisect_right(self.starts, mark) - 1
        local = mark - self.starts[j]
        if local == 0:
            return self.token_starts[j]
        piece = self.pieces[j]
        if not piece.ids or piece.is_added:
            return None  # inside an added token
        k = bisect.bisect_right(piece.ends, local)  # tokens 0..k-1 all end at or before local
        if k == len(piece.starts) or piece.starts[k] >= local:
            return self.token_starts[j] + k
        return None

    def tokens_before(self, char_pos: int) -> int:
        """Tokens that end at or before char_pos."""
        if char_pos >= self.num_chars:
            return len(self.ids)
        j = bisect.bisect_right(self.starts, char_pos) - 1
        local = char_pos - self.starts[j]
        return self.token_starts[j] + bisect.bisect_right(self.pieces[j].ends, local)


class SegmentEncoder:
    def __init__(self, tokenizer: Any, added: dict[str, int]) -> None:
        self._tok = tokenizer
        self._added = added
        self._added_pieces = {t: _Piece(array("i", [i])) for t, i in added.items()}  # shared
        alternatives = sorted(added, key=len, reverse=True)  # leftmost, then longest
        self._split = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
        self._cache: OrderedDict[str, _Piece] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()  # the frontend pool encodes from several threads

    @staticmethod
    def build(tokenizer: Any) -> SegmentEncoder | None:
        """An encoder for `tokenizer`, or None when segment-wise encoding may not be exact."""
        decoder = tokenizer.get_added_tokens_decoder()
        if not decoder:
            return None
        for t in decoder.values():
            if t.lstrip or t.rstrip or t.single_word or t.normalized or not t.content:
                return None
        if _has_first_scheme(json.loads(tokenizer.to_str())):
            return None
        enc = SegmentEncoder(tokenizer, {t.content: i for i, t in decoder.items()})
        return enc if enc._probe(list(decoder.values())) else None

    def _probe(self, added: Sequence[Any]) -> bool:
        words = ["", " ", "\n", "a", " hi", "\n\nx y", "é 你好"]
        texts = [w + t.content + v for t in added[:64] for w in words[:4] for v in words[3:]]
        texts.append("".join(t.content + " x\n" for t in added[:64]))
        for text in texts:
            whole = list(self._tok.encode(text, add_special_tokens=False).ids)
            if self.encode(text).ids != whole:
                return False
        return True

    def _encode_pieces(self, texts: list[str]) -> list[_Piece]:
        """The fastest call of `tokenizers`: a parallel batch without offsets."""
        if not texts:
            return []
        encs = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        return [_Piece(array("i", e.ids), t, self._tok) for t, e in zip(texts, encs, strict=True)]

    def encode(self, text: str) -> SegmentedEncoding:
        return self.begin(text, background=False)()

    def begin(self, text: str, background: bool = True) -> Callable[[], SegmentedEncoding]:
        """Starts encoding `text`; the returned function waits for the encoding and returns it.
        New segments of MIN_BACKGROUND_CHARS or more are encoded on a helper thread."""
        parts = [p for p in self._split.split(text) if p]
        found: dict[str, _Piece] = {}
        with self._lock:
            for p in parts:
                if p not in self._added and p not in found:
                    hit = self._cache.get(p)
                    if hit is not None:
                        self._cache.move_to_end(p)
                        found[p] = hit
        missing = [p for p in dict.fromkeys(parts) if p not in self._added and p not in found]
        # outside the lock: the slow part
        if background and sum(map(len, missing)) >= MIN_BACKGROUND_CHARS:
            pending = _Background(self._encode_pieces, missing)
            return lambda: self._assemble(parts, found, missing, pending.result())
        fresh = self._encode_pieces(missing)
        return lambda: self._assemble(parts, found, missing, fresh)

    def _assemble(self, parts: list[str], found: dict[str, _Piece], missing: list[str],
                  fresh: list[_Piece]) -> SegmentedEncoding:  # fmt: skip
        with self._lock:
            for p, piece in zip(missing, fresh, strict=True):
                found[p] = piece
                self._remember(p, piece)
        ids: array[int] = array("i")  # array to array extends copy; one tolist() at the end
        starts: list[int] = []
        token_starts: list[int] = []
        pieces: list[_Piece] = []
        pos = 0
        for p in parts:
            starts.append(pos)
            token_starts.append(len(ids))
            added = self._added_pieces.get(p)
            piece = found[p] if added is None else added
            pieces.append(piece)
            ids.extend(piece.ids)
            pos += len(p)
        return SegmentedEncoding(ids.tolist(), starts, token_starts, pieces, pos)

    def _remember(self, text: str, piece: _Piece) -> None:
        if text in self._cache:
            return
        self._cache[text] = piece
        self._cached_chars += len(text)
        while self._cached_chars > MAX_CACHED_CHARS and self._cache:
            old, _ = self._cache.popitem(last=False)
            self._cached_chars -= len(old)


class _Background:
    """fn(texts) on a thread of its own; result() joins it and returns (or raises) its outcome."""

    def __init__(self, fn: Callable[[list[str]], list[_Piece]], texts: list[str]) -> None:
        self._out: list[_Piece] = []
        self._exc: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(fn, texts), name="flare-tokenize", daemon=True
        )
        self._thread.start()

    def _run(self, fn: Callable[[list[str]], list[_Piece]], texts: list[str]) -> None:
        try:
            self._out = fn(texts)
        except BaseException as exc:  # re-raised in the caller's thread
            self._exc = exc

    def result(self, timeout_s: float = 60.0) -> list[_Piece]:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"tokenizing the prompt took longer than {timeout_s:.0f}s")
        if self._exc is not None:
            raise self._exc
        return self._out


_NONE: array[int] = array("i")


def _has_first_scheme(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") == "first":
            return True
        return any(_has_first_scheme(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_first_scheme(v) for v in node)
    return False
