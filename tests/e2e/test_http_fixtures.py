"""A real flare-http app (uvicorn, in a thread with its own event loop) on an ephemeral
loopback port, in front of a real daemon. Imported by the test_http_* modules."""

from __future__ import annotations

import asyncio
import threading
import time
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
