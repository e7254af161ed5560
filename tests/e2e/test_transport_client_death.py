"""A SIGKILLed client's pages, rows, live requests, session and ring segments (the daemon's
memfd mappings) are all free within one second, for both transports."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from e2e_support import Daemon, child_env, is_baseline

from libflare_client import Client

VICTIM = textwrap.dedent(
    """
    import sys
    from libflare_client import Client
    with Client(sys.argv[1], transport=sys.argv[2]) as c:
        for ev in c.stream(prompt_token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True,
                           logprobs=5, request_id="victim-" + sys.argv[2]):
            if ev.token_ids:
                print("first", flush=True)
    """
)


def _ring_maps(pid: int) -> int:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sum(1 for line in maps if "memfd:flare-" in line)


@pytest.mark.parametrize("transport", ["ring", "socket"])
def test_killed_client_frees_pages_rows_and_segments_within_a_second(
    daemon: Daemon, transport: str
) -> None:
    with Client(daemon.socket, transport="socket") as watcher:  # maps no segments itself
        # the daemon is shared: a session an earlier test just closed may still be unmapping
        # its segments, so the baseline is taken once only the watcher's session is left
        deadline = time.monotonic() + 5.0
        while watcher.stats()["sessions"] > 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        base_maps = _ring_maps(daemon.proc.pid)
        base_sessions = watcher.stats()["sessions"]
        p = subprocess.Popen(
            [sys.executable, "-c", VICTIM, str(daemon.socket), transport],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        try:
            assert p.stdout is not None and p.stdout.readline() == "first\n", p.stderr
            s = watcher.stats()
            assert s["requests_live"] == 1 and s["sessions"] == base_sessions + 1, s
            ring = transport == "ring"
            assert _ring_maps(daemon.proc.pid) == base_maps + (2 if ring else 0)
        finally:
            p.kill()
        t0 = time.monotonic()
        p.wait(timeout=10)
        while True:
            s = watcher.stats()
            freed = is_baseline(s) and s["sessions"] == base_sessions
            if freed and _ring_maps(daemon.proc.pid) == base_maps:
                break
            assert time.monotonic() - t0 < 1.0, (s, _ring_maps(daemon.proc.pid), base_maps)
            time.sleep(0.01)
