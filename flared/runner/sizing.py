"""Derive the RunnerPlan (page count, rows, backend) from the bundle, the engine config and the
memory planner.

The planner (flared.memory) accounts for every consumer against the physical backing; this
module only turns the bundle and runner facts into its `Measurements` and its plan into a
`RunnerPlan`. It runs before any weight is loaded, so an unsatisfiable plan fails first
(`PlanDoesNotFit`, naming the consumer that did not fit).

Not yet measured (declared as estimates, and reported in the plan's notes): operator scratch
and the CUDA-graph pool. Until prep records them, a fixed scratch estimate stands in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from flared.memory import (
    Measurements,
    MemoryConfig,
    MemoryPlan,
    PlanDoesNotFit,
    Platform,
    plan_memory,
    read_platform,
)
from flared.runner.runner import RunnerPlan
from prep.bundle import Manifest, read_manifest
from prep.calls import auto_prefill_fresh
from prep.components.fused import (
    DECODE_GEMMS,
    FOLDED_ROWS_MAX,
    SINGLE_ATTENTIONS,
    SINGLE_GEMMS,
    auto_single_attention,
    auto_single_gemm,
)
from prep.components.launch import ATTENTION_PREFETCH, PDL_TRIGGERS
from prep.components.sampling import CANDIDATE_DRAWS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CPU_KV_BUDGET_BYTES = 1 << 30
CUDA_SCRATCH_ESTIMATE_BYTES = 4 << 30  # activations of the largest prefill chunk + workspaces


def kv_bytes_per_page(m: Manifest) -> int:
    g = m.geometry
    return (
        2 * len(g.attention_layers) * g.page_size * g.num_kv_heads * g.head_dim
        * DTYPE_BYTES[m.kv_dtype]
    )  # fmt: skip


def request_state_bytes_per_row(m: Manifest) -> int:
    """Persistent per-row device state: the int32 histogram dominates, plus the hidden vector
    and the int64 page table."""
    g, c = m.geometry, m.catalog
    pages = -(-c.max_context_tokens // g.page_size) + 1
    return 4 * g.vocab_size + DTYPE_BYTES[m.dtype] * g.hidden_size + 8 * pages + 256


DEFAULT_SNAPSHOTS_PER_ROW = 16  # checkpoint snapshot rows per request slot when not configured
# ... or as many as fit in this many bytes, if more: a snapshot of a model without recurrent
# state is only its hidden vector (kilobytes; its pages come from the KV pool), and a long agent
# conversation publishes one checkpoint per message
DEFAULT_SNAPSHOT_BYTES = 256 * 2**20
MAX_DEFAULT_SNAPSHOTS = 4096


# On a device whose KV pool takes whatever memory is left, snapshot rows get up to this share of
# what the pool and the snapshots take together, within SNAPSHOT_BUDGET_BYTES: a hybrid model's
# cached pages are only resumable at checkpoints, each a snapshot row (51.5 MB for a 9B
# Gated DeltaNet hybrid), so 256 MiB (four of them) would leave a 100 GiB page pool without
# endpoints to resume from, while the pool itself could hold hundreds of conversations.
SNAPSHOT_SHARE = 1 / 8
SNAPSHOT_BUDGET_BYTES = 4 * 2**30


def auto_snapshots(row_bytes: int, cache_bytes: int, floor: int) -> int:
    """Snapshot rows for a device plan whose page pool and snapshot rows take `cache_bytes`
    together: SNAPSHOT_SHARE of it within SNAPSHOT_BUDGET_BYTES, never below `floor` (the
    default count) nor above MAX_DEFAULT_SNAPSHOTS."""
    budget = min(SNAPSHOT_BUDGET_BYTES, int(cache_bytes * SNAPSHOT_SHARE))
    return max(floor, min(MAX_DEFAULT_SNAPSHOTS, budget // max(1, row_bytes)))


def default_snapshots(m: Manifest, rows: int) -> int:
    by_bytes = min(MAX_DEFAULT_SNAPSHOTS, DEFAULT_SNAPSHOT_BYTES // snapshot_row_bytes(m))
    return max(DEFAULT_SNAPSHOTS_PER_ROW * rows, by_bytes)


def state_row_bytes(m: Manifest) -> int:
    return m.geometry.state_row_bytes(DTYPE_BYTES[m.dtype])


def snapshot_row_bytes(m: Manifest) -> int:
    """One snapshot row: the recurrent state, the saved final hidden vector and its consumed
    count. Its partial tail page comes out of the KV page pool (the engine accounts for it)."""
    return state_row_bytes(m) + DTYPE_BYTES[m.dtype] * m.geometry.hidden_size + 8


def measurements(m: Manifest, rows: int, cuda: bool) -> Measurements:
    c = m.catalog
    return Measurements(
        weights_bytes=m.weight_bytes,
        kv_bytes_per_page=kv_bytes_per_page(m),
        page_tokens=m.geometry.page_size,
        max_context_tokens=c.max_context_tokens,
        max_num_rows=rows,
        operator_scratch_bytes=CUDA_SCRATCH_ESTIMATE_BYTES if cuda else 0,
        request_state_bytes_per_row=request_state_bytes_per_row(m),
        pinned_host_bytes=4 * c.max_context_tokens * 8 if cuda else 0,
        state_row_bytes=state_row_bytes(m),
        snapshot_row_bytes=snapshot_row_bytes(m),
    )


def plan_runner(
    bundle: Path,
    config: Any,
    platform_reader: Callable[[], Platform] | None = None,
) -> RunnerPlan:
    m = read_manifest(bundle)
    device = str(config.device)
    cuda = device.startswith("cuda")
    rows = config.max_num_rows or max(m.catalog.decode_capacities)
    mem: MemoryConfig = getattr(config, "memory", None) or MemoryConfig()
    if config.num_pages is not None:
        mem = replace(mem, num_kv_pages=config.num_pages)
    elif not cuda and not mem.num_kv_pages:
        # CPU: a bounded default so tests and the demo stay small (not below a concurrency
        # guarantee); the plan still checks it fits. A [memory] num_kv_pages pin is kept.
        pages = rows * (-(-m.catalog.max_context_tokens // m.geometry.page_size) + 1)
        if not mem.guarantee_concurrency:
            pages = min(pages, CPU_KV_BUDGET_BYTES // kv_bytes_per_page(m))
        mem = replace(mem, num_kv_pages=max(1, pages))
    mem = replace(mem, target_concurrency=mem.target_concurrency or rows)
    auto = not mem.target_snapshots and getattr(config, "prefix_cache", True)
    if auto:
        mem = replace(mem, target_snapshots=default_snapshots(m, rows))
    if not getattr(config, "prefix_cache", True):
        mem = replace(mem, target_snapshots=0)
    platform = _platform(device, platform_reader)
    sizes = measurements(m, rows, cuda)
    plan = plan_memory(platform, sizes, mem)
    if auto and not mem.num_kv_pages:  # pages from the remainder: share it with snapshots
        row = snapshot_row_bytes(m)
        cache = plan.num_kv_pages * sizes.kv_bytes_per_page + plan.num_snapshots * row
        more = auto_snapshots(row, cache, plan.num_snapshots)
        if more > plan.num_snapshots:
            with contextlib.suppress(PlanDoesNotFit):  # else the default count's plan stands
                plan = plan_memory(platform, sizes, replace(mem, target_snapshots=more))
    step_wait = getattr(config, "step_wait", "spin")
    if step_wait not in ("spin", "block"):
        raise ValueError(f"step_wait must be spin or block, got {step_wait!r}")
    trigger = getattr(config, "decode_pdl_trigger", "after_wait")
    single_trigger = getattr(config, "decode_single_pdl_trigger", "end")
    for key, value in (
        ("decode_pdl_trigger", trigger),
        ("decode_single_pdl_trigger", single_trigger),
    ):
        if value not in PDL_TRIGGERS:
            raise ValueError(f"{key} must be one of {', '.join(PDL_TRIGGERS)}, got {value!r}")
    prefetch = getattr(config, "decode_attention_prefetch", "auto")
    if prefetch not in ATTENTION_PREFETCH:
        raise ValueError(
            f"decode_attention_prefetch must be one of {', '.join(ATTENTION_PREFETCH)}, "
            f"got {prefetch!r}"
        )
    draw = getattr(config, "candidate_draw", "ops")
    if draw not in CANDIDATE_DRAWS:
        raise ValueError(
            f"candidate_draw must be one of {', '.join(CANDIDATE_DRAWS)}, got {draw!r}"
        )
    gemm = getattr(config, "decode_gemm", "skinny")
    if gemm not in DECODE_GEMMS:
        raise ValueError(f"decode_gemm must be one of {', '.join(DECODE_GEMMS)}, got {gemm!r}")
    folded_rows = getattr(config, "decode_folded_rows", FOLDED_ROWS_MAX)
    if not (isinstance(folded_rows, int) and 1 <= folded_rows <= FOLDED_ROWS_MAX):
        raise ValueError(f"decode_folded_rows must be 1-{FOLDED_ROWS_MAX}, got {folded_rows!r}")
    single = getattr(config, "decode_single_gemm", "auto")
    if single not in (*SINGLE_GEMMS, "auto"):
        raise ValueError(
            f"decode_single_gemm must be one of auto, {', '.join(SINGLE_GEMMS)}, got {single!r}"
        )
    if single == "auto":
        single = auto_single_gemm(cuda, gemm)
    if single != "none" and gemm != "skinny":
        raise ValueError(
            f"decode_single_gemm {single!r} runs beside decode_gemm 'skinny' only, not {gemm!r}"
        )
    attention = getattr(config, "decode_single_attention", "auto")
    if attention not in (*SINGLE_ATTENTIONS, "auto"):
        raise ValueError(
            f"decode_single_attention must be one of auto, {', '.join(SINGLE_ATTENTIONS)}, "
            f"got {attention!r}"
        )
    if attention == "auto":
        attention = auto_single_attention(cuda)
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if cuda and m.geometry.sliding_window is None else "reference"
    fresh = getattr(config, "prefill_fresh", "auto")
    if fresh not in ("auto", "on", "off"):
        raise ValueError(f"prefill_fresh must be auto, on or off, got {fresh!r}")
    if fresh == "auto":
        fresh = "on" if auto_prefill_fresh(cuda, backend == "triton") else "off"
    return RunnerPlan(
        device=device,
        num_pages=plan.num_kv_pages,
        max_num_rows=plan.max_num_rows,
        compile=config.compile,
        cuda_graphs=config.cuda_graphs,
        attention_backend=backend,
        decode_gemm=gemm,
        decode_folded_rows=folded_rows,
        decode_single_gemm=single,
        decode_single_attention=attention,
        prefill_fresh=fresh == "on" and m.geometry.sliding_window is None,
        decode_pdl=getattr(config, "decode_pdl", False),
        decode_pdl_trigger=trigger,
        decode_single_pdl=bool(getattr(config, "decode_single_pdl", True)) and single != "none",
        decode_single_pdl_trigger=single_trigger,
        decode_split_k=getattr(config, "decode_split_k", False),
        decode_attention_prefetch=prefetch,
        candidate_draw=draw,
        step_wait=step_wait,
        num_snapshot_rows=plan.num_snapshots,
        memory=plan,
    )


def _platform(device: str, reader: Callable[[], Platform] | None) -> Platform:
    if reader is not None:
        return reader()
    if device.startswith("cuda"):
        from flared.memory.device import cuda_device_info

        index = int(device.split(":")[1]) if ":" in device else 0
        return read_platform("/", lambda: cuda_device_info(index))
    return read_platform("/")


def describe(plan: MemoryPlan | None) -> str:
    return plan.table() if plan is not None else "(no memory plan)"
