"""The coalesced-doorbell protocol between two real processes over a real sealed memfd ring
and a real socket: every record arrives once, in order, and no wake-up is ever lost (a reader
that declared its sleep is always woken by a doorbell, never by its wait's timeout)."""

from __future__ import annotations

import json
import os
import random
import select
import socket
import time

from shm_protocol.ring import RingReader, RingWriter
from shm_protocol.segment import create_ring_segment, map_ring_segment

CAP = 1 << 12
RECORDS = 3000
WAIT_TIMEOUT_S = 2.0  # far above any scheduling delay: a timeout that finds records = lost


def _reader(sock: socket.socket, fd: int, result_fd: int) -> None:
    seg = map_ring_segment(fd, CAP)
    ring = RingReader(seg.view, seg.capacity)
    got: list[int] = []
    lost = doorbells = 0
    while len(got) < RECORDS:
        got += [int.from_bytes(r, "little") for r in ring.drain()]
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
    ok = got == list(range(RECORDS))
    os.write(result_fd, json.dumps({"ok": ok, "lost": lost, "doorbells": doorbells}).encode())


def test_no_lost_wakeups_and_coalesced_doorbells() -> None:
    a, b = socket.socketpair()
    fd, seg = create_ring_segment("flare-test-doorbell", CAP)
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            a.close()
            _reader(b, os.dup(fd), res_w)
            code = 0
        finally:
            os._exit(code)
    b.close()
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
                a.send(b"!")
                rung += 1
            if rng.random() < 0.05:
                time.sleep(rng.random() / 1000)  # let the reader fall asleep now and then
        a.close()  # EOF: the reader has seen every doorbell once it reads it
        _, status = os.waitpid(pid, 0)
        out = json.loads(os.read(res_r, 4096))
    finally:
        os.close(res_r)
        a.close()
        writer.release()
        seg.close()
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out["ok"], "records lost, duplicated or reordered"
    assert out["lost"] == 0, f"{out['lost']} wake-ups were lost"
    assert out["doorbells"] == rung
    assert rung < RECORDS  # coalesced: fewer doorbells than records
