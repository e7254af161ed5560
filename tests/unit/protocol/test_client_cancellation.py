"""The client's connection and stream are safe to cancel at any await: a handshake still
running in its thread when its opener is cancelled has its socket and ring fds closed, and the
blocking Client's stream, left before its first event, waits until the request was cancelled."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from libflare_client import _connection
from libflare_client.client import Client


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_cancelled_open_closes_what_its_handshake_opened(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: dict[str, Any] = {}
    release = threading.Event()

    def slow_handshake(*_args: Any) -> tuple[socket.socket, Any, list[int]]:
        a, b = socket.socketpair()
        r, w = os.pipe()
        opened.update(sock=a, peer=b, fds=[r, w])
        release.wait(10)  # still in the handshake when the opener is cancelled
        return a, object(), [r, w]

    monkeypatch.setattr(_connection, "handshake", slow_handshake)

    async def main() -> None:
        task = asyncio.ensure_future(
            _connection.Connection.open(
                Path("/unused"),
                transport="ring",
                connect_timeout_s=5,
                liveness_timeout_s=5,
                client_name="t",
            )
        )
        while not opened:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(200):  # the handshake thread returns, its result is closed
            if opened["sock"].fileno() == -1:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert opened["sock"].fileno() == -1
    assert not any(_is_open(fd) for fd in opened["fds"])
    opened["peer"].close()


def test_leaving_a_stream_early_waits_for_its_cancel() -> None:
    """The consumer leaves (an exception in its loop body) while the client's loop thread is
    busy: the stream still starts afterwards, and the generator closes only after the stream's
    cleanup (where AsyncClient.stream sends its Cancel) ran."""
    log: list[str] = []

    async def stream(*_args: Any, **_kwargs: Any) -> Any:
        log.append("submitted")
        try:
            await asyncio.sleep(10)
            yield None
        finally:
            log.append("cancel sent")

    c = Client("/unused")
    try:
        c._aclient.stream = stream  # type: ignore[method-assign]
        c._loop.call_soon_threadsafe(time.sleep, 0.3)  # the loop thread is busy for 300 ms
        gen = c.stream([1])

        class Leave(Exception):
            """The consumer's own reason to stop."""

        def take(_out: Any) -> Any:
            raise Leave

        c._take = take  # type: ignore[method-assign]
        with pytest.raises(Leave):
            next(gen)
        log.append("left")
        assert log == ["submitted", "cancel sent", "left"]
    finally:
        c.close()
