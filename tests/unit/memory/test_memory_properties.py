"""Property tests over random platforms, measurements and configs: a plan is never negative,
never over any budget, KV takes exactly the floor of what is left, and more budget never
gives fewer pages (or turns a fitting plan into one that does not fit)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from flared.memory import (
    Measurements,
    MemoryConfig,
    MemoryConfigError,
    MemoryPlan,
    PlanDoesNotFit,
    Platform,
    plan_memory,
)
from flared.memory.units import GIB, MIB

sizes = st.integers(min_value=0, max_value=256 * GIB)
small = st.integers(min_value=0, max_value=GIB)


@st.composite
def platforms(draw: st.DrawFn) -> Platform:
    has_device = draw(st.booleans())
    host_total = draw(st.integers(min_value=GIB, max_value=1024 * GIB))
    device_total = draw(st.integers(min_value=GIB, max_value=200 * GIB)) if has_device else 0
    limited = draw(st.booleans())
    limit = draw(st.integers(min_value=0, max_value=host_total)) if limited else None
    shm = draw(st.none() | st.integers(min_value=0, max_value=host_total))
    return Platform(
        host_total_bytes=host_total,
        host_available_bytes=draw(st.integers(min_value=0, max_value=host_total)),
        has_device=has_device,
        is_integrated=has_device and draw(st.booleans()),
        device_name="GPU",
        device_total_bytes=device_total,
        device_free_bytes=draw(st.integers(min_value=0, max_value=device_total)),
        cgroup_limit_bytes=limit,
        cgroup_usage_bytes=draw(st.integers(min_value=0, max_value=host_total)),
        shm_total_bytes=shm,
        shm_free_bytes=shm,
    )


@st.composite
def measurements(draw: st.DrawFn) -> Measurements:
    return Measurements(
        weights_bytes=draw(st.integers(min_value=0, max_value=100 * GIB)),
        kv_bytes_per_page=draw(st.integers(min_value=1, max_value=64 * MIB)),
        page_tokens=draw(st.sampled_from([1, 16, 64, 256])),
        max_context_tokens=draw(st.integers(min_value=1, max_value=1 << 17)),
        max_num_rows=draw(st.integers(min_value=1, max_value=256)),
        operator_scratch_bytes=draw(small),
        graph_pool_bytes=draw(small),
        request_state_bytes_per_row=draw(st.integers(min_value=0, max_value=16 * MIB)),
        state_row_bytes=draw(st.integers(min_value=0, max_value=64 * MIB)),
        snapshot_row_bytes=draw(st.integers(min_value=0, max_value=64 * MIB)),
        verify_width=draw(st.integers(min_value=1, max_value=8)),
        pinned_host_bytes=draw(small),
        ring_bytes_per_session=draw(st.integers(min_value=0, max_value=4 * MIB)),
        max_num_sessions=draw(st.integers(min_value=0, max_value=1024)),
    )


@st.composite
def configs(draw: st.DrawFn) -> MemoryConfig:
    return MemoryConfig(
        budget_bytes=draw(st.sampled_from([0, 0]) | sizes),
        budget_fraction=draw(st.floats(min_value=0.05, max_value=1.0)),
        reserve_bytes=draw(small),
        host_reserve_bytes=draw(small),
        driver_margin_bytes=draw(st.integers(min_value=0, max_value=256 * MIB)),
        target_context_tokens=draw(st.integers(min_value=0, max_value=1 << 17)),
        target_concurrency=draw(st.integers(min_value=0, max_value=256)),
        target_snapshots=draw(st.integers(min_value=0, max_value=512)),
        guarantee_concurrency=draw(st.booleans()),
        num_kv_pages=draw(st.sampled_from([0, 0, 0]) | st.integers(1, 1 << 16)),
        host_tier_bytes=draw(st.sampled_from([0]) | small),
    )


def _try(
    p: Platform, m: Measurements, c: MemoryConfig
) -> MemoryPlan | PlanDoesNotFit | MemoryConfigError:
    try:
        return plan_memory(p, m, c)
    except PlanDoesNotFit as exc:
        return exc
    except MemoryConfigError as exc:  # the one contradiction a valid config can hold: pinned
        # pages below the concurrency guarantee
        rows = c.target_concurrency or m.max_num_rows
        context = c.target_context_tokens or m.max_context_tokens
        assert c.guarantee_concurrency
        assert 0 < c.num_kv_pages < rows * -(-context // m.page_tokens)
        return exc


@settings(max_examples=300, deadline=None)
@given(platforms(), measurements(), configs())
def test_plan_is_never_negative_nor_over_budget(
    p: Platform, m: Measurements, c: MemoryConfig
) -> None:
    out = _try(p, m, c)
    if isinstance(out, MemoryConfigError):
        return  # refused with the reason (checked in _try)
    if isinstance(out, PlanDoesNotFit):
        assert out.short_bytes > 0
        assert out.consumer and out.pool in {"device", "host", "unified", "shm"}
        assert out.consumer in str(out) and f"{out.short_bytes:,}" in str(out)
        return
    plan = out
    plan.check_integrity()
    for b in plan.budgets:
        assert 0 <= plan.used_bytes(b.name) <= b.capacity_bytes
    assert all(v >= 0 for v in plan.as_metrics().values())
    main = plan.budgets[0].name
    if c.num_kv_pages == 0:
        fixed = plan.used_bytes(main) - plan.consumer("kv_pages").size_bytes
        left = plan.budget(main).capacity_bytes - fixed
        assert plan.num_kv_pages == left // m.kv_bytes_per_page
    else:
        assert plan.num_kv_pages == c.num_kv_pages
    if p.shm_free_bytes is not None:
        assert plan.consumer("shm_rings").size_bytes <= p.shm_free_bytes
    if p.unified:
        assert plan.num_host_tier_pages == 0 and plan.consumer("host_tier").size_bytes == 0
    assert plan.num_full_context_requests <= plan.max_num_rows
    if c.guarantee_concurrency:
        assert plan.num_full_context_requests == plan.max_num_rows


@settings(max_examples=300, deadline=None)
@given(
    platforms(),
    measurements(),
    configs(),
    st.integers(min_value=0, max_value=64 * GIB),
    st.integers(min_value=0, max_value=64 * GIB),
)
def test_more_budget_never_gives_less(
    p: Platform, m: Measurements, c: MemoryConfig, extra: int, extra_budget: int
) -> None:
    c = dataclasses.replace(c, num_kv_pages=0)
    bigger_p = dataclasses.replace(
        p,
        device_free_bytes=p.device_free_bytes + extra,
        device_total_bytes=p.device_total_bytes + extra,
        host_available_bytes=p.host_available_bytes + extra,
    )
    bigger_c = dataclasses.replace(
        c, budget_bytes=c.budget_bytes + extra_budget if c.budget_bytes else 0
    )
    small_plan = _try(p, m, c)
    big_plan = _try(bigger_p, m, bigger_c)
    if isinstance(small_plan, PlanDoesNotFit):
        return
    assert isinstance(big_plan, MemoryPlan), "more memory made a fitting plan not fit"
    assert big_plan.num_kv_pages >= small_plan.num_kv_pages
    for b in small_plan.budgets:
        assert big_plan.budget(b.name).capacity_bytes >= b.capacity_bytes
