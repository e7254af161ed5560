"""An unsatisfiable memory plan fails before the socket binds, with the planner's table; a
satisfiable one is printed at startup and exported in stats."""

from __future__ import annotations

import signal
import subprocess

from e2e_support import TEST_CONFIG, Daemon

from libflare_client import Client


def test_plan_that_does_not_fit_exits_before_binding(tiny_bundle, tmp_path):
    d = Daemon(tiny_bundle, tmp_path, TEST_CONFIG + "[memory]\nbudget_bytes = 1048576\n")
    code = d.proc.wait(timeout=120)
    log = d.log()
    assert code == 3, log
    assert "does not fit" in log and "weights" in log, log
    assert not d.socket.exists()
    assert not d.socket.parent.exists() or not any(d.socket.parent.iterdir())


def test_pinned_pages_below_the_guarantee_exit_before_binding(tiny_bundle, tmp_path):
    memory = "[memory]\nguarantee_concurrency = true\ntarget_concurrency = 4\nnum_kv_pages = 1\n"
    d = Daemon(tiny_bundle, tmp_path, TEST_CONFIG + memory)
    try:
        code: int | None = d.proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    log = d.log()
    d.stop(signal.SIGKILL)  # a daemon that started anyway must not outlive the test
    assert code == 2, log
    assert "num_kv_pages = 1 pins fewer pages" in log and "nothing was started" in log, log
    assert not d.socket.exists()


def test_plan_table_at_startup_and_in_stats(tiny_bundle, tmp_path):
    d = Daemon(tiny_bundle, tmp_path).wait_ready()
    try:
        log = d.log()
        assert "memory plan" in log and "kv_pages" in log, log
        with Client(d.socket) as c:
            stats = c.stats()
        flat = str(stats)
        assert "flare_memory_kv_pages_bytes" in flat or "kv_pages" in flat, stats
    finally:
        assert d.stop() == 0
