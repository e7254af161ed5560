"""flare-http's wait for a starting daemon: one health poll shared by every waiting request,
a bounded wait, and no poll left running once no request waits."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette")

from libflare_client import ConnectionLost
from libflare_client.http.app import START_POLL_S, StartWatch


class StartingDaemon:
    """health() answers "starting" `polls` times, then `then`."""

    def __init__(self, polls: int, then: str | Exception = "ready") -> None:
        self.polls, self.then, self.calls = polls, then, 0

    async def health(self) -> str:
        self.calls += 1
        await asyncio.sleep(0)
        if self.calls <= self.polls:
            return "starting"
        if isinstance(self.then, Exception):
            raise self.then
        return self.then


def test_waiting_requests_share_one_poll() -> None:
    daemon = StartingDaemon(polls=5)

    async def main() -> list[str]:
        watch = StartWatch(daemon)  # type: ignore[arg-type]
        return list(await asyncio.gather(*(watch.wait(30.0) for _ in range(50))))

    assert asyncio.run(main()) == ["ready"] * 50
    assert daemon.calls == 6  # five "starting", one "ready": for all fifty requests


def test_a_wait_ends_at_its_timeout_and_the_poll_stops_with_its_last_waiter() -> None:
    daemon = StartingDaemon(polls=10**9)

    async def main() -> tuple[str, int, int]:
        watch = StartWatch(daemon)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        state = await watch.wait(3 * START_POLL_S)
        took = loop.time() - t0
        assert 3 * START_POLL_S <= took < 3 * START_POLL_S + 1.0, took
        calls = daemon.calls
        await asyncio.sleep(3 * START_POLL_S)  # the poll noticed no one waits and ended
        return state, calls, daemon.calls

    state, calls, later = asyncio.run(main())
    assert state == "starting" and 2 <= calls <= 5 and later <= calls + 1


def test_a_daemon_lost_while_starting_ends_every_wait_with_the_error() -> None:
    daemon = StartingDaemon(polls=2, then=ConnectionLost("the daemon closed the connection"))

    async def main() -> list[object]:
        watch = StartWatch(daemon)  # type: ignore[arg-type]
        return list(
            await asyncio.gather(*(watch.wait(30.0) for _ in range(3)), return_exceptions=True)
        )

    assert all(isinstance(r, ConnectionLost) for r in asyncio.run(main()))


def test_other_states_end_the_wait_at_once() -> None:
    for state in ("draining", "failed", "ready"):
        daemon = StartingDaemon(polls=0, then=state)
        assert asyncio.run(StartWatch(daemon).wait(30.0)) == state  # type: ignore[arg-type]
        assert daemon.calls == 1
