"""The daemon's listening socket: where it lives by default, the modes it is created with, the
directories it refuses, stale and live sockets at its path, socket activation, the peer
allow-list, and the event loop the daemon falls back to without uvloop."""

from __future__ import annotations

import asyncio
import builtins
import logging
import os
import socket
import stat
from pathlib import Path

import pytest

from flared.server import listener as L
from shm_protocol import paths as P


# -- default paths (INTERFACES.md) -------------------------------------------------------------
def test_daemon_socket_path_resolution() -> None:
    assert P.daemon_socket_path({"FLARE_SOCKET": "/x/y.sock"}, uid=0) == Path("/x/y.sock")
    # a system service: systemd's INVOCATION_ID and root or a system uid
    assert P.daemon_socket_path({"INVOCATION_ID": "abc"}, uid=0) == Path("/run/flare/flared.sock")
    assert P.daemon_socket_path({"INVOCATION_ID": "abc"}, uid=999) == P.SYSTEM_SOCKET
    # a user's own unit (uid >= 1000) and no unit at all: the user's runtime directory
    user = {"INVOCATION_ID": "abc", "XDG_RUNTIME_DIR": "/run/user/1000"}
    assert P.daemon_socket_path(user, uid=1000) == Path("/run/user/1000/flare/flared.sock")
    assert P.daemon_socket_path({"XDG_RUNTIME_DIR": "/r"}, uid=0) == Path("/r/flare/flared.sock")
    # no runtime directory: a private per-uid directory under /tmp
    assert P.daemon_socket_path({}, uid=1234) == Path("/tmp/flare-1234/flared.sock")
    # the explicit variable wins over everything
    both = {"FLARE_SOCKET": "/e.sock", "INVOCATION_ID": "a", "XDG_RUNTIME_DIR": "/r"}
    assert P.daemon_socket_path(both, uid=0) == Path("/e.sock")


def test_client_socket_path_takes_the_path_that_exists(tmp_path: Path, monkeypatch) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    user = tmp_path / "flare" / "flared.sock"
    monkeypatch.setattr(P, "SYSTEM_SOCKET", tmp_path / "system" / "flared.sock")
    assert P.client_socket_path(env) == user  # neither exists: the user path, named in errors
    P.SYSTEM_SOCKET.parent.mkdir()
    P.SYSTEM_SOCKET.touch()
    assert P.client_socket_path(env) == P.SYSTEM_SOCKET  # only the system daemon runs
    user.parent.mkdir()
    user.touch()
    assert P.client_socket_path(env) == user  # the user's own daemon first
    assert P.client_socket_path({**env, "FLARE_SOCKET": "/e.sock"}) == Path("/e.sock")


# -- creating the socket -----------------------------------------------------------------------
def test_socket_is_0660_in_a_0750_directory_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)  # the most permissive umask: modes must not depend on it
    try:
        lst = L.bind_socket(tmp_path / "run" / "flared.sock", None)
    finally:
        os.umask(old)
    try:
        assert lst.path is not None and lst.owned
        assert stat.S_IMODE(os.stat(lst.path.parent).st_mode) == 0o750
        st = os.lstat(lst.path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert lst.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        assert not os.get_inheritable(lst.sock.fileno())  # not leaked into children
    finally:
        lst.close()
    assert not (tmp_path / "run" / "flared.sock").exists()  # an owned path goes at close


def test_refuses_unsafe_directories(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(L.ListenerError, match="not a directory"):
        L.bind_socket(link / "flared.sock", None)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(L.ListenerError, match="world-writable"):
        L.bind_socket(open_dir / "flared.sock", None)
    os.chmod(open_dir, 0o1777)  # sticky, like /tmp: others cannot replace our socket
    L.bind_socket(open_dir / "flared.sock", None).close()
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    with pytest.raises(L.ListenerError, match="not a directory"):
        L.bind_socket(not_dir / "flared.sock", None)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_refuses_a_directory_another_user_owns(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 4321, 4321)
    with pytest.raises(L.ListenerError, match="belongs to uid 4321"):
        L.bind_socket(theirs / "flared.sock", None)


def test_stale_socket_is_replaced_and_a_live_one_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d" / "flared.sock"
    first = L.bind_socket(path, None)
    # a daemon killed without cleanup leaves its path behind: nobody listens there any more
    first.sock.close()
    assert path.exists()
    second = L.bind_socket(path, None)
    try:
        with pytest.raises(L.ListenerError, match="already listening"):
            L.bind_socket(path, None)
        assert path.exists()  # the live daemon's socket is left alone
    finally:
        second.close()
    path.write_text("not a socket")
    with pytest.raises(L.ListenerError, match="exists and is not a socket"):
        L.bind_socket(path, None)
    assert path.read_text() == "not a socket"  # never deleted


def test_activation_variables_for_another_process_are_ignored(monkeypatch) -> None:
    """LISTEN_FDS meant for a parent (LISTEN_PID not ours) is not taken; the real activation
    path runs in tests/e2e/test_lifecycle.py with a daemon started on an inherited socket."""
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert L.activated_socket() is None
    assert os.environ["LISTEN_FDS"] == "1"  # not ours: left for whoever it was meant for
    monkeypatch.delenv("LISTEN_PID")
    assert L.activated_socket() is None


# -- the peer allow-list -----------------------------------------------------------------------
def test_peer_policy(monkeypatch) -> None:
    me = os.geteuid()
    policy = L.PeerPolicy.build("", (4242,))
    assert policy.allows(me, 0) and policy.allows(0, 0) and policy.allows(4242, 99)
    assert not policy.allows(5151, 5151)
    with pytest.raises(L.ListenerError, match="does not exist"):
        L.PeerPolicy.build("no-such-group-flare", ())
    group = L.grp.getgrgid(os.getegid()).gr_name
    grouped = L.PeerPolicy.build(group, ())
    assert grouped.allowed_gid == os.getegid()
    assert grouped.allows(5151, os.getegid())  # primary group of the peer
    # supplementary membership, as NSS reports it for the peer's user name
    monkeypatch.setattr(L.pwd, "getpwuid", lambda uid: type("pw", (), {"pw_name": "ann"})())
    monkeypatch.setattr(L.os, "getgrouplist", lambda name, gid: [gid, os.getegid()])
    assert grouped.allows(5151, 5151)
    monkeypatch.setattr(L.os, "getgrouplist", lambda name, gid: [gid])
    assert not grouped.allows(5151, 5151)

    def no_user(uid: int) -> None:
        raise KeyError(uid)

    monkeypatch.setattr(L.pwd, "getpwuid", no_user)  # a uid without a passwd entry
    assert not grouped.allows(5151, 5151)


def test_peer_credentials_are_the_connecting_process(tmp_path: Path) -> None:
    lst = L.bind_socket(tmp_path / "s" / "flared.sock", None)
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(lst.path))
        lst.sock.setblocking(True)
        conn, _ = lst.sock.accept()
        pid, uid, gid = L.peer_credentials(conn)
        assert (pid, uid, gid) == (os.getpid(), os.geteuid(), os.getegid())
        conn.close()
        c.close()
    finally:
        lst.close()


# -- the event loop ----------------------------------------------------------------------------
def test_daemon_runs_on_asyncio_without_uvloop(monkeypatch, caplog) -> None:
    from flared import daemon

    real_import = builtins.__import__

    def no_uvloop(name: str, *args: object, **kwargs: object) -> object:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    async def main() -> int:
        return 0 if isinstance(asyncio.get_running_loop(), asyncio.BaseEventLoop) else 1

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    with caplog.at_level(logging.WARNING, logger="flared"):
        assert daemon._run_loop(main()) == 0
    assert "uvloop is not installed" in caplog.text


def test_a_refusal_sent_before_the_clients_hello_still_reaches_it(monkeypatch) -> None:
    """A daemon at its connection cap answers Busy and closes at once, possibly before the
    client's OpenSession is written: the client's write then fails (EPIPE), and the reply
    waiting in its socket must still become the typed error, not a ConnectionLost."""
    from libflare_client import Busy, ConnectionLost
    from libflare_client import _handshake as H
    from shm_protocol import messages as m
    from shm_protocol.codec import encode_frame

    def refused(path: Path, timeout_s: float) -> socket.socket:
        ours, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        daemon.sendall(encode_frame(m.ErrorReply(m.BUSY, "uid 1000 already has 3 connections")))
        daemon.close()
        ours.settimeout(timeout_s)
        return ours

    monkeypatch.setattr(H, "_connect", refused)
    with pytest.raises(Busy, match="already has 3 connections"):
        H.handshake(Path("/nonexistent"), "socket", 5.0, "test")

    def closed(path: Path, timeout_s: float) -> socket.socket:  # closed without a word
        ours, daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        daemon.close()
        ours.settimeout(timeout_s)
        return ours

    monkeypatch.setattr(H, "_connect", closed)
    with pytest.raises(ConnectionLost):
        H.handshake(Path("/nonexistent"), "socket", 5.0, "test")


# -- accepting under fd exhaustion --------------------------------------------------------------
def test_accept_backs_off_when_out_of_fds_and_recovers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """accept() failing with EMFILE (the process is out of file descriptors) leaves the pending
    connection queued: the acceptor waits 0.1 s before trying again instead of spinning on a
    socket that stays readable, and accepts the connection once an fd is free."""
    import errno
    import itertools
    import time

    from flared.server import acceptor

    handled: list[socket.socket] = []

    async def record(_service: object, conn: socket.socket, _policy: object) -> None:
        handled.append(conn)

    monkeypatch.setattr(acceptor, "_handle", record)
    path = tmp_path / "s.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(path))
    listening.listen(4)
    listening.setblocking(False)
    attempts: list[float] = []

    async def main() -> float:
        loop = asyncio.get_running_loop()
        real_accept = loop.sock_accept

        async def out_of_fds(sock: socket.socket) -> tuple[socket.socket, object]:
            attempts.append(time.monotonic())
            if len(attempts) <= 3:
                raise OSError(errno.EMFILE, "Too many open files")
            return await real_accept(sock)

        loop.sock_accept = out_of_fds  # type: ignore[method-assign]
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))  # queued in the backlog while accept fails
        t0 = time.monotonic()
        task = loop.create_task(acceptor.serve(None, listening, None))  # type: ignore[arg-type]
        while not handled and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        took = time.monotonic() - t0
        task.cancel()
        client.close()
        return took

    took = asyncio.run(main())
    # three failures, the accept, and the next accept waiting for a connection
    assert len(handled) == 1 and len(attempts) == 5, attempts
    assert took >= 0.3  # three back-offs of 0.1 s, not a busy loop
    assert all(b - a >= 0.09 for a, b in itertools.pairwise(attempts[:4])), attempts
    handled[0].close()
    listening.close()
