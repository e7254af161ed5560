"""Text tables for the memory plan (printed at startup) and for a plan that does not fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flared.memory.units import gib

if TYPE_CHECKING:
    from flared.memory.planner import Budget, Consumer, MemoryPlan

_ROW = "  {:<18} {:>18} {:>9}  {}"


def render_plan(plan: MemoryPlan) -> str:
    lines = [f"Flare memory plan ({plan.platform_description})"]
    for b in plan.budgets:
        used = plan.used_bytes(b.name)
        lines.append(
            f"{b.name}: capacity {b.capacity_bytes:,} bytes ({gib(b.capacity_bytes)} GiB) "
            f"= {b.source}"
        )
        lines.append(_ROW.format("consumer", "bytes", "GiB", "note"))
        for c in plan.consumers:
            if b.name in c.pools:
                lines.append(_ROW.format(c.name, f"{c.size_bytes:,}", gib(c.size_bytes), c.note))
        lines.append(_ROW.format("total", f"{used:,}", gib(used), ""))
        lines.append(
            _ROW.format("left", f"{b.capacity_bytes - used:,}", gib(b.capacity_bytes - used), "")
        )
    lines.append(
        f"capacity: KV {plan.kv_capacity_tokens:,} tokens ({plan.num_kv_pages:,} pages × "
        f"{plan.page_tokens}); {plan.max_num_rows} concurrent requests "
        f"({plan.num_state_rows} state rows); {plan.num_snapshots} snapshots; "
        f"{plan.num_full_context_requests} requests at {plan.target_context_tokens:,} tokens "
        f"fit at once; host tier {plan.num_host_tier_pages:,} pages"
    )
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(line.rstrip() for line in lines)


def render_shortfall(shortfalls: list[tuple[Budget, list[Consumer], int, str]]) -> str:
    lines: list[str] = []
    for budget, members, short, culprit in shortfalls:
        lines.append(
            f"memory plan does not fit in {budget.name}: short by {short:,} bytes "
            f"({gib(short)} GiB); first consumer that does not fit: {culprit}"
        )
        lines.append(
            f"{budget.name}: capacity {budget.capacity_bytes:,} bytes "
            f"({gib(budget.capacity_bytes)} GiB) = {budget.source}"
        )
        lines.append(_ROW.format("consumer", "bytes", "GiB", "cumulative GiB"))
        used = 0
        for c in members:
            used += c.size_bytes
            mark = ""
            if c.name == culprit:
                mark = f"  <-- does not fit: {used - budget.capacity_bytes:,} bytes over"
            lines.append(
                _ROW.format(c.name, f"{c.size_bytes:,}", gib(c.size_bytes), gib(used) + mark)
            )
    lines.append(
        "to fit: lower the [memory] option behind the consumers above (targets, snapshots, "
        "host tier, reserves) or raise memory.budget_fraction / memory.budget_bytes"
    )
    return "\n".join(line.rstrip() for line in lines)
