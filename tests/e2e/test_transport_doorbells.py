"""Event-ring doorbells through a real daemon: the pipe (what the client asks for) and the
EventsReady frame (what a client that asks for no pipe gets). A reader that declared its sleep
is woken by the daemon's doorbell, never by its wait's timeout, and doorbells are coalesced."""

from __future__ import annotations

import os
import select
import socket
from typing import Any

from e2e_support import Daemon, is_baseline, wait_baseline

from libflare_client._handshake import handshake
from shm_protocol import doorbell
from shm_protocol import messages as m
from shm_protocol.codec import FrameBuffer, daemon_decoder, encode_frame, ring_event_decoder
from shm_protocol.ring import RingReader
from shm_protocol.segment import map_ring_segment

TOKENS = 24
WAIT_TIMEOUT_S = 5.0  # far above any step on the tiny model: a timeout that finds records = lost


class _Session:
    def __init__(self, daemon: Daemon, bell: str) -> None:
        self.sock, self.welcome, fds = handshake(daemon.socket, "ring", 10.0, "doorbells", bell)
        self.segs = [
            map_ring_segment(fds[0], self.welcome.event_ring_bytes),
            map_ring_segment(fds[1], self.welcome.request_ring_bytes),
        ]
        self.bell_fd = fds[2] if len(fds) > 2 else -1
        self.ring = RingReader(self.segs[0].view, self.segs[0].capacity)
        self.frames = FrameBuffer(daemon_decoder(), self.welcome.max_frame_bytes)
        self.dec = ring_event_decoder()
        self.events: list[Any] = []
        self.frames_seen: list[Any] = []
        self.lost = 0

    def submit(self, rid: str) -> None:
        msg = m.Submit(rid, TOKENS, [1, 2, 3], ignore_eos=True, detokenize=False)
        self.sock.sendall(encode_frame(msg))

    def take(self) -> None:
        self.events += [e for r in self.ring.drain() for e in self.dec.decode(r)]

    def done(self) -> bool:
        return any(isinstance(e, (m.Finished, m.ErrorReply)) for e in self.events)

    def run(self) -> None:
        """The client's loop: wait for a doorbell (pipe byte or frame), take the records, and
        declare the next sleep only when the ring stayed empty across the declaration."""
        waits = [self.sock] + ([self.bell_fd] if self.bell_fd >= 0 else [])
        while not self.done():
            while True:
                self.take()
                if self.done() or self.ring.prepare_sleep():
                    break
            if self.done():
                break
            ready, _, _ = select.select(waits, [], [], WAIT_TIMEOUT_S)
            if not ready:
                self.lost += self.ring.pending()
                continue
            if self.bell_fd in ready:
                self.take()
                doorbell.reset(self.bell_fd)
            if self.sock in ready:
                data = self.sock.recv(1 << 16)
                assert data, "the daemon closed the session"
                for msg in self.frames.feed(data):
                    self.frames_seen.append(msg)
                    if isinstance(msg, m.EventsReady) and msg.writer_blocked:
                        self.sock.sendall(encode_frame(m.Advance()))

    def close(self) -> None:
        self.ring.release()
        for seg in self.segs:
            seg.close()
        if self.bell_fd >= 0:
            os.close(self.bell_fd)
        self.sock.close()


def _stream(daemon: Daemon, bell: str, rid: str) -> _Session:
    s = _Session(daemon, bell)
    try:
        s.submit(rid)
        s.run()
    except BaseException:
        s.close()
        raise
    return s


def _tokens(s: _Session) -> int:
    return sum(len(e.token_ids) for e in s.events if isinstance(e, m.TokenDelta))


def test_pipe_doorbell_wakes_the_reader(daemon: Daemon) -> None:
    s = _stream(daemon, m.DOORBELL_PIPE, "bell-pipe")
    try:
        assert s.welcome.doorbell == m.DOORBELL_PIPE and s.bell_fd >= 0
        assert _tokens(s) == TOKENS and isinstance(s.events[-1], m.Finished)
        assert s.lost == 0, "a declared sleep was ended by the timeout, not by the doorbell"
        # the pipe carried every wake-up: no EventsReady frame for a ring that never filled
        assert not [f for f in s.frames_seen if isinstance(f, m.EventsReady)]
    finally:
        s.close()
    assert is_baseline(wait_baseline(daemon.socket))


def test_frame_doorbell_for_a_client_without_the_pipe(daemon: Daemon) -> None:
    s = _stream(daemon, "", "bell-frame")
    try:
        assert s.welcome.doorbell == "" and s.bell_fd == -1
        assert _tokens(s) == TOKENS and isinstance(s.events[-1], m.Finished)
        assert s.lost == 0, "a declared sleep was ended by the timeout, not by the doorbell"
        bells = [f for f in s.frames_seen if isinstance(f, m.EventsReady)]
        assert 1 <= len(bells) <= len(s.events)  # coalesced: at most one per record
    finally:
        s.close()
    assert is_baseline(wait_baseline(daemon.socket))


def test_unknown_doorbell_is_refused(daemon: Daemon) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10.0)
    sock.connect(str(daemon.socket))
    try:
        sock.sendall(encode_frame(m.OpenSession(m.PROTOCOL_VERSION, "x", "ring", "carrier-pigeon")))
        frames = FrameBuffer(daemon_decoder(), 1 << 16)
        got: list[Any] = []
        while not got:
            data = sock.recv(4096)
            assert data, "closed without a reply"
            got = frames.feed(data)
        assert isinstance(got[0], m.ErrorReply) and got[0].code == m.PROTOCOL
    finally:
        sock.close()
