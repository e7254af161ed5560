"""Structured output with xgrammar: compile per bundle tokenizer, one matcher per request.

Backend choice (benchmarks/frontend_grammar_choice.py, results/frontend_grammar_choice_*.jsonl,
synthetic 151,936-token byte vocabulary, this 2-core CPU): xgrammar compiles a 7-property JSON
schema in ~100-135 ms (a second schema ~6-16 ms) and fills a mask in ~9 us p50 / ~31-40 us p99;
llguidance compiles lazily (~2-7 ms) but its masks took ~37-67 us p50 and ~94-127 ms p99 (mean
~20-27 ms) along the same document. Masks sit on the decode critical path, so xgrammar.

MASK CONTRACT (what the runner applies inside sampling):
  dtype int32, shape [N, ceil(V / 32)] for N rows and the model's vocab size V (the logits'
  width, geometry.vocab_size; may exceed the tokenizer's size). Token t is allowed iff bit
  (t % 32) of word t // 32 is set: (mask[n, t >> 5] >> (t & 31)) & 1, i.e. little-endian bit
  order within each word. A row of all ones (every word == -1) means unconstrained. Ids beyond
  the tokenizer's vocabulary are never allowed by a constrained row. Masking sets disallowed
  logits to -inf before temperature/top-k/top-p; logprobs stay pre-mask (INTERFACES.md).
  `apply_bitmask` is the pure-torch reference.

Composition with the output protocol. While reasoning is open (the prompt ended in `<think>`,
or the first answer token sampled was `<think>`), the row is all ones until `</think>`; then
the grammar constrains the answer. At the first answer position the escape tokens
(`<tool_call>`) are also allowed; sampling one releases the grammar for the rest of the output,
so tool payloads keep their ordinary parsing and validation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from flared.engine.errors import InvalidRequest

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf"]
MAX_CACHED_GRAMMARS = 64


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reference masking; graph-safe (no data-dependent shapes or host syncs).

    logits: [N, V] float; mask: [N, ceil(V / 32)] int32 -> [N, V], disallowed set to -inf.
    """
    n, v = logits.shape
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)  # [32]
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).reshape(n, -1)[:, :v]  # [N, W*32] -> [N, V]
    return logits.masked_fill(allowed == 0, float("-inf"))


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str = ""  # schema JSON text, regex or EBNF; empty for json_object


def spec_from_response_format(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI response_format (plus regex/grammar extensions) -> GrammarSpec, None for text."""
    import json

    if not response_format or response_format.get("type") in (None, "text"):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        js = response_format.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema (object)")
        return GrammarSpec("json_schema", json.dumps(schema, sort_keys=True))
    if kind in ("regex", "grammar", "ebnf"):
        src = response_format.get(kind if kind != "ebnf" else "grammar") or response_format.get(
            "grammar"
        )
        if not isinstance(src, str) or not src:
            raise InvalidRequest(f"response_format {kind} needs a non-empty string")
        return GrammarSpec("regex" if kind == "regex" else "ebnf", src)
    raise InvalidRequest(f"unsupported response_format type {kind!r}")


def token_bytes(tokenizer: Any) -> tuple[list[bytes], list[int]]:
    """Raw bytes of every tokenizer id (special tokens as b"", so text never matches them)
    and the special ids. Handles byte-level BPE and Metaspace/byte-fallback vocabularies."""
    from tokenizers import decoders

    size = int(tokenizer.get_vocab_size(with_added_tokens=True))
    vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
    specials = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    inverse = {c: b for b, c in _bytes_to_unicode().items()}
    out = [b""] * size
    for piece, i in vocab.items():
        if i in specials or i >= size:
            continue
        if byte_level and all(ch in inverse for ch in piece):
            out[i] = bytes(inverse[ch] for ch in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out[i] = bytes([int(piece[3:5], 16)])
        elif byte_level:
            out[i] = piece.encode()  # an added, non-special token: its literal text
        else:
            out[i] = piece.replace("\u2581", " ").encode()
    return out, sorted(specials)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


class GrammarCompiler:
    """One per bundle: the tokenizer's xgrammar info and an LRU of compiled grammars."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 4
    ) -> None:
        import xgrammar as xgr

        encoded, specials = token_bytes(tokenizer)
        self.vocab_size = max(vocab_size, len(encoded))
        self.specials = specials
        self._token_ids: dict[str, int] = tokenizer.get_vocab(with_added_tokens=True)
        info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()

    def token_id(self, text: str) -> int | None:
        return self._token_ids.get(text)

    def compile(self, spec: GrammarSpec) -> Any:
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        try:
            if spec.kind == "json_schema":
                # bounded whitespace runs: a sampler cannot wander in layout forever
                compiled = self._compiler.compile_json_schema(spec.source, max_whitespace_cnt=2)
            elif spec.kind == "json_object":  # OpenAI json_object: any JSON object
                compiled = self._compiler.compile_json_schema(
                    '{"type": "object"}', max_whitespace_cnt=2
                )
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.source)
            else:
                compiled = self._compiler.compile_grammar(spec.source)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError on bad input
            raise InvalidRequest(f"cannot compile {spec.kind} grammar: {exc}") from exc
        self._cache[spec] = compiled
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)
        return compiled

    def matcher(
        self, spec: GrammarSpec, *, reasoning_open: bool = False, allow_reasoning: bool = False,
        allow_tool_calls: bool = False,
    ) -> RequestGrammar:  # fmt: skip
        think_open = self.token_id("<think>") if allow_reasoning else None
        think_close = self.token_id("</think>")
        if (reasoning_open or think_open is not None) and think_close is None:
            raise InvalidRequest("reasoning with a grammar needs a single-token </think>")
        escapes = {t for t in [self.token_id("<tool_call>")] if t is not None and allow_tool_calls}
        return RequestGrammar(
            self.compile(spec), self.vocab_size, reasoning_open=reasoning_open,
            think_open=think_open, think_close=think_close, escapes=frozenset(escapes),
        )  # fmt: skip


class RequestGrammar:
    """Per-request matcher state. fill() never changes state; accept() advances by one token.

    States: "reasoning" (all ones until </think>), "answer_start" (grammar + <think> + escapes),
    "answer" (grammar), "free" (all ones after an escape token).
    """

    def __init__(
        self, compiled: Any, vocab_size: int, *, reasoning_open: bool, think_open: int | None,
        think_close: int | None, escapes: frozenset[int],
    ) -> None:  # fmt: skip
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._think_open, self._think_close, self._escapes = think_open, think_close, escapes
        self.state = "reasoning" if reasoning_open else "answer_start"

    @property
    def num_words(self) -> int:
        return mask_words(self.vocab_size)

    @property
    def is_terminated(self) -> bool:
        return self.state == "answer" and bool(self._m.is_terminated())

    def fill(self, mask: torch.Tensor, row: int = 0) -> None:
        """Write this request's next-token row into mask[row] (int32 CPU tensor [N, W])."""
        if self.state in ("reasoning", "free"):
            mask[row].fill_(-1)
            return
        self._m.fill_next_token_bitmask(mask, row)
        if self.state == "answer_start":
            extra = [t for t in (self._think_open, *self._escapes) if t is not None]
            for t in extra:
                word = int(mask[row, t >> 5]) | (1 << (t & 31))
                mask[row, t >> 5] = word - (1 << 32) if word >= 1 << 31 else word

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it (a runner bug)."""
        if self.state == "free":
            return True
        if self.state == "reasoning":
            if token_id == self._think_close:
                self.state = "answer_start"
            return True
        if self.state == "answer_start":
            if token_id == self._think_open:
                self.state = "reasoning"
                return True
            if token_id in self._escapes:
                self.state = "free"
                return True
            self.state = "answer"
        return bool(self._m.accept_token(token_id))
