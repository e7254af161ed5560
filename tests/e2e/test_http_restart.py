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


def test_a_killed_shim_frees_its_requests_in_the_daemon(daemon: Any, tmp_path: Path) -> None:
    """SIGKILL flare-http with streams open: the daemon sees its one session end and frees
    every request within a second (a dead client like any other); a new shim serves at once."""
    import signal
    import socket
    import subprocess
    import sys
    import threading

    from e2e_support import child_env, is_baseline, wait_baseline

    def start() -> tuple[subprocess.Popen[bytes], str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "libflare_client.http", "--socket", str(daemon.socket),
               "--port", str(port), "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "flare-http did not start"
            time.sleep(0.1)

    wait_baseline(daemon.socket)
    proc, url = start()
    started = threading.Barrier(7)
    body = {**BODY, "max_tokens": 400, "stream": True, "min_tokens": 400}

    def stream(seed: int) -> None:
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "seed": seed},
                              timeout=60) as r:  # fmt: skip
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                started.wait(30)
                for _ in lines:
                    pass
        except httpx.HTTPError:
            pass  # the shim is gone

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(60)
    from libflare_client import Client

    with Client(daemon.socket) as c:
        assert c.stats()["requests_live"] == 6
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    st = wait_baseline(daemon.socket, timeout_s=5)
    assert is_baseline(st) and time.monotonic() - t0 < 1.0, st
    for t in threads:
        t.join(10)
    proc2, url2 = start()
    try:
        assert httpx.post(url2 + "/v1/chat/completions", json=BODY, timeout=60).status_code == 200
    finally:
        proc2.terminate()
        proc2.wait(10)
