"""Random submit / plan / complete / cancel sequences, with integrity checked after each step."""

from collections import deque
from dataclasses import dataclass

from engine_fakes import FakeDevice, assert_drained
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from flared.engine.errors import Busy, CapacityError, InvalidRequest
from flared.engine.events import EngineEvent, FinishEvent, TokenEvent
from flared.engine.plan import FinishReason, RequestParams, StepResult
from flared.engine.scheduler import MAX_STEPS_IN_FLIGHT, Scheduler, SchedulerConfig

IDS = "abcdef"
EOS = 3


@dataclass
class Expected:
    prompt_len: int
    max_tokens: int
    num_tokens: int = 0


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_pages=st.integers(3, 24),
        page_size=st.sampled_from([1, 2, 4, 8]),
        max_num_rows=st.integers(1, 4),
        capacities=st.sampled_from([(1,), (1, 2), (2, 4)]),
        chunk=st.integers(1, 8),
        max_context_tokens=st.integers(4, 48),
        eos=st.booleans(),
    )
    def setup(
        self,
        num_pages: int,
        page_size: int,
        max_num_rows: int,
        capacities: tuple[int, ...],
        chunk: int,
        max_context_tokens: int,
        eos: bool,
    ) -> None:
        self.config = SchedulerConfig(
            num_pages, page_size, max_num_rows, capacities, chunk, max_context_tokens, 3
        )
        self.sched = Scheduler(self.config)
        self.device = FakeDevice(self.config, eos_token_id=EOS if eos else None, vocab_size=13)
        self.pending: deque[StepResult] = deque()
        self.live: dict[str, Expected] = {}

    def _take(self, events: list[EngineEvent]) -> None:
        for ev in events:
            exp = self.live[ev.request_id]  # KeyError: an event for a request that is over
            if isinstance(ev, TokenEvent):
                exp.num_tokens += len(ev.tokens)
                assert exp.num_tokens <= exp.max_tokens
                assert exp.prompt_len + exp.num_tokens <= self.config.max_context_tokens
                continue
            assert isinstance(ev, FinishEvent)
            assert ev.completion_tokens == exp.num_tokens
            assert ev.prompt_tokens == exp.prompt_len
            if ev.reason is FinishReason.LENGTH:
                assert exp.num_tokens == exp.max_tokens
            del self.live[ev.request_id]

    @rule(
        rid=st.sampled_from(IDS),
        prompt_len=st.integers(1, 40),
        max_tokens=st.integers(1, 16),
        seed=st.integers(0, 2**32),
        raw_endpoints=st.sets(st.integers(1, 39), max_size=3),
    )
    def submit(
        self, rid: str, prompt_len: int, max_tokens: int, seed: int, raw_endpoints: set[int]
    ) -> None:
        endpoints = sorted(e for e in raw_endpoints if e < prompt_len)
        prompt = [(seed + i) % 13 for i in range(prompt_len)]
        waiting = self.sched.stats()["requests_waiting"]
        try:
            self.sched.submit(
                rid, prompt, RequestParams(max_tokens=max_tokens, seed=seed), endpoints
            )
        except InvalidRequest:
            assert rid in self.live
        except CapacityError:
            cfg = self.config
            assert (
                prompt_len + 1 > cfg.max_context_tokens
                or cfg.admission_pages(prompt_len) > cfg.num_pages
            )
        except Busy:
            assert waiting >= self.config.max_num_waiting
        else:
            assert rid not in self.live
            self.live[rid] = Expected(prompt_len, max_tokens)

    @precondition(lambda self: self.sched.num_in_flight < MAX_STEPS_IN_FLIGHT)
    @rule()
    def plan(self) -> None:
        self.pending.append(self.device.execute(self.sched.plan()))

    @precondition(lambda self: bool(self.pending))
    @rule()
    def complete(self) -> None:
        self._take(self.sched.complete(self.pending.popleft()))

    @rule(rid=st.sampled_from(IDS + "z"))
    def cancel(self, rid: str) -> None:
        events = self.sched.cancel(rid)
        if rid in self.live:
            exp = self.live[rid]
            assert events == [
                FinishEvent(rid, FinishReason.CANCELLED, exp.prompt_len, exp.num_tokens)
            ]
        else:
            assert events == []
        self._take(events)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_integrity()
            stats = self.sched.stats()
            assert min(stats.values()) >= 0
            assert stats["requests_running"] + stats["requests_waiting"] <= len(self.live)

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(10_000):
            if self.sched.num_in_flight < MAX_STEPS_IN_FLIGHT and self.sched.has_work():
                self.plan()
            elif self.pending:
                self.complete()
            else:
                break
            self.sched.check_integrity()
        assert not self.live, f"requests never finished: {self.live}"
        assert_drained(self.sched, self.device)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase
