"""64 clients in separate processes; every 8th is SIGKILLed mid-stream."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from e2e_support import Daemon, child_env, is_baseline, wait_baseline

from libflare_client import Client

WORKER = str(Path(__file__).with_name("_stream_worker.py"))
NUM_CLIENTS = 64
MAX_TOKENS = 24


def _spawn(sock: Path, rid: str, max_tokens: int, seed: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, WORKER, str(sock), rid, str(max_tokens), str(seed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip


def test_64_clients_kill_every_8th(daemon: Daemon) -> None:
    # victims ask for far more tokens than the others, so they are surely mid-stream when killed
    victims = [i for i in range(NUM_CLIENTS) if i % 8 == 0]
    procs = {
        i: _spawn(daemon.socket, f"c{i}", 400 if i in victims else MAX_TOKENS, i)
        for i in range(NUM_CLIENTS)
    }
    for i in victims:
        line = procs[i].stdout.readline()  # type: ignore[union-attr]
        assert json.loads(line) == {"first": True}, procs[i].stderr.read()  # type: ignore[union-attr]
        procs[i].send_signal(signal.SIGKILL)
    for i in victims:
        procs[i].wait(timeout=30)
    for i, p in procs.items():
        if i in victims:
            continue
        out, err = p.communicate(timeout=120)
        last = json.loads(out.strip().splitlines()[-1])
        assert last == {"done": "length", "n": MAX_TOKENS}, (i, out, err)
    stats = wait_baseline(daemon.socket, timeout_s=5.0)
    assert is_baseline(stats), stats
    assert stats["sessions"] == 1, stats  # every worker's session closed (this one asked)
    # a new client reuses a dead client's request id
    with Client(daemon.socket) as c:
        r = c.generate(prompt_token_ids=[1, 2], max_tokens=3, ignore_eos=True, request_id="c0")
        assert r.request_id == "c0" and len(r.token_ids) == 3


def test_client_death_frees_resources_within_a_second(daemon: Daemon) -> None:
    p = _spawn(daemon.socket, "dies", 400, 1)
    assert json.loads(p.stdout.readline()) == {"first": True}  # type: ignore[union-attr]
    with Client(daemon.socket) as c:
        assert c.stats()["requests_live"] == 1
        p.kill()
        t0 = time.monotonic()
        p.wait()
        while not is_baseline(s := c.stats()):
            assert time.monotonic() - t0 < 1.0, s
            time.sleep(0.01)
        assert s["sessions"] == 1  # only this one
