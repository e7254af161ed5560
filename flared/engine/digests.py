"""Content-addressed identity of a token prefix, independent of the physical page size.

A prefix of S tokens is identified by a chain of digests over fixed 64-token blocks:

    d[0]   = H(root)                 root: model id, token layout (the conditioning identity)
    d[b+1] = H(d[b], block b)        block b: tokens 64*b .. 64*b+63 and the identities of the
                                     conditioning inputs (images) that enter the stream there
    key(S) = H(d[S // 64], S, the S % 64 tail tokens and their conditioning inputs)

so a checkpoint key names an exact token count, not a page or chunk boundary, and two prefixes
share a key only if every token and conditioning input before S agrees (up to the 128-bit
collision bound of BLAKE2b). Appending tokens or images never changes the key of an earlier,
unchanged prefix. Digests are plain ints, so the cache stays pure CPU.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

HASH_BLOCK_TOKENS = 64
_DIGEST_BYTES = 16
_DIGEST_LEN = _DIGEST_BYTES.to_bytes(8, "little")  # _h's length prefix of a chained digest
_BLOCK_LEN = (8 * HASH_BLOCK_TOKENS).to_bytes(8, "little")  # ... and of a block's token bytes


@dataclass(frozen=True)
class ConditioningInput:
    """A non-token input (an image) whose identity enters the prefix at token `offset`.

    `identity` is a digest of the complete decoded representation and its preprocessing profile;
    the engine only compares it.
    """

    offset: int
    identity: bytes


def _h(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    # Token ids are non-negative and far below 2**63; a fixed width keeps the encoding injective.
    # One struct call (a 4,096-token prompt in about 0.05 ms, not 1.5 ms token by token).
    try:
        return struct.pack(f"<{len(tokens)}Q", *tokens)
    except struct.error:  # out of range for the fast path: the same bytes, one by one
        return b"".join((t & ((1 << 64) - 1)).to_bytes(8, "little") for t in tokens)


def _inputs_bytes(inputs: Sequence[ConditioningInput], lo: int, hi: int) -> bytes:
    return b"".join(
        c.offset.to_bytes(8, "little") + len(c.identity).to_bytes(4, "little") + c.identity
        for c in inputs
        if lo <= c.offset < hi
    )


def root_digest(model_id: str, token_layout: str) -> int:
    """The conditioning identity every chain starts from."""
    return _h(b"flare-prefix-v1", model_id.encode(), token_layout.encode())


class PrefixDigests:
    """Block digests of one token sequence, computed incrementally; `key(S)` for any S ≤ len.

    `inputs` must be sorted by offset. Extending the sequence keeps earlier keys unchanged.
    """

    def __init__(
        self, root: int, tokens: Sequence[int], inputs: Sequence[ConditioningInput] = ()
    ) -> None:
        self._tokens: list[int] = []
        self._inputs = tuple(inputs)
        self._blocks = [root]  # _blocks[b] = d[b]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self._tokens.extend(tokens)
        n = HASH_BLOCK_TOKENS
        first, last = len(self._blocks) - 1, len(self._tokens) // n  # blocks [first, last) are new
        if last <= first:
            return
        # the bytes _h would hash, built for every new block from one packing of their tokens
        data = _tokens_bytes(self._tokens[first * n : last * n])
        width = 8 * n
        prev = self._blocks[-1]
        blake2b, join = hashlib.blake2b, b"".join
        for b in range(first, last):
            inputs = _inputs_bytes(self._inputs, b * n, (b + 1) * n) if self._inputs else b""
            block = data[(b - first) * width : (b - first + 1) * width]
            h = blake2b(
                join((_DIGEST_LEN, prev.to_bytes(_DIGEST_BYTES, "little"), _BLOCK_LEN, block,
                      len(inputs).to_bytes(8, "little"), inputs)),
                digest_size=_DIGEST_BYTES,
            )  # fmt: skip
            prev = int.from_bytes(h.digest(), "little")
            self._blocks.append(prev)

    def fork(self, num_tokens: int) -> PrefixDigests:
        """The digests of this sequence's first `num_tokens` tokens, as a new object that can be
        extended independently (the block digests they share are reused, not recomputed)."""
        if not 0 <= num_tokens <= len(self._tokens):
            raise ValueError(f"no prefix of {num_tokens} tokens in {len(self._tokens)}")
        out = PrefixDigests.__new__(PrefixDigests)
        out._tokens = self._tokens[:num_tokens]
        out._inputs = tuple(c for c in self._inputs if c.offset < num_tokens)
        out._blocks = self._blocks[: num_tokens // HASH_BLOCK_TOKENS + 1]
        return out

    def key(self, num_tokens: int) -> int:
        """The checkpoint key of the first `num_tokens` tokens (1 ≤ num_tokens ≤ len)."""
        if not 0 < num_tokens <= len(self._tokens):
            raise ValueError(f"no prefix of {num_tokens} tokens in {len(self._tokens)}")
        b = num_tokens // HASH_BLOCK_TOKENS
        lo = b * HASH_BLOCK_TOKENS
        return _h(
            self._blocks[b].to_bytes(_DIGEST_BYTES, "little"),
            num_tokens.to_bytes(8, "little"),
            _tokens_bytes(self._tokens[lo:num_tokens]),
            _inputs_bytes(self._inputs, lo, num_tokens),
        )
