"""Incremental detokenization and text-level stop strings.

IncrementalDetokenizer invariant: the concatenation of everything push() and flush() return
equals decode(all ids) exactly, and no returned piece ends inside a UTF-8 sequence. It decodes a
short window (the tokens since the last clean character boundary) and diffs it against the
window's already-emitted prefix, as vLLM does, so per-token cost does not grow with the output
and tokenizers whose decode strips a leading space (Metaspace) stay exact. A trailing U+FFFD is
held back: it is how an incomplete UTF-8 sequence decodes until its remaining bytes arrive.

StopMatcher invariant: text it releases can never be part of a stop string, whatever arrives
next: it holds back the longest buffered suffix that is a proper prefix of some stop. The
stop that completes first wins (ties: the longer one), output is cut at its start, and the
matched string is reported. This acts on text only; the model's token history is untouched.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from flared.frontend.deltas import holdback

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        skip_token_ids: Collection[int] = (),
    ) -> None:
        from tokenizers import decoders

        self._tok = tokenizer
        # byte-level decoding concatenates at clean character boundaries: decode(a + b) ==
        # decode(a) + decode(b), so a new window's base length follows without decoding it
        self._concat = isinstance(getattr(tokenizer, "decoder", None), decoders.ByteLevel)
        self._skip = skip_special_tokens
        self._skip_ids = frozenset(int(t) for t in skip_token_ids)
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids[prefix:] are decoded together
        self._read = 0  # ids[prefix:read] decode to text that was fully emitted
        self._base_len = 0  # len(decode(ids[prefix:read]))
        self._extra = 0  # chars of the window beyond base_len already emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self._skip))

    def push(self, token_ids: Sequence[int]) -> str:
        if self._skip_ids:
            self._ids.extend(int(t) for t in token_ids if int(t) not in self._skip_ids)
        else:
            self._ids.extend(int(t) for t in token_ids)
        text = self._decode(self._ids[self._prefix :])
        end = len(text)
        while end > self._base_len and text[end - 1] == _REPLACEMENT:
            end -= 1
        start = self._base_len + self._extra
        out = text[start:end] if end > start else ""
        self._extra = max(self._extra, end - self._base_len)
        if end == len(text) and len(text) > self._base_len:
            # a clean character boundary: later bytes cannot merge with what came before
            self._prefix, self._read = self._read, len(self._ids)
            if self._concat:
                self._base_len = len(text) - self._base_len
            else:
                self._base_len = len(self._decode(self._ids[self._prefix : self._read]))
            self._extra = 0
        return out

    def flush(self) -> str:
        text = self._decode(self._ids[self._prefix :])
        out = text[self._base_len + self._extra :]
        self._prefix = self._read = len(self._ids)
        self._base_len = self._extra = 0
        return out


@dataclass(frozen=True)
class StopResult:
    text: str  # text safe to release now
    stopped: bool = False
    matched: str | None = None  # the stop string that ended the output


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self._max_hold = max((len(s) - 1 for s in self.stops), default=0)
        self._buf = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str) -> StopResult:
        if self.stopped:
            return StopResult("", True, self.matched)
        if not self.stops:
            return StopResult(text)
        buf = self._buf + text
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0:
                key = (i + len(stop), -len(stop), stop)
                best = key if best is None or key < best else best
        if best is not None:
            end, neg_len, stop = best
            self.stopped, self.matched, self._buf = True, stop, ""
            return StopResult(buf[: end + neg_len], True, stop)
        hold = holdback(buf, self.stops)
        self._buf = buf[len(buf) - hold :] if hold else ""
        return StopResult(buf[: len(buf) - hold])

    def flush(self) -> str:
        """End of output without a stop: release what was held back."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out
