"""The daemon's engine-progress check: by device when engine_stall_timeout_s is 0 (60 s on
CUDA, never on CPU, where a step of a large model may take minutes), explicit otherwise."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from flared.config import DaemonConfig
from flared.server.service import Service


class StuckEngine:
    """An engine whose loop never advances its heartbeat (a hung execution)."""

    def __init__(self, device: str) -> None:
        self.runner_plan = SimpleNamespace(device=device)
        self.heartbeat = 7
        self.state, self.failure = "ready", None
        self.abandoned: list[str] = []

    def abandon(self, reason: str) -> None:
        self.abandoned.append(reason)
        self.state, self.failure = "failed", reason


def _watch(device: str, timeout_s: float, after_s: float) -> tuple[Any, Service]:
    async def run() -> tuple[Any, Service]:
        svc = Service(DaemonConfig(engine_stall_timeout_s=timeout_s))
        engine = StuckEngine(device)
        svc.attach(engine, None)
        svc._check_engine_progress(1000.0)  # the first look: remembers the heartbeat
        svc._check_engine_progress(1000.0 + after_s)
        svc.shutdown_pools()
        return engine, svc

    return asyncio.run(run())


def test_by_device_cuda_fails_after_sixty_seconds() -> None:
    engine, svc = _watch("cuda", 0.0, 59.0)
    assert not engine.abandoned and svc.health == "ready"
    engine, svc = _watch("cuda", 0.0, 61.0)
    assert engine.abandoned and "no progress for 61.0s" in engine.abandoned[0]
    assert svc.health == "failed" and svc.counters["engine_stalls_total"] == 1


def test_by_device_cpu_never_fails() -> None:
    engine, svc = _watch("cpu", 0.0, 3600.0)
    assert not engine.abandoned and svc.health == "ready"


def test_an_explicit_timeout_applies_on_any_device() -> None:
    engine, svc = _watch("cpu", 5.0, 6.0)
    assert engine.abandoned and svc.health == "failed"
    engine, _ = _watch("cpu", 5.0, 4.0)
    assert not engine.abandoned
