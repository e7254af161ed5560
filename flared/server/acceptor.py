"""Accept loop: every connection is peer-checked, handshaken and turned into a Session.

A connection that fails any step gets a typed ErrorReply (when it can still receive one) and
is closed; nothing here affects other sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket

from flared.server.handshake import (
    HandshakeRefused,
    close_fds,
    read_open_session,
    refuse,
    send_with_fds,
)
from flared.server.listener import PeerPolicy, peer_credentials
from flared.server.service import Service
from flared.server.session import Session
from shm_protocol import messages as m
from shm_protocol.codec import encode_frame
from shm_protocol.doorbell import DoorbellPipe
from shm_protocol.segment import Segment, create_ring_segment

log = logging.getLogger("flared.server")
_ids = itertools.count(1)


async def serve(service: Service, listener: socket.socket, policy: PeerPolicy) -> None:
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError as exc:  # EMFILE and friends: back off rather than spin
            log.warning("accept failed: %s", exc)
            await asyncio.sleep(0.1)
            continue
        conn.setblocking(False)
        task = loop.create_task(_handle(service, conn, policy))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _handle(service: Service, conn: socket.socket, policy: PeerPolicy) -> None:
    counted: int | None = None  # the uid this connection is counted against, once admitted
    try:
        try:
            peer = peer_credentials(conn)
            await _check_peer(service, peer, policy)
            counted = peer[1]
            service.connections += 1
            service.connections_by_uid[counted] += 1
            session = await _open(service, conn, peer)
        except HandshakeRefused as exc:
            service.counters["connections_refused_total"] += 1
            log.info("refused a connection: %s", exc)
            await refuse(conn, exc.reply)
            return
        except (OSError, TimeoutError) as exc:
            log.info("handshake failed: %s", exc)
            with contextlib.suppress(OSError):
                conn.close()
            return
        await session.run()
    finally:
        if counted is not None:
            service.connections -= 1
            service.connections_by_uid[counted] -= 1
            if not service.connections_by_uid[counted]:
                del service.connections_by_uid[counted]


async def _check_peer(service: Service, peer: tuple[int, int, int], policy: PeerPolicy) -> None:
    """The allow-list, then the connection caps. Connections still in their handshake count
    too: a peer holding many half-open connections cannot starve the others of sessions."""
    _pid, uid, gid = peer
    if uid not in policy.allowed_uids:
        allowed = await asyncio.get_running_loop().run_in_executor(None, policy.allows, uid, gid)
        if not allowed:
            raise HandshakeRefused(m.PERMISSION_DENIED, f"uid {uid} may not use this daemon")
    cfg = service.config
    if service.connections >= cfg.max_sessions:
        raise HandshakeRefused(m.BUSY, f"the daemon already has {cfg.max_sessions} connections")
    per_uid = cfg.max_sessions_per_uid
    if per_uid and service.connections_by_uid[uid] >= per_uid:
        raise HandshakeRefused(m.BUSY, f"uid {uid} already has {per_uid} connections")


async def _open(service: Service, conn: socket.socket, peer: tuple[int, int, int]) -> Session:
    cfg = service.config
    uid = peer[1]
    hello = await read_open_session(conn, cfg.handshake_timeout_s)
    session_id = f"s{next(_ids)}-{os.getpid()}"
    fds: list[int] = []
    segments: list[Segment] = []
    bell: DoorbellPipe | None = None
    try:
        if hello.transport == "ring":
            for name, size in (
                ("events", cfg.event_ring_bytes),
                ("prompts", cfg.request_ring_bytes),
            ):
                fd, seg = create_ring_segment(f"flare-{session_id}-{name}", size)
                fds.append(fd)
                segments.append(seg)
            if hello.doorbell == m.DOORBELL_PIPE:
                bell = DoorbellPipe()
        welcome = _welcome(service, session_id, hello.transport, bell is not None)
        sent = fds + ([bell.read_fd] if bell is not None else [])
        await asyncio.wait_for(send_with_fds(conn, encode_frame(welcome), sent), 5.0)
        reader, writer = await asyncio.open_unix_connection(sock=conn)
    except BaseException:
        for seg in segments:
            seg.close()
        if bell is not None:
            bell.close()
        raise
    finally:
        close_fds(fds)  # the client has its own copies now; ours would only leak
        if bell is not None:
            bell.close_read_end()
    session = Session(service, session_id, reader, writer, hello.transport, segments, peer, bell)
    service.sessions[session_id] = session
    log.debug("session %s open (pid %d uid %d, %s)", session_id, peer[0], uid, hello.transport)
    return session


def _welcome(service: Service, session_id: str, transport: str, pipe: bool) -> m.Welcome:
    cfg = service.config
    vocab = ctx = 0
    eos: list[int] = []
    if service.engine is not None:
        mf = service.engine.manifest
        vocab, ctx = mf.geometry.vocab_size, mf.catalog.max_context_tokens
        eos = list(mf.frontend.eos_token_ids)
    ring = transport == "ring"
    return m.Welcome(
        m.PROTOCOL_VERSION,
        session_id,
        service.health,
        cfg.max_frame_bytes,
        cfg.event_ring_bytes if ring else 0,
        cfg.request_ring_bytes if ring else 0,
        vocab,
        ctx,
        eos,
        m.DOORBELL_PIPE if pipe else "",
    )
