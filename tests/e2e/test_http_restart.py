"""The daemon restarting under a running shim: 503 with Retry-After while it is gone, then
serving again by itself (the shim's client reconnects on the next call)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from e2e_support import Daemon  # noqa: E402
from test_http_fixtures import Shim  # noqa: E402

BODY = {"model": "flare", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.slow
def test_daemon_restart_503_then_serves(tiny_bundle: Path, tmp_path: Path) -> None:
    d = Daemon(tiny_bundle, tmp_path / "d1").wait_ready()
    shim = Shim(d.socket)
    try:
        url = shim.url + "/v1/chat/completions"
        assert httpx.post(url, json=BODY, timeout=30).status_code == 200
        assert d.stop() == 0
        r = httpx.post(url, json=BODY, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert str(tmp_path) not in r.text  # the socket's path is not the clients' business
        health = httpx.get(shim.url + "/health")
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        assert health.json()["status"] == "unavailable" and str(tmp_path) not in health.text
        assert "flare_up 0" in httpx.get(shim.url + "/metrics").text
        d2: Any = Daemon(tiny_bundle, tmp_path / "d1").wait_ready()  # same socket path
        try:
            deadline = time.monotonic() + 20
            while True:
                r = httpx.post(url, json=BODY, timeout=30)
                if r.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert r.status_code == 200, r.text
        finally:
            assert d2.stop() == 0
    finally:
        shim.stop()
