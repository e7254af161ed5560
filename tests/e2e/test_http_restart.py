"""The daemon restarting under a running shim: 503 with Retry-After while it is gone, then
serving again by itself (the shim's client reconnects on the next call)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from e2e_support import Daemon, listening_socket  # noqa: E402
from test_http_fixtures import Shim  # noqa: E402

BODY = {"model": "flare", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def read_stream(url: str, body: dict[str, Any], started: threading.Barrier) -> str:
    """A streamed response's lines: its first data event, then a wait at `started` (every
    stream of the test open), then the rest until the server ends it."""
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = [next(line for line in lines if line.startswith("data: {"))]
        started.wait(30)
        seen += list(lines)
    return "\n".join(seen)


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


HELD_ACTIVATE = """
import os, sys
os.dup2(int(sys.argv[1]), 3)  # SD_LISTEN_FDS_START, as systemd passes it
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = "1"
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def test_a_request_waits_for_a_socket_activated_daemon_to_start(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """A request that reaches the shim before flared runs (systemd's socket queues the
    connection) and is still waiting while flared loads its model (health "starting") is
    served once the daemon is ready: the shim waits up to its connect_timeout_s (minutes by
    default) instead of failing after the library's 5 s handshake default or answering 503
    while the model loads. /health answers meanwhile."""
    import signal
    import subprocess
    import sys

    from e2e_support import TEST_CONFIG, child_env

    launcher = Path(__file__).resolve().parent / "_faulty_daemon.py"

    path = tmp_path / "run" / "flared.sock"
    listening = listening_socket(path)
    release = tmp_path / "release-the-start"
    shim = Shim(path)
    got: list[tuple[Any, float]] = []

    def post() -> None:
        t0 = time.monotonic()
        r = httpx.post(shim.url + "/v1/chat/completions", json=BODY, timeout=180)
        got.append((r, time.monotonic() - t0))

    requests = [threading.Thread(target=post, daemon=True) for _ in range(3)]
    proc = None
    log = open(tmp_path / "flared.log", "wb")  # noqa: SIM115
    try:
        for t in requests:
            t.start()
        sent = time.monotonic()
        time.sleep(1.0)  # in the handshake: no daemon process yet
        config = tmp_path / "flared.toml"
        config.write_text(TEST_CONFIG)
        cmd = [sys.executable, "-c", HELD_ACTIVATE, str(listening.fileno()), str(launcher),
               "run", str(tiny_bundle), "--config", str(config)]  # fmt: skip
        env = {**child_env(), "FLARE_TEST_HOLD_START_FILE": str(release)}
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log,
                                pass_fds=(listening.fileno(),))  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # the daemon answers, its model held back: "starting"
            health = httpx.get(shim.url + "/health", timeout=30)
            if health.json().get("daemon") == "starting":
                break
            assert proc.poll() is None and time.monotonic() < deadline, health.text
            time.sleep(0.1)
        assert health.status_code == 503 and health.headers["retry-after"] == "1"
        time.sleep(max(0.0, 6.0 - (time.monotonic() - sent)))
        assert not got, [r.text for r, _ in got]  # past 5 s, every request still waiting
        release.touch()
        for t in requests:
            t.join(120)
        assert len(got) == 3, (tmp_path / "flared.log").read_text()
        for r, took in got:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1 and took >= 6.0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "flared.log").read_text()
    finally:
        release.touch()
        if proc is not None and proc.poll() is None:
            proc.kill()
        shim.stop()
        log.close()
        listening.close()


def test_the_shims_handshake_wait_is_bounded(tmp_path: Path) -> None:
    """A socket that accepts connections but never answers the handshake (a daemon hung in its
    start): the request fails after the shim's connect_timeout_s with a retryable 503 that names
    no path, and the next one waits afresh."""

    path = tmp_path / "hung.sock"
    listening = listening_socket(path)
    shim = Shim(path, connect_timeout_s=1.0)
    try:
        for _ in range(2):
            t0 = time.monotonic()
            r = httpx.post(shim.url + "/v1/chat/completions", json=BODY, timeout=30)
            took = time.monotonic() - t0
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "daemon_unavailable", r.text
            assert str(tmp_path) not in r.text
            assert 1.0 <= took < 10.0, took
    finally:
        shim.stop()
        listening.close()


def test_streams_open_when_the_daemon_is_killed_end_with_an_error(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """SIGKILL the daemon under three open streams (chat, completions, Anthropic messages):
    each ends within seconds with its format's error and no success marker, the shim stays up
    and answers 503, and serves again once a daemon is back on the socket."""
    import json
    import signal

    d = Daemon(tiny_bundle, tmp_path / "d").wait_ready()
    shim = Shim(d.socket)
    long = {"max_tokens": 400, "min_tokens": 400, "stream": True}
    asks = [
        ("/v1/chat/completions", {**BODY, **long}),
        ("/v1/completions", {"model": "flare", "prompt": "hi", **long}),
        ("/v1/messages", {**BODY, **long}),
    ]
    started = threading.Barrier(len(asks) + 1)
    raw: dict[str, str] = {}
    ended: dict[str, float] = {}

    def stream(path: str, body: dict[str, Any]) -> None:
        raw[path] = read_stream(shim.url + path, body, started)
        ended[path] = time.monotonic()

    threads = [threading.Thread(target=stream, args=a, daemon=True) for a in asks]
    d2: Any = None
    try:
        for t in threads:
            t.start()
        started.wait(60)
        d.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        assert sorted(raw) == sorted(p for p, _ in asks), raw.keys()
        for path, text in raw.items():
            assert ended[path] - killed < 10.0, path
            assert "[DONE]" not in text, path
            if path == "/v1/messages":
                assert "event: error" in text and "message_stop" not in text, text[-400:]
                continue
            chunks = [json.loads(line.removeprefix("data: ")) for line in text.splitlines()
                      if line.startswith("data: {")]  # fmt: skip
            assert chunks[-1]["error"]["type"] == "server_error", chunks[-1]
            assert len(chunks) >= 2, chunks  # it was streaming
            ends = [c["finish_reason"] for k in chunks[:-1] for c in k["choices"]]
            assert ends == [None] * len(ends), chunks[-2:]  # and nothing claimed an end
        r = httpx.post(shim.url + "/v1/chat/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        d2 = Daemon(tiny_bundle, tmp_path / "d").wait_ready()  # the same socket path
        r = httpx.post(shim.url + "/v1/chat/completions", json=BODY, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        shim.stop()
        d.stop(signal.SIGKILL)
        if d2 is not None:
            assert d2.stop() == 0, d2.log()


def test_a_draining_daemon_through_the_shim(tiny_bundle: Path, tmp_path: Path) -> None:
    """SIGTERM under the shim: /health turns 503 "draining" with Retry-After, a new request
    is refused with a retryable 503 at once (not queued behind the drain), a short stream
    already running finishes, and a long one ends with a `cancelled` error and no success
    marker at the drain deadline; the daemon exits 0 and the shim stays up."""
    import json
    import signal

    from e2e_support import TEST_CONFIG

    config = TEST_CONFIG.replace("drain_timeout_s = 3.0", "drain_timeout_s = 0.5")
    d = Daemon(tiny_bundle, tmp_path / "d", config).wait_ready()
    shim = Shim(d.socket)
    asks = {"short": 12, "long": 500}
    started = threading.Barrier(len(asks) + 1)
    raw: dict[str, str] = {}

    def stream(name: str) -> None:
        body = {**BODY, "stream": True, "max_tokens": asks[name], "min_tokens": asks[name],
                "logprobs": True, "top_logprobs": 20}  # fmt: skip
        raw[name] = read_stream(shim.url + "/v1/chat/completions", body, started)

    threads = [threading.Thread(target=stream, args=(n,), daemon=True) for n in asks]
    try:
        for t in threads:
            t.start()
        started.wait(60)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        while (h := httpx.get(shim.url + "/health", timeout=10)).json().get("daemon") == "ready":
            assert time.monotonic() - t0 < 0.4, h.text
        assert h.status_code == 503 and h.json()["status"] == "draining", h.text
        assert h.headers["retry-after"] == "1"
        t1 = time.monotonic()
        r = httpx.post(shim.url + "/v1/chat/completions", json=BODY, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "busy" and time.monotonic() - t1 < 1.0, r.text
        for t in threads:
            t.join(30)
        short = [json.loads(x.removeprefix("data: ")) for x in raw["short"].splitlines()
                 if x.startswith("data: {")]  # fmt: skip
        assert "[DONE]" in raw["short"], raw["short"][-300:]  # finished within the drain
        assert [c["finish_reason"] for k in short for c in k["choices"] if c["finish_reason"]] == [
            "length"
        ]
        assert "[DONE]" not in raw["long"]
        last = json.loads(raw["long"].strip().splitlines()[-1].removeprefix("data: "))
        assert last["error"]["code"] == "cancelled", last
        assert d.stop(timeout_s=30) == 0, d.log()
        assert httpx.get(shim.url + "/health", timeout=10).status_code == 503  # shim still up
    finally:
        shim.stop()
        d.stop(signal.SIGKILL)
