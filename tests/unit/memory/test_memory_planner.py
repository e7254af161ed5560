"""Planner tables for a discrete H200, a 128 GB unified-memory machine and a cgroup-limited
machine (made-up measurements), the doesn't-fit message, and the plan's invariants."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from memory_cases import cgroup_limited, h200, hybrid_30b, qwen3_8b, spark

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

FIXED = (
    "driver_margin",
    "reserve",
    "weights",
    "operator_scratch",
    "graph_pool",
    "request_state",
    "state_rows",
    "snapshot_rows",
)


def _assert_invariants(plan: MemoryPlan, m: Measurements) -> None:
    plan.check_integrity()
    main = "unified" if plan.unified else "device"
    for b in plan.budgets:
        assert plan.used_bytes(b.name) <= b.capacity_bytes
    fixed = plan.used_bytes(main) - plan.consumer("kv_pages").size_bytes
    assert plan.num_kv_pages == (plan.budget(main).capacity_bytes - fixed) // m.kv_bytes_per_page
    assert 0 <= plan.free_bytes(main) < m.kv_bytes_per_page
    assert plan.kv_capacity_tokens == plan.num_kv_pages * m.page_tokens
    full = plan.num_kv_pages // plan.pages_per_request
    assert plan.num_full_context_requests == min(plan.max_num_rows, full)


def test_h200_discrete_budgets_are_separate() -> None:
    m = qwen3_8b()
    plan = plan_memory(h200(), m, MemoryConfig(host_tier_bytes=8 * GIB))
    _assert_invariants(plan, m)
    assert not plan.unified
    assert [b.name for b in plan.budgets] == ["device", "host", "shm"]
    device = plan.budget("device")
    assert device.capacity_bytes == int(0.9 * h200().device_total_bytes)
    # weights and KV live on the device, pinned buffers, rings and the host tier on the host
    device_names = [c.name for c in plan.consumers if "device" in c.pools]
    assert device_names == [*FIXED, "kv_pages"]
    host_names = [c.name for c in plan.consumers if "host" in c.pools]
    assert host_names == ["host_reserve", "pinned_host", "shm_rings", "host_tier"]
    assert plan.consumer("host_tier").size_bytes == 8 * GIB
    assert plan.num_host_tier_pages == 8 * GIB // m.kv_bytes_per_page
    assert plan.max_num_rows == 64 and plan.num_state_rows == 65
    assert plan.num_kv_pages == 48_799
    assert plan.kv_capacity_tokens == 780_784
    assert plan.num_full_context_requests == 23


H200_TABLE = """\
Flare memory plan (discrete GPU: NVIDIA H200)
device: capacity 135,679,338,086 bytes (126.36 GiB) = min(0.9 × 140.40 GiB device total: \
126.36 GiB, driver free: 139.82 GiB)
  consumer                        bytes       GiB  note
  driver_margin              67,108,864      0.06
  reserve                             0      0.00
  weights                17,179,869,184     16.00
  operator_scratch        2,147,483,648      2.00
  graph_pool              1,073,741,824      1.00
  request_state              77,856,768      0.07  64 rows
  state_rows                          0      0.00  65 rows
  snapshot_rows                       0      0.00  0 snapshots
  kv_pages              115,131,285,504    107.22  needs >= 2048 pages (1 × 32768 tokens)
  total                 135,677,345,792    126.36
  left                        1,992,294      0.00
host: capacity 128,849,018,880 bytes (120.00 GiB) = MemAvailable: 120.00 GiB
  consumer                        bytes       GiB  note
  host_reserve            2,147,483,648      2.00  left to the OS
  pinned_host               268,435,456      0.25
  shm_rings                 335,544,320      0.31  256 sessions × 1310720 bytes
  host_tier                           0      0.00
  total                   2,751,463,424      2.56
  left                  126,097,555,456    117.44
shm: capacity 68,719,476,736 bytes (64.00 GiB) = /dev/shm free
  consumer                        bytes       GiB  note
  shm_rings                 335,544,320      0.31  256 sessions × 1310720 bytes
  total                     335,544,320      0.31
  left                   68,383,932,416     63.69
capacity: KV 780,784 tokens (48,799 pages × 16); 64 concurrent requests (65 state rows); \
0 snapshots; 23 requests at 32,768 tokens fit at once; host tier 0 pages"""


def test_h200_table_golden() -> None:
    assert plan_memory(h200(), qwen3_8b(), MemoryConfig()).table() == H200_TABLE


def test_unified_one_budget_min_of_driver_and_os() -> None:
    m = hybrid_30b()
    cfg = MemoryConfig(target_snapshots=64, host_tier_bytes=32 * GIB)
    plan = plan_memory(spark(), m, cfg)
    _assert_invariants(plan, m)
    assert plan.unified
    assert [b.name for b in plan.budgets] == ["unified", "shm"]
    # MemAvailable (100 GiB) is below both the driver's free (110) and 0.9 × total (107.1)
    assert plan.budget("unified").capacity_bytes == 100 * GIB
    assert "MemAvailable" in plan.budget("unified").source
    # every consumer, host-side ones included, comes out of the one pool
    assert all("unified" in c.pools for c in plan.consumers)
    assert plan.used_bytes("unified") == sum(c.size_bytes for c in plan.consumers)
    # the host tier adds no capacity and the plan says so
    assert plan.consumer("host_tier").size_bytes == 0
    assert plan.num_host_tier_pages == 0
    assert any("adds no capacity" in n for n in plan.notes)
    assert "host tier of 32.00 GiB requested but not allocated" in plan.table()
    assert plan.num_state_rows == 1 + 32 * 4
    assert plan.consumer("state_rows").size_bytes == 129 * 48 * MIB
    assert plan.num_snapshots == 64
    assert plan.consumer("snapshot_rows").size_bytes == 64 * m.snapshot_row_bytes


def test_unified_driver_free_can_be_the_limit() -> None:
    p = dataclasses.replace(spark(), device_free_bytes=90 * GIB)
    plan = plan_memory(p, hybrid_30b(), MemoryConfig())
    assert plan.budget("unified").capacity_bytes == 90 * GIB


def test_cpu_only_is_planned_as_one_host_pool() -> None:
    p = Platform(host_total_bytes=64 * GIB, host_available_bytes=50 * GIB)
    m = dataclasses.replace(qwen3_8b(), weights_bytes=GIB)
    plan = plan_memory(p, m, MemoryConfig())
    assert plan.unified and plan.budgets[0].name == "unified"
    assert plan.budget("unified").capacity_bytes == 50 * GIB
    assert "CPU only" in plan.table()


def test_cgroup_limit_bounds_the_host_budget() -> None:
    m = qwen3_8b()
    plan = plan_memory(cgroup_limited(), m, MemoryConfig(host_tier_bytes=8 * GIB))
    _assert_invariants(plan, m)
    assert plan.budget("host").capacity_bytes == 18 * GIB  # 24 GiB limit − 6 GiB in use
    assert "cgroup limit − usage" in plan.budget("host").source


def test_cgroup_limited_doesnt_fit_names_the_consumer_and_amount() -> None:
    with pytest.raises(PlanDoesNotFit) as info:
        plan_memory(cgroup_limited(), qwen3_8b(), MemoryConfig(host_tier_bytes=16 * GIB))
    err = info.value
    assert err.pool == "host" and err.consumer == "host_tier"
    short = 2 * GIB + 256 * MIB + 256 * ((1 << 20) + (1 << 18)) + 16 * GIB - 18 * GIB
    assert err.short_bytes == short == 603_979_776
    text = str(err)
    assert text.splitlines()[0] == (
        "memory plan does not fit in host: short by 603,979,776 bytes (0.56 GiB); "
        "first consumer that does not fit: host_tier"
    )
    assert "host_tier              17,179,869,184     16.00  18.56  <-- does not fit" in text
    assert "cgroup limit − usage: 18.00 GiB" in text


def test_device_doesnt_fit_when_weights_exceed_free() -> None:
    p = dataclasses.replace(h200(), device_free_bytes=10 * GIB)
    with pytest.raises(PlanDoesNotFit) as info:
        plan_memory(p, qwen3_8b(), MemoryConfig())
    err = info.value
    assert (err.pool, err.consumer) == ("device", "weights")
    needed = 64 * MIB + 19 * GIB + 64 * 152064 * 8 + 2048 * qwen3_8b().kv_bytes_per_page
    assert err.short_bytes == needed - 10 * GIB
    assert f"short by {err.short_bytes:,} bytes" in str(err)
    for name in (*FIXED, "kv_pages"):
        assert f"\n  {name} " in str(err)


def test_minimum_kv_is_checked() -> None:
    # the fixed consumers fit, but not one request at the full context
    m = qwen3_8b()
    fixed = 64 * MIB + 19 * GIB + 64 * 152064 * 8
    p = dataclasses.replace(h200(), device_free_bytes=fixed + 100 * m.kv_bytes_per_page)
    with pytest.raises(PlanDoesNotFit) as info:
        plan_memory(p, m, MemoryConfig())
    assert info.value.consumer == "kv_pages"
    assert info.value.short_bytes == (2048 - 100) * m.kv_bytes_per_page
    short_ctx = MemoryConfig(target_context_tokens=1600)  # 100 pages
    assert plan_memory(p, m, short_ctx).num_kv_pages == 100


def test_guarantee_concurrency_needs_every_row_at_full_context() -> None:
    m = qwen3_8b()
    cfg = MemoryConfig(guarantee_concurrency=True)
    with pytest.raises(PlanDoesNotFit, match="kv_pages"):
        plan_memory(h200(), m, cfg)  # 64 × 2048 pages do not fit in 126 GiB
    ok = MemoryConfig(guarantee_concurrency=True, target_concurrency=16)
    plan = plan_memory(h200(), m, ok)
    assert plan.num_full_context_requests == 16 and plan.max_num_rows == 16


def test_pinned_pages_below_the_concurrency_guarantee_are_refused() -> None:
    m = qwen3_8b()
    cfg = MemoryConfig(guarantee_concurrency=True, target_concurrency=4, num_kv_pages=100)
    with pytest.raises(MemoryConfigError, match="num_kv_pages = 100 pins fewer pages"):
        plan_memory(h200(), m, cfg)
    enough = dataclasses.replace(cfg, num_kv_pages=4 * 2048)  # 4 × 32k tokens in pages of 16
    assert plan_memory(h200(), m, enough).num_full_context_requests == 4


def test_pinned_kv_pages() -> None:
    plan = plan_memory(h200(), qwen3_8b(), MemoryConfig(num_kv_pages=5000))
    assert plan.num_kv_pages == 5000
    assert plan.free_bytes("device") > 0
    with pytest.raises(PlanDoesNotFit):
        plan_memory(h200(), qwen3_8b(), MemoryConfig(num_kv_pages=10**6))


def test_rings_never_overcommit_shm() -> None:
    p = dataclasses.replace(h200(), shm_free_bytes=64 * MIB)
    with pytest.raises(PlanDoesNotFit) as info:
        plan_memory(p, qwen3_8b(), MemoryConfig())
    assert (info.value.pool, info.value.consumer) == ("shm", "shm_rings")
    assert info.value.short_bytes == 256 * ((1 << 20) + (1 << 18)) - 64 * MIB


def test_budget_bytes_and_reserve() -> None:
    m = qwen3_8b()
    cfg = MemoryConfig(budget_bytes=40 * GIB, reserve_bytes=4 * GIB)
    plan = plan_memory(h200(), m, cfg)
    assert plan.budget("device").capacity_bytes == 40 * GIB
    assert plan.consumer("reserve").size_bytes == 4 * GIB
    _assert_invariants(plan, m)
    # a budget above what is free is capped by the driver
    big = plan_memory(h200(), m, MemoryConfig(budget_bytes=1 << 50))
    assert big.budget("device").capacity_bytes == h200().device_free_bytes


def test_metrics_names_and_values() -> None:
    plan = plan_memory(h200(), qwen3_8b(), MemoryConfig())
    metrics = plan.as_metrics()
    for c in plan.consumers:
        assert metrics[f"flare_memory_{c.name}_bytes"] == c.size_bytes
    assert metrics["flare_memory_device_budget_bytes"] == plan.budget("device").capacity_bytes
    assert metrics["flare_memory_num_kv_pages"] == plan.num_kv_pages
    assert metrics["flare_memory_kv_capacity_tokens"] == plan.kv_capacity_tokens
    assert all(isinstance(v, int) and v >= 0 for v in metrics.values())
    assert all(k.startswith("flare_memory_") for k in metrics)


@pytest.mark.parametrize(
    ("field", "value"),
    [("budget_fraction", 0.0), ("budget_fraction", 1.5), ("reserve_bytes", -1)],
)
def test_bad_config_names_the_field(field: str, value: float) -> None:
    with pytest.raises(MemoryConfigError, match=field):
        plan_memory(h200(), qwen3_8b(), MemoryConfig(**{field: value}))  # type: ignore[arg-type]


def test_bad_measurement_names_the_field() -> None:
    with pytest.raises(MemoryConfigError, match="kv_bytes_per_page"):
        plan_memory(h200(), dataclasses.replace(qwen3_8b(), kv_bytes_per_page=0), MemoryConfig())


def test_memory_package_does_not_import_torch() -> None:
    code = (
        "import sys, flared.memory, flared.memory.device, flared.memory.planner;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3])


def test_pinned_pages_below_one_request_are_honoured_and_explained():
    """memory.num_kv_pages smaller than one full-context request is allocated as pinned (the
    scheduler rejects prompts larger than the pool at admission); the fit check uses the
    pinned count, and the KV line says what it means."""
    m = qwen3_8b()
    per_request = -(-m.max_context_tokens // m.page_tokens)
    plan = plan_memory(h200(), m, MemoryConfig(num_kv_pages=per_request // 2))
    plan.check_integrity()
    assert plan.num_kv_pages == per_request // 2 < plan.pages_per_request
    assert plan.num_full_context_requests == 0
    assert "larger prompts fail admission" in plan.consumer("kv_pages").note
