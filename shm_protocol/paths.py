"""Where the daemon's socket lives by default (shared by the daemon and the client).

Resolution for the daemon (INTERFACES.md): `$FLARE_SOCKET`; else `/run/flare/flared.sock` when
running as a system service (systemd set `$INVOCATION_ID` and the effective uid is root or a
system user, uid < 1000); else `$XDG_RUNTIME_DIR/flare/flared.sock`; else, with no
XDG_RUNTIME_DIR, a private per-uid directory `/tmp/flare-<uid>/flared.sock`.

A client does not know how the daemon was started, so it uses `$FLARE_SOCKET`, else the first
of the per-user path and the system path that exists, else the per-user path (so the error
message names where it looked).

The names of these environment variables are declared here because libflare_client cannot
import flared; flared/env.py re-exports them with the daemon's own variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

FLARE_SOCKET: Final = "FLARE_SOCKET"
XDG_RUNTIME_DIR: Final = "XDG_RUNTIME_DIR"
INVOCATION_ID: Final = "INVOCATION_ID"

SYSTEM_SOCKET: Final = Path("/run/flare/flared.sock")
SOCKET_NAME: Final = "flared.sock"
MAX_SYSTEM_UID: Final = 999  # login.defs SYS_UID_MAX on Debian/Fedora


def user_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    env = os.environ if env is None else env
    runtime = env.get(XDG_RUNTIME_DIR)
    if runtime:
        return Path(runtime) / "flare" / SOCKET_NAME
    return Path("/tmp") / f"flare-{os.geteuid() if uid is None else uid}" / SOCKET_NAME


def is_system_service(env: Mapping[str, str] | None = None, uid: int | None = None) -> bool:
    env = os.environ if env is None else env
    uid = os.geteuid() if uid is None else uid
    return bool(env.get(INVOCATION_ID)) and uid <= MAX_SYSTEM_UID


def daemon_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    env = os.environ if env is None else env
    explicit = env.get(FLARE_SOCKET)
    if explicit:
        return Path(explicit)
    if is_system_service(env, uid):
        return SYSTEM_SOCKET
    return user_socket_path(env, uid)


def client_socket_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    explicit = env.get(FLARE_SOCKET)
    if explicit:
        return Path(explicit)
    user = user_socket_path(env)
    for candidate in (user, SYSTEM_SOCKET):
        if candidate.exists():
            return candidate
    return user
