"""Derive the RunnerPlan (page count, rows, backend) from the bundle and the engine config.

This is the interim sizing rule until the memory planner owns it: KV pages get a share of the
memory left after weights and request state, never more than every row could use at the
context limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flared.runner.runner import RunnerPlan
from prep.bundle import Manifest, read_manifest

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_KV_BUDGET_BYTES = 1 << 30


def kv_bytes_per_page(m: Manifest) -> int:
    g = m.geometry
    return (
        2
        * len(g.attention_layers)
        * g.page_size
        * g.num_kv_heads
        * g.head_dim
        * DTYPE_BYTES[m.kv_dtype]
    )


def plan_runner(bundle: Path, config: Any) -> RunnerPlan:
    m = read_manifest(bundle)
    device = config.device
    rows = config.max_num_rows or max(m.catalog.decode_capacities)
    pages_per_row = -(-m.catalog.max_context_tokens // m.geometry.page_size) + 1
    ceiling = rows * pages_per_row
    per_page = kv_bytes_per_page(m)
    if config.num_pages is not None:
        num_pages = config.num_pages
    elif device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        state = rows * m.geometry.vocab_size * 4 * 2
        budget = int((free - m.weight_bytes - state) * config.kv_memory_fraction)
        num_pages = max(1, min(ceiling, budget // per_page))
    else:
        num_pages = max(1, min(ceiling, CPU_KV_BUDGET_BYTES // per_page))
    backend = config.attention_backend
    if backend == "auto":
        backend = (
            "triton"
            if device.startswith("cuda") and m.geometry.sliding_window is None
            else "reference"
        )
    return RunnerPlan(
        device=device,
        num_pages=num_pages,
        max_num_rows=rows,
        compile=config.compile,
        cuda_graphs=config.cuda_graphs,
        attention_backend=backend,
    )
