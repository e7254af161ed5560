"""The `flare` command line against real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from e2e_support import Daemon, child_env


def _flare(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flared.cli", *args], capture_output=True,
                          text=True, env=child_env(), timeout=timeout)  # fmt: skip


def test_status_and_chat(daemon: Daemon) -> None:
    st = _flare("status", "--socket", str(daemon.socket))
    assert st.returncode == 0, st.stderr
    data = json.loads(st.stdout)
    assert data["health"] == "ready" and data["pages_total"] > 0
    chat = _flare("chat", "--socket", str(daemon.socket), "--max-tokens", "8", "--seed", "3",
                  "hello fox")  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.strip()


def test_status_without_a_daemon(tmp_path: Path) -> None:
    st = _flare("status", "--socket", str(tmp_path / "none.sock"))
    assert st.returncode == 1
    assert json.loads(st.stdout)["health"] == "unreachable"


def test_prep_runs_in_a_child_process(tmp_path: Path) -> None:
    ok = _flare("prep", "--help")
    assert ok.returncode == 0 and "--no-compile" in ok.stdout
    bad = _flare("prep", str(tmp_path / "missing"), "--out", str(tmp_path / "b"), "--device", "cpu")
    assert bad.returncode != 0


def test_run_rejects_a_bad_config(tiny_bundle: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[daemon]\nno_such_option = 1\n")
    r = _flare("run", str(tiny_bundle), "--socket", str(tmp_path / "s.sock"), "--config", str(cfg))
    assert r.returncode == 2 and "no_such_option" in r.stderr


def test_demo(demo_cache: Path) -> None:
    r = _flare("demo", "--cache-dir", str(demo_cache), "--max-tokens", "12", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "flare> " in r.stdout
    assert "daemon stopped (exit 0)" in r.stderr


def test_interactive_chat_keeps_the_conversation(daemon: Daemon) -> None:
    """`flare chat` without a message reads turns from stdin until EOF (blank lines skipped),
    streams each reply, and sends the whole conversation each turn: the second reply equals
    a one-off request for the same three messages with the same seed."""
    from libflare_client import Client, SamplingParams

    args = ["chat", "--socket", str(daemon.socket), "--max-tokens", "6", "--seed", "3"]
    run = subprocess.run([sys.executable, "-m", "flared.cli", *args], input=b"hello fox\n\nand then?\n",
                         capture_output=True, env=child_env(), timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = run.stdout.decode()
    assert out.startswith("you> flare> ") and out.count("flare> ") == 2, out
    first = out[len("you> flare> ") : out.index("\nyou> ")]
    second = out.split("flare> ")[2].rsplit("\nyou> ", 1)[0]
    with Client(daemon.socket) as c:
        sampling = SamplingParams(seed=3)
        messages = [{"role": "user", "content": "hello fox"}]
        again = c.chat(messages, max_tokens=6, sampling=sampling)
        assert again.content == first
        messages += [
            {"role": "assistant", "content": first},
            {"role": "user", "content": "and then?"},
        ]
        assert c.chat(messages, max_tokens=6, sampling=sampling).content == second
