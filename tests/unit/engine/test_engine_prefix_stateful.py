"""Random admit / branch / append / follow / cancel / finish / preempt / evict sequences with the prefix
cache on, under tight page and snapshot pools; `check_integrity()` after every step.

Prompts are cut from a few shared base sequences and from finished conversations (an appended
turn, or a branch from an earlier point), so lookups hit at arbitrary lengths. The fake device
checks every restore against the prompt, every shared page against writes, and (with content
sampling) teardown replays finished requests cold: a cached continuation must match.
"""

from collections import deque
from dataclasses import dataclass, field

from engine_fakes import FakeDevice, assert_drained, drive
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flared.engine.errors import Busy, CapacityError
from flared.engine.events import EngineEvent, FinishEvent, TokenEvent
from flared.engine.plan import FinishReason, RequestParams, StepResult
from flared.engine.scheduler import MAX_STEPS_IN_FLIGHT, Scheduler, SchedulerConfig

VOCAB = 11
EOS = 3
BASES = [[(7 * b + 3 * i) % VOCAB for i in range(64)] for b in range(3)]


@dataclass
class Live:
    prompt: list[int]
    params: RequestParams
    tokens: list[int] = field(default_factory=list)


class PrefixCacheMachine(RuleBasedStateMachine):
    @initialize(
        pool_tokens=st.integers(8, 64),
        page_size=st.sampled_from([1, 2, 4, 8]),
        max_num_rows=st.integers(1, 4),
        chunk=st.integers(1, 8),
        max_context_tokens=st.integers(12, 48),
        num_snapshot_rows=st.integers(1, 8),
        eos=st.booleans(),
        recurrent_state=st.booleans(),
    )
    def setup(
        self,
        pool_tokens: int,
        page_size: int,
        max_num_rows: int,
        chunk: int,
        max_context_tokens: int,
        num_snapshot_rows: int,
        eos: bool,
        recurrent_state: bool,
    ) -> None:
        num_pages = max(3, pool_tokens // page_size)
        self.config = SchedulerConfig(
            num_pages,
            page_size,
            max_num_rows,
            (1, 2),
            chunk,
            max_context_tokens,
            4,
            num_snapshot_rows=num_snapshot_rows,
            model_id="m",
            recurrent_state=recurrent_state,
        )
        self.eos = EOS if eos else None
        self.sched = Scheduler(self.config)
        self.device = self._device(self.config)
        self.pending: deque[StepResult] = deque()
        self.live: dict[str, Live] = {}
        self.done: dict[str, tuple[Live, FinishEvent]] = {}
        self.next_id = 0

    def _device(self, config: SchedulerConfig) -> FakeDevice:
        return FakeDevice(config, eos_token_id=self.eos, vocab_size=VOCAB, content_sampling=True)

    def _take(self, events: list[EngineEvent]) -> None:
        for ev in events:
            live = self.live[ev.request_id]
            if isinstance(ev, TokenEvent):
                live.tokens.extend(t.token_id for t in ev.tokens)
                assert len(live.tokens) <= live.params.max_tokens
                continue
            assert isinstance(ev, FinishEvent)
            assert ev.completion_tokens == len(live.tokens)
            assert ev.prompt_tokens == len(live.prompt)
            assert 0 <= ev.cached_tokens <= len(live.prompt)
            del self.live[ev.request_id]
            self.done[ev.request_id] = (live, ev)

    def _submit(self, prompt: list[int], max_tokens: int, seed: int, ends: list[int]) -> None:
        prompt = prompt[: self.config.max_context_tokens]
        if not prompt:
            return
        endpoints = sorted({e for e in ends if 0 < e < len(prompt)})
        rid = f"r{self.next_id}"
        self.next_id += 1
        p = RequestParams(max_tokens=max_tokens, seed=seed)
        try:
            self.sched.submit(rid, prompt, p, endpoints)
        except CapacityError:
            cfg = self.config
            assert (
                len(prompt) + 1 > cfg.max_context_tokens
                or cfg.admission_pages(len(prompt)) > cfg.num_pages
            )
        except Busy:
            pass
        else:
            self.live[rid] = Live(prompt, p)

    @rule(
        base=st.integers(0, 2),
        length=st.integers(1, 24),
        suffix=st.lists(st.integers(0, VOCAB - 1), max_size=4),
        max_tokens=st.integers(1, 12),
        seed=st.integers(0, 3),
        ends=st.lists(st.integers(1, 44), max_size=3),
    )
    def admit(
        self,
        base: int,
        length: int,
        suffix: list[int],
        max_tokens: int,
        seed: int,
        ends: list[int],
    ) -> None:
        self._submit(BASES[base][:length] + suffix, max_tokens, seed, ends)

    @precondition(lambda self: bool(self.done))
    @rule(
        data=st.data(),
        extra=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5),
        max_tokens=st.integers(1, 6),
    )
    def append_or_branch(self, data: st.DataObject, extra: list[int], max_tokens: int) -> None:
        """Continue a finished conversation after its reply (cut = its whole history) or
        branch from an earlier point of it."""
        rid = data.draw(st.sampled_from(sorted(self.done)))
        live, _ = self.done[rid]
        history = live.prompt + live.tokens
        cut = data.draw(st.integers(1, len(history)))
        self._submit(history[:cut] + extra, max_tokens, 1, [cut])

    @precondition(lambda self: bool(self.done))
    @rule(data=st.data(), max_tokens=st.integers(1, 6))
    def repeat(self, data: st.DataObject, max_tokens: int) -> None:
        """The same prompt again: a full-prompt hit if its prompt checkpoint survived."""
        live, _ = self.done[data.draw(st.sampled_from(sorted(self.done)))]
        self._submit(live.prompt, max_tokens, 2, [])

    @precondition(lambda self: bool(self.live))
    @rule(
        data=st.data(),
        extra=st.lists(st.integers(0, VOCAB - 1), max_size=3),
        max_tokens=st.integers(1, 6),
    )
    def follow(self, data: st.DataObject, extra: list[int], max_tokens: int) -> None:
        """Share a running request's prompt while its captures may still be in flight: the
        new request may restore from a checkpoint that is not published yet."""
        live = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        cut = data.draw(st.integers(1, len(live.prompt)))
        self._submit(live.prompt[:cut] + extra, max_tokens, 3, [cut])

    @rule(base=st.integers(0, 2), length=st.integers(1, 24), max_tokens=st.integers(1, 6))
    def twins(self, base: int, length: int, max_tokens: int) -> None:
        """One prompt twice at once: equal captures race (duplicate publication)."""
        for _ in range(2):
            self._submit(BASES[base][:length], max_tokens, 0, [length // 2])

    @rule(length=st.integers(1, 12), max_tokens=st.integers(8, 16))
    def burst(self, length: int, max_tokens: int) -> None:
        """Several long generations at once: growth runs out of pages (preemption)."""
        for b in range(3):
            self._submit(BASES[b][:length], max_tokens, b, [])

    @precondition(lambda self: self.sched.num_in_flight < MAX_STEPS_IN_FLIGHT)
    @rule()
    def plan(self) -> None:
        self.pending.append(self.device.execute(self.sched.plan()))

    @precondition(lambda self: bool(self.pending))
    @rule()
    def complete(self) -> None:
        self._take(self.sched.complete(self.pending.popleft()))

    @rule(n=st.integers(1, 12))
    def run_steps(self, n: int) -> None:
        """Up to n plan/complete rounds, two steps in flight."""
        for _ in range(n):
            if self.sched.num_in_flight < MAX_STEPS_IN_FLIGHT and self.sched.has_work():
                self.plan()
            if self.pending:
                self.complete()
            self.sched.check_integrity()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        events = self.sched.cancel(rid)
        assert [type(e) for e in events] == [FinishEvent]
        self._take(events)

    @rule()
    def evict(self) -> None:
        self.sched.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "sched"):
            self.sched.check_integrity()
            stats = self.sched.stats()
            assert min(stats.values()) >= 0
            assert stats["snapshots_used"] <= stats["snapshots_total"]
            assert stats["pages_cached"] + stats["pages_free"] <= stats["pages_total"]

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
        self._replay_cold()

    def _replay_cold(self) -> None:
        """Finished requests admitted once (never preempted) match a cold engine's stream."""
        admits: dict[str, int] = {}
        for plan in self.device.plans:
            for a in plan.admits:
                admits[a.request_id] = admits.get(a.request_id, 0) + 1
        checked = 0
        for rid, (live, fin) in self.done.items():
            if fin.reason is FinishReason.CANCELLED or admits.get(rid) != 1 or checked >= 3:
                continue
            config = SchedulerConfig(**{**self.config.__dict__, "num_snapshot_rows": 0})
            sched = Scheduler(config)
            device = self._device(config)
            sched.submit("cold", live.prompt, live.params)
            tokens = drive(sched, device).tokens.get("cold", [])
            if fin.reason is FinishReason.CAPACITY:
                assert live.tokens == tokens[: len(live.tokens)]
            else:
                assert live.tokens == tokens, f"{rid}: cached continuation differs from cold"
            checked += 1


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
