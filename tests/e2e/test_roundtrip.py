"""Requests through a real daemon (socket + shared-memory rings) equal the in-process engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_support import Daemon, is_baseline, wait_baseline

from libflare_client import (
    AsyncClient,
    CapacityError,
    Client,
    InvalidRequest,
    SamplingParams,
)

CASES: list[dict[str, Any]] = [
    dict(prompt=[1, 2, 3, 4, 5], max_tokens=12, seed=7, logprobs=3),
    dict(prompt=list(range(10, 60)), max_tokens=9, seed=11, logprobs=0),  # > 32 ids: prompt ring
    dict(prompt=[7] * 3, max_tokens=16, seed=3, logprobs=1, temperature=1.3, top_k=5),
    dict(prompt=list(range(100, 300)), max_tokens=5, seed=99, logprobs=2, top_p=0.5),
]


@pytest.fixture(scope="module")
def engine(tiny_bundle: Path) -> Iterator[Any]:
    from flared.llm_engine import Engine, EngineConfig

    e = Engine(tiny_bundle, EngineConfig(device="cpu", compile=False)).start()
    yield e
    e.shutdown()


def _sampling(case: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        temperature=case.get("temperature"), top_k=case.get("top_k"), top_p=case.get("top_p"),
        seed=case["seed"],
    )  # fmt: skip


@pytest.mark.parametrize("transport", ["ring", "socket"])
def test_daemon_equals_in_process_engine(daemon: Daemon, engine: Any, transport: str) -> None:
    from flared.requests import SamplingParams as EngineSampling

    with Client(daemon.socket, transport=transport) as c:
        for case in CASES:
            s = _sampling(case)
            kw = dict(max_tokens=case["max_tokens"], logprobs=case["logprobs"], ignore_eos=True)
            got = c.generate(prompt_token_ids=case["prompt"], sampling=s, **kw)
            want = engine.generate(case["prompt"], sampling=EngineSampling(**vars(s)), **kw)
            assert got.token_ids == want.token_ids
            assert got.finish_reason == "length"
            assert got.usage.completion_tokens == case["max_tokens"]
            assert got.usage.prompt_tokens == len(case["prompt"])
            if case["logprobs"]:
                assert [lp.logprob for lp in got.logprobs] == pytest.approx(
                    [t.logprob for t in want.tokens]
                )
                assert [lp.top for lp in got.logprobs] == [
                    [(a, pytest.approx(b)) for a, b in t.top_logprobs] for t in want.tokens
                ]
            else:
                assert got.logprobs == []


def test_stream_events_add_up_to_generate(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        kw = dict(max_tokens=10, sampling=SamplingParams(seed=5), ignore_eos=True)
        events = list(c.stream(prompt_token_ids=[3, 4, 5], **kw))
        whole = c.generate(prompt_token_ids=[3, 4, 5], **kw)
    assert all(ev.finish_reason is None for ev in events[:-1])
    assert events[-1].finish_reason == "length" and events[-1].usage is not None
    assert [t for ev in events for t in ev.token_ids] == whole.token_ids
    assert "".join(ev.text for ev in events) == whole.text
    assert len(whole.text) > 0


def test_render_chat_and_messages_match_the_frontend(daemon: Daemon, tiny_bundle: Path) -> None:
    from flared.frontend.text import TextFrontend

    fe = TextFrontend.from_bundle(tiny_bundle)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there, fox"},
    ]
    local = fe.render(messages)
    with Client(daemon.socket) as c:
        r = c.render(messages)
        assert r.token_ids == local.token_ids
        assert r.message_end_token_offsets == local.message_end_token_offsets
        s = SamplingParams(seed=2)
        by_messages = c.generate(messages=messages, max_tokens=8, sampling=s)
        by_ids = c.generate(prompt_token_ids=local.token_ids, max_tokens=8, sampling=s)
        chat = c.chat(messages, max_tokens=8, sampling=s)
    assert by_messages.token_ids == by_ids.token_ids == chat.token_ids
    assert chat.content == by_ids.text == fe.decode(by_ids.token_ids)
    assert chat.reasoning is None and chat.tool_calls == []
    assert chat.usage.prompt_tokens == len(local.token_ids)


def test_cancel_ends_the_stream_with_cancelled(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        reasons = []
        for ev in c.stream(prompt_token_ids=[1, 2], max_tokens=400, ignore_eos=True,
                           request_id="cancel-me"):  # fmt: skip
            if ev.finish_reason is None and ev.token_ids:
                c.cancel("cancel-me")
            reasons.append(ev.finish_reason)
        assert reasons[-1] == "cancelled"
        assert len(reasons) < 400
    assert is_baseline(wait_baseline(daemon.socket))


def test_breaking_out_of_a_stream_cancels_it(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        for _ev in c.stream(prompt_token_ids=[1, 2], max_tokens=400, ignore_eos=True):
            break
    assert is_baseline(wait_baseline(daemon.socket))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(prompt_token_ids=[1], sampling=SamplingParams(temperature=0.0)), InvalidRequest),
        (dict(prompt_token_ids=[1, 10_000]), InvalidRequest),  # outside the vocabulary
        (dict(prompt_token_ids=[]), InvalidRequest),
        (dict(prompt_token_ids=[1], max_tokens=0), InvalidRequest),
        (dict(prompt_token_ids=[1], logprobs=999), InvalidRequest),
        (dict(prompt_token_ids=[1] * 600), CapacityError),  # context is 512
        (dict(messages=[{"role": "user", "content": 5}]), InvalidRequest),
        (dict(prompt_token_ids=[1], request_id="x" * 300), InvalidRequest),
    ],
)
def test_typed_errors(daemon: Daemon, kwargs: dict[str, Any], error: type[Exception]) -> None:
    with Client(daemon.socket) as c:
        with pytest.raises(error):
            c.generate(**kwargs)
        with pytest.raises(error):  # through the stream's pump too, and the client goes on
            list(c.stream(**kwargs))
        assert c.generate(prompt_token_ids=[1], max_tokens=2).usage.completion_tokens >= 1
        assert len(list(c.stream(prompt_token_ids=[1], max_tokens=2, ignore_eos=True))) >= 1


def test_request_ids_are_per_client(daemon: Daemon) -> None:
    """A live id is refused within its client; another client's requests live in a namespace
    of their own, so the same id there is simply another request (and a's is unaffected)."""
    with Client(daemon.socket) as a, Client(daemon.socket) as b:
        it = a.stream(prompt_token_ids=[1], max_tokens=300, ignore_eos=True, request_id="dup")
        n = len(next(it).token_ids)
        with pytest.raises(InvalidRequest, match="already in flight"):
            a.generate(prompt_token_ids=[1], request_id="dup")
        r = b.generate(prompt_token_ids=[1], max_tokens=3, ignore_eos=True, request_id="dup")
        assert r.request_id == "dup" and len(r.token_ids) == 3
        n += sum(len(ev.token_ids) for ev in it)
        assert n == 300


def test_async_client_concurrent_streams(daemon: Daemon) -> None:
    async def main() -> list[int]:
        async with AsyncClient(daemon.socket) as c:
            rs = await asyncio.gather(
                *[
                    c.generate(
                        prompt_token_ids=[i + 1, 2],
                        max_tokens=6 + i,
                        ignore_eos=True,
                        sampling=SamplingParams(seed=i),
                    )
                    for i in range(12)
                ]
            )
            st = await c.stats()
            assert st["health"] == "ready"
            return [len(r.token_ids) for r in rs]

    assert asyncio.run(main()) == [6 + i for i in range(12)]


def test_anticipating_reader_streams_the_same_tokens_and_learns_the_cadence(
    daemon: Daemon,
) -> None:
    """A client that wakes before each expected batch (shm_protocol/cadence.py) gets exactly
    what a doorbell-only client gets; on a steady decode stream it learns the step period and
    opens poll windows. Whether a window catches its batch depends on timing, so only the
    tokens and the windows' existence are asserted (the benchmark measures the catch rate)."""
    kw: dict[str, Any] = dict(
        prompt_token_ids=[5, 6, 7], max_tokens=96, ignore_eos=True,
        sampling=SamplingParams(seed=5),
    )  # fmt: skip
    with Client(daemon.socket, anticipate_events=False) as plain:  # doorbells only
        want = plain.generate(**kw)
        assert plain.transport_stats()["poll_windows"] == 0
        assert plain.transport_stats()["anticipating"] == 0
    with Client(daemon.socket, anticipate_events=True) as c:
        got = [t for ev in c.stream(**kw) for t in ev.token_ids]
        stats = c.transport_stats()
    assert got == want.token_ids
    assert stats["poll_windows"] > 0, stats
    assert stats["anticipating"] == 1
    assert stats["polls_caught"] <= stats["poll_windows"]
    assert 0 <= stats["late_publishes"] < 96


def test_a_stale_timer_readiness_does_not_start_a_poll_window(daemon: Daemon) -> None:
    """The event loop may report the wake timer ready in the same iteration as the doorbell;
    the doorbell's drain re-arms the timer for the next window, so the timer's callback must
    not poll (its sleep withdrawn, the daemon would ring no doorbell) until that window ends."""
    import select
    import time

    async def main() -> tuple[float, dict[str, int], bool]:
        async with AsyncClient(daemon.socket, anticipate_events=True) as c:
            await c.generate(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
            conn = await c.connect()
            timer, ring = conn._timer, conn._events
            assert timer is not None and ring is not None
            conn._drain_events()  # settle: everything taken, the sleep declared
            assert ring.asleep
            before = dict(conn.transport_counters)
            timer.arm_at(time.monotonic() - 1.0)
            assert select.select([timer.fd], [], [], 1.0)[0]  # what the loop saw...
            timer.arm_at(time.monotonic() + 30.0)  # ...before a doorbell's drain re-armed it
            conn._poll_until = time.monotonic() + 2.0
            t0 = time.monotonic()
            conn._on_timer()
            took = time.monotonic() - t0
            stats = {k: conn.transport_counters[k] - before[k] for k in before}
            asleep = ring.asleep
            timer.disarm()
            return took, stats, asleep

    took, stats, asleep = asyncio.run(main())
    assert took < 0.5, f"polled {took:.2f} s for a window that was re-armed"
    assert stats["poll_windows"] == 0
    assert asleep  # the sleep declaration stands: the next batch rings its doorbell


def test_an_oversized_request_fails_alone(daemon: Daemon) -> None:
    """A request whose frame is over the daemon's limit is refused by the client before it is
    sent (the daemon would close the connection for it, failing every other request of this
    client): InvalidRequest, and the client's other stream runs to the end."""
    with Client(daemon.socket) as c:
        it = c.stream(prompt_token_ids=[1], max_tokens=200, ignore_eos=True)
        n = len(next(it).token_ids)
        huge = [{"role": "user", "content": "many words " * 200_000}]  # ~2.2 MB of text
        with pytest.raises(InvalidRequest, match="max_frame_bytes"):
            c.generate(messages=huge, max_tokens=2)
        with pytest.raises(InvalidRequest, match="max_frame_bytes"):
            c.render(huge)
        n += sum(len(ev.token_ids) for ev in it)
        assert n == 200
        assert len(c.generate(prompt_token_ids=[3], max_tokens=2, ignore_eos=True).token_ids) == 2
        # a long token-id prompt (it would go through the prompt ring) with an oversized rest:
        # refused before its ring record is written, so the next ring prompt is its own
        ids = list(range(3, 403))
        with pytest.raises(InvalidRequest, match="max_frame_bytes"):
            c.generate(prompt_token_ids=ids, stop=["x" * (2 << 20)], max_tokens=2)
        seeded = {"max_tokens": 4, "ignore_eos": True, "sampling": SamplingParams(seed=5)}
        after = c.generate(prompt_token_ids=ids[::-1], **seeded)
        assert after.usage.prompt_tokens == 400
    with Client(daemon.socket) as fresh:
        assert fresh.generate(prompt_token_ids=ids[::-1], **seeded).token_ids == after.token_ids


def test_the_first_event_reports_the_prompt_length(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        events = list(c.stream(prompt_token_ids=[4, 5, 6, 7], max_tokens=3, ignore_eos=True))
        assert events[0].prompt_tokens == 4 and events[0].token_ids
        assert all(e.prompt_tokens is None for e in events[1:])
        assert events[-1].usage is not None and events[-1].usage.prompt_tokens == 4
        msgs = [{"role": "user", "content": "hello there"}]
        first = next(iter(c.stream(messages=msgs, max_tokens=2, ignore_eos=True)))
        assert first.prompt_tokens == len(c.render(msgs).token_ids)
