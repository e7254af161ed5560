"""End-to-end fixtures: one tiny bundle for the whole session, real daemon processes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# small rings and short timeouts so the bounded paths are reached quickly in tests
TEST_CONFIG = """
[daemon]
handshake_timeout_s = 2.0
stall_timeout_s = 2.0
drain_timeout_s = 3.0
event_ring_bytes = 16384
request_ring_bytes = 65536
max_backlog_records = 64
[engine]
device = "cpu"
"""


def listening_socket(path: Path) -> socket.socket:
    """A bound, listening Unix socket at `path` (its directory made 0750), as systemd's
    flared.socket holds one for the daemon it activates."""
    path.parent.mkdir(mode=0o750, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(16)
    return sock


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FLARE_SOCKET", None)
    return env


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `flare demo --cache-dir` layout holding the tiny checkpoint and its CPU bundle."""
    from prep.__main__ import main as prep_main
    from prep.tiny import make_tiny_checkpoint

    cache = tmp_path_factory.mktemp("demo-cache")
    ckpt = make_tiny_checkpoint(cache / "tiny-qwen3", "qwen3")
    args = ["--out", str(cache / "tiny-qwen3.bundle"), "--device", "cpu", "--max-context", "512"]
    assert prep_main([str(ckpt), *args, "--prefill-chunk", "256", "--no-compile"]) == 0
    return cache


@pytest.fixture(scope="session")
def tiny_bundle(demo_cache: Path) -> Path:
    return demo_cache / "tiny-qwen3.bundle"


class Daemon:
    """A `flare run` child process on a private socket."""

    def __init__(
        self,
        bundle: Path,
        workdir: Path,
        config: str = TEST_CONFIG,
        extra_env: dict[str, str] | None = None,
        launcher: Path | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket = workdir / "sock" / "flared.sock"
        self.config_path = workdir / "flared.toml"
        self.config_path.write_text(config)
        self.log_path = workdir / "flared.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        entry = ["-m", "flared.cli"] if launcher is None else [str(launcher)]
        cmd = [sys.executable, *entry, "run", str(bundle), "--socket",
               str(self.socket), "--config", str(self.config_path)]  # fmt: skip
        env = {**child_env(), **(extra_env or {})}
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=self._log)

    def wait_ready(self, timeout_s: float = 120.0) -> Daemon:
        from libflare_client import Client, ConnectionLost

        deadline = time.monotonic() + timeout_s
        client = Client(self.socket)
        try:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"daemon exited early:\n{self.log()}"
                try:
                    if client.health() == "ready":
                        return self
                except ConnectionLost:
                    pass
                time.sleep(0.1)
        finally:
            client.close()
        raise AssertionError(f"daemon not ready in {timeout_s}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:  # after stop() too (an assertion's message)
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout_s)
        self._log.close()
        return code


@pytest.fixture(scope="session")
def daemon(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tiny_bundle, tmp_path_factory.mktemp("daemon")).wait_ready()
    yield d
    assert d.stop() == 0, d.log()


def wait_baseline(socket: Path, timeout_s: float = 5.0) -> dict[str, object]:
    """Poll the daemon until no request is live and every page and row is free."""
    from libflare_client import Client

    deadline = time.monotonic() + timeout_s
    with Client(socket) as c:
        while True:
            s = c.stats()
            if is_baseline(s) or time.monotonic() > deadline:
                return s
            time.sleep(0.02)


def is_baseline(s: dict[str, object]) -> bool:
    """Nothing running and nothing leaked: every page is free or held by a checkpoint of the
    prefix cache (which only the cache's eviction frees)."""
    cached = s.get("pages_cached", 0)
    assert isinstance(cached, int)
    return (
        s["pages_free"] + cached == s["pages_total"]  # type: ignore[operator]
        and s["state_rows_free"] == s["state_rows_total"]
        and s["requests_running"] == 0
        and s["requests_waiting"] == 0
        and s["requests_live"] == 0
    )


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "flare" in n.lower()}


# -- grammar steering: a random tiny model rarely writes markup by itself, so tests that need
# reasoning or a tool call make it write known text with a regex grammar and assert on what
# was parsed from it
NO_THINK = {"enable_thinking": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def call_text(city: str) -> str:
    """A get_weather call in the tiny Qwen3 bundle's tool-call syntax (Hermes JSON)."""
    return (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'
    )


def regex(text: str) -> dict[str, Any]:
    """A regex response format matching exactly `text` (metacharacters escaped)."""
    return {"type": "regex", "regex": re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)}
