"""The planner's two inputs besides the Platform: what the bundle/runner measured, and what the
user asked for. Both frozen, plain ints; `validate()` names the bad field."""

from __future__ import annotations

from dataclasses import dataclass, fields

from flared.memory.units import GIB, MIB


class MemoryConfigError(ValueError):
    """A memory option or measurement is invalid; the message names the field."""


@dataclass(frozen=True)
class Measurements:
    """Sizes the runner knows before it allocates anything (from the bundle manifest and the
    prepared executions). Per-unit sizes; the planner multiplies.

    Model-state rows follow the seed's fixed partition: row 0 is the null state, request slot s
    owns rows 1 + s*W .. (s+1)*W, snapshots follow. Live rows cost `state_row_bytes` each; a
    snapshot costs `snapshot_row_bytes` (its state row plus the KV tail page it owns when its
    endpoint is not page-aligned). Attention-only models have state_row_bytes == 0.
    """

    weights_bytes: int
    kv_bytes_per_page: int
    page_tokens: int
    max_context_tokens: int  # the bundle's prepared context limit
    max_num_rows: int  # the largest prepared decode capacity
    operator_scratch_bytes: int = 0  # workspaces of attention/sampling/GEMM kernels
    graph_pool_bytes: int = 0  # the CUDA-graph memory pool shared by every capture
    request_state_bytes_per_row: int = 0  # per request slot: token ids, sampling buffers, logits
    state_row_bytes: int = 0  # one live model-state row
    snapshot_row_bytes: int = 0  # one immutable snapshot row
    verify_width: int = 1  # W: state rows per request slot (speculative verification width)
    pinned_host_bytes: int = 0  # page-locked host staging buffers
    ring_bytes_per_session: int = 0  # event ring + request ring of one client session
    max_num_sessions: int = 0

    def validate(self) -> Measurements:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise MemoryConfigError(f"measurement {f.name} must be >= 0")
        for name in ("kv_bytes_per_page", "page_tokens", "max_context_tokens", "max_num_rows"):
            if getattr(self, name) < 1:
                raise MemoryConfigError(f"measurement {name} must be >= 1")
        if self.verify_width < 1:
            raise MemoryConfigError("measurement verify_width must be >= 1")
        return self


@dataclass(frozen=True)
class MemoryConfig:
    """The `[memory]` section of flared.toml. Every size is bytes; 0 means "derive it".

    budget: the device pool (discrete) or the one pool (unified) is
        min(budget_bytes or budget_fraction × physical total, what is free right now).
    reserve_bytes: kept unallocated inside that pool (other CUDA users, fragmentation).
    host_reserve_bytes: host memory left to the OS and other programs. On unified memory it
        comes out of the one pool, which is exactly why it matters there.
    driver_margin_bytes: CUDA context growth, cuBLAS handles, allocator rounding.
    target_concurrency: live request slots (0 = the largest prepared decode capacity).
    target_context_tokens: tokens one request must be able to hold (0 = the bundle's limit).
        The plan needs KV for one such request, or for target_concurrency of them at once
        when guarantee_concurrency is set; the rest of the pool becomes more KV pages
        (prefix cache), unless num_kv_pages pins the count.
    target_snapshots: immutable snapshot rows to reserve.
    host_tier_bytes: a requested host-memory KV tier. Real capacity on discrete GPUs; on
        unified memory it is the same memory, so it adds nothing and is reported as such.
    """

    budget_bytes: int = 0
    budget_fraction: float = 0.9
    reserve_bytes: int = 0
    host_reserve_bytes: int = 2 * GIB
    driver_margin_bytes: int = 64 * MIB
    target_context_tokens: int = 0
    target_concurrency: int = 0
    target_snapshots: int = 0
    guarantee_concurrency: bool = False
    num_kv_pages: int = 0
    host_tier_bytes: int = 0

    def validate(self) -> MemoryConfig:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool) and value < 0:
                raise MemoryConfigError(f"memory.{f.name} must be >= 0, got {value}")
        if not 0.0 < self.budget_fraction <= 1.0:
            raise MemoryConfigError(
                f"memory.budget_fraction must be in (0, 1], got {self.budget_fraction}"
            )
        return self
