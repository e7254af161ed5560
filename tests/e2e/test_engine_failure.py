"""A failing or hung execution inside a real daemon: every in-flight request ends with
EngineError within a bounded time, health reads "failed" with the reason, new requests are
refused with EngineError, and the daemon still answers stats and exits cleanly on SIGTERM.
Under systemd the way out of a failed engine is the watchdog: WATCHDOG=1 comes while the engine
loop runs (idle included) and stops once a step raised or hung, so systemd kills the service
after WatchdogSec and restarts it, instead of leaving a daemon that only refuses."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import TEST_CONFIG, Daemon, shm_names

from libflare_client import Client, EngineError, SamplingParams

LAUNCHER = Path(__file__).resolve().parent / "_faulty_daemon.py"


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_engine_fault_fails_requests_and_the_daemon_reports_it(
    fault: str, tiny_bundle: Path, tmp_path: Path
) -> None:
    import socket

    before = shm_names()
    trigger = tmp_path / "break-the-device"
    config = TEST_CONFIG.replace("[daemon]\n", "[daemon]\nengine_stall_timeout_s = 1.0\n")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    env = {"FLARE_TEST_FAULT": fault, "FLARE_TEST_FAULT_FILE": str(trigger),
           "NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "400000"}  # fmt: skip
    d = Daemon(tiny_bundle, tmp_path / "d", config, extra_env=env, launcher=LAUNCHER)
    d.wait_ready()

    def pings(window_s: float) -> int:
        """WATCHDOG=1 datagrams that arrive within the next window_s."""
        n, end = 0, time.monotonic() + window_s
        while (left := end - time.monotonic()) > 0:
            notify.settimeout(left)
            try:
                n += "WATCHDOG=1" in notify.recv(4096).decode()
            except TimeoutError:
                break
        return n

    try:
        assert pings(1.0) >= 2, d.log()  # the loop moves while idle: a ping every 0.2 s
        clients = [Client(d.socket) for _ in range(3)]
        outs: list[dict[str, Any]] = [{} for _ in clients]
        started = [threading.Event() for _ in clients]

        def stream(i: int) -> None:
            n = 0
            try:
                for ev in clients[i].stream(prompt_token_ids=[5, 6, 7 + i], max_tokens=400,
                                            ignore_eos=True, sampling=SamplingParams(seed=i)):  # fmt: skip
                    n += len(ev.token_ids)
                    started[i].set()
                outs[i]["finish"] = "ended without an error"
            except Exception as exc:
                outs[i]["error"], outs[i]["at"] = exc, time.monotonic()
            finally:
                outs[i]["n"] = n
                started[i].set()

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
        for t in threads:
            t.start()
        assert all(s.wait(60) for s in started)
        trigger.touch()
        t0 = time.monotonic()
        for t in threads:
            t.join(30)
        for out in outs:
            assert isinstance(out.get("error"), EngineError), (out, d.log())
            assert out["n"] < 400
            # raise: at the next step; hang: the stall timeout (1 s) plus the monitor's tick
            assert out["at"] - t0 < (2.0 if fault == "raise" else 4.0), out
        want = "device fault" if fault == "raise" else "no progress"
        assert want in str(outs[0]["error"])
        assert "flare-secret" not in str(outs[0]["error"])  # no filesystem paths to clients
        with Client(d.socket) as c:
            assert c.health() == "failed"
            stats = c.stats()
            assert want in str(stats["failure"]) and stats["requests_live"] == 0, stats
            assert "flare-secret" not in str(stats["failure"])
            with pytest.raises(EngineError, match=want):
                c.generate(prompt_token_ids=[1, 2], max_tokens=2)
        pings(0.3)  # one already on its way may still come
        assert pings(1.5) == 0, d.log()
    finally:
        for c in clients:
            c.close()
        code = d.stop(timeout_s=40)
        notify.close()
    assert code == 0, d.log()
    if fault == "raise":
        assert (
            "/opt/flare-secret/libdev.so.1" in d.log_path.read_text()
        )  # the operator's log keeps it
    assert shm_names() <= before


def test_engine_fault_through_the_http_shim(tiny_bundle: Path, tmp_path: Path) -> None:
    """The same failure seen by HTTP clients: an open stream ends with an error chunk, a
    unary request gets 500 with x-should-retry: false, /health turns 503 "failed", and a new
    request is refused with a 500 (engine failed) rather than retried into the void."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_http_fixtures import Shim

    trigger = tmp_path / "break-the-device"
    env = {"FLARE_TEST_FAULT": "raise", "FLARE_TEST_FAULT_FILE": str(trigger)}
    d = Daemon(tiny_bundle, tmp_path / "d", extra_env=env, launcher=LAUNCHER).wait_ready()
    shim = Shim(d.socket)
    try:
        url = shim.url + "/v1/chat/completions"
        body = {"model": "flare", "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}],
                "stream": True, "ignore_eos": True}  # fmt: skip
        assert httpx.get(shim.url + "/health").json()["daemon"] == "ready"
        with httpx.stream("POST", url, json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert "choices" in first
            trigger.touch()
            rest = list(lines)
        errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and '"error"' in x]
        assert errors and "device fault" in errors[-1]["error"]["message"], rest[-3:]
        assert "flare-secret" not in "".join(rest)
        unary = httpx.post(url, json={**body, "stream": False}, timeout=60)
        assert unary.status_code == 500 and unary.headers["x-should-retry"] == "false"
        health = httpx.get(shim.url + "/health")
        assert health.status_code == 503 and health.json()["daemon"] == "failed"
    finally:
        shim.stop()
        assert d.stop(timeout_s=40) == 0, d.log()
