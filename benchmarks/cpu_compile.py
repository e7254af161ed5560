"""CPU compile time and decode time by Inductor's inlining limit (prep.compiling.CPU_REALIZE_OPCOUNT).

    python benchmarks/cpu_compile.py [--arch qwen3] [--tokens 32] [--repeats 5] [--out FILE]

Variants, each in a process of its own over its own bundle (Inductor's cache key includes the
setting, and no variant may reuse another's compiled code):
  torch-default  CPU_REALIZE_OPCOUNT None: Inductor's own CPU limit (50 in torch 2.13)
  flare          Flare's setting (30, the GPU's limit)
Each starts a CPU engine with its decode executions compiled whole ("decode") on a tiny
random-weight checkpoint (prep.tiny), one decode capacity, and reports the start's seconds
(almost all of it compiling) and the median milliseconds per decoded token over --repeats
seeded requests of --tokens tokens. One JSON line per variant (with its ratio to torch-default)
to stdout and --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"torch-default": None, "flare": 30}


def measure(variant: str, arch: str, tokens: int, repeats: int, root: Path) -> dict[str, object]:
    import prep.compiling
    from flared.llm_engine import Engine, EngineConfig, SamplingParams
    from prep.prepare import PrepConfig, prepare
    from prep.tiny import make_tiny_checkpoint

    prep.compiling.CPU_REALIZE_OPCOUNT = VARIANTS[variant]
    ckpt = make_tiny_checkpoint(root / "ckpt", arch)
    bundle = root / "bundle"
    prepare(PrepConfig(checkpoint=ckpt, out=bundle, compile=False, device="cpu",
                       max_context_tokens=256, max_prefill_chunk_tokens=128,
                       decode_capacities=(1,)))  # fmt: skip
    t0 = time.perf_counter()
    eng = Engine(bundle, EngineConfig(device="cpu", compile="decode")).start()
    start_s = time.perf_counter() - t0
    try:
        per_token = []
        for r in range(repeats + 1):
            sp = SamplingParams(temperature=1.0, seed=r)
            t = time.perf_counter()
            out = eng.generate(list(range(5, 45)), max_tokens=tokens, ignore_eos=True, sampling=sp)
            if r:  # the first warms the prefill path
                per_token.append((time.perf_counter() - t) * 1e3 / len(out.token_ids))
    finally:
        eng.shutdown()
    return {"variant": variant, "arch": arch, "opcount": VARIANTS[variant],
            "start_s": round(start_s, 2), "ms_per_token": round(statistics.median(per_token), 3),
            "ms_per_token_runs": [round(x, 3) for x in per_token]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    if args.variant:
        with tempfile.TemporaryDirectory() as d:
            print(json.dumps(measure(args.variant, args.arch, args.tokens, args.repeats, Path(d))))
        return
    records = []
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", variant, "--arch", args.arch,
               "--tokens", str(args.tokens), "--repeats", str(args.repeats)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        records.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = records[0]
    for rec in records:
        rec["start_vs_default"] = round(rec["start_s"] / base["start_s"], 3)
        rec["ms_per_token_vs_default"] = round(rec["ms_per_token"] / base["ms_per_token"], 3)
        line = json.dumps(rec)
        print(line)
        if args.out:
            with args.out.open("a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
