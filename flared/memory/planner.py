"""plan_memory(platform, measurements, config) -> MemoryPlan. Pure: plain ints, no torch, no I/O.

Every byte the daemon will hold is a named `Consumer` charged against one or more `Budget`s,
each a physical backing:

    discrete GPU   device  = min(budget_bytes or fraction × device total, driver free)
                   host    = OS available (MemAvailable, cgroup limit − working set)
    unified / CPU  unified = min(budget_bytes or fraction × total, driver free, OS available)
    both           shm     = /dev/shm free (the rings are also charged to host/unified)

Consumers are listed fixed-first; KV pages come last and take what is left (floor of the
remainder over the page size) unless `num_kv_pages` pins them. The plan fails — before any
allocation, before the socket binds — when the fixed consumers plus the minimum KV (one
request, or target_concurrency requests with guarantee_concurrency, at the target context)
exceed any budget; `PlanDoesNotFit` carries the table that says which consumer crossed the
line and by how much.

Invariants (check_integrity): every size >= 0; for every budget, the sum of the consumers
charged to it <= its capacity; num_kv_pages × kv_bytes_per_page == the kv_pages consumer.
"""

from __future__ import annotations

from dataclasses import dataclass

from flared.memory.inputs import Measurements, MemoryConfig, MemoryConfigError
from flared.memory.platform import Platform
from flared.memory.table import render_plan, render_shortfall
from flared.memory.units import ceil_div, gib

KV = "kv_pages"


@dataclass(frozen=True)
class Consumer:
    name: str  # metric-safe: flare_memory_<name>_bytes
    size_bytes: int
    pools: tuple[str, ...]  # the budgets this allocation is charged to
    note: str = ""


@dataclass(frozen=True)
class Budget:
    name: str  # "device", "host", "unified" or "shm"
    capacity_bytes: int
    source: str  # how the capacity was derived, for the table


@dataclass(frozen=True)
class MemoryPlan:
    """The derived memory layout: what to allocate and what it buys. Built once at startup."""

    platform_description: str
    unified: bool
    budgets: tuple[Budget, ...]
    consumers: tuple[Consumer, ...]
    kv_bytes_per_page: int
    page_tokens: int
    num_kv_pages: int
    max_num_rows: int  # concurrent requests (live request slots)
    num_state_rows: int  # 1 (null row) + max_num_rows × verify_width
    num_snapshots: int
    target_context_tokens: int
    pages_per_request: int  # KV pages one request at target_context_tokens needs
    num_host_tier_pages: int  # 0 on unified memory: a host tier adds no capacity there
    notes: tuple[str, ...] = ()

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_pages * self.page_tokens

    @property
    def num_full_context_requests(self) -> int:
        """Requests at target_context_tokens whose KV fits at once (capped at the row count)."""
        return min(self.max_num_rows, self.num_kv_pages // self.pages_per_request)

    def consumer(self, name: str) -> Consumer:
        return next(c for c in self.consumers if c.name == name)

    def used_bytes(self, pool: str) -> int:
        return sum(c.size_bytes for c in self.consumers if pool in c.pools)

    def free_bytes(self, pool: str) -> int:
        return self.budget(pool).capacity_bytes - self.used_bytes(pool)

    def budget(self, pool: str) -> Budget:
        return next(b for b in self.budgets if b.name == pool)

    def check_integrity(self) -> None:
        names = [c.name for c in self.consumers]
        assert len(names) == len(set(names)), f"duplicate consumers {names}"
        pools = {b.name for b in self.budgets}
        for c in self.consumers:
            assert c.size_bytes >= 0, c
            assert set(c.pools) <= pools, c
        for b in self.budgets:
            assert b.capacity_bytes >= 0, b
            assert self.used_bytes(b.name) <= b.capacity_bytes, (b, self.used_bytes(b.name))
        assert self.consumer(KV).size_bytes == self.num_kv_pages * self.kv_bytes_per_page
        # a pinned page count may hold less than one full-context request (admission then
        # rejects prompts larger than the pool); a budget-derived one always holds the minimum
        assert self.num_kv_pages >= 1 and self.pages_per_request >= 1
        assert self.num_state_rows >= 1 + self.max_num_rows >= 2

    def table(self) -> str:
        """The startup table: every consumer per pool, totals against capacity, capacities."""
        return render_plan(self)

    def as_metrics(self) -> dict[str, int]:
        """Gauges for stats / Prometheus; names carry units."""
        out = {f"flare_memory_{c.name}_bytes": c.size_bytes for c in self.consumers}
        for b in self.budgets:
            out[f"flare_memory_{b.name}_budget_bytes"] = b.capacity_bytes
            out[f"flare_memory_{b.name}_free_bytes"] = self.free_bytes(b.name)
        out["flare_memory_unified"] = int(self.unified)
        out["flare_memory_num_kv_pages"] = self.num_kv_pages
        out["flare_memory_kv_capacity_tokens"] = self.kv_capacity_tokens
        out["flare_memory_max_num_rows"] = self.max_num_rows
        out["flare_memory_num_state_rows"] = self.num_state_rows
        out["flare_memory_num_snapshots"] = self.num_snapshots
        out["flare_memory_num_full_context_requests"] = self.num_full_context_requests
        out["flare_memory_num_host_tier_pages"] = self.num_host_tier_pages
        return out


class PlanDoesNotFit(RuntimeError):
    """The fixed consumers plus the minimum KV exceed a physical budget. `str()` is the table."""

    def __init__(self, shortfalls: list[tuple[Budget, list[Consumer], int, str]]) -> None:
        self.shortfalls = shortfalls  # (budget, its consumers in order, short_bytes, culprit)
        budget, _, self.short_bytes, self.consumer = shortfalls[0]
        self.pool = budget.name
        super().__init__(render_shortfall(shortfalls))


def plan_memory(platform: Platform, measurements: Measurements, config: MemoryConfig) -> MemoryPlan:
    m = measurements.validate()
    config = config.validate()
    rows = config.target_concurrency or m.max_num_rows
    context = config.target_context_tokens or m.max_context_tokens
    pages_per_request = ceil_div(context, m.page_tokens)
    guaranteed = rows if config.guarantee_concurrency else 1
    if config.guarantee_concurrency and 0 < config.num_kv_pages < pages_per_request * guaranteed:
        raise MemoryConfigError(
            f"memory.num_kv_pages = {config.num_kv_pages} pins fewer pages than "
            f"memory.guarantee_concurrency needs: {guaranteed} requests × {pages_per_request} "
            f"pages of {m.page_tokens} tokens ({context}-token context)"
        )
    # pinned pages are what is allocated, so they are what must fit
    min_pages = config.num_kv_pages or pages_per_request * guaranteed
    main = "unified" if platform.unified else "device"
    host = main if platform.unified else "host"
    budgets = _budgets(platform, config, main)
    fixed, notes = _fixed_consumers(platform, m, config, rows, main, host)
    kv_note = f"needs >= {min_pages} pages ({guaranteed} × {context} tokens)"
    _raise_if_short(budgets, [*fixed, Consumer(KV, min_pages * m.kv_bytes_per_page, (main,))])
    if config.num_kv_pages:
        num_pages = config.num_kv_pages
        kv_note = "pinned by memory.num_kv_pages"
        if num_pages < pages_per_request:
            kv_note += f" (less than one {context}-token request: larger prompts fail admission)"
    else:
        capacity = next(b.capacity_bytes for b in budgets if b.name == main)
        left = capacity - sum(c.size_bytes for c in fixed if main in c.pools)
        num_pages = left // m.kv_bytes_per_page
    kv = Consumer(KV, num_pages * m.kv_bytes_per_page, (main,), kv_note)
    plan = MemoryPlan(
        platform_description=platform.describe(),
        unified=platform.unified,
        budgets=tuple(budgets),
        consumers=(*fixed, kv),
        kv_bytes_per_page=m.kv_bytes_per_page,
        page_tokens=m.page_tokens,
        num_kv_pages=num_pages,
        max_num_rows=rows,
        num_state_rows=1 + rows * m.verify_width,
        num_snapshots=config.target_snapshots,
        target_context_tokens=context,
        pages_per_request=pages_per_request,
        num_host_tier_pages=0
        if platform.unified
        else config.host_tier_bytes // m.kv_bytes_per_page,
        notes=tuple(notes),
    )
    plan.check_integrity()
    return plan


def _budgets(platform: Platform, config: MemoryConfig, main: str) -> list[Budget]:
    if platform.has_device:
        total, total_name = platform.device_total_bytes, "device total"
    else:
        total, total_name = platform.host_total_bytes, "host total"
    if config.budget_bytes:
        terms = [(config.budget_bytes, "memory.budget_bytes")]
    else:
        limit = int(config.budget_fraction * total)
        terms = [(limit, f"{config.budget_fraction:g} × {gib(total)} GiB {total_name}")]
    if platform.has_device:
        terms.append((platform.device_free_bytes, "driver free"))
    os_terms = _os_terms(platform)
    if platform.unified:
        terms += os_terms
    out = [_budget(main, terms)]
    if not platform.unified:
        out.append(_budget("host", os_terms))
    if platform.shm_free_bytes is not None:
        out.append(Budget("shm", platform.shm_free_bytes, "/dev/shm free"))
    return out


def _os_terms(platform: Platform) -> list[tuple[int, str]]:
    terms = [(platform.host_available_bytes, "MemAvailable")]
    if platform.cgroup_limit_bytes is not None:
        headroom = max(0, platform.cgroup_limit_bytes - platform.cgroup_usage_bytes)
        terms.append((headroom, "cgroup limit − usage"))
    return terms


def _budget(name: str, terms: list[tuple[int, str]]) -> Budget:
    capacity = max(0, min(v for v, _ in terms))
    parts = [f"{label}: {gib(v)} GiB" for v, label in terms]
    return Budget(name, capacity, f"min({', '.join(parts)})" if len(parts) > 1 else parts[0])


def _fixed_consumers(
    platform: Platform, m: Measurements, config: MemoryConfig, rows: int, main: str, host: str
) -> tuple[list[Consumer], list[str]]:
    """Everything but the KV pages, in the order the table and the shortfall check use."""
    notes: list[str] = []
    live_rows = 1 + rows * m.verify_width
    rings = m.ring_bytes_per_session * m.max_num_sessions
    out = [
        Consumer("driver_margin", config.driver_margin_bytes, (main,)),
        Consumer("reserve", config.reserve_bytes, (main,)),
        Consumer("host_reserve", config.host_reserve_bytes, (host,), "left to the OS"),
        Consumer("weights", m.weights_bytes, (main,)),
        Consumer("operator_scratch", m.operator_scratch_bytes, (main,)),
        Consumer("graph_pool", m.graph_pool_bytes, (main,)),
        Consumer("request_state", rows * m.request_state_bytes_per_row, (main,), f"{rows} rows"),
        Consumer("state_rows", live_rows * m.state_row_bytes, (main,), f"{live_rows} rows"),
        Consumer(
            "snapshot_rows",
            config.target_snapshots * m.snapshot_row_bytes,
            (main,),
            f"{config.target_snapshots} snapshots",
        ),
        Consumer("pinned_host", m.pinned_host_bytes, (host,)),
        Consumer(
            "shm_rings",
            rings,
            (host, "shm") if platform.shm_free_bytes is not None else (host,),
            f"{m.max_num_sessions} sessions × {m.ring_bytes_per_session} bytes",
        ),
    ]
    if platform.unified:
        out.append(Consumer("host_tier", 0, (host,), "adds no capacity on unified memory"))
        if config.host_tier_bytes:
            notes.append(
                f"host tier of {gib(config.host_tier_bytes)} GiB requested but not allocated: "
                "on unified memory host and device are the same physical memory, so a host "
                "tier adds no capacity (the KV pages already use that memory)"
            )
    else:
        out.append(Consumer("host_tier", config.host_tier_bytes, (host,)))
    return out, notes


def _raise_if_short(budgets: list[Budget], consumers: list[Consumer]) -> None:
    shortfalls: list[tuple[Budget, list[Consumer], int, str]] = []
    for b in budgets:
        members = [c for c in consumers if b.name in c.pools]
        used = 0
        culprit = ""
        for c in members:
            used += c.size_bytes
            if used > b.capacity_bytes and not culprit:
                culprit = c.name
        if used > b.capacity_bytes:
            shortfalls.append((b, members, used - b.capacity_bytes, culprit))
    if shortfalls:
        raise PlanDoesNotFit(shortfalls)
