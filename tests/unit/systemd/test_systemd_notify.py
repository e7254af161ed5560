"""sd_notify and the watchdog against a fake NOTIFY_SOCKET (a real AF_UNIX datagram socket)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flared.sdnotify import Notifier, watchdog_interval_s
from flared.watchdog import Watchdog, WatchdogPlan

REPO = Path(__file__).resolve().parents[3]


class FakeSystemd:
    """The receiving end of $NOTIFY_SOCKET."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bind = "\0" + address[1:] if address.startswith("@") else address
        self.sock.bind(bind)

    def recv(self, timeout_s: float = 5.0) -> dict[str, str] | None:
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        return dict(line.split("=", 1) for line in data.decode().splitlines())

    def drain(self) -> list[dict[str, str]]:
        out = []
        while (msg := self.recv(0.0001)) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[FakeSystemd]:
    fake = FakeSystemd(str(tmp_path / "notify.sock"))
    yield fake
    fake.close()


def test_ready_status_stopping(systemd: FakeSystemd) -> None:
    n = Notifier.from_env({"NOTIFY_SOCKET": systemd.address})
    assert n.enabled
    assert n.ready("serving qwen3\n64 rows")
    msg = systemd.recv()
    assert msg == {"READY": "1", "MAINPID": str(os.getpid()), "STATUS": "serving qwen3 64 rows"}
    assert n.stopping()
    assert systemd.recv() == {"STOPPING": "1"}
    assert n.status("draining 3 requests") and n.watchdog() and n.mainpid(42)
    assert systemd.drain() == [
        {"STATUS": "draining 3 requests"},
        {"WATCHDOG": "1"},
        {"MAINPID": "42"},
    ]


def test_abstract_socket() -> None:
    fake = FakeSystemd(f"@flare-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        assert Notifier(fake.address).ready()
        assert (fake.recv() or {}).get("READY") == "1"
    finally:
        fake.close()


def test_without_systemd_or_with_a_vanished_socket_nothing_raises(tmp_path: Path) -> None:
    assert not Notifier.from_env({}).enabled
    assert Notifier.from_env({}).ready() is False
    assert Notifier(str(tmp_path / "gone.sock")).ready() is False


def test_watchdog_interval_env() -> None:
    me = str(os.getpid())
    assert watchdog_interval_s({"WATCHDOG_USEC": "60000000"}) == 60.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": me}) == 2.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({}) is None
    assert WatchdogPlan(60.0).interval_s == 30.0


# A stand-in daemon: READY=1 only after its (simulated) load finishes, STOPPING=1 on SIGTERM.
DAEMON = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from flared.sdnotify import Notifier

    n = Notifier.from_env()
    gate = Path(sys.argv[1])
    while not gate.exists():          # "loading the bundle and capturing every execution"
        time.sleep(0.01)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    n.ready("ready")
    while not stop:
        time.sleep(0.01)
    n.stopping("draining")
    """
)


def test_daemon_ready_after_load_and_stopping_on_sigterm(
    systemd: FakeSystemd, tmp_path: Path
) -> None:
    gate = tmp_path / "loaded"
    envs = {**os.environ, "NOTIFY_SOCKET": systemd.address, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", DAEMON, str(gate)], env=envs)
    try:
        assert systemd.recv(timeout_s=0.5) is None, "READY before the load finished"
        gate.touch()
        ready = systemd.recv()
        assert ready is not None and ready["READY"] == "1"
        assert ready["MAINPID"] == str(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert systemd.recv() == {"STOPPING": "1", "STATUS": "draining"}
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class FakeEngineLoop:
    """Advances a heartbeat like the engine loop does (every step and every idle wait)."""

    def __init__(self) -> None:
        self.heartbeat = 0
        self.wedged = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.wedged.is_set():
                self.heartbeat += 1
            time.sleep(0.005)


def test_watchdog_pings_while_progressing_and_stops_when_wedged(systemd: FakeSystemd) -> None:
    loop = FakeEngineLoop()
    loop.thread.start()
    dog = Watchdog(Notifier(systemd.address), lambda: loop.heartbeat, WatchdogPlan(0.1))
    dog.start()
    try:
        time.sleep(0.5)  # ~10 intervals of 50 ms
        pings = systemd.drain()
        assert len(pings) >= 5 and all(p == {"WATCHDOG": "1"} for p in pings)
        loop.wedged.set()
        time.sleep(0.1)
        systemd.drain()  # at most one ping may race the wedge
        time.sleep(0.4)
        assert systemd.drain() == [], "watchdog kept pinging a wedged engine loop"
        assert dog.num_consecutive_skips >= 5
        loop.wedged.clear()  # progress again: pings resume
        time.sleep(0.3)
        assert len(systemd.drain()) >= 2
    finally:
        dog.stop()
        loop.stop.set()


def test_watchdog_tick_is_gated_on_progress(systemd: FakeSystemd) -> None:
    value = [0]
    dog = Watchdog(Notifier(systemd.address), lambda: value[0], WatchdogPlan(10.0))
    assert dog.tick()  # the first reading counts as progress
    assert not dog.tick() and not dog.tick()
    value[0] += 1
    assert dog.tick()
    assert len(systemd.drain()) == 2

    def broken() -> int:
        raise RuntimeError("probe failed")

    bad = Watchdog(Notifier(systemd.address), broken, WatchdogPlan(10.0))
    assert not bad.tick()


def test_watchdog_from_env(monkeypatch: pytest.MonkeyPatch, systemd: FakeSystemd) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert Watchdog.from_env(Notifier(systemd.address), lambda: 0) is None
    monkeypatch.setenv("WATCHDOG_USEC", "4000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    dog = Watchdog.from_env(Notifier(systemd.address), lambda: 0)
    assert dog is not None and dog.plan.interval_s == 2.0
    assert Watchdog.from_env(Notifier(None), lambda: 0) is None
