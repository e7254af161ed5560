"""The in-process engine: seeded reproducibility under batching, limits, stop ids, logprobs,
cancellation, penalties' histogram, capacity and validation errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from flared.engine.errors import CapacityError, InvalidRequest
from flared.engine.events import FinishEvent, TokenEvent
from flared.engine.plan import FinishReason
from flared.llm_engine import Engine, EngineConfig, SamplingParams, prompt_ids


@pytest.fixture(scope="module")
def engine(tiny):
    eng = Engine(tiny.bundle("qwen3"), EngineConfig(device="cpu", num_pages=160)).start()
    yield eng
    eng.shutdown()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _baseline(engine: Engine) -> None:
    import time

    for _ in range(100):
        s = engine.stats()
        if s.get("requests_running") == 0 and s["pages_free"] + s.get("pages_cached", 0) == s.get(
            "pages_total"
        ):
            break
        time.sleep(0.02)
    s = engine.stats()
    # every page is free or held by a prefix-cache checkpoint
    assert s["pages_free"] + s.get("pages_cached", 0) == s["pages_total"]
    assert s["state_rows_free"] == s["state_rows_total"]


def test_seeded_request_is_independent_of_batch_company(engine, monkeypatch):
    """Alone, the request (top-k 50) runs the candidate-only decode execution; beside requests
    with top-k off it runs the one that also sorts their vocabulary: the same tokens."""
    from prep.executions import Executions

    paths_run: list[str] = []
    decode = Executions.decode

    def spy(self, rows, out, token_mask=None, paths="both", single_row=False):  # type: ignore[no-untyped-def]
        paths_run.append(paths)
        return decode(self, rows, out, token_mask, paths, single_row)

    monkeypatch.setattr(Executions, "decode", spy)
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=4242)
    alone = engine.generate(_prompt(40, 1), max_tokens=24, ignore_eos=True, sampling=sp).token_ids
    assert set(paths_run) == {"candidates"}
    paths_run.clear()
    results: dict[int, list[int]] = {}

    def go(i: int) -> None:
        if i == 3:
            results[i] = engine.generate(
                _prompt(40, 1), max_tokens=24, ignore_eos=True, sampling=sp
            ).token_ids
        else:
            company = SamplingParams(seed=i, top_k=0 if i % 2 else 20)
            results[i] = engine.generate(_prompt(10 + 17 * i, 50 + i), max_tokens=5 + 7 * i, ignore_eos=True,
                                         sampling=company).token_ids  # fmt: skip

    threads = [threading.Thread(target=go, args=(i,)) for i in range(7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[3] == alone
    assert "both" in paths_run  # the requests with top-k off ran the sorting execution
    assert all(len(results[i]) == 5 + 7 * i for i in range(7) if i != 3)
    _baseline(engine)


def test_single_row_executions_serve_only_lone_requests_without_a_seed(tiny, monkeypatch):
    """Engine with decode_single_gemm="folded": a request without a seed decoding alone runs
    the one-row executions; a seeded one (or one with top_k = 1) never does, alone or in
    company, so its tokens are the same alone and beside requests without a seed."""
    from prep.executions import Executions

    runs: list[tuple[int, bool]] = []  # (live rows, single_row) of every decode execution
    decode = Executions.decode

    def spy(self, rows, out, token_mask=None, paths="both", single_row=False):  # type: ignore[no-untyped-def]
        runs.append((int((rows != 0).sum()), single_row))
        return decode(self, rows, out, token_mask, paths, single_row)

    monkeypatch.setattr(Executions, "decode", spy)
    bundle = tiny.bundle("qwen3", max_context_tokens=256, max_prefill_chunk_tokens=128)
    with Engine(bundle, EngineConfig(device="cpu", decode_single_gemm="folded")) as eng:
        sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=4242)
        runs.clear()
        alone = eng.generate(_prompt(40, 1), max_tokens=16, ignore_eos=True, sampling=sp)
        assert runs and not any(single for _, single in runs)
        before = eng.stats()["decode_steps_by_execution"]
        for params in (SamplingParams(top_k=50), SamplingParams(top_k=0)):  # no seed: single
            runs.clear()
            eng.generate(_prompt(30, 2), max_tokens=8, ignore_eos=True, sampling=params)
            assert runs and all(single for _, single in runs)
        after = eng.stats()["decode_steps_by_execution"]
        ran = {name: after[name] - before[name] for name in after if after[name] > before[name]}
        assert ran == {"decode1_lean_single": 7, "decode1_single": 7}  # max_tokens 8: 1 + 7
        runs.clear()
        eng.generate(_prompt(30, 2), max_tokens=8, ignore_eos=True,
                     sampling=SamplingParams(top_k=1))  # fmt: skip
        assert runs and not any(single for _, single in runs)
        results: dict[int, list[int]] = {}

        def go(i: int) -> None:
            if i == 2:
                out = eng.generate(_prompt(40, 1), max_tokens=16, ignore_eos=True, sampling=sp)
            else:  # company without seeds, finishing before and after the seeded request
                out = eng.generate(_prompt(9 + 5 * i, 70 + i), max_tokens=3 + 9 * i,
                                   ignore_eos=True, sampling=SamplingParams(top_k=20))  # fmt: skip
            results[i] = out.token_ids

        runs.clear()
        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results[2] == alone.token_ids
        assert all(rows == 1 for rows, single in runs if single)


def test_seeded_tokens_do_not_depend_on_row_or_batch_deterministically(tiny):
    """The same check without threads: one seeded request decodes alone in row 2, then in row
    5 beside three others (different seeds, penalties, top-k off so the sorting path runs too)
    in batches whose size and order change every step: the same tokens."""
    from runner_harness import Harness

    mine = dict(seed=4242, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                ignore_eos=True)  # fmt: skip
    prompt = _prompt(23, 5)
    alone = Harness(tiny.bundle("qwen3"))
    alone.admit(2, prompt, **mine)
    alone.prefill(2, 0, len(prompt), sample=True)
    for _ in range(12):
        alone.decode([2])
    crowd = Harness(tiny.bundle("qwen3"))
    company = {0: dict(seed=1, top_k=0), 1: dict(seed=2, top_k=20, presence_penalty=0.5),
               7: dict(seed=3, top_p=0.5, frequency_penalty=0.3)}  # fmt: skip
    for row, params in company.items():
        crowd.admit(row, _prompt(7 + row * 5, 60 + row), ignore_eos=True, **params)
        crowd.prefill(row, 0, 7 + row * 5, sample=True)
    crowd.admit(5, prompt, **mine)
    crowd.prefill(5, 0, len(prompt), sample=True)
    batches = [[5, 0], [1, 5, 7], [5], [7, 0, 1, 5], [0, 5], [5, 7], [1, 0, 5, 7]] * 2
    for rows in batches[:12]:
        crowd.decode(rows)
    assert crowd.seq[5] == alone.seq[2]


def test_max_tokens_and_stop_token_ids(engine):
    sp = SamplingParams(seed=7)
    full = engine.generate(_prompt(20, 2), max_tokens=12, ignore_eos=True, sampling=sp)
    assert len(full.token_ids) == 12 and full.finish.reason == FinishReason.LENGTH
    stop = full.token_ids[5]
    first = full.token_ids.index(stop)
    cut = engine.generate(
        _prompt(20, 2), max_tokens=12, ignore_eos=True, sampling=sp, stop_token_ids=[stop]
    )
    assert cut.token_ids == full.token_ids[: first + 1]
    assert cut.finish.reason == FinishReason.STOP_TOKEN
    # min_tokens bans stop ids until reached: the stop token can no longer end the request early
    held = engine.generate(_prompt(20, 2), max_tokens=12, ignore_eos=True, sampling=sp,
                           stop_token_ids=[stop], min_tokens=first + 1)  # fmt: skip
    assert stop not in held.token_ids[: first + 1]


def test_logprobs_are_raw_log_softmax(engine, tiny):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32)
    prompt = _prompt(30, 3)
    out = engine.generate(prompt, max_tokens=6, ignore_eos=True, logprobs=5,
                          sampling=SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=1))  # fmt: skip
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
    for i, tok in enumerate(out.tokens):
        row = ref[len(prompt) - 1 + i]
        assert abs(tok.logprob - float(row[tok.token_id])) < 1e-4
        ids = [t for t, _ in tok.top_logprobs]
        assert len(ids) == 5 and ids == torch.topk(row, 5).indices.tolist()


def test_top_logprobs_of_a_row_beside_rows_that_did_not_ask(engine, tiny):
    """Decode batches mix a request that asked for top logprobs with two that did not (whose
    rows' top-k is skipped): the asking request's top logprobs are still the raw
    distribution's, at every token."""
    import threading

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny.checkpoint("qwen3"), dtype=torch.float32)
    prompt = _prompt(25, 8)
    outs = {}

    def go(i: int) -> None:
        outs[i] = engine.generate(
            prompt if i == 0 else _prompt(20 + i, 9 + i), max_tokens=10, ignore_eos=True,
            logprobs=4 if i == 0 else 0, sampling=SamplingParams(top_k=20, seed=i),
        )  # fmt: skip

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seq = prompt + outs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), -1)
    for i, tok in enumerate(outs[0].tokens):
        row = ref[len(prompt) - 1 + i]
        assert [t for t, _ in tok.top_logprobs] == torch.topk(row, 4).indices.tolist()
        assert [lp for _, lp in tok.top_logprobs] == pytest.approx(
            torch.topk(row, 4).values.tolist(), abs=1e-4
        )
    assert all(not t.top_logprobs for i in (1, 2) for t in outs[i].tokens)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_penalty_histogram_is_exact_across_prefill_and_decode(tiny, prefix_cache):
    """Also after a longer prompt in the same row: the runner uploads an admission's prompt
    buffer only as far as the longest prompt it still holds, and stale tokens beyond the new
    prompt must not be counted."""
    eng = Engine(
        tiny.bundle("qwen3"),
        EngineConfig(device="cpu", num_pages=64, max_num_rows=1, prefix_cache=prefix_cache),
    )
    eng.start()
    try:
        # two prefill chunks (256 + 44), then shorter prompts, one of them a prefix of the first
        first = _prompt(300, 4)
        for prompt in (first, _prompt(40, 5), first[:120], _prompt(7, 6)):
            out = eng.generate(
                prompt,
                max_tokens=9,
                ignore_eos=True,
                sampling=SamplingParams(seed=3, frequency_penalty=0.5),
            )
            hist = eng.runner.state.hist[1]
            expect = torch.bincount(torch.tensor(prompt + out.token_ids), minlength=hist.shape[0])
            assert torch.equal(hist.long(), expect)
    finally:
        eng.shutdown()


def test_cancel_mid_stream_frees_everything(engine):
    events = []
    done = threading.Event()

    def sink(ev):
        events.append(ev)
        if isinstance(ev, FinishEvent):
            done.set()

    rid = engine.submit(
        _prompt(50, 5),
        sink,
        max_tokens=10_000 // 50,
        ignore_eos=True,
        sampling=SamplingParams(seed=1),
    )
    while sum(len(e.tokens) for e in events if isinstance(e, TokenEvent)) < 3:
        done.wait(0.01)
    engine.cancel(rid)
    assert done.wait(5)
    assert events[-1].reason == FinishReason.CANCELLED
    _baseline(engine)
    # the id can be reused at once
    again = engine.generate(
        _prompt(5, 6), request_id=rid, max_tokens=2, sampling=SamplingParams(seed=1)
    )
    assert len(again.token_ids) <= 2


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ([3, 0, 9], (3, 0, 9)),
        ((3, 0, 9), (3, 0, 9)),
        ([], ()),
        (range(3), (0, 1, 2)),
        (np.array([4, 5]), (4, 5)),
        ([np.int64(4), 5], (4, 5)),
        ([1, 10], "outside the vocabulary"),
        ([-1], "outside the vocabulary"),
        ([2**70], "outside the vocabulary"),
        ([1, 2.5], "must be integers"),
        ([1, "2"], "must be integers"),
        ([1, None], "must be integers"),
    ],
)
def test_prompt_ids_are_integers_in_the_vocabulary(prompt, expected):
    if isinstance(expected, str):
        with pytest.raises(InvalidRequest, match=expected):
            prompt_ids(prompt, 10)
    else:
        ids = prompt_ids(prompt, 10)
        assert ids == expected and isinstance(ids, tuple)


def test_checked_prompt_packs_lists_and_tuples_only():
    import struct

    from flared.llm_engine import checked_prompt

    assert checked_prompt([3, 1, 2], 10) == ((3, 1, 2), struct.pack("<3q", 3, 1, 2))
    assert checked_prompt((4,), 10)[1] == struct.pack("<q", 4)
    assert checked_prompt(iter([3, 1]), 10) == ((3, 1), None)  # converted, not packed


def test_capacity_and_validation_errors(engine):
    with pytest.raises(CapacityError, match="context limit"):
        engine.submit(_prompt(600, 1), lambda ev: None)
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.submit([5], lambda ev: None, sampling=SamplingParams(temperature=0.0))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.submit([5, 99999], lambda ev: None)
    with pytest.raises(InvalidRequest, match="must be integers"):
        engine.submit([5, 6.0], lambda ev: None)
    with pytest.raises(InvalidRequest, match="top_p"):
        engine.submit([5], lambda ev: None, sampling=SamplingParams(top_p=1.5))
    with pytest.raises(InvalidRequest, match="logprobs"):
        engine.submit([5], lambda ev: None, logprobs=100)
    # the context limit (512 tokens: prompt + output) ends a long generation with CAPACITY
    out = engine.generate([5, 6], max_tokens=600, sampling=SamplingParams(seed=2), ignore_eos=True)
    assert len(out.token_ids) == 512 - 2 and out.finish.reason == FinishReason.CAPACITY
    _baseline(engine)


def test_submit_nowait_reports_the_engines_verdict_without_blocking(engine):
    """The daemon's loop submits token-only requests with submit_nowait: the same tokens as
    submit, argument errors raised at the call, the scheduler's rejections as the verdict."""
    import queue

    sp = SamplingParams(temperature=1.0, seed=11)
    prompt = _prompt(30, 3)
    want = engine.generate(prompt, max_tokens=6, ignore_eos=True, sampling=sp).token_ids
    verdicts: queue.SimpleQueue = queue.SimpleQueue()
    events: queue.SimpleQueue = queue.SimpleQueue()
    rid = engine.submit_nowait(prompt, events.put, verdicts.put, request_id="nowait",
                               max_tokens=6, ignore_eos=True, sampling=sp)  # fmt: skip
    assert rid == "nowait" and verdicts.get(timeout=30) is None
    tokens: list[int] = []
    while not isinstance(ev := events.get(timeout=30), FinishEvent):
        tokens += [t.token_id for t in ev.tokens]
    assert tokens == want
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.submit_nowait([5, 99999], lambda ev: None, verdicts.put)
    engine.submit_nowait(_prompt(600, 1), lambda ev: None, verdicts.put)
    assert isinstance(verdicts.get(timeout=30), CapacityError)
    assert verdicts.empty()
    _baseline(engine)


def test_a_finish_waits_for_the_step_that_captures_its_request(tiny, monkeypatch):
    """With two steps in flight (as on CUDA), a request that finishes owing a terminal capture
    the next plan makes (a length finish) has its FinishEvent delivered only after that plan,
    capture included, was submitted; a request still referenced by the step in flight (a stop
    token found on the device) owes no capture yet, and its finish is delivered at once."""
    import queue

    eng = Engine(tiny.bundle("qwen3"),
                 EngineConfig(device="cpu", num_pages=160, max_steps_in_flight=2)).start()  # fmt: skip
    try:
        log: list[tuple[str, object]] = []
        submit, complete = eng.runner.submit, eng.scheduler.complete

        def logged_submit(plan, masks=None):  # type: ignore[no-untyped-def]
            log.append(("submit", len(plan.snapshots)))
            return submit(plan, masks)

        def logged_complete(result):  # type: ignore[no-untyped-def]
            events = complete(result)
            log.extend(("finished", ev.request_id) for ev in events if isinstance(ev, FinishEvent))
            return events

        monkeypatch.setattr(eng.runner, "submit", logged_submit)
        monkeypatch.setattr(eng.scheduler, "complete", logged_complete)
        sp = SamplingParams(temperature=1.0, seed=5)
        stop = eng.generate(_prompt(20, 8), max_tokens=12, ignore_eos=True, sampling=sp).token_ids[
            5
        ]

        def run(rid: str, **kw) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
            log.clear()
            q: queue.SimpleQueue = queue.SimpleQueue()

            def sink(ev) -> None:  # type: ignore[no-untyped-def]
                if isinstance(ev, FinishEvent):
                    log.append(("delivered", ev.request_id))
                q.put(ev)

            eng.submit(_prompt(20, 8), sink, request_id=rid, sampling=sp, **kw)
            while not isinstance(q.get(timeout=60), FinishEvent):
                continue
            entries = list(log)
            return entries[entries.index(("finished", rid)) : entries.index(("delivered", rid))]

        between = run("length", max_tokens=4, ignore_eos=True)
        assert ("submit", 1) in between, between  # the capture went out first
        between = run("stop", max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
        assert between == [("finished", "stop")], between  # nothing waited for
        _baseline(eng)
    finally:
        eng.shutdown()


def test_the_first_token_yield_follows_first_tokens_only(tiny, monkeypatch):
    """first_token_yield_s releases the GIL once after a step that delivered a request's first
    token while another step is in flight, and after no other step; dispatch_yield_s after
    every step that delivered events."""
    import flared.llm_engine as le

    sp = SamplingParams(temperature=1.0, seed=5)
    for config, expected in (({"first_token_yield_s": 0.0}, "one"),
                             ({"dispatch_yield_s": 0.0}, "per step"), ({}, "none")):  # fmt: skip
        eng = Engine(tiny.bundle("qwen3"), EngineConfig(
            device="cpu", num_pages=160, max_steps_in_flight=2, **config)).start()  # fmt: skip
        try:
            pauses: list[float] = []
            monkeypatch.setattr(le.time, "sleep", pauses.append)
            out = eng.generate(_prompt(20, 8), max_tokens=8, ignore_eos=True, sampling=sp)
            monkeypatch.undo()
            assert len(out.token_ids) == 8
            if expected == "one":
                assert pauses == [0.0]
            elif expected == "per step":
                assert len(pauses) >= 6 and set(pauses) == {0.0}  # every step but the last two
            else:
                assert pauses == []
        finally:
            eng.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "mode", "gemm"),
    [("qwen3", "decode-forward", "skinny"), ("qwen3", "forward-sampling", "skinny"),
     ("qwen3", "regional", "skinny"), ("qwen3_5", "regional", "skinny"),
     ("llama", "regional", "fused"), ("qwen3", "decode-forward", "fused"),
     ("qwen3", "regional", "folded")],
)  # fmt: skip
def test_compiled_executions_match_eager(tiny, monkeypatch, arch, mode, gemm):
    """The compiled decoder stack (one decode capacity, to keep CPU compile time small) gives the
    eager path's logits within fp32 reordering error and the same seeded tokens; "forward-sampling"
    also compiles the prefill forward and every sampling/commit region; "regional" runs prefill
    through decoder layers compiled once for all layers (the hybrid's too: its decode stack
    compiles whole around the recurrent layers' state-pool operations). decode_gemm "fused":
    the fused decode layers (skinny_fused ops) compile too, against the eager canonical path;
    "folded": the folded layers (skinny_folded ops over weights folded at load) and the prefill
    layers over the same weights. qwen3 "regional" also builds prefill128_fresh, whose decoder
    code differs from prefill128's only by AttentionMeta.fresh: compiled, each keeps its own
    version (runner_harness.check_fresh_routing)."""
    from runner_harness import Harness, check_fresh_routing
    from torch._dynamo.utils import counters

    from prep import calls

    bundle = tiny.bundle(arch, max_context_tokens=256, max_prefill_chunk_tokens=128,
                         decode_capacities=(1,))  # fmt: skip
    fresh = (arch, mode, gemm) == ("qwen3", "regional", "skinny")
    if fresh:
        monkeypatch.setattr(calls, "FRESH_MIN_TOKENS", 128)
    eager = Harness(bundle)
    compiled = Harness(bundle, compile=mode, decode_gemm=gemm, prefill_fresh=fresh)
    ex = compiled.r.ex
    assert ex._base_decode is not ex.base  # the compiled stack is what runs
    # and a decode step's inputs come from one compiled region, not ~20 eager kernels
    assert ex._decode_inputs != ex._step_inputs
    assert eager.r.ex._decode_inputs == eager.r.ex._step_inputs
    if mode == "forward-sampling":
        assert ex._base_prefill is not ex.base and ex._commit_other != ex._commit
    if mode == "regional":
        assert ex._base_prefill is ex.base and ex._commit_other is ex._commit_decode
    prompt = _prompt(40, 8)
    for h in (eager, compiled):
        graphs = counters["stats"]["unique_graphs"]
        h.admit(1, prompt)
        h.prefill(1, 0, 40, sample=True)
        for _ in range(3):
            h.decode([1])
        if h is compiled:  # warm-up traced everything: serving compiles nothing
            assert counters["stats"]["unique_graphs"] == graphs
    assert eager.seq[1] == compiled.seq[1]
    rel = (eager.logits(1) - compiled.logits(1)).norm() / eager.logits(1).norm()
    assert float(rel) < 1e-5
    if fresh:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            tiny.checkpoint(arch), dtype=torch.float32, attn_implementation="eager"
        )
        graphs = counters["stats"]["unique_graphs"]
        check_fresh_routing(compiled, hf, monkeypatch)
        assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regional", "layers", "decode"])
def test_compiled_single_row_executions_keep_their_own_layers(tiny, mode):
    """decode_single_gemm="folded" compiled: the one-row execution for a request without a seed
    and the batch-invariant one at the same capacity trace the same decoder code with a
    different AttentionMeta.single_row, so the compiled code must keep one version per value.
    A marker tells which layers ran: every input norm's weight set to 2 after the prompts'
    prefill, which the canonical layer reads (the folded weights already hold the norm) and the folded layer does
    not. The lone request without a seed then matches Transformers; the seeded one runs the
    canonical layer and, marked, does not; both exactly as the eager runner does; serving
    compiles nothing."""
    from runner_harness import Harness, reference_logits, rel_l2
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3"), dtype=torch.float32, attn_implementation="eager"
    )
    bundle = tiny.bundle("qwen3", max_context_tokens=256, max_prefill_chunk_tokens=128,
                         decode_capacities=(1,))  # fmt: skip
    eager = Harness(bundle, decode_single_gemm="folded")
    compiled = Harness(bundle, compile=mode, decode_single_gemm="folded")
    logits: dict[int, list[torch.Tensor]] = {}
    for h in (eager, compiled):
        graphs = counters["stats"]["unique_graphs"]
        for row, p in ((1, {"reproducible": False}), (2, {})):
            h.admit(row, _prompt(30 + row, row), **p)
            h.prefill(row, 0, 30 + row, sample=True)
        for layer in h.r.model.base_model.layers:  # the marker, after the prompts' KV
            layer.input_layernorm.weight.fill_(2.0)  # (folded: all ones before)
        for step in range(2):
            for row in (1, 2):
                h.decode([row], forced={row: 40 + 7 * step + row})
                ref = reference_logits(hf, h.seq[row][:-1])[-1]
                err = rel_l2(h.logits(row), ref)
                assert err < 1e-5 if row == 1 else err > 1e-2, (h is compiled, step, row, err)
                logits.setdefault(row, []).append(h.logits(row))
        if h is compiled:  # warm-up traced both versions: serving compiles nothing
            assert counters["stats"]["unique_graphs"] == graphs
    for row, (e1, e2, c1, c2) in logits.items():
        for e, c in ((e1, c1), (e2, c2)):
            assert float((e - c).norm() / e.norm()) < 1e-5, row


def test_engine_sets_the_configured_gil_switch_interval(tiny):
    """engine.gil_switch_interval_ms bounds how long another Python thread can keep the engine
    thread waiting for the GIL; 0 leaves Python's interval alone, and shutdown restores it."""
    import sys

    before = sys.getswitchinterval()
    try:
        bundle = tiny.bundle("qwen3", max_context_tokens=256, max_prefill_chunk_tokens=128,
                             decode_capacities=(1,))  # fmt: skip
        with Engine(bundle, EngineConfig(device="cpu")):
            assert sys.getswitchinterval() == before
        with Engine(bundle, EngineConfig(device="cpu", gil_switch_interval_s=0.0002)):
            assert sys.getswitchinterval() == pytest.approx(0.0002)
        assert sys.getswitchinterval() == before  # restored at shutdown
    finally:
        sys.setswitchinterval(before)


def test_tiny_positive_temperature_samples_instead_of_failing(engine):
    # 1e-45 is 0 in fp32: it must clamp to the minimum temperature, not reach the device as 0
    out = engine.generate(
        _prompt(20, 9), max_tokens=4, ignore_eos=True, sampling=SamplingParams(temperature=1e-45)
    )
    assert len(out.tokens) == 4 and all(t.valid for t in out.tokens)
    assert engine.state == "ready"


def test_tiny_positive_repetition_penalty_samples_instead_of_failing(engine):
    # seen tokens' positive logits are divided by it: 1e-40 must not reach the device (fp32 0)
    sp = SamplingParams(repetition_penalty=1e-40, seed=1)
    out = engine.generate(_prompt(20, 9), max_tokens=4, ignore_eos=True, sampling=sp)
    assert len(out.tokens) == 4 and all(t.valid for t in out.tokens)
    assert engine.state == "ready"


def test_ttft_and_itl_histograms_in_stats(engine):
    engine.generate(_prompt(12, 11), max_tokens=5, ignore_eos=True, sampling=SamplingParams(seed=1))
    s = engine.stats()
    for name in ("ttft_ms", "itl_ms"):
        h = s[name]
        assert h["count"] >= 1 and h["p50"] >= 0
        counts = [h[k] for k in h if k.startswith("le_")]
        assert counts == sorted(counts) and counts[-1] <= h["count"]


@pytest.mark.parametrize("model_type, kinds", [("qwen3", 1), ("qwen3_5", 2)])
def test_regional_prefill_traces_one_layer_per_kind(tiny, model_type, kinds):
    """Regional compilation: every decoder layer reads its KV pages and recurrent state from
    buffers bound to its own modules, so one traced layer serves every layer of its kind (the
    tiny hybrid has GDN and attention layers) instead of one trace per layer index, and the
    compiled prefill matches the eager one."""
    from runner_harness import Harness
    from torch._dynamo.utils import counters

    bundle = tiny.bundle(model_type, max_context_tokens=256, max_prefill_chunk_tokens=128,
                         decode_capacities=(1,))  # fmt: skip
    eager = Harness(bundle)
    torch._dynamo.reset()  # traces of other tests' models would serve this one's layers too
    before = counters["stats"]["unique_graphs"]
    compiled = Harness(bundle, compile="layers")
    layers = compiled.r.ex.base.layers
    assert len(layers) > kinds  # more layers than traces
    # one trace per layer kind and shape: decode1 and prefill128; and decode1's step inputs
    assert counters["stats"]["unique_graphs"] - before == 2 * kinds + 1
    prompt = _prompt(100, 4)
    for h in (eager, compiled):
        h.admit(1, prompt)
        h.prefill(1, 0, 60, sample=False)
        h.prefill(1, 60, 40, sample=True)
        h.decode([1])
    assert eager.seq[1] == compiled.seq[1]
    rel = (eager.logits(1) - compiled.logits(1)).norm() / eager.logits(1).norm()
    assert float(rel) < 1e-5


def test_extra_prefill_capacity_pads_less_and_matches(tiny):
    """An extra prefill capacity (192 between 128 and 256) is prepared and chosen for a chunk
    that fits it; the result equals the power-of-two-only bundle's."""
    from runner_harness import Harness

    kw = dict(max_context_tokens=512, max_prefill_chunk_tokens=256, decode_capacities=(1,))
    plain = Harness(tiny.bundle("qwen3", **kw))
    extra = Harness(tiny.bundle("qwen3", extra_prefill_capacities=(192,), **kw))
    steps = extra.r.steps
    assert steps.prefill_caps == [128, 192, 256] and "prefill192" in extra.r.calls
    assert steps._capacity(steps.prefill_caps, 150, "prefill chunk") == 192
    prompt = _prompt(150, 6)
    for h in (plain, extra):
        h.admit(1, prompt)
        h.prefill(1, 0, 150, sample=True)
    assert plain.seq[1] == extra.seq[1]
    rel = (plain.logits(1) - extra.logits(1)).norm() / plain.logits(1).norm()
    assert float(rel) < 1e-5


def test_chunk_costs_cut_prefill_into_the_cheapest_chunks(tiny):
    """With chunk costs (measured on CUDA; given here) a 260-token prompt is prefilled as
    128 + 128 + 4 when a chunk of 256 costs three of 128, instead of 256 + 4; the tokens are the
    same as without costs. Costs naming a capacity the bundle lacks are refused."""
    bundle = tiny.bundle("qwen3", max_context_tokens=512, max_prefill_chunk_tokens=256)
    prompt = _prompt(260, 9)
    sp = SamplingParams(seed=5)
    out = {}
    for costs in ((), ((128, 1.0), (256, 3.0))):
        eng = Engine(bundle, EngineConfig(device="cpu", num_pages=80, prefix_cache=False,
                                          prefill_chunk_costs=costs)).start()  # fmt: skip
        chunks: list[int] = []
        submit = eng.runner.submit

        def record(plan, masks=None, submit=submit, chunks=chunks):
            if plan.prefill is not None:
                chunks.append(len(plan.prefill.token_ids))
            return submit(plan, masks)

        eng.runner.submit = record
        try:
            out[costs] = (eng.generate(prompt, max_tokens=6, ignore_eos=True, sampling=sp), chunks)
        finally:
            eng.shutdown()
    (plain, plain_chunks), (cut, cut_chunks) = out.values()
    assert plain_chunks == [256, 4] and cut_chunks == [128, 128, 4]
    assert cut.token_ids == plain.token_ids
    with pytest.raises(ValueError, match="lacks"):
        Engine(bundle, EngineConfig(device="cpu", num_pages=80, prefill_chunk_costs=((192, 1.0),)))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5"])
def test_one_or_two_steps_in_flight_serve_the_same_tokens(tiny, model_type):
    """A CPU runner executes each step inside its submit, so the CPU engine runs one step at a
    time by default (a second step in flight would hold every result back a step). The
    pipelined loop CUDA runs (two in flight: plans and restores ahead of completions) serves
    exactly the same seeded tokens and cache hits: an agent's next turn, then a concurrent
    batch, each engine back to its baseline after."""
    bundle = tiny.bundle(model_type)
    with Engine(bundle, EngineConfig(device="cpu")) as eng:
        assert eng.max_steps_in_flight == 1
    with pytest.raises(ValueError, match="max_steps_in_flight"):
        Engine(bundle, EngineConfig(device="cpu", max_steps_in_flight=3))
    prompt = _prompt(70, 11)
    got = {}
    for n in (1, 2):
        with Engine(
            bundle, EngineConfig(device="cpu", num_pages=160, max_steps_in_flight=n)
        ) as eng:
            assert eng.max_steps_in_flight == n
            sp = SamplingParams(temperature=1.0, top_k=40, seed=7)
            first = eng.generate(prompt, max_tokens=9, ignore_eos=True, sampling=sp)
            end = len(prompt) + len(first.token_ids)
            turn = [*prompt, *first.token_ids, *_prompt(23, 12)]
            second = eng.generate(
                turn, max_tokens=9, ignore_eos=True, sampling=sp, endpoints=(end,)
            )
            batch: dict[int, list[int]] = {}

            def go(i: int, eng: Engine = eng, batch: dict = batch) -> None:
                batch[i] = eng.generate(_prompt(15 + 9 * i, 30 + i), max_tokens=4 + 3 * i,
                                        ignore_eos=True, sampling=SamplingParams(seed=i)).token_ids  # fmt: skip

            threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            got[n] = (first.token_ids, second.token_ids, second.finish.cached_tokens, batch)
            _baseline(eng)
    assert got[1] == got[2]
    assert got[1][2] == len(prompt) + len(got[1][0]) - 1  # the turn resumed from the last one
