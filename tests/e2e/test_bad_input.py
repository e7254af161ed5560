"""Hostile or broken peers get a typed ErrorReply and/or a closed connection; the daemon keeps
serving everyone else (checked after every case) and leaks nothing."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import pytest
from e2e_support import Daemon, child_env, is_baseline, wait_baseline

from libflare_client import Client
from libflare_client._handshake import handshake
from shm_protocol import messages as m
from shm_protocol.codec import HEADER, daemon_decoder, encode_frame
from shm_protocol.ring import DATA_OFFSET, HEAD_OFFSET, TAIL_OFFSET
from shm_protocol.segment import Segment, map_ring_segment


def _read(sock: socket.socket, timeout_s: float = 10.0) -> Any:
    """The next daemon message, or None at EOF."""
    sock.settimeout(timeout_s)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = HEADER.unpack(head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        assert chunk, "EOF inside a frame"
        body += chunk
    return daemon_decoder().decode(body)


def _next_non_doorbell(sock: socket.socket, limit: int = 5000) -> Any:
    for _ in range(limit):
        msg = _read(sock)
        if not isinstance(msg, m.EventsReady):
            return msg
    raise AssertionError(f"{limit} doorbells and nothing else")


def _expect_error_then_close(sock: socket.socket, code: str) -> m.ErrorReply:
    msg = _next_non_doorbell(sock)
    assert isinstance(msg, m.ErrorReply) and msg.code == code, msg
    assert _read(sock) is None  # then the daemon closes this connection
    return msg


def _session(daemon: Daemon, transport: str = "socket") -> tuple[socket.socket, list[Segment]]:
    sock, welcome, fds = handshake(daemon.socket, transport, 5.0, "hostile")
    segs = []
    if fds:
        segs = [
            map_ring_segment(fds[0], welcome.event_ring_bytes),
            map_ring_segment(fds[1], welcome.request_ring_bytes),
        ]
    return sock, segs


def _assert_serving(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        assert (
            len(c.generate(prompt_token_ids=[1, 2], max_tokens=4, ignore_eos=True).token_ids) == 4
        )
    assert is_baseline(wait_baseline(daemon.socket))


@pytest.mark.parametrize(
    "frame",
    [
        HEADER.pack(50 << 20),  # oversized length prefix: refused before any body is read
        HEADER.pack(1) + b"\xc1",  # garbage msgpack
        HEADER.pack(3) + b"\x92\x63\x01",  # unknown tag 99
        HEADER.pack(3) + b"\x92\x03\x05",  # wrong-typed field (an int request id)
        HEADER.pack(6) + b"\x93\x02\xa1x\xa1y",  # Submit with a string max_tokens
        encode_frame(m.OpenSession(1)),  # a second OpenSession
        encode_frame(m.Welcome(1, "s", "ready", 1)),  # a daemon-side message
    ],
)
def test_bad_frames_after_handshake(daemon: Daemon, frame: bytes) -> None:
    sock, _ = _session(daemon)
    sock.sendall(frame)
    _expect_error_then_close(sock, m.PROTOCOL)
    sock.close()
    _assert_serving(daemon)


@pytest.mark.parametrize(
    ("first", "code"),
    [
        (encode_frame(m.OpenSession(99)), m.UNSUPPORTED_VERSION),
        (encode_frame(m.Ping(1)), m.PROTOCOL),
        (HEADER.pack(1 << 30), m.PROTOCOL),
        (HEADER.pack(10) + b"abc", m.PROTOCOL),  # truncated: the handshake timeout ends it
        (encode_frame(m.OpenSession(m.PROTOCOL_VERSION, transport="carrier-pigeon")), m.PROTOCOL),
        (encode_frame(m.OpenSession(1)), m.UNSUPPORTED_VERSION),  # the first release's clients
    ],
)
def test_bad_handshakes(daemon: Daemon, first: bytes, code: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(daemon.socket))
    sock.sendall(first)
    _expect_error_then_close(sock, code)
    sock.close()
    _assert_serving(daemon)


def test_client_library_raises_protocol_error_on_unknown_version(daemon: Daemon) -> None:
    from libflare_client import ProtocolError

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(daemon.socket))
    sock.sendall(encode_frame(m.OpenSession(m.PROTOCOL_VERSION + 1)))
    reply = _read(sock)
    assert isinstance(reply, m.ErrorReply)
    from libflare_client.errors import from_reply

    assert isinstance(from_reply(reply), ProtocolError)
    assert "not supported" in reply.message


def test_truncated_frame_then_hangup(daemon: Daemon) -> None:
    sock, _ = _session(daemon)
    sock.sendall(encode_frame(m.Submit("t", 4, [1, 2, 3]))[:7])
    sock.close()
    _assert_serving(daemon)


def _poke_u64(seg: Segment, offset: int, value: int) -> None:
    struct.pack_into("<Q", seg.view, offset, value)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda r: _poke_u64(r, HEAD_OFFSET, 2**63),  # head far beyond the ring
        lambda r: _poke_u64(r, HEAD_OFFSET, 8),  # misaligned head
        lambda r: (
            _poke_u64(r, HEAD_OFFSET, 64),
            struct.pack_into("<I", r.view, DATA_OFFSET, 10**9),
        ),
        lambda r: (_poke_u64(r, HEAD_OFFSET, 64), struct.pack_into("<I", r.view, DATA_OFFSET, 12)),
    ],
    ids=["head-out-of-range", "head-misaligned", "record-too-long", "length-mismatch"],
)
def test_hostile_request_ring_indices(daemon: Daemon, corrupt: Any) -> None:
    sock, (_events, prompts) = _session(daemon, "ring")
    corrupt(prompts)
    sock.sendall(encode_frame(m.Submit("hostile", 4, prompt_ring_bytes=40)))
    err = _expect_error_then_close(sock, m.PROTOCOL)
    assert "ring" in err.message or "record" in err.message
    sock.close()
    _assert_serving(daemon)


def test_hostile_event_ring_tail(daemon: Daemon) -> None:
    sock, (events, _prompts) = _session(daemon, "ring")
    sock.sendall(encode_frame(m.Submit("tail", 300, [1, 2], logprobs=20, ignore_eos=True)))
    _poke_u64(events, TAIL_OFFSET, 2**62)  # a tail the daemon never published
    err = _expect_error_then_close(sock, m.PROTOCOL)
    assert "tail" in err.message
    sock.close()
    _assert_serving(daemon)


def test_slow_consumer_is_cancelled_and_others_are_unaffected(daemon: Daemon) -> None:
    sock, _segs = _session(daemon, "ring")  # never drains its event ring
    sock.sendall(encode_frame(m.Submit("slow", 400, [1, 2], logprobs=20, ignore_eos=True)))
    with Client(daemon.socket) as c:  # meanwhile another client is served normally
        r = c.generate(prompt_token_ids=[3], max_tokens=20, ignore_eos=True)
        assert len(r.token_ids) == 20
    msg = _next_non_doorbell(sock)
    assert isinstance(msg, m.ErrorReply) and msg.code == m.CANCELLED, msg
    assert msg.request_id == "slow" and "stopped reading" in msg.message
    assert is_baseline(wait_baseline(daemon.socket))
    sock.close()
    _assert_serving(daemon)


CHILD = textwrap.dedent(
    """
    import os, sys
    import concurrent.futures.thread  # imported lazily later; nobody cannot read root's stdlib
    from libflare_client import Client, PermissionDenied
    client = Client(sys.argv[1], connect_timeout_s=5)
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    assert os.geteuid() == 65534
    try:
        client.health()
    except PermissionDenied as exc:
        print("denied:", exc)
    else:
        print("allowed")
    """
)


def _as_nobody(sock: Path) -> str:
    out = subprocess.run([sys.executable, "-c", CHILD, str(sock)], capture_output=True,
                         text=True, env=child_env(), timeout=60)  # fmt: skip
    return out.stdout + out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_uid_outside_the_allow_list(daemon: Daemon) -> None:
    st_dir, st_sock = os.stat(daemon.socket.parent), os.stat(daemon.socket)
    assert st_dir.st_mode & 0o777 == 0o750 and st_sock.st_mode & 0o777 == 0o660
    # first fence: file permissions keep other users away from the socket
    assert "denied:" in _as_nobody(daemon.socket)
    # second fence: even with a path it may open (a hard link to the socket inode in a
    # world-traversable directory, socket mode 0666), SO_PEERCRED refuses the uid
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)
        link = Path(tmp) / "flared.sock"
        os.link(daemon.socket, link)
        try:
            os.chmod(daemon.socket, 0o666)
            out = _as_nobody(link)
        finally:
            os.chmod(daemon.socket, 0o660)
    assert "denied:" in out and "uid 65534" in out, out
    _assert_serving(daemon)


def test_msgpack_never_unpickles(daemon: Daemon) -> None:
    import pickle

    sock, _ = _session(daemon)
    body = pickle.dumps({"x": 1})
    sock.sendall(HEADER.pack(len(body)) + body)
    _expect_error_then_close(sock, m.PROTOCOL)
    assert msgspec  # the codec is msgspec-only; see shm_protocol/codec.py
    _assert_serving(daemon)


def _until_finished(sock: socket.socket, rid: str) -> tuple[int, list[m.ErrorReply], Any]:
    """Read one request's events: (tokens, error replies, its Finished or terminal error)."""
    n, errors = 0, []
    while True:
        msg = _next_non_doorbell(sock)
        assert getattr(msg, "request_id", rid) == rid, msg
        if isinstance(msg, m.TokenDelta):
            n += len(msg.token_ids)
        elif isinstance(msg, m.ErrorReply) and msg.code == m.INVALID_REQUEST:
            errors.append(msg)  # a refused Submit; the live request goes on
        else:
            return n, errors, msg


def test_request_ids_are_private_to_their_session(daemon: Daemon) -> None:
    """Two clients may use the same request id at once; one cannot cancel, probe or reserve the
    other's ids. Within a session a live id is refused (InvalidRequest) and the live request
    is unaffected."""
    a, _ = _session(daemon)
    b, _ = _session(daemon)
    a.sendall(encode_frame(m.Submit("shared", 400, [1, 2], logprobs=20, ignore_eos=True)))
    first = _next_non_doorbell(a)
    assert isinstance(first, m.TokenDelta) and first.request_id == "shared", first
    a.sendall(encode_frame(m.Submit("shared", 2, [3])))  # the same id, same session, while live
    b.sendall(encode_frame(m.Cancel("shared")))  # names nothing in b's session
    b.sendall(encode_frame(m.Submit("shared", 3, [4, 5], ignore_eos=True)))
    n_b, errors_b, end_b = _until_finished(b, "shared")
    assert not errors_b and isinstance(end_b, m.Finished), (errors_b, end_b)
    assert end_b.finish_reason == "length" and n_b == 3
    with Client(daemon.socket) as c:
        assert c.stats()["requests_live"] == 1  # a's request was live throughout
    n_a, errors_a, end_a = _until_finished(a, "shared")
    assert [e.code for e in errors_a] == [m.INVALID_REQUEST], errors_a
    assert "already in use" in errors_a[0].message
    assert isinstance(end_a, m.Finished) and end_a.finish_reason == "length", end_a
    assert n_a + len(first.token_ids) == 400  # b's cancel did not touch it
    a.close()
    b.close()
    _assert_serving(daemon)


def test_slow_socket_consumer_is_cancelled_and_others_are_unaffected(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """The socket transport's bound: a client that stops reading fills its socket, then the
    daemon's write buffer past max_socket_buffer_bytes; after stall_timeout_s its requests are
    cancelled with a clear error, and another client is served meanwhile."""
    from e2e_support import TEST_CONFIG

    config = TEST_CONFIG.replace(
        "stall_timeout_s = 2.0", "stall_timeout_s = 0.2\nmax_socket_buffer_bytes = 4096"
    )
    d = Daemon(tiny_bundle, tmp_path, config).wait_ready()
    try:
        sock, _ = _session(d, "socket")
        rids = [f"slow{i}" for i in range(8)]
        for i, rid in enumerate(rids):  # ~2.6 kB of events per step, never read
            sock.sendall(encode_frame(m.Submit(rid, 480, [1, 2 + i], logprobs=20, ignore_eos=True)))
        with Client(d.socket) as c:
            r = c.generate(prompt_token_ids=[3], max_tokens=20, ignore_eos=True)
            assert len(r.token_ids) == 20
        cancelled: dict[str, str] = {}
        finished: set[str] = set()
        while len(cancelled) + len(finished) < len(rids):
            msg = _read(sock, timeout_s=60)
            assert msg is not None, "the daemon closed the slow client's connection"
            if isinstance(msg, m.ErrorReply):
                assert msg.code == m.CANCELLED, msg
                cancelled[msg.request_id] = msg.message
            elif isinstance(msg, m.Finished):
                finished.add(msg.request_id)
        assert cancelled, "no request was cancelled"
        assert all("stopped reading" in text for text in cancelled.values()), cancelled
        sock.close()
        assert is_baseline(wait_baseline(d.socket))
        with Client(d.socket) as c:
            assert c.stats()["slow_consumer_cancels_total"] >= 1
    finally:
        assert d.stop() == 0, d.log()


def test_a_full_frontend_pool_answers_busy(tiny_bundle: Path, tmp_path: Path) -> None:
    """Admission work (templates, tokenization) is bounded: with one pending job allowed, a
    request that arrives while a large render is still being tokenized gets a typed Busy at
    once instead of queueing behind it; the render still completes, and then requests pass."""
    from e2e_support import TEST_CONFIG

    config = TEST_CONFIG.replace(
        "[daemon]\n", "[daemon]\nfrontend_workers = 1\nmax_pending_frontend_jobs = 1\n"
    )
    d = Daemon(tiny_bundle, tmp_path, config).wait_ready()
    try:
        sock, _ = _session(d, "socket")
        big = [{"role": "user", "content": "many words of text " * 20_000}]  # ~380 kB
        small = [{"role": "user", "content": "hi"}]
        # both frames in one write: the daemon takes them in order, the render still pending
        sock.sendall(
            encode_frame(m.Render(1, big)) + encode_frame(m.Submit("r1", 2, messages=small))
        )
        replies = [_next_non_doorbell(sock), _next_non_doorbell(sock)]
        busy = [r for r in replies if isinstance(r, m.ErrorReply)]
        assert len(busy) == 1 and busy[0].code == m.BUSY and busy[0].request_id == "r1", replies
        assert any(isinstance(r, m.RenderResult) and len(r.token_ids) > 20_000 for r in replies)
        sock.close()
        with Client(d.socket) as c:
            assert c.chat(small, max_tokens=2).usage.completion_tokens >= 1
    finally:
        assert d.stop() == 0, d.log()
