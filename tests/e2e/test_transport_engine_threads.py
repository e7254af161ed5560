"""The engine's CPU thread team leaves a core to the daemon's delivery threads.

Through the daemon, a token's delivery needs the event loop, a detokenizer lane and the client
to run. With torch's default team (every core), each of those wake-ups preempted a team member
in the middle of an op, and on a loaded 2-core machine the engine's steps went from ~4 ms to
100-500 ms while the same engine alone stayed fast (flared/daemon_threads.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_support import REPO, Daemon, child_env

from flared.daemon_threads import cgroup_cpu_limit, engine_cpu_threads, usable_cpus


def test_policy_keeps_a_core_for_the_daemon() -> None:
    assert engine_cpu_threads(1, None) == 1
    assert engine_cpu_threads(2, None) == 1
    assert engine_cpu_threads(16, "") == 15
    assert engine_cpu_threads(16, "4") is None  # the operator's OMP_NUM_THREADS is kept


def test_cgroup_quota_caps_the_cpus(tmp_path: Path) -> None:
    membership = tmp_path / "cgroup"
    membership.write_text("0::/flare.slice\n")
    (tmp_path / "flare.slice").mkdir()
    quota = tmp_path / "flare.slice" / "cpu.max"
    quota.write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path, membership) == 1.5
    quota.write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path, membership) is None
    membership.write_text("12:cpu,cpuacct:/legacy\n")  # cgroup v1 only: no v2 quota to read
    assert cgroup_cpu_limit(tmp_path, membership) is None


_PROBE = """
import threading
from flared.daemon_threads import configure_engine_threads
import torch
applied = configure_engine_threads()
seen = []
def engine_thread():
    torch.ones(64, 64).sum()  # the first parallel op fixes this thread's team size
    seen.append(torch.get_num_threads())
t = threading.Thread(target=engine_thread)
t.start(); t.join()
print(applied, seen[0])
"""


def test_a_thread_started_after_configuring_runs_the_reduced_team() -> None:
    """The daemon configures on its loader thread and the engine's own thread starts later:
    the count must carry over to a new thread (torch applies it lazily per thread)."""
    env = child_env()
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()  # fmt: skip
    expected = engine_cpu_threads(usable_cpus(), None)
    assert [int(x) for x in out] == [expected, expected]


def test_daemon_reports_the_engine_team(daemon: Daemon) -> None:
    from libflare_client import Client

    explicit = os.environ.get("OMP_NUM_THREADS")
    with Client(daemon.socket) as c:
        stats = c.stats()
    expected = engine_cpu_threads(usable_cpus(), explicit)
    assert stats["engine_cpu_threads"] == (expected if expected is not None else int(explicit))


def test_daemon_freezes_its_loaded_objects_out_of_the_gc(daemon: Daemon) -> None:
    """After loading, the daemon freezes what the load created (a full cyclic collection over
    it would stall the engine thread for a long time); stats say how many objects."""
    from libflare_client import Client

    with Client(daemon.socket) as c:
        stats = c.stats()
    assert stats["gc_frozen_objects"] > 10_000


def test_frozen_objects_are_freed_at_exit_without_leak_reports() -> None:
    """Frozen objects return to the collector at exit: a native extension that checks for
    leaks at teardown (Triton's bindings) reports none."""
    pytest.importorskip("triton")
    probe = (
        "import triton\nfrom flared.daemon import freeze_loaded_objects\nfreeze_loaded_objects()\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "leaked" not in out.stderr


def test_the_daemon_names_its_own_threads(daemon: Daemon) -> None:
    """The engine thread, the detokenizer lanes and the front-end workers carry their names
    into the OS (top -H, /proc/PID/task/*/comm), so their CPU is told apart from the tensor
    library's pool."""
    from libflare_client import Client

    with Client(daemon.socket) as c:  # a request runs a lane and a front-end worker
        c.generate(prompt_token_ids=[5, 6, 7], max_tokens=2)
    tasks = Path(f"/proc/{daemon.proc.pid}/task")
    names = {t.joinpath("comm").read_text().strip() for t in tasks.iterdir()}
    assert "flare-engine" in names, names
    assert any(n.startswith("flare-detok") for n in names), names
    assert any(n.startswith("flare-front") for n in names), names
