"""The coalesced-doorbell protocol between two real processes over a real sealed memfd ring
and a real doorbell (a socket, as for EventsReady frames, or the session's doorbell pipe):
every record arrives once, in order, and no wake-up is ever lost (a reader that declared its
sleep is always woken by a doorbell, never by its wait's timeout)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import select
import socket
import time

import pytest

from shm_protocol import doorbell
from shm_protocol.doorbell import DoorbellPipe
from shm_protocol.ring import RingReader, RingWriter
from shm_protocol.segment import create_ring_segment, map_ring_segment

CAP = 1 << 12
RECORDS = 3000
WAIT_TIMEOUT_S = 2.0  # far above any scheduling delay: a timeout that finds records = lost


def _take(ring: RingReader, got: list[int]) -> None:
    got += [int.from_bytes(r, "little") for r in ring.drain()]


def _reader_socket(sock: socket.socket, ring: RingReader) -> tuple[list[int], int, int]:
    got: list[int] = []
    lost = doorbells = 0
    while len(got) < RECORDS:
        _take(ring, got)
        if len(got) >= RECORDS or not ring.prepare_sleep():
            continue
        ready, _, _ = select.select([sock], [], [], WAIT_TIMEOUT_S)
        if ready:
            doorbells += len(sock.recv(4096))
        elif ring.pending():
            lost += 1
    # A sleep declared and then called off (records arrived first) still earns a doorbell:
    # count the ones rung after the last record too, until the writer closes its end.
    sock.settimeout(10.0)
    while data := sock.recv(4096):
        doorbells += len(data)
    return got, lost, doorbells


def _reader_pipe(fd: int, ring: RingReader) -> tuple[list[int], int, int]:
    """The client's order (libflare_client._connection._on_doorbell): records first, then the
    doorbell byte, then drain-and-declare."""
    got: list[int] = []
    lost = doorbells = 0
    os.set_blocking(fd, False)
    while len(got) < RECORDS:
        ready, _, _ = select.select([fd], [], [], WAIT_TIMEOUT_S)
        if not ready and ring.pending():
            lost += 1
        _take(ring, got)
        doorbells += doorbell.reset(fd)
        while len(got) < RECORDS:
            _take(ring, got)
            if ring.prepare_sleep():
                break
    os.set_blocking(fd, True)
    while data := os.read(fd, 4096):  # until the writer closes its end (EOF)
        doorbells += len(data)
    return got, lost, doorbells


def _run_reader(kind: str, end: socket.socket | int, fd: int, result_fd: int) -> None:
    seg = map_ring_segment(fd, CAP)
    ring = RingReader(seg.view, seg.capacity)
    if kind == "pipe":
        assert isinstance(end, int)
        got, lost, doorbells = _reader_pipe(end, ring)
    else:
        assert isinstance(end, socket.socket)
        got, lost, doorbells = _reader_socket(end, ring)
    ok = got == list(range(RECORDS))
    os.write(result_fd, json.dumps({"ok": ok, "lost": lost, "doorbells": doorbells}).encode())


@pytest.mark.parametrize("kind", ["socket", "pipe"])
def test_no_lost_wakeups_and_coalesced_doorbells(kind: str) -> None:
    a, b = socket.socketpair()
    bell = DoorbellPipe()
    fd, seg = create_ring_segment("flare-test-doorbell", CAP)
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            a.close()
            os.close(bell.write_fd)  # the writer's end stays with the writer (EOF at its close)
            _run_reader(kind, bell.read_fd if kind == "pipe" else b, os.dup(fd), res_w)
            code = 0
        finally:
            os._exit(code)
    b.close()
    bell.close_read_end()
    os.close(res_w)
    writer = RingWriter(seg.view, seg.capacity)
    try:
        rng = random.Random(7)
        rung = sent = 0
        deadline = time.monotonic() + 30
        while sent < RECORDS:
            assert time.monotonic() < deadline, "the reader stopped taking records"
            burst = [i.to_bytes(4, "little") for i in range(sent, min(RECORDS, sent + 8))]
            sent += writer.push_batch(burst[: rng.randint(1, len(burst))])
            writer.publish()
            if writer.reader_slept():
                assert bell.ring() if kind == "pipe" else a.send(b"!")
                rung += 1
            if rng.random() < 0.05:
                time.sleep(rng.random() / 1000)  # let the reader fall asleep now and then
        a.close()  # EOF: the reader has seen every doorbell once it reads it
        bell.close()
        _, status = os.waitpid(pid, 0)
        out = json.loads(os.read(res_r, 4096))
    finally:
        os.close(res_r)
        a.close()
        bell.close()
        writer.release()
        seg.close()
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out["ok"], "records lost, duplicated or reordered"
    assert out["lost"] == 0, f"{out['lost']} wake-ups were lost"
    assert out["doorbells"] == rung
    assert rung < RECORDS  # coalesced: fewer doorbells than records


def test_doorbell_pipe_never_blocks_the_daemon() -> None:
    """A client that never reads fills the pipe, one that flips its end to blocking changes
    only its own description, one that closes its end is gone: ring() returns every time."""
    bell = DoorbellPipe()
    client_end = os.dup(bell.read_fd)
    bell.close_read_end()
    os.set_blocking(client_end, True)  # what a hostile client can do to its own end
    capacity = fcntl.fcntl(client_end, fcntl.F_GETPIPE_SZ)
    for _ in range(capacity + 100):
        assert bell.ring()
    assert bell.rung == capacity  # the rest found a doorbell pending (EAGAIN) and returned
    os.close(client_end)
    assert bell.ring() is False  # EPIPE: the reader is gone (Python ignores SIGPIPE)
    bell.close()
