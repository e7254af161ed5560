"""A real flare-http app (uvicorn, in a thread with its own event loop) on an ephemeral
loopback port, in front of a real daemon. Imported by the test_http_* modules."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from libflare_client.http.app import Settings, build_app


class Shim:
    def __init__(self, socket: Path, **settings: Any) -> None:
        import uvicorn

        self.app = build_app(Settings(socket_path=str(socket), **settings))
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, loop="asyncio",
                                http="httptools", log_level="warning", lifespan="on")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "shim did not start"
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        import uvloop

        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_shim_starts_and_stops(daemon: Any) -> None:
    import httpx

    shim = Shim(daemon.socket)
    try:
        r = httpx.get(shim.url + "/health")
        assert r.status_code == 200 and r.json()["daemon"] == "ready"
    finally:
        shim.stop()


def test_request_size_limits(daemon: Any) -> None:
    """A body over max_body_bytes is refused with 413 (declared or streamed in chunks, never
    buffered past the limit), a /v1/completions call asking for more than max_choices
    choices is a 400, and an oversized chat message (over the daemon's frame limit) is a 400
    that leaves the shim's one daemon connection, and everyone else's requests, intact."""
    import httpx

    shim = Shim(daemon.socket, max_body_bytes=64 << 10, max_choices=8)
    try:
        url = shim.url + "/v1/chat/completions"
        big = {"model": "flare", "max_tokens": 2,
               "messages": [{"role": "user", "content": "x" * (100 << 10)}]}  # fmt: skip
        r = httpx.post(url, json=big, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.headers["x-should-retry"] == "false"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies as it streams
            yield b'{"model": "flare", "messages": [{"role": "user", "content": "'
            for _ in range(40):
                yield b"y" * 4096
            yield b'"}]}'

        r = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        body = {"model": "flare", "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}
        r = httpx.post(shim.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and "9 choices" in r.json()["error"]["message"], r.text
    finally:
        shim.stop()
    wide = Shim(daemon.socket)  # the default body limit (32 MiB), the daemon's 1 MiB frames
    try:
        ok = {"model": "flare", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(wide.url + "/v1/chat/completions", json=ok, timeout=60).is_success
        conn = wide.app.state.client._conn
        huge = {"model": "flare", "max_tokens": 2,
                "messages": [{"role": "user", "content": "many words " * 200_000}]}  # fmt: skip
        r = httpx.post(wide.url + "/v1/chat/completions", json=huge, timeout=60)
        assert r.status_code == 400 and "max_frame_bytes" in r.text, r.text
        r = httpx.post(wide.url + "/v1/chat/completions", json=ok, timeout=60)
        assert r.status_code == 200, r.text
        assert wide.app.state.client._conn is conn and not conn.closed  # never dropped
    finally:
        wide.stop()
