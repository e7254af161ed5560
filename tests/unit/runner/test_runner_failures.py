"""The in-process engine when an execution fails or hangs, and EOS on the prepared path.

A failing execution ends every request with EngineError (not a quiet "cancelled"), the engine
reports why, and later submits are refused with that reason. A hung execution never raises: its
owner gives up on the loop (`abandon`), and the engine refuses new work at once and fails what
it still holds should the loop ever resume.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from flared.engine.events import FinishEvent, TokenEvent
from flared.engine.plan import FinishReason
from flared.llm_engine import Engine, EngineConfig, EngineError, SamplingParams
from flared.runner.runner import ModelRunner

GREEDY = SamplingParams(temperature=1.0, top_k=1, seed=7)  # top-k 1: the argmax, deterministic


def _engine(bundle: Path) -> Engine:
    return Engine(bundle, EngineConfig(device="cpu", num_pages=64))


def _wait_for(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_a_failing_execution_fails_every_request_with_engine_error(tiny, monkeypatch):
    eng = _engine(tiny.bundle("qwen3")).start()
    try:
        steps = {"n": 0}
        submit = ModelRunner.submit

        def flaky(self, plan, masks=None):  # type: ignore[no-untyped-def]
            steps["n"] += 1
            if steps["n"] > 4:
                raise RuntimeError("device fault (injected)")
            return submit(self, plan, masks)

        monkeypatch.setattr(ModelRunner, "submit", flaky)
        seen: list[object] = []
        with pytest.raises(EngineError, match="device fault"):
            for ev in eng.stream([5, 6, 7], max_tokens=50, ignore_eos=True):
                seen.append(ev)
        assert seen and all(isinstance(e, TokenEvent) for e in seen)  # tokens, then the error
        assert eng.state == "failed" and "RuntimeError: device fault" in str(eng.failure)
        assert eng.stats()["state"] == "failed"
        with pytest.raises(EngineError, match="failed: RuntimeError: device fault"):
            eng.generate([1, 2], max_tokens=2)
        with pytest.raises(EngineError, match="device fault"):  # the sink API alike
            eng.submit([1, 2], lambda ev: None, max_tokens=2)
    finally:
        eng.shutdown()


def test_an_abandoned_engine_refuses_work_and_fails_what_it_held(tiny, monkeypatch):
    eng = _engine(tiny.bundle("qwen3")).start()
    release = threading.Event()
    hung = threading.Event()
    try:
        steps = {"n": 0}
        submit = ModelRunner.submit

        def hangs(self, plan, masks=None):  # type: ignore[no-untyped-def]
            steps["n"] += 1
            if steps["n"] == 3:
                hung.set()
                assert release.wait(30), "the test never released the hung step"
            return submit(self, plan, masks)

        monkeypatch.setattr(ModelRunner, "submit", hangs)
        events: list[object] = []
        eng.submit([5, 6, 7], events.append, max_tokens=50, ignore_eos=True)
        assert hung.wait(30)
        beat = eng.heartbeat
        time.sleep(0.2)
        assert eng.heartbeat == beat  # what the daemon's stall check sees: no progress
        eng.abandon("no progress for 60s (a hung execution)")
        assert eng.state == "failed" and eng.stats()["state"] == "failed"
        with pytest.raises(EngineError, match="hung execution"):
            eng.generate([1, 2], max_tokens=2)
        release.set()  # the execution returns late: the loop stops and fails what it held
        _wait_for(lambda: any(isinstance(e, FinishEvent) for e in events))
        finish = events[-1]
        assert isinstance(finish, FinishEvent) and finish.reason is FinishReason.ERROR
        assert eng.failure == "no progress for 60s (a hung execution)"  # the owner's reason
    finally:
        release.set()
        eng.shutdown()


def _with_eos(bundle: Path, dest: Path, eos: int) -> Path:
    """The same bundle, its model's EOS id set to `eos`."""
    shutil.copytree(bundle, dest)
    path = dest / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["frontend"]["eos_token_ids"] = [eos]
    path.write_text(json.dumps(manifest))
    return dest


def test_eos_ends_a_request_on_the_prepared_path_and_min_tokens_bans_it(tiny, tmp_path):
    """The decode execution's own EOS check: a model whose EOS is the token greedy decoding
    emits third stops there ("stop" reason, EOS not counted past it); ignore_eos runs on; with
    min_tokens beyond it EOS cannot be sampled until then."""
    prompt = [11, 12, 13, 14]
    with _engine(tiny.bundle("qwen3")) as eng:
        free = eng.generate(prompt, max_tokens=12, ignore_eos=True, sampling=GREEDY).token_ids
    eos = free[2]
    first = free.index(eos)  # greedy may emit it earlier too
    with _engine(_with_eos(tiny.bundle("qwen3"), tmp_path / "eos", eos)) as eng:
        out = eng.generate(prompt, max_tokens=12, sampling=GREEDY)
        assert out.finish.reason is FinishReason.EOS
        assert out.token_ids == free[: first + 1]  # the EOS token is the last one returned
        ignored = eng.generate(prompt, max_tokens=12, ignore_eos=True, sampling=GREEDY)
        assert ignored.token_ids == free and ignored.finish.reason is FinishReason.LENGTH
        late = eng.generate(prompt, max_tokens=12, min_tokens=first + 3, sampling=GREEDY)
        assert eos not in late.token_ids[: first + 3]  # banned while under min_tokens
        assert late.token_ids[:first] == free[:first]
