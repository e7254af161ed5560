"""Scheduler behaviour against the fake device: admission, prefill, decode, limits, cancel."""

from collections import deque

import pytest
from engine_fakes import FakeDevice, Transcript, assert_drained, create_scheduler, drive, token_for

from flared.engine.events import EngineEvent, FinishEvent, TokenEvent
from flared.engine.plan import NO_PAGE, FinishReason, RequestParams, StepPlan, StepResult
from flared.engine.scheduler import Scheduler


def params(max_tokens: int = 8, seed: int = 0, min_tokens: int = 0) -> RequestParams:
    return RequestParams(max_tokens=max_tokens, seed=seed, min_tokens=min_tokens)


def run_one(sched: Scheduler, device: FakeDevice) -> tuple[StepPlan, list[EngineEvent]]:
    """Plan, execute and complete one step with nothing else in flight."""
    plan = sched.plan()
    events = sched.complete(device.execute(plan))
    sched.check_integrity()
    return plan, events


def test_admission_is_strict_fifo() -> None:
    sched = create_scheduler(num_pages=6, page_size=4, max_num_rows=4)
    device = FakeDevice(sched.config)
    sched.submit("big1", [1] * 12, params(max_tokens=1))  # 3 + 1 pages
    sched.submit("big2", [1] * 12, params(max_tokens=1))  # 4 pages: only 2 left
    sched.submit("small", [1] * 2, params(max_tokens=1))  # 2 pages would fit, must not pass
    plan, _ = run_one(sched, device)
    assert [a.request_id for a in plan.admits] == ["big1"]
    admitted = [a.request_id for _ in range(10) for a in run_one(sched, device)[0].admits]
    assert admitted == ["big2", "small"]


def test_admission_writes_the_reserved_pages() -> None:
    sched = create_scheduler(page_size=4)
    sched.submit("a", [1] * 9, params())
    plan = sched.plan()
    (admit,) = plan.admits
    assert admit.prompt_token_ids == (1,) * 9
    writes = [(w.row, w.index) for w in plan.page_table_writes]
    assert writes == [(admit.row, i) for i in range(4)]  # ceil(9 / 4) + 1


def test_packed_prompt_reaches_the_admission() -> None:
    import struct

    from flared.engine.errors import InvalidRequest

    sched = create_scheduler(page_size=4)
    with pytest.raises(InvalidRequest, match="packed prompt"):
        sched.submit("bad", [1, 2], params(), packed=struct.pack("<q", 1))
    packed = struct.pack("<3q", 5, 6, 7)
    sched.submit("a", [5, 6, 7], params(), packed=packed)
    sched.submit("b", [5, 6], params())  # not packed: the runner converts the ids
    admits = {a.request_id: a for a in sched.plan().admits}
    assert admits["a"].prompt_packed == packed and admits["a"].prompt_token_ids == (5, 6, 7)
    assert admits["b"].prompt_packed is None


@pytest.mark.parametrize("prompt_len", [3, 4, 5, 7, 8, 9])
def test_chunked_prefill_slots_are_exact(prompt_len: int) -> None:
    sched = create_scheduler(page_size=4, max_prefill_chunk_tokens=3)
    device = FakeDevice(sched.config)
    sched.submit("a", list(range(100, 100 + prompt_len)), params(max_tokens=1), [2])
    chunks = []
    pages: dict[int, int] = {}
    transcript = Transcript()
    while sched.has_work():
        plan = sched.plan()
        pages.update((w.index, w.page_id) for w in plan.page_table_writes if w.page_id != NO_PAGE)
        transcript.add(sched.complete(device.execute(plan)))
        if plan.prefill is None:
            continue
        assert len(pages) == -(-prompt_len // 4) + 1  # all reserved at admission
        op = plan.prefill
        chunks.append(len(op.token_ids))
        expected = tuple(
            pages[p // 4] * 4 + p % 4 for p in range(op.start_pos, op.start_pos + len(op.token_ids))
        )
        assert op.slot_mapping == expected
        assert op.sample == (op.start_pos + len(op.token_ids) == prompt_len)
    # without the prefix cache nothing is captured, so the endpoint at 2 clips nothing
    assert chunks == [3] * (prompt_len // 3) + ([prompt_len % 3] if prompt_len % 3 else [])
    assert transcript.finishes["a"].completion_tokens == 1


def test_growth_is_exactly_one_position_ahead() -> None:
    sched = create_scheduler(page_size=4)
    device = FakeDevice(sched.config)
    sched.submit("a", [1] * 5, params(max_tokens=30))
    num_pages = 0
    next_pos = None
    for _ in range(40):
        plan = sched.plan()
        num_pages += sum(w.page_id != NO_PAGE for w in plan.page_table_writes)
        if plan.decode is not None:
            next_pos = device.rows[plan.decode.rows[0]].consumed
            # covers next_pos + 1, and no page earlier than that needs (3 are reserved)
            assert num_pages == max(3, (next_pos + 1) // 4 + 1)
        sched.complete(device.execute(plan))
        if not sched.has_work():
            break
    assert next_pos == 5 + 30 - 2
    assert_drained(sched, device)


def test_decode_capacity_caps_rows_oldest_first() -> None:
    sched = create_scheduler(decode_capacities=(1, 2), max_num_rows=4)
    device = FakeDevice(sched.config)
    for rid in "abcd":
        sched.submit(rid, [1, 2], params(max_tokens=3))
    transcript = Transcript()
    decode_sets = []
    while sched.has_work():
        plan, events = run_one(sched, device)
        transcript.add(events)
        if plan.decode:
            assert len(plan.decode.rows) <= 2
            decode_sets.append(plan.decode.request_ids)
    assert decode_sets[0] == ("a",) and ("a", "b") in decode_sets
    assert all(len(transcript.tokens[r]) == 3 for r in "abcd")


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("enforce", [True, False])
def test_every_request_gets_exactly_max_tokens(depth: int, enforce: bool) -> None:
    sched = create_scheduler()
    device = FakeDevice(sched.config, enforce_limits=enforce)
    for i in range(12):
        sched.submit(f"r{i}", [i + 1] * (1 + 3 * i), params(max_tokens=1 + i, seed=i))
    transcript = drive(sched, device, depth=depth)
    for i in range(12):
        rid = f"r{i}"
        assert transcript.tokens[rid] == [token_for(i, k, 1000) for k in range(1 + i)]
        assert transcript.finishes[rid] == FinishEvent(rid, FinishReason.LENGTH, 1 + 3 * i, 1 + i)
    assert_drained(sched, device)
    assert sched.stats()["generated_tokens_total"] == sum(range(1, 13))


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("enforce", [True, False])
def test_context_limit_finishes_capacity(depth: int, enforce: bool) -> None:
    sched = create_scheduler(max_context_tokens=20)
    device = FakeDevice(sched.config, enforce_limits=enforce)
    sched.submit("a", [1] * 15, params(max_tokens=100))
    sched.submit("b", [1] * 19, params(max_tokens=100))
    transcript = drive(sched, device, depth=depth)
    assert transcript.finishes["a"] == FinishEvent("a", FinishReason.CAPACITY, 15, 5)
    assert transcript.finishes["b"] == FinishEvent("b", FinishReason.CAPACITY, 19, 1)
    assert_drained(sched, device)


def test_eos_stops_early_and_late_device_finishes_are_ignored() -> None:
    sched = create_scheduler()
    device = FakeDevice(sched.config, eos_token_id=3, vocab_size=7)
    for i in range(10):
        sched.submit(f"r{i}", [1, 2, 3], params(max_tokens=40, seed=i))
    transcript = drive(sched, device, depth=2)
    for i in range(10):
        toks, fin = transcript.tokens[f"r{i}"], transcript.finishes[f"r{i}"]
        assert len(toks) <= 40
        assert (fin.reason is FinishReason.EOS) == (toks[-1] == 3 and 3 not in toks[:-1])
    assert device.num_invalid > 0  # late device finishes came back valid=False, ignored
    assert_drained(sched, device)


def test_two_in_flight_matches_one_in_flight() -> None:
    streams = []
    for depth in (1, 2):
        sched = create_scheduler(max_prefill_chunk_tokens=5, decode_capacities=(1, 2, 4))
        device = FakeDevice(sched.config, eos_token_id=5, vocab_size=11)
        for i in range(9):
            sched.submit(f"r{i}", [7] * (2 + 5 * i), params(max_tokens=3 + 2 * i, seed=10 * i))
        transcript = drive(sched, device, depth=depth)
        assert_drained(sched, device)
        streams.append((transcript.tokens, transcript.finishes))
    assert streams[0] == streams[1]


def test_host_dependency_flags_plans_that_follow_in_flight_work() -> None:
    sched = create_scheduler()
    device = FakeDevice(sched.config)
    sched.submit("a", [1, 2], params(max_tokens=5))
    first = sched.plan()
    second = sched.plan()
    assert first.host_dependency and first.prefill is not None and first.prefill.sample
    assert second.decode is not None and not second.host_dependency  # decodes a's pending token
    sched.complete(device.execute(first))
    sched.complete(device.execute(second))
    sched.check_integrity()


def test_complete_checks_order_and_plan_limits_in_flight() -> None:
    sched = create_scheduler()
    sched.submit("a", [1, 2], params())
    first, second = sched.plan(), sched.plan()
    with pytest.raises(RuntimeError):
        sched.plan()
    with pytest.raises(ValueError, match="expected step"):
        sched.complete(StepResult(second.step_id))
    with pytest.raises(ValueError, match="prefill sample"):
        sched.complete(StepResult(first.step_id))
    sched.check_integrity()


@pytest.mark.parametrize("depth", [1, 2])
def test_cancel_mid_stream_releases_after_in_flight_steps(depth: int) -> None:
    sched = create_scheduler()
    device = FakeDevice(sched.config)
    sched.submit("a", [1] * 9, params(max_tokens=50))
    sched.submit("b", [2] * 3, params(max_tokens=20, seed=1))
    pending: deque[StepResult] = deque()
    transcript = Transcript()
    while len(transcript.tokens.get("a", [])) < 4:
        while len(pending) < depth:
            pending.append(device.execute(sched.plan()))
        transcript.add(sched.complete(pending.popleft()))
    while len(pending) < depth:
        pending.append(device.execute(sched.plan()))
    emitted = len(transcript.tokens["a"])
    events = sched.cancel("a")
    assert events == [FinishEvent("a", FinishReason.CANCELLED, 9, emitted)]
    transcript.add(events)  # any later "a" event now fails the transcript
    assert sched.cancel("a") == [] and sched.cancel("nobody") == []
    assert sched.stats()["state_rows_free"] == sched.config.max_num_rows - 2  # still referenced
    sched.check_integrity()
    drive(sched, device, depth=depth, transcript=transcript, pending=pending)
    assert len(transcript.tokens["b"]) == 20
    assert sched.stats()["requests_cancelled_total"] == 1
    assert_drained(sched, device)


def test_cancel_waiting_request_and_reuse_the_id_at_once() -> None:
    sched = create_scheduler(max_num_rows=1)
    device = FakeDevice(sched.config)
    sched.submit("a", [1], params(max_tokens=30))
    sched.submit("b", [1, 2], params(max_tokens=2))
    assert sched.cancel("b") == [FinishEvent("b", FinishReason.CANCELLED, 2, 0)]
    first = sched.plan()
    second = sched.plan()
    transcript = Transcript()
    transcript.add(sched.complete(device.execute(first)))
    assert sched.cancel("a") == [FinishEvent("a", FinishReason.CANCELLED, 1, 1)]
    sched.submit("a", [4, 5], params(max_tokens=6, seed=99))  # same id, while old "a" in flight
    result = device.execute(second)
    assert any(t.valid for t in result.decoded)  # the old "a" really produced a token...
    assert sched.complete(result) == []  # ...which is dropped
    transcript = drive(sched, device)
    assert transcript.tokens["a"] == [token_for(99, k, 1000) for k in range(6)]
    assert transcript.finishes["a"].prompt_tokens == 2
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_by_recompute_keeps_counts_and_continues(depth: int) -> None:
    sched = create_scheduler(num_pages=10, page_size=4, max_num_rows=4)
    device = FakeDevice(sched.config)
    prompts = {f"r{i}": [10 + i] * (3 + i) for i in range(4)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.submit(rid, prompt, params(max_tokens=22, seed=i, min_tokens=5))
    transcript = drive(sched, device, depth=depth)
    assert sched.stats()["preemptions_total"] > 0
    for rid, prompt in prompts.items():
        assert transcript.finishes[rid] == FinishEvent(rid, FinishReason.LENGTH, len(prompt), 22)
    # The oldest request is never the victim: its stream is unbroken.
    assert transcript.tokens["r0"] == [token_for(0, k, 1000) for k in range(22)]
    readmits = [a for p in device.plans for a in p.admits if len(a.prompt_token_ids) > 7]
    assert readmits
    for op in readmits:
        original = prompts[op.request_id]
        generated = len(op.prompt_token_ids) - len(original)
        stream = transcript.tokens[op.request_id]
        assert op.prompt_token_ids == tuple(original) + tuple(stream[:generated])
        assert op.params.max_tokens == 22 - generated
        assert op.params.min_tokens == max(0, 5 - generated)
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_alone_and_out_of_pages_finishes_capacity(depth: int) -> None:
    sched = create_scheduler(num_pages=3, page_size=4)
    device = FakeDevice(sched.config)
    sched.submit("a", [1] * 8, params(max_tokens=100))
    transcript = drive(sched, device, depth=depth)
    # 3 pages cover positions 0..11; decodes at 8, 9, 10 (each needs the next position mapped).
    assert transcript.finishes["a"] == FinishEvent("a", FinishReason.CAPACITY, 8, 4)
    assert_drained(sched, device)


def test_stats_keys_and_token_events() -> None:
    sched = create_scheduler()
    device = FakeDevice(sched.config)
    sched.submit("a", [1, 2, 3], params(max_tokens=2))
    events = [e for _ in range(3) for e in run_one(sched, device)[1]]
    assert [type(e) for e in events] == [TokenEvent, TokenEvent, FinishEvent]
    assert set(sched.stats()) >= {
        "pages_total",
        "pages_free",
        "state_rows_total",
        "state_rows_free",
        "requests_running",
        "requests_waiting",
        "prompt_tokens_total",
        "generated_tokens_total",
        "preemptions_total",
        "requests_finished_total",
        "requests_cancelled_total",
        # the prefix cache (off here: all zero)
        "pages_cached",
        "snapshots_total",
        "snapshots_used",
        "prefix_hit_tokens_total",
        "page_pressure_total",
        "snapshot_pressure_total",
    }
    assert sched.stats()["prompt_tokens_total"] == 3


def test_a_prompts_first_chunk_takes_its_fresh_executions_saving() -> None:
    """With chunk costs where two 8-token chunks cost less than one of 16 (the near-tie), a
    16-token prompt is cut 8 + 8; with the fresh execution's saving at 16 (from 14 tokens on)
    it goes in one chunk (chunking's tests: later chunks are cut by the costs alone)."""
    costs = ((8, 10.0), (16, 20.5))
    for bonus, want in (((), [8, 8]), (((16, 14, 1.0),), [16])):
        sched = create_scheduler(prefill_chunk_costs=costs, prefill_fresh_bonus=bonus)
        device = FakeDevice(sched.config)
        sched.submit("a", list(range(100, 116)), params(max_tokens=1), [])
        chunks = []
        while sched.has_work():
            plan = sched.plan()
            if plan.prefill is not None:
                chunks.append((plan.prefill.start_pos, len(plan.prefill.token_ids)))
            sched.complete(device.execute(plan))
        assert [n for _, n in chunks] == want, (bonus, chunks)
        assert chunks[0][0] == 0
