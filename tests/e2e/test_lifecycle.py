"""Daemon lifecycle: SIGTERM drains, SIGKILL -> ConnectionLost, restart + reconnect, segments."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import TEST_CONFIG, Daemon, child_env, listening_socket, shm_names

from libflare_client import Busy, Cancelled, Client, ConnectionLost


def _stream_in_thread(client: Client, out: dict[str, Any], first: threading.Event,
                      **kwargs: Any) -> threading.Thread:  # fmt: skip
    def run() -> None:
        n = 0
        try:
            for ev in client.stream(prompt_token_ids=[1, 2], ignore_eos=True, **kwargs):
                n += len(ev.token_ids)
                first.set()
                out["finish"] = ev.finish_reason
        except Exception as exc:
            out["error"] = exc
            out["error_at"] = time.monotonic()
        finally:
            out["n"] = n
            first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_drains_in_flight_requests(tiny_bundle: Path, tmp_path: Path) -> None:
    before = shm_names()
    # The deadline sits between the two requests' needs: 12 tokens take well under 0.5 s here,
    # 500 tokens with logprobs need 500 steps (> 0.5 s unless a step took under 1 ms)
    d = Daemon(
        tiny_bundle, tmp_path, TEST_CONFIG.replace("drain_timeout_s = 3.0", "drain_timeout_s = 0.5")
    )
    d.wait_ready()
    short, long_ = Client(d.socket), Client(d.socket)
    outs: list[dict[str, Any]] = [{}, {}]
    firsts = [threading.Event(), threading.Event()]
    threads = [
        _stream_in_thread(short, outs[0], firsts[0], max_tokens=12),
        _stream_in_thread(long_, outs[1], firsts[1], max_tokens=500, logprobs=20),
    ]
    assert all(f.wait(60) for f in firsts)
    late = Client(d.socket)  # connected before the signal, asks after it
    assert late.health() == "ready"
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    while (health := late.health()) == "ready" and time.monotonic() - t0 < 0.4:
        time.sleep(0.005)
    assert health == "draining"
    with pytest.raises(Busy, match="draining"):  # admission stopped; typed, retryable
        late.generate(prompt_token_ids=[1, 2], max_tokens=2)
    late.close()
    for t in threads:
        t.join(30)
    assert outs[0].get("finish") == "length" and outs[0]["n"] == 12, outs[0]  # finished in time
    assert isinstance(outs[1].get("error"), Cancelled), outs[1]  # cancelled at the deadline
    assert "shutting down" in str(outs[1]["error"])
    assert d.stop(timeout_s=30) == 0, d.log()
    assert time.monotonic() - t0 < 15
    assert not d.socket.exists()  # the socket path is removed
    assert shm_names() == before  # memfd segments: nothing ever appears in /dev/shm
    with pytest.raises(ConnectionLost):
        short.generate(prompt_token_ids=[1], max_tokens=2)
    short.close()
    long_.close()


def test_sigkill_raises_connection_lost_then_reconnects(tiny_bundle: Path, tmp_path: Path) -> None:
    d = Daemon(tiny_bundle, tmp_path / "a").wait_ready()
    client = Client(d.socket)
    out: dict[str, Any] = {}
    first = threading.Event()
    t = _stream_in_thread(client, out, first, max_tokens=500)
    assert first.wait(60)
    killed_at = time.monotonic()
    d.proc.send_signal(signal.SIGKILL)
    t.join(10)
    assert isinstance(out.get("error"), ConnectionLost), out
    assert out["error_at"] - killed_at < 5.0
    d.stop()
    assert d.socket.exists()  # a killed daemon leaves its socket file behind ...
    # ... and the next daemon removes the stale socket and binds the same path
    d2 = Daemon(tiny_bundle, tmp_path / "a")
    states = set()
    starting = refused = 0  # "starting" answers, and requests refused right after one
    served_at_ready = 0  # requests that met the daemon ready just after a "starting" answer
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            state = client.health()  # the same Client reconnects
        except ConnectionLost:
            time.sleep(0.05)
            continue
        states.add(state)
        if state == "ready":
            break
        starting += 1
        try:
            client.generate(prompt_token_ids=[1], max_tokens=2)
        except Busy:  # typed, retryable while starting
            refused += 1
        else:  # served: only because it became ready between the two calls
            assert client.health() == "ready"
            served_at_ready += 1
        time.sleep(0.05)
    assert "ready" in states and "starting" in states, states
    assert refused + served_at_ready == starting  # each request after "starting": one or other
    r = client.generate(prompt_token_ids=[4, 5, 6], max_tokens=3, ignore_eos=True)
    assert len(r.token_ids) == 3
    stats = client.stats()
    # the killed in-flight request was not resubmitted
    assert stats["requests_total"] == 1 + served_at_ready
    assert stats["prompt_tokens_total"] == 3 + served_at_ready
    client.close()
    assert d2.stop() == 0, d2.log()


def test_session_segments_are_unmapped_when_the_client_goes(daemon: Daemon) -> None:
    maps = Path(f"/proc/{daemon.proc.pid}/maps")

    def ring_maps() -> int:
        return sum(1 for line in maps.read_text().splitlines() if "memfd:flare-" in line)

    base = ring_maps()
    with Client(daemon.socket) as c:
        c.health()
        assert ring_maps() == base + 2  # one event ring, one request ring
    deadline = time.monotonic() + 1.0
    while ring_maps() != base:
        assert time.monotonic() < deadline, "segments still mapped after the client left"
        time.sleep(0.01)


def test_client_library_does_not_import_torch_flared_or_prep() -> None:
    code = (
        "import sys, libflare_client\n"
        "from libflare_client import Client, AsyncClient, SamplingParams, FlareError\n"
        "bad = [m for m in ('torch', 'flared', 'prep', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), timeout=60)


def test_systemd_notify_and_watchdog(tiny_bundle: Path, tmp_path: Path) -> None:
    import socket

    addr = tmp_path / "notify.sock"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(addr))
    rx.settimeout(60)
    env = {"NOTIFY_SOCKET": str(addr), "WATCHDOG_USEC": "1000000"}
    d = Daemon(tiny_bundle, tmp_path / "d", extra_env=env).wait_ready()
    got: list[str] = []
    while not any("WATCHDOG=1" in g for g in got):
        got.append(rx.recv(4096).decode())
    assert any("READY=1" in g for g in got), got
    assert d.stop() == 0, d.log()
    rx.settimeout(5)
    while not any("STOPPING=1" in g for g in got):
        got.append(rx.recv(4096).decode())
    rx.close()


def test_shipped_config_file_loads() -> None:
    from flared.config import load_config

    # (not `from conftest import REPO`: several conftest modules share that name)
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "config" / "flared.toml")
    assert cfg.memory is not None and cfg.engine.compile == "auto"


ACTIVATE = """
import os, sys
os.dup2(int(sys.argv[1]), 3)  # SD_LISTEN_FDS_START, as systemd passes it
os.environ["LISTEN_PID"] = str(os.getpid())  # exec keeps the pid: the socket is for this one
os.environ["LISTEN_FDS"] = "1"
os.execv(sys.executable, [sys.executable, "-m", "flared.cli", "run", *sys.argv[2:]])
"""


def test_socket_activation_serves_on_the_inherited_socket(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """Started the way systemd's flared.socket starts it: the daemon serves on the listening
    socket it inherited (no --socket, no path of its own) and leaves that socket's path to
    its owner at exit."""
    path = tmp_path / "run" / "flared.sock"
    listening = listening_socket(path)
    config = tmp_path / "flared.toml"
    config.write_text(TEST_CONFIG)
    log = open(tmp_path / "flared.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-c", ACTIVATE, str(listening.fileno()), str(tiny_bundle),
           "--config", str(config)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=log,
                            pass_fds=(listening.fileno(),))  # fmt: skip
    try:
        # connects at once (the kernel queues it until the daemon runs); the handshake's answer
        # waits for the daemon's start, interpreter and imports included, so it gets the time
        # the readiness wait below gets rather than a client's default of 5 s
        with Client(path, connect_timeout_s=120) as c:
            deadline = time.monotonic() + 120
            while c.health() != "ready":
                assert proc.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "flared.log"
                ).read_text()
                time.sleep(0.1)
            r = c.generate(prompt_token_ids=[4, 5, 6], max_tokens=3, ignore_eos=True)
            assert len(r.token_ids) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "flared.log").read_text()
        assert path.exists()  # systemd's socket, not the daemon's to remove
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
        listening.close()


def test_a_session_opened_while_the_daemon_starts_is_renewed_with_the_models_facts(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """A client that connects while flared loads its model gets a Welcome without the model's
    facts and Busy for a request; once the daemon is ready, welcome() (and wait_ready) renew
    the session, whose Welcome then matches a fresh client's, and it serves."""
    release = tmp_path / "release-the-start"
    launcher = Path(__file__).resolve().parent / "_faulty_daemon.py"
    env = {"FLARE_TEST_HOLD_START_FILE": str(release)}
    d = Daemon(tiny_bundle, tmp_path / "d", extra_env=env, launcher=launcher)
    c = Client(d.socket)  # connects at its first call: the socket is not bound yet
    try:

        def health() -> str:
            try:
                return c.health()
            except ConnectionLost:
                return "unbound"  # the daemon has not bound its socket yet

        deadline = time.monotonic() + 60
        while health() != "starting":
            assert d.proc.poll() is None and time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        w = c.welcome()
        facts = (w.health, w.vocab_size, w.max_context_tokens, w.eos_token_ids)
        assert facts == ("starting", 0, 0, []), facts
        first = w.session_id
        with pytest.raises(Busy, match="starting"):
            c.generate(prompt_token_ids=[4, 5, 6], max_tokens=2)
        release.touch()
        c.wait_ready(60)
        w = c.welcome()
        with Client(d.socket) as fresh:
            assert w.health == "ready" and w.vocab_size > 0 and w.max_context_tokens == 512
            assert w.eos_token_ids and w.eos_token_ids == fresh.welcome().eos_token_ids
            assert w.vocab_size == fresh.welcome().vocab_size
        assert w.session_id != first  # renewed, and only once
        assert c.welcome().session_id == w.session_id
        r = c.generate(prompt_token_ids=[4, 5, 6], max_tokens=3, ignore_eos=True)
        assert len(r.token_ids) == 3
    finally:
        c.close()
        release.touch()
        assert d.stop() == 0, d.log()
