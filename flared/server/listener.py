"""The listening socket: a pathname Unix socket (never abstract), 0660 in a 0750 directory,
or the one systemd passed (socket activation); and the SO_PEERCRED allow-list.

Permissions are the first fence (the kernel refuses connect() without write permission on the
socket); SO_PEERCRED is the second, checked on every accepted connection before any byte is
read: root, the daemon's own uid, `allowed_uids`, and members of `allowed_group`.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from flared import env

log = logging.getLogger("flared.server")

SOCKET_MODE = 0o660
DIR_MODE = 0o750
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class ListenerError(RuntimeError):
    """The socket cannot be set up (another daemon is running, bad permissions, ...)."""


@dataclass(frozen=True)
class Listener:
    sock: socket.socket
    path: Path | None  # None for an inherited (socket-activated) socket
    owned: bool  # we created the path and unlink it at exit

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.owned and self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def activated_socket() -> socket.socket | None:
    """The socket systemd passed to this process, if any (sd_listen_fds semantics)."""
    pid, fds = env.get(env.LISTEN_PID), env.get(env.LISTEN_FDS)
    if not pid or not fds or pid != str(os.getpid()):
        return None
    for name in (env.LISTEN_PID, env.LISTEN_FDS, env.LISTEN_FDNAMES):
        env.pop(name)  # children must not think the fds are theirs
    if int(fds) < 1:
        return None
    sock = socket.socket(fileno=env.SD_LISTEN_FDS_START)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise ListenerError("the socket passed by systemd is not a Unix stream socket")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        raise ListenerError("the socket passed by systemd is not listening")
    os.set_inheritable(sock.fileno(), False)
    sock.setblocking(False)
    return sock


def _prepare_dir(directory: Path, group_gid: int | None) -> None:
    if not directory.exists():
        directory.mkdir(mode=DIR_MODE, parents=True)
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask
        if group_gid is not None:
            os.chown(directory, -1, group_gid)
        return
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ListenerError(f"{directory} is not a directory")
    if st.st_uid != os.geteuid() and st.st_uid != 0:
        raise ListenerError(f"{directory} belongs to uid {st.st_uid}; refusing to use it")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ListenerError(f"{directory} is world-writable; refusing to put the socket there")


def _remove_stale(path: Path) -> None:
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ListenerError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s", path)
        path.unlink(missing_ok=True)
        return
    except OSError as exc:
        raise ListenerError(f"cannot probe existing socket {path}: {exc}") from exc
    finally:
        probe.close()
    raise ListenerError(f"another daemon is already listening on {path}")


def bind_socket(path: Path, group_gid: int | None, backlog: int = 256) -> Listener:
    """Bind a fresh pathname socket. Call before starting threads: the umask is process-wide
    and is narrowed around bind() so the socket is never briefly more permissive than 0660."""
    path = path.absolute()
    _prepare_dir(path.parent, group_gid)
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o117)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ListenerError(f"cannot bind {path}: {exc}") from exc
    finally:
        os.umask(old)
    os.chmod(path, SOCKET_MODE)
    if group_gid is not None:
        os.chown(path, -1, group_gid)
    sock.listen(backlog)
    sock.setblocking(False)
    return Listener(sock, path, owned=True)


@dataclass(frozen=True)
class PeerPolicy:
    allowed_uids: frozenset[int]
    allowed_gid: int | None

    @staticmethod
    def build(allowed_group: str, allowed_uids: tuple[int, ...]) -> PeerPolicy:
        gid = None
        if allowed_group:
            try:
                gid = grp.getgrnam(allowed_group).gr_gid
            except KeyError:
                raise ListenerError(f"allowed_group {allowed_group!r} does not exist") from None
        return PeerPolicy(frozenset({0, os.geteuid(), *allowed_uids}), gid)

    def allows(self, uid: int, gid: int) -> bool:
        """May blocks on NSS (group membership); call it off the event loop."""
        if uid in self.allowed_uids:
            return True
        if self.allowed_gid is None:
            return False
        if gid == self.allowed_gid:
            return True
        try:
            name = pwd.getpwuid(uid).pw_name
            return self.allowed_gid in os.getgrouplist(name, gid)
        except KeyError:
            return False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer as of its connect() (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid
