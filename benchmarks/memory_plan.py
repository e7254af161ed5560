"""Planned capacity vs what really fits, and the load peak, on one GPU.

    python benchmarks/memory_plan.py --shape qwen3-1.7b --work /tmp/fb

Plans the whole device (budget fraction 1, no reserve), loads the runner with that plan (weights,
KV pages, request state, every CUDA graph), then allocates 64 MiB blocks until the device
refuses: what is left over was capacity the plan did not use. Prints JSON lines:
planned KV bytes, leftover bytes, the KV share of (planned + leftover), and the load peak
against weights + planned storage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode_latency import prep_bundle
from benchmarks.shapes import make_checkpoint

BLOCK = 64 << 20


def leftover_bytes() -> int:
    blocks = []
    try:
        while True:
            blocks.append(torch.empty(BLOCK, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
    n = len(blocks) * BLOCK
    del blocks
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fb"))
    ap.add_argument("--compile", default="decode-forward")
    args = ap.parse_args()
    from flared.llm_engine import EngineConfig
    from flared.memory import MemoryConfig
    from flared.runner.runner import ModelRunner
    from flared.runner.sizing import plan_runner

    work = args.work / args.shape
    ckpt = make_checkpoint(args.shape, work / "ckpt")
    bundle = work / "bundle-fused"
    prep_bundle(ckpt, bundle, chunk=4096, ctx=8192, compile=False)  # the plan, not the speed
    torch.cuda.init()
    cfg = EngineConfig(
        device="cuda", compile=args.compile, max_num_rows=8,
        memory=MemoryConfig(budget_fraction=1.0, reserve_bytes=0, host_reserve_bytes=0),
    )  # fmt: skip
    free0, total = torch.cuda.mem_get_info()
    plan = plan_runner(bundle, cfg)
    mp = plan.memory
    print(mp.table(), flush=True)
    runner = ModelRunner(bundle, plan)
    rep = runner.memory_report
    kv = mp.consumer("kv_pages").size_bytes
    state = mp.consumer("request_state").size_bytes
    weights = runner.weight_bytes
    free_after, _ = torch.cuda.mem_get_info()
    left = leftover_bytes()
    peak = torch.cuda.max_memory_allocated()
    rec = {
        "kind": "memory_plan", "shape": args.shape, "device": torch.cuda.get_device_name(),
        "total_bytes": total, "free_before_load": free0, "weights_bytes": weights,
        "planned_kv_bytes": kv, "planned_request_state_bytes": state,
        "planned_scratch_bytes": mp.consumer("operator_scratch").size_bytes,
        "planned_graph_pool_bytes": mp.consumer("graph_pool").size_bytes,
        "num_kv_pages": mp.num_kv_pages, "free_after_load": free_after,
        "leftover_allocatable_bytes": left,
        "kv_share_of_fit": kv / (kv + left),
        "load_peak_allocated_bytes": rep.get("prepared_peak_allocated_bytes"),
        "load_peak_vs_weights_plus_storage": rep.get("prepared_peak_allocated_bytes", 0)
        / (weights + kv + state),
        "graph_pool_and_scratch_reserved_bytes": rep["prepared_reserved_bytes"]
        - rep["storage_reserved_bytes"],
        "probe_peak_allocated_bytes": peak,
        **rep,
    }  # fmt: skip
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
