"""A grammar-constrained request runs with one step in flight while unconstrained ones keep two:
it is never planned while a step that references it is still in flight."""

from __future__ import annotations

from collections import deque

from engine_fakes import FakeDevice, create_scheduler

from flared.engine.plan import RequestParams


def test_constrained_request_is_never_planned_while_in_flight() -> None:
    sched = create_scheduler()
    device = FakeDevice(sched.config)
    sched.submit("c", (1, 2, 3), RequestParams(seed=1, max_tokens=12, constrained=True))
    sched.submit("u", (4, 5, 6), RequestParams(seed=2, max_tokens=12))
    in_flight: deque[tuple[object, set[str]]] = deque()
    counts = {"c": 0, "u": 0}
    finished: set[str] = set()
    for _ in range(200):
        while len(in_flight) < 2 and sched.has_work():
            plan = sched.plan()
            rids = set(plan.decode.request_ids if plan.decode else ())
            if plan.prefill is not None:
                rids.add(plan.prefill.request_id)
            if "c" in rids:  # its mask needs its previous token: nothing of it in flight
                assert all("c" not in earlier for _p, earlier in in_flight)
            in_flight.append((plan, rids))
            if plan.is_empty:
                break
        if not in_flight:
            break
        plan, _ = in_flight.popleft()
        for ev in sched.complete(device.execute(plan)):  # type: ignore[arg-type]
            if hasattr(ev, "tokens"):
                counts[ev.request_id] += len(ev.tokens)
            else:
                finished.add(ev.request_id)
        sched.check_integrity()
    assert finished == {"c", "u"} and counts == {"c": 12, "u": 12}
