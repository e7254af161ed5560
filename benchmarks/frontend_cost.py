"""Frontend cost per request and per token (targets: 32K render+tokenize <= 30 ms; detokenize +
stop + parse <= 20 us/token). Uses the tiny tokenizer and the Qwen3 fixture template.
Prints JSON lines; --out also writes them. Run: .venv/bin/python benchmarks/frontend_cost.py

render_tokenize rows: `ms_p50` renders the same conversation repeatedly (after the first
render, a frontend that caches serves it from its caches); `next_turn_ms_p50` renders the
conversation extended by one assistant reply and one user message after rendering the
conversation itself (an agent's next request: what a multi-turn client pays); `cold_ms_p50`
renders it on a fresh frontend each time (nothing cached). The frontend's version is whatever
`flared` is importable (PYTHONPATH), so one script measures before and after.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _frontend(name: str) -> Any:
    from flared.frontend.text import TextFrontend
    from prep.tiny import write_tokenizer

    d = Path(tempfile.mkdtemp())
    write_tokenizer(d)
    tpl = (ROOT / "tests/fixtures/templates" / f"{name}.jinja").read_text()
    return TextFrontend.from_files(d / "tokenizer.json", d / "tokenizer_config.json", tpl, [2])


def _conversation(fe: Any, target_tokens: int, tokens_per_msg: int) -> list[dict[str, Any]]:
    unit = "The quick brown fox 你好 🙂 jumps over the lazy dog; tools json reasoning. "
    per = max(1, len(fe.encode(unit)))
    body = unit * max(1, tokens_per_msg // per)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful."}]
    while len(fe.render(msgs).token_ids) < target_tokens:
        msgs.append({"role": "user", "content": body})
        msgs.append({"role": "assistant", "content": body})
    msgs.append({"role": "user", "content": "and now?"})
    return msgs


def _p50(xs: list[float]) -> float:
    xs = sorted(xs)
    return round(xs[len(xs) // 2] * 1e3, 2)


def bench_render(fe: Any, name: str, target: int, per_msg: int, reps: int) -> dict[str, Any]:
    msgs = _conversation(fe, target, per_msg)
    times, r = [], None
    for _ in range(reps):
        t = time.perf_counter()
        r = fe.render(msgs)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    fe.encode(r.text)
    tok_s = time.perf_counter() - t
    cold, nxt = [], []
    reply = {"role": "assistant", "content": msgs[-2]["content"][:400]}
    for k in range(reps):
        fresh = _frontend(name)
        t = time.perf_counter()
        fresh.render(msgs)
        cold.append(time.perf_counter() - t)
        turn = [*msgs, reply, {"role": "user", "content": f"and then {k}?"}]
        t = time.perf_counter()
        fresh.render(turn)
        nxt.append(time.perf_counter() - t)
    return {"bench": "render_tokenize", "template": name, "tokens": len(r.token_ids),
            "messages": len(msgs), "endpoints": len(r.message_end_token_offsets),
            "ms_p50": _p50(times), "ms_min": round(min(times) * 1e3, 2),
            "next_turn_ms_p50": _p50(nxt), "cold_ms_p50": _p50(cold),
            "tokenize_only_ms": round(tok_s * 1e3, 2)}  # fmt: skip


def bench_stream(fe: Any, reps: int = 5) -> dict[str, Any]:
    """Median of `reps` runs of the whole stream."""
    runs = [_bench_stream(fe) for _ in range(reps)]
    runs.sort(key=lambda r: r["us_per_token"])
    return runs[len(runs) // 2]


def _bench_stream(fe: Any) -> dict[str, Any]:
    from flared.frontend.detok import StopMatcher
    from flared.frontend.output import OutputParser
    from prep.bundle import ReasoningParser, ToolParser

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = ("<think>\nlet me think about the weather 你好 🙂\n</think>\n\nThe answer is 42. " * 3
            + '<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}\n</tool_call>') * 40  # fmt: skip
    ids = fe.encode(text)
    t = time.perf_counter()
    d = fe.detokenizer(skip_special_tokens=False)
    stop = StopMatcher(["<|endoftext|>", "STOP HERE"])
    p = OutputParser(ReasoningParser.THINK_TAGS, ToolParser.HERMES_JSON, tools, id_prefix="b")
    for tid in ids:
        p.push(stop.push(d.push([tid])).text)
    p.push(stop.push(d.flush()).text + stop.flush())
    out = p.finish()
    dt = time.perf_counter() - t
    return {"bench": "detok_stop_parse", "tokens": len(ids), "tool_calls": len(out.tool_calls),
            "us_per_token": round(dt / len(ids) * 1e6, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu_threads": __import__("os").cpu_count()}
    fe = _frontend("qwen3")
    rows = [
        bench_render(fe, "qwen3", 4096, 512, 20),
        bench_render(fe, "qwen3", 32768, 2048, 10),
        bench_render(fe, "qwen3", 32768, 512, 5),
        bench_stream(fe),
    ]
    lines = [json.dumps({**meta, **r}) for r in rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
