"""Daemon side of a new connection: peer check, OpenSession, Welcome with the ring fds (and the
doorbell pipe's read end when the client asked for one).

Runs on raw non-blocking sockets so that exactly the handshake bytes are read (nothing is
over-read into a buffer) and the memfds can ride on the Welcome frame with SCM_RIGHTS.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket

from shm_protocol import messages as m
from shm_protocol.codec import (
    HEADER,
    HEADER_BYTES,
    ProtocolViolation,
    check_length,
    client_decoder,
    encode_frame,
)

MAX_HANDSHAKE_FRAME_BYTES = 64 << 10


class HandshakeRefused(Exception):
    """Carries the ErrorReply to send before closing."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.reply = m.ErrorReply(code, message)


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await loop.sock_recv(sock, n - len(buf))
        if not data:
            raise ConnectionResetError("peer closed during the handshake")
        buf += data
    return bytes(buf)


async def read_open_session(sock: socket.socket, timeout_s: float) -> m.OpenSession:
    loop = asyncio.get_running_loop()

    async def read() -> m.ClientMessage:
        (n,) = HEADER.unpack(await _recv_exact(loop, sock, HEADER_BYTES))
        body = await _recv_exact(loop, sock, check_length(n, MAX_HANDSHAKE_FRAME_BYTES))
        return client_decoder().decode(body)

    try:
        msg = await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise HandshakeRefused(m.PROTOCOL, f"no OpenSession within {timeout_s}s") from None
    except ProtocolViolation as exc:
        raise HandshakeRefused(m.PROTOCOL, str(exc)) from None
    if not isinstance(msg, m.OpenSession):
        raise HandshakeRefused(m.PROTOCOL, f"expected OpenSession first, got {type(msg).__name__}")
    if msg.protocol_version not in m.SUPPORTED_VERSIONS:
        raise HandshakeRefused(
            m.UNSUPPORTED_VERSION,
            f"protocol version {msg.protocol_version} is not supported; this daemon speaks "
            f"{sorted(m.SUPPORTED_VERSIONS)}",
        )
    if msg.transport not in m.TRANSPORTS:
        raise HandshakeRefused(m.PROTOCOL, f"unknown transport {msg.transport!r}")
    if msg.doorbell not in m.DOORBELLS:
        raise HandshakeRefused(m.PROTOCOL, f"unknown doorbell {msg.doorbell!r}")
    return msg


async def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send `data` with `fds` attached to its first byte; the rest (if the kernel took only
    part) goes without ancillary data."""
    loop = asyncio.get_running_loop()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    for _ in range(200):
        try:
            sent = sock.sendmsg([data], anc)
            break
        except BlockingIOError:
            await asyncio.sleep(0.005)
    else:
        raise TimeoutError("the client is not reading its handshake")
    if sent < len(data):
        await loop.sock_sendall(sock, data[sent:])


async def refuse(sock: socket.socket, reply: m.ErrorReply) -> None:
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, TimeoutError):
        await asyncio.wait_for(loop.sock_sendall(sock, encode_frame(reply)), 1.0)
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
