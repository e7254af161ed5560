"""Frontend cost per request and per token (targets: 32K render+tokenize <= 30 ms; detokenize +
stop + parse <= 20 us/token). Uses the tiny tokenizer and the Qwen3 fixture template.
Prints JSON lines; --out also writes them. Run: .venv/bin/python benchmarks/frontend_cost.py

Conversations: `chat` alternates user and assistant messages of `per_msg` tokens (every message
distinct, so nothing is shared between them); `agent` is one user request followed by rounds of
an assistant tool call and its tool result (the shape of an agent trace), with 12 tools.

render_tokenize rows: `cold_ms_p50` renders on a fresh frontend each time (nothing cached: a
never-seen conversation); `next_turn_ms_p50` then renders that conversation extended by one
assistant reply and one user message (an agent's next request); `repeat_ms_p50` renders the
same conversation again. The breakdown (each alone, cold): `jinja_ms` one render of the whole
conversation, `pieces_ms` encode_batch_fast of the text split at added tokens, `whole_ms` one
encode of the whole text with offsets; `other_ms` = cold - jinja - pieces (endpoints, digests;
a long new prompt is tokenized on a helper thread while its endpoints render, so other_ms is what
that overlap leaves, not the endpoints' own cost).
`load_1m` is the 1-minute load average when the row was measured.

--compare DIR measures the frontend in DIR (a checkout of the code before a change) and this
one alternately, in fresh interpreters, `--rounds` times each, and tags rows `code`: before /
after (same run, same machine conditions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORDS = [
    "quick",
    "brown",
    "fox",
    "你好",
    "🙂",
    "jumps",
    "over",
    "lazy",
    "dog",
    "tools",
    "json",
    "reasoning",
    "weather",
    "Paris",
    "函数",
    "résumé",
    "naïve",
    "answer",
    "because",
    "however",
    "42",
    "3.14",
    "code",
    "def",
    "return",
]


def _tokenizer_dir() -> Path:
    from prep.tiny import write_tokenizer

    d = Path(tempfile.mkdtemp())
    write_tokenizer(d)
    return d


def _frontend(tok_dir: Path, name: str = "qwen3") -> Any:
    from flared.frontend.text import TextFrontend

    tpl = (ROOT / "tests/fixtures/templates" / f"{name}.jinja").read_text()
    return TextFrontend.from_files(
        tok_dir / "tokenizer.json", tok_dir / "tokenizer_config.json", tpl, [2]
    )


def _body(fe: Any, seed: int, tokens: int) -> str:
    """Distinct text of about `tokens` tokens (a seeded shuffle of WORDS, repeated)."""
    import random

    rng = random.Random(seed)
    out: list[str] = [f"message {seed}:"]
    while len(fe.encode(" ".join(out))) < tokens:
        out.extend(rng.sample(WORDS, len(WORDS)))
    return " ".join(out)


def _conversation(fe: Any, shape: str, target: int, per_msg: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are helpful."}]
    if shape == "agent":
        msgs.append({"role": "user", "content": _body(fe, 1, per_msg)})
    while len(fe.encode(fe.render_text(msgs))) < target:
        n = len(msgs)
        if shape == "chat":
            msgs.append({"role": "user", "content": _body(fe, n, per_msg)})
            msgs.append({"role": "assistant", "content": _body(fe, n + 1, per_msg)})
        else:
            call = {"name": "search", "arguments": {"query": f"step {n}"}}
            msgs.append({"role": "assistant", "content": _body(fe, n, per_msg // 4),
                         "tool_calls": [{"type": "function", "function": call}]})  # fmt: skip
            msgs.append({"role": "tool", "content": _body(fe, n + 1, per_msg)})
    msgs.append({"role": "user", "content": "and now?"})
    return msgs


def _ms(xs: list[float]) -> float:
    return round(sorted(xs)[len(xs) // 2] * 1e3, 2)


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _tools(n: int) -> list[dict[str, Any]]:
    """`n` function declarations of an agent's size (a few typed parameters each)."""
    props = {"query": {"type": "string", "description": "What to look for."},
             "limit": {"type": "integer", "description": "At most this many results."},
             "mode": {"type": "string", "enum": ["fast", "exact", "fuzzy"]}}  # fmt: skip
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Tool number {i}: searches source {i}.",
        "parameters": {"type": "object", "properties": props, "required": ["query"]}}}
        for i in range(n)]  # fmt: skip


def bench_render(tok_dir: Path, shape: str, target: int, per_msg: int, reps: int) -> dict[str, Any]:
    fe = _frontend(tok_dir)
    msgs = _conversation(fe, shape, target, per_msg)
    tools = _tools(12) if shape == "agent" else None
    reply = {"role": "assistant", "content": _body(fe, 99991, 200)}
    cold, nxt, again, jinja, pieces, whole = [], [], [], [], [], []
    r = None
    for k in range(reps):
        fresh = _frontend(tok_dir)
        t = time.perf_counter()
        r = fresh.render(msgs, tools)
        cold.append(time.perf_counter() - t)
        again.append(_timed(lambda f=fresh: f.render(msgs, tools)))
        turn = [*msgs, reply, {"role": "user", "content": f"and then {k}?"}]
        nxt.append(_timed(lambda f=fresh, m=turn: f.render(m, tools)))
        text = _frontend(tok_dir).render_text(msgs, tools)
        jinja.append(_timed(lambda f=fresh: f.render_text(msgs, tools)))
        tok = fresh.tokenizer
        added = sorted(tok.get_added_tokens_decoder().values(), key=lambda a: -len(a.content))
        split = re.compile("(" + "|".join(re.escape(a.content) for a in added) + ")")
        names = {a.content for a in added}
        parts = [p for p in split.split(text) if p and p not in names]
        pieces.append(
            _timed(lambda t=tok, p=parts: t.encode_batch_fast(p, add_special_tokens=False))
        )
        whole.append(_timed(lambda t=tok, x=text: t.encode(x, add_special_tokens=False)))
    assert r is not None
    return {"bench": "render_tokenize", "template": "qwen3", "shape": shape,
            "tools": len(tools or ()),
            "tokens": len(r.token_ids), "messages": len(msgs),
            "endpoints": len(r.message_end_token_offsets), "cold_ms_p50": _ms(cold),
            "next_turn_ms_p50": _ms(nxt), "repeat_ms_p50": _ms(again), "jinja_ms": _ms(jinja),
            "pieces_ms": _ms(pieces), "whole_ms": _ms(whole),
            "other_ms": round(_ms(cold) - _ms(jinja) - _ms(pieces), 2),
            "load_1m": round(os.getloadavg()[0], 2)}  # fmt: skip


def bench_stream(tok_dir: Path, reps: int = 5) -> dict[str, Any]:
    """Median of `reps` runs of the whole stream."""
    fe = _frontend(tok_dir)
    runs = [_bench_stream(fe) for _ in range(reps)]
    runs.sort(key=lambda r: r["us_per_token"])
    return {**runs[len(runs) // 2], "load_1m": round(os.getloadavg()[0], 2)}


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


CASES = {  # name: (shape, target tokens, tokens per message, repetitions)
    "chat4k": ("chat", 4096, 512, 15),
    "chat32k_2k": ("chat", 32768, 2048, 7),
    "chat32k_512": ("chat", 32768, 512, 7),
    "agent32k": ("agent", 32768, 256, 5),
}


def rows(names: list[str]) -> list[dict[str, Any]]:
    tok_dir = _tokenizer_dir()
    out = [bench_render(tok_dir, *CASES[n]) for n in names if n in CASES]
    if "stream" in names:
        out.append(bench_stream(tok_dir))
    return out


def compare(base: Path, rounds: int, names: list[str], labels: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(rounds):
        for code, root in zip(labels, (base, ROOT), strict=True):
            env = {**os.environ, "PYTHONPATH": str(root)}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--only", ",".join(names)]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            out.extend({**json.loads(line), "code": code} for line in res.stdout.splitlines())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default=",".join([*CASES, "stream"]))
    ap.add_argument("--compare", default=None, help="root of the code to compare against")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--labels", default="before,after", help="`code` of the two sides")
    args = ap.parse_args()
    names = args.only.split(",")
    meta = {"date": time.strftime("%Y-%m-%d"), "cpu_threads": os.cpu_count()}
    labels = args.labels.split(",")
    found = compare(Path(args.compare), args.rounds, names, labels) if args.compare else rows(names)
    lines = [json.dumps({**meta, **r}) for r in found]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
