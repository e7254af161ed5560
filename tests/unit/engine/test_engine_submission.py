"""Configuration validation, submission rejections, and the seed derivation."""

from typing import Any

import pytest
from engine_fakes import DEFAULTS, create_scheduler

from flared.engine.errors import Busy, CapacityError, EngineRejection, InvalidRequest
from flared.engine.plan import RequestParams
from flared.engine.scheduler import SchedulerConfig
from flared.engine.seeds import derive_seed

P = RequestParams(max_tokens=4)


@pytest.mark.parametrize(
    "bad",
    [
        {"num_pages": 0},
        {"page_size": 0},
        {"max_num_rows": 0},
        {"max_prefill_chunk_tokens": 0},
        {"max_context_tokens": 1},
        {"max_num_waiting": -1},
        {"decode_capacities": ()},
        {"decode_capacities": (0, 2)},
        {"decode_capacities": (4, 2)},
        {"decode_capacities": (2, 2)},
        {"num_snapshot_rows": -1},
    ],
)
def test_config_rejects_invalid_values(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**{**DEFAULTS, **bad})


def test_config_derived_sizes() -> None:
    cfg = SchedulerConfig(**{**DEFAULTS, "page_size": 4, "max_context_tokens": 9})
    assert cfg.max_decode_rows == 8
    assert cfg.admission_pages(8) == 3 and cfg.admission_pages(9) == 4
    assert cfg.max_pages_per_row == 3  # a prompt of 8 tokens


def test_invalid_requests() -> None:
    sched = create_scheduler()
    with pytest.raises(InvalidRequest, match="empty"):
        sched.submit("a", [], P)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        sched.submit("a", [1], RequestParams(max_tokens=0))
    for endpoints in ([0], [3], [2, 1], [1, 1]):
        with pytest.raises(InvalidRequest, match="endpoints"):
            sched.submit("a", [1, 2, 3], P, endpoints)
    sched.submit("a", [1, 2, 3], P, [1, 2])
    with pytest.raises(InvalidRequest, match="already live"):
        sched.submit("a", [1], P)


def test_context_limit_message_names_the_limit() -> None:
    sched = create_scheduler(max_context_tokens=8192, num_pages=10_000)
    with pytest.raises(CapacityError) as info:
        sched.submit("a", [1] * 9000, P)
    assert str(info.value) == "prompt of 9000 tokens + 1 exceeds the context limit of 8192 tokens"
    sched.submit("b", [1] * 8191, P)  # prompt + one output fits exactly
    with pytest.raises(CapacityError, match="8192 tokens"):
        sched.submit("c", [1] * 8192, P)


def test_prompt_larger_than_the_pool() -> None:
    sched = create_scheduler(num_pages=4, page_size=4)
    sched.submit("fits", [1] * 12, P)  # 3 pages + 1
    with pytest.raises(CapacityError, match="pool of 4 pages"):
        sched.submit("too-big", [1] * 13, P)  # 4 pages + 1


def test_busy_when_the_waiting_queue_is_full() -> None:
    sched = create_scheduler(max_num_waiting=2, max_num_rows=1)
    sched.submit("a", [1], P)
    sched.submit("b", [1], P)
    with pytest.raises(Busy, match="2 requests"):
        sched.submit("c", [1], P)
    sched.plan()  # admits a
    sched.submit("c", [1], P)


def test_rejections_change_nothing() -> None:
    sched = create_scheduler(max_num_waiting=1)
    sched.submit("a", [1], P)
    before = sched.stats()
    for args in (("a", [1]), ("b", []), ("b", [1] * 300), ("b", [1])):
        with pytest.raises(EngineRejection):
            sched.submit(args[0], args[1], P)
    assert sched.stats() == before
    sched.check_integrity()


def test_derive_seed_is_a_deterministic_63_bit_mix() -> None:
    assert derive_seed(7, 3) == derive_seed(7, 3)
    seeds = {derive_seed(s, n) for s in range(20) for n in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert 0 <= derive_seed(-1, 5) < 2**63 and 0 <= derive_seed(2**70, 5) < 2**63
    with pytest.raises(ValueError):
        derive_seed(1, -1)


def test_a_request_is_reproducible_when_it_names_a_seed_or_one_token() -> None:
    """RequestParams.reproducible: a seed of the client's own, or top_k = 1 (defaults included),
    keeps the request on the batch-invariant decode executions; otherwise the engine drew the
    seed and a lone step may take the faster one-row products."""
    from flared.requests import SamplingParams, resolve_params
    from prep.bundle import SamplingDefaults

    def resolved(sp: SamplingParams, defaults: SamplingDefaults | None = None) -> RequestParams:
        return resolve_params(
            sp, defaults or SamplingDefaults(), max_tokens=4, logprobs=0, stop_token_ids=(),
            min_tokens=0, ignore_eos=False, max_top_logprobs=0, max_stop_token_ids=4,
            vocab_size=100,
        )  # fmt: skip

    assert resolved(SamplingParams(seed=0)).reproducible
    assert resolved(SamplingParams(top_k=1)).reproducible
    assert resolved(SamplingParams(), SamplingDefaults(top_k=1)).reproducible
    for sp in (SamplingParams(), SamplingParams(top_k=20), SamplingParams(top_k=-1)):
        params = resolved(sp)
        assert not params.reproducible and 0 <= params.seed < 2**63
    assert RequestParams().reproducible  # built by hand: the invariant executions
