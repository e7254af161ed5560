"""What a decode step pays when every layer's attention op gets its own copy of the step's
shared inputs, against reading them once (`prep.components.SHARED_STEP_INPUTS`).

    python benchmarks/step_inputs.py [--layers 28] [--rows 1,4] [--out FILE]

A compiled stack of `--layers` decode attention ops (`flare::paged_decode_attention_from_qkv`,
Qwen3-1.7B's heads by default) whose shared inputs are computed in the graph the way the
prepared decode computes them: each row's page table and position gathered from the request
state, its slot, q_pos + 1 and the rotary cos/sin (the canonical module's arithmetic). Each mode
compiles in a process of its own with the compiler's caches off (the tag changes the lowering,
not the traced graph, so a cached result would serve both): "shared" as Flare registers the ops,
"copied" with the tag removed (the compiler's default layout constraint). Each captured step is
replayed in a CUDA graph; the record gives the median device time per step (CUDA events over
200 replays, median of --repeats) and the number of compiler-generated kernels per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(mode: str, layers: int, rows: int, repeats: int) -> dict:
    import torch

    import prep.components

    if mode == "copied":  # before the ops are registered: the compiler's default constraint
        prep.components.SHARED_STEP_INPUTS = ()
    from torch._inductor.utils import run_and_get_code

    from prep.components import triton_decode as td

    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, ps, ctx, pages = 16, 8, 128, 16, 40960, 4096
    g = torch.Generator(device=dev).manual_seed(0)
    slots_per_row = ctx // ps
    state_rows, used = 8, 48  # rows of ~600 tokens (48 pages hold 768)
    state_table = torch.randperm(pages, device=dev, generator=g)[: state_rows * used]
    table_rows = torch.full((state_rows, slots_per_row), -1, dtype=torch.int64, device=dev)
    table_rows[:, :used] = state_table.view(state_rows, used)
    consumed = torch.randint(500, 700, (state_rows,), device=dev, generator=g)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    caches = [
        (
            torch.randn(pages + 1, ps, hkv, d, device=dev, generator=g).to(dt),
            torch.randn(pages + 1, ps, hkv, d, device=dev, generator=g).to(dt),
        )
        for _ in range(layers)
    ]
    qkv = torch.randn(layers, rows, (hq + 2 * hkv) * d, device=dev, generator=g).to(dt)
    sel = torch.arange(rows, device=dev) * 2 % state_rows

    def step(qkv: torch.Tensor, sel: torch.Tensor) -> list[torch.Tensor]:
        pos = consumed[sel]
        table = table_rows[sel]
        page = table.gather(1, (pos // ps)[:, None]).squeeze(1)
        slots = torch.where(page >= 0, page * ps + pos % ps, -1)
        lens = pos + 1
        freqs = pos[None, :, None].float() * inv_freq  # the canonical rotary module's
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        outs = []
        for i, (kc, vc) in enumerate(caches):
            o = td.decode_attention_from_qkv(
                qkv[i], kc, vc, table, lens, d**-0.5, slots, hq, None, None, 0.0, 0.0,
                cos[0], sin[0],
            )  # fmt: skip
            outs.append(o)
        return outs

    compiled = torch.compile(step, fullgraph=True)
    _, code = run_and_get_code(compiled, qkv, sel)
    source = code[0][code[0].index("def call(") :]
    generated = sum(1 for line in source.splitlines() if ".run(" in line or "cpp_fused_" in line)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            compiled(qkv, sel)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(qkv, sel)
    per_step = []
    for _ in range(repeats):
        for _ in range(20):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_step.append(start.elapsed_time(end) * 1e3 / 200)
    return {
        "bench": "step_inputs",
        "mode": mode,
        "layers": layers,
        "rows": rows,
        "step_us": statistics.median(per_step),
        "step_us_runs": per_step,
        "generated_kernels": generated,
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, rows = args.child.split(":")
        print(json.dumps(child(mode, args.layers, int(rows), args.repeats)))
        return
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    records = []
    for rows in [int(r) for r in args.rows.split(",")]:
        for mode in ("copied", "shared"):
            cmd = [sys.executable, __file__, "--child", f"{mode}:{rows}",
                   "--layers", str(args.layers), "--repeats", str(args.repeats)]  # fmt: skip
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env)
            rec = json.loads(out.stdout.strip().splitlines()[-1])
            records.append(rec)
            print(json.dumps(rec), flush=True)
    if args.out is not None:
        with args.out.open("a") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    for rows in sorted({r["rows"] for r in records}):
        by = {r["mode"]: r for r in records if r["rows"] == rows}
        saved = by["copied"]["step_us"] - by["shared"]["step_us"]
        print(
            f"rows {rows}: copied {by['copied']['step_us']:.1f} us "
            f"({by['copied']['generated_kernels']} generated kernels), shared "
            f"{by['shared']['step_us']:.1f} us ({by['shared']['generated_kernels']}): "
            f"{saved:.1f} us a step, {saved / args.layers:.2f} us a layer"
        )


if __name__ == "__main__":
    main()
