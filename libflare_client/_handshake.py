"""The blocking part of connecting: connect, OpenSession, Welcome (+ ring fds). Runs in a
worker thread so the caller's event loop never blocks on it; every step has a timeout."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from libflare_client.errors import ConnectionLost, PermissionDenied, ProtocolError, from_reply
from shm_protocol import messages as m
from shm_protocol.codec import (
    HEADER,
    HEADER_BYTES,
    ProtocolViolation,
    check_length,
    daemon_decoder,
    encode_frame,
)

MAX_HANDSHAKE_FRAME_BYTES = 64 << 10
RING_FDS = 2  # event ring, request ring; the doorbell pipe's read end follows when granted


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    """Read exactly n bytes, collecting any SCM_RIGHTS fds that arrive with them."""
    buf = bytearray()
    while len(buf) < n:
        data, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), RING_FDS + 2)
        fds.extend(got)
        if not data:
            raise ConnectionLost("the daemon closed the connection during the handshake")
        buf += data
    return bytes(buf)


def _connect(path: Path, timeout_s: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
    except PermissionError as exc:
        sock.close()
        raise PermissionDenied(f"not allowed to connect to {path}: {exc.strerror}") from None
    except (OSError, TimeoutError) as exc:
        sock.close()
        raise ConnectionLost(f"no Flare daemon reachable at {path}: {exc}") from None
    return sock


def handshake(
    path: Path, transport: str, timeout_s: float, client_name: str, doorbell: str | None = None
) -> tuple[socket.socket, m.Welcome, list[int]]:
    """Returns the connected socket (still blocking), the Welcome, and the ring fds
    (event ring, request ring, then the doorbell pipe's read end when Welcome.doorbell says
    so) when transport is "ring". `doorbell`: what to ask for (default: the pipe for "ring")."""
    sock = _connect(path, timeout_s)
    fds: list[int] = []
    if doorbell is None:
        doorbell = m.DOORBELL_PIPE if transport == "ring" else ""
    try:
        hello = m.OpenSession(m.PROTOCOL_VERSION, client_name, transport, doorbell)
        # a daemon that refuses a connection (Busy, PermissionDenied) may answer and close
        # before our OpenSession arrives: the write fails, and its reply is still readable below
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(encode_frame(hello))
        (n,) = HEADER.unpack(_recv_exact(sock, HEADER_BYTES, fds))
        msg = daemon_decoder().decode(
            _recv_exact(sock, check_length(n, MAX_HANDSHAKE_FRAME_BYTES), fds)
        )
        if isinstance(msg, m.ErrorReply):
            raise from_reply(msg)
        if not isinstance(msg, m.Welcome):
            raise ProtocolError(f"expected Welcome, got {type(msg).__name__}")
        expected = (RING_FDS + (msg.doorbell == m.DOORBELL_PIPE)) if transport == "ring" else 0
        if len(fds) != expected:
            raise ProtocolError(f"expected {expected} fds with Welcome, got {len(fds)}")
        return sock, msg, fds
    except ProtocolViolation as exc:
        _close_all(sock, fds)
        raise ProtocolError(str(exc)) from None
    except (OSError, TimeoutError) as exc:
        _close_all(sock, fds)
        raise ConnectionLost(f"handshake with {path} failed: {exc}") from None
    except BaseException:
        _close_all(sock, fds)
        raise


def _close_all(sock: socket.socket, fds: list[int]) -> None:
    sock.close()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
