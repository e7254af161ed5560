"""Decode inter-token latency while another thread of the same process runs Python, per GIL
switch interval.

The daemon renders chat templates and parses output on worker threads of its own process. A
template render is pure Python (Jinja2); while one runs, every call of the engine thread that
releases the GIL (each torch call does) waits up to the interpreter's switch interval to get it
back, and an engine step makes dozens of such calls. This measures one stream's ITL through the
in-process engine with the process idle and with a thread rendering a long conversation, for
each switch interval, in the same run.

    python benchmarks/gil_convoy.py --bundle B [--device cpu] [--tokens 64]
        [--intervals-ms 5,1,0.5,0.2] [--out results.jsonl]

Prints one JSON line per (interval, load) and a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jinja2

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ m.content | trim }}{% endif %}<|im_end|>\n{% endfor %}"
)


def render_forever(stop: threading.Event, counter: list[int]) -> None:
    """Render a 400-message agent conversation again and again (pure Python)."""
    tpl = jinja2.Environment().from_string(TEMPLATE)
    messages = []
    for i in range(200):
        messages.append({"role": "user", "content": f"tool result {i}: " + "x " * 60})
        messages.append(
            {"role": "assistant", "tool_calls": [{"name": "search", "arguments": {"q": str(i)}}]}
        )
    while not stop.is_set():
        tpl.render(messages=messages)
        counter[0] += 1


def stream_itl(eng, prompt: list[int], tokens: int) -> list[float]:
    from flared.engine.events import TokenEvent
    from flared.requests import SamplingParams

    stamps = []
    for ev in eng.stream(prompt, max_tokens=tokens, ignore_eos=True,
                         sampling=SamplingParams(temperature=1.0, seed=0)):  # fmt: skip
        if isinstance(ev, TokenEvent):
            stamps.extend([time.perf_counter()] * len(ev.tokens))
    return [1e3 * (b - a) for a, b in itertools.pairwise(stamps)]


def main() -> None:
    from flared.llm_engine import Engine, EngineConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for interval_ms in (float(x) for x in args.intervals_ms.split(",")):
        eng = Engine(
            args.bundle, EngineConfig(device=args.device, gil_switch_interval_s=interval_ms / 1e3)
        ).start()
        prompt = list(range(10, 74))
        stream_itl(eng, prompt, 4)  # warm
        for load in ("idle", "render"):
            stop, counter = threading.Event(), [0]
            th = None
            if load == "render":
                th = threading.Thread(target=render_forever, args=(stop, counter), daemon=True)
                th.start()
                time.sleep(0.05)
            t0 = time.perf_counter()
            itl = stream_itl(eng, prompt, args.tokens)
            seconds = time.perf_counter() - t0
            stop.set()
            if th is not None:
                th.join()
            row = {
                "bench": "gil_convoy", "device": args.device, "host": platform.node(),
                "switch_interval_ms": interval_ms, "load": load, "tokens": args.tokens,
                "itl_p50_ms": round(statistics.median(itl), 3),
                "itl_p90_ms": round(sorted(itl)[int(0.9 * (len(itl) - 1))], 3),
                "itl_max_ms": round(max(itl), 3),
                "renders_per_s": round(counter[0] / seconds, 1),
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        eng.shutdown()
        sys.setswitchinterval(0.005)
    if args.out:
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("| switch ms | load | ITL p50 | ITL p90 | ITL max | renders/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['switch_interval_ms']} | {r['load']} | {r['itl_p50_ms']} | "
              f"{r['itl_p90_ms']} | {r['itl_max_ms']} | {r['renders_per_s']} |")  # fmt: skip


if __name__ == "__main__":
    main()
