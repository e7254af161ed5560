"""xgrammar vs llguidance on a synthetic 151,936-token byte vocabulary (Qwen-sized, offline).

Measures, per backend: tokenizer-info construction, JSON-schema compile time (cold and a second
distinct schema), and per-token mask time (fill the packed int32 bitmask + advance) along a valid
JSON document tokenized greedily with the same vocabulary. Prints one JSON line per backend.
Run: .venv/bin/python benchmarks/frontend_grammar_choice.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

VOCAB_SIZE = 151936
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "unit", "address", "active"],
    "additionalProperties": False,
}
SCHEMA2 = {**SCHEMA, "properties": {**SCHEMA["properties"], "extra": {"type": "string"}}}
DOC = {
    "name": "Ada Lovelace 你好 🙂",
    "age": 36,
    "score": 99.5,
    "tags": ["math", "engine", "poetry", "notes", "analysis"],
    "unit": "celsius",
    "address": {"city": "London", "zip": "W1"},
    "active": True,
}


def synthetic_vocab(n: int, seed: int = 0) -> list[bytes]:
    """256 single bytes, then word / space-word / digit / punctuation / CJK tokens, unique."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(out)
    punct = ['{"', '":', '",', '"}', ", ", ": ", '["', '"]', "\n", "  ", "\t", "}}", "{\n"]
    for p in punct:
        if p.encode() not in seen:
            seen.add(p.encode())
            out.append(p.encode())
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 6000)]
    while len(out) < n - 2:
        r = rng.random()
        if r < 0.55:
            w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            if rng.random() < 0.3:
                w = w.capitalize()
            if rng.random() < 0.5:
                w = " " + w
        elif r < 0.65:
            w = str(rng.randint(0, 999))
        elif r < 0.85:
            w = "".join(rng.choice(cjk) for _ in range(rng.randint(1, 2)))
        else:
            w = "".join(rng.choice(" !\"#$%&'()*+,-./:;<=>?@[]{}_\n") for _ in range(2, 4))
        b = w.encode()
        if b not in seen:
            seen.add(b)
            out.append(b)
    out += [b"<|endoftext|>", b"<|im_end|>"]
    return out


def greedy_tokenize(text: bytes, vocab: list[bytes]) -> list[int]:
    index = {t: i for i, t in enumerate(vocab[:-2])}
    ids, i = [], 0
    while i < len(text):
        for k in range(min(12, len(text) - i), 0, -1):
            j = index.get(text[i : i + k])
            if j is not None:
                ids.append(j)
                i += k
                break
    return ids


def bench_xgrammar(vocab: list[bytes], doc_ids: list[int]) -> dict[str, Any]:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[len(vocab) - 1]
    )
    compiler = xgr.GrammarCompiler(info, max_threads=8)
    t1 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA))
    t2 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA2))
    t3 = time.perf_counter()
    matcher = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, len(vocab))
    times = []
    for tid in doc_ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        ok = matcher.accept_token(tid)
        times.append(time.perf_counter() - s)
        assert ok, tid
    matcher.fill_next_token_bitmask(mask, 0)
    accepted_stop = bool(mask[0, (len(vocab) - 1) // 32] >> ((len(vocab) - 1) % 32) & 1)
    del torch
    return _summary("xgrammar", t1 - t0, t2 - t1, t3 - t2, times, accepted_stop)


def bench_llguidance(vocab: list[bytes], doc_ids: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.torch as lt

    class G:
        eos_token_id = len(vocab) - 1
        bos_token_id = None
        tokens = vocab
        special_token_ids = (len(vocab) - 2, len(vocab) - 1)

        def __call__(self, s: bytes) -> list[int]:
            return greedy_tokenize(s, vocab)

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(G()))
    t1 = time.perf_counter()
    g1 = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(tok, g1)
    t2 = time.perf_counter()
    llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA2)))
    t3 = time.perf_counter()
    assert not m.is_error(), m.get_error()
    mask = lt.allocate_token_bitmask(1, len(vocab))
    times = []
    for tid in doc_ids:
        s = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        ok = m.consume_token(tid)
        times.append(time.perf_counter() - s)
        assert ok, (tid, m.get_error())
    lt.fill_next_token_bitmask(m, mask, 0)
    accepted_stop = bool(mask[0, (len(vocab) - 1) // 32] >> ((len(vocab) - 1) % 32) & 1)
    return _summary("llguidance", t1 - t0, t2 - t1, t3 - t2, times, accepted_stop)


def _summary(
    name: str, init_s: float, c1: float, c2: float, times: list[float], stop_ok: bool
) -> dict[str, Any]:
    us = sorted(t * 1e6 for t in times)
    return {
        "backend": name,
        "vocab_size": VOCAB_SIZE,
        "tokenizer_init_ms": round(init_s * 1e3, 2),
        "compile_json_schema_ms": round(c1 * 1e3, 2),
        "compile_second_schema_ms": round(c2 * 1e3, 2),
        "mask_tokens": len(us),
        "mask_us_mean": round(statistics.fmean(us), 1),
        "mask_us_p50": round(us[len(us) // 2], 1),
        "mask_us_p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
        "mask_us_max": round(us[-1], 1),
        "stop_allowed_at_end": stop_ok,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    vocab = synthetic_vocab(VOCAB_SIZE)
    doc_ids = greedy_tokenize(json.dumps(DOC, ensure_ascii=False).encode(), vocab)
    rows = [bench_xgrammar(vocab, doc_ids), bench_llguidance(vocab, doc_ids)]
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu_threads": __import__("os").cpu_count()}
    lines = [json.dumps({**meta, **r}) for r in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
