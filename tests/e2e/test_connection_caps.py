"""Connection caps: half-open connections (no handshake yet) count against max_sessions and
the per-uid cap, so a peer that opens connections and never speaks cannot starve others; a
refused client gets a typed Busy, and a freed connection makes room at once."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from e2e_support import TEST_CONFIG, Daemon

from libflare_client import Busy, Client


def _half_open(path: Path, n: int) -> list[socket.socket]:
    conns = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        conns.append(s)
    return conns


def _connections(path: Path, want: int) -> None:
    """Wait until the daemon counts `want` connections besides the asking one."""
    deadline = time.monotonic() + 5
    with Client(path) as c:
        while c.stats()["connections"] != want + 1:
            assert time.monotonic() < deadline, c.stats()["connections"]
            time.sleep(0.02)


@pytest.mark.parametrize("cap", ["max_sessions = 3", "max_sessions_per_uid = 3"])
def test_half_open_connections_count_against_the_caps(
    cap: str, tiny_bundle: Path, tmp_path: Path
) -> None:
    config = TEST_CONFIG.replace("handshake_timeout_s = 2.0", "handshake_timeout_s = 30.0")
    config = config.replace("[daemon]\n", f"[daemon]\n{cap}\n")
    d = Daemon(tiny_bundle, tmp_path, config).wait_ready()
    try:
        idle = _half_open(d.socket, 2)  # connected, never sends OpenSession
        _connections(d.socket, 2)  # both counted before they say anything
        with Client(d.socket) as third:  # the third connection: the cap
            r = third.generate(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
            assert len(r.token_ids) == 2
            with pytest.raises(Busy, match="connections"), Client(d.socket) as fourth:
                fourth.health()
        idle[0].close()  # one half-open connection goes: its place is free again
        deadline = time.monotonic() + 5
        while True:
            try:
                with Client(d.socket) as c:
                    assert c.health() == "ready"
                break
            except Busy:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        for s in idle[1:]:
            s.close()
    finally:
        assert d.stop() == 0, d.log()


def test_a_full_waiting_queue_answers_busy_and_loses_nothing(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """One decode row and one waiting place: a third request is refused with a typed Busy at
    once, and the two accepted ones still produce every token they asked for."""
    import threading

    config = TEST_CONFIG.replace("[engine]\n", "[engine]\nmax_num_rows = 1\nmax_num_waiting = 1\n")
    d = Daemon(tiny_bundle, tmp_path, config).wait_ready()
    clients = [Client(d.socket) for _ in range(3)]
    counts = [0, 0]
    started = threading.Event()

    def run(i: int) -> None:
        n = (480, 300)[i]  # the first holds the row long enough for the rest of the test
        for ev in clients[i].stream(prompt_token_ids=[3, 4 + i], max_tokens=n, ignore_eos=True):
            counts[i] += len(ev.token_ids)
            started.set()

    try:
        first = threading.Thread(target=run, args=(0,))
        first.start()
        assert started.wait(60)
        second = threading.Thread(target=run, args=(1,))
        second.start()
        deadline = time.monotonic() + 10
        while clients[2].stats()["requests_waiting"] != 1:  # the second waits for the row
            assert time.monotonic() < deadline and counts[0] < 480, "the second never queued"
            time.sleep(0.005)
        with pytest.raises(Busy, match="waiting queue is full"):
            clients[2].generate(prompt_token_ids=[9], max_tokens=2)
        first.join(60)
        second.join(60)
        assert counts == [480, 300]
    finally:
        for c in clients:
            c.close()
        assert d.stop() == 0, d.log()
