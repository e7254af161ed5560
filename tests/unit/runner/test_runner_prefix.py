"""The prefix cache end to end in the engine on CPU: checkpoints taken by the prepared
snapshot/copy executions, restored into new rows, and continued.

fp32 on CPU and seeded sampling: a continuation from a checkpoint must give exactly the tokens
of the cold run (the restored KV pages, recurrent state, hidden vector and consumed count are
bit copies), and the reuse shows in cached_tokens. For the hybrid model a restored prefix splits
the recurrent prefill where the cold run does not, which changes the recurrence's association
(fp32 differences ~1e-6, see test_runner_hybrid); at these sizes the sampled tokens still agree.
"""

from __future__ import annotations

import pytest
import torch

from flared.llm_engine import Engine, EngineConfig, SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_next"])
def engines(request, tiny):
    bundle = tiny.bundle(request.param)
    cached = Engine(bundle, EngineConfig(device="cpu", num_pages=160, prefix_cache=True)).start()
    cold = Engine(bundle, EngineConfig(device="cpu", num_pages=160, prefix_cache=False)).start()
    yield cached, cold
    cached.shutdown()
    cold.shutdown()


class _Out:
    def __init__(self, out) -> None:
        self.tokens = [t.token_id for t in out.tokens]
        self.logprobs = [t.logprob for t in out.tokens]
        self.finish = out.finish


def _gen(eng: Engine, prompt: list[int], seed: int, **kw) -> _Out:
    sp = SamplingParams(temperature=0.9, top_k=40, seed=seed)
    return _Out(eng.generate(prompt, max_tokens=12, sampling=sp, ignore_eos=True, **kw))


@pytest.mark.parametrize("length", [47, 48, 49, 64, 100])
def test_full_prompt_hit_resumes_from_saved_hidden_vector(engines, length):
    cached, cold = engines
    prompt = _prompt(length, length)
    first = _gen(cached, prompt, seed=5)
    again = _gen(cached, prompt, seed=5)
    ref = _gen(cold, prompt, seed=5)
    assert first.tokens == ref.tokens
    assert first.finish.cached_tokens == 0
    assert again.finish.cached_tokens == length
    assert again.tokens == ref.tokens
    assert again.logprobs == pytest.approx(ref.logprobs, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("split", [15, 16, 17, 40])
def test_appended_turn_reuses_the_declared_endpoint(engines, split):
    cached, cold = engines
    history = _prompt(split, 100 + split)
    _gen(cached, history, seed=1)  # the final prompt boundary is checkpointed
    follow = history + _prompt(23, 200 + split)
    hit = _gen(cached, follow, seed=2, endpoints=(split,))
    ref = _gen(cold, follow, seed=2)
    assert hit.finish.cached_tokens >= split
    assert hit.tokens == ref.tokens


def test_branches_from_one_prefix_continue_independently(engines):
    cached, cold = engines
    base = _prompt(40, 7)
    _gen(cached, base, seed=3)
    for i in range(3):
        branch = base + _prompt(9, 300 + i)
        hit = _gen(cached, branch, seed=10 + i, endpoints=(40,))
        assert hit.finish.cached_tokens >= 40
        assert hit.tokens == _gen(cold, branch, seed=10 + i).tokens
    stats = cached.stats()
    assert stats["prefix_hits_total"] >= 3
    assert stats["checkpoints"] >= 1


def test_message_endpoints_inside_one_chunk_are_reused_exactly(engines):
    """Endpoints at 21, 50 and 77 of a 100-token prompt: the dense model prefills it in one
    chunk and checkpoints inside it (pages, count; no hidden vector), the hybrid one clips its
    chunks there; either way a request sharing 50 tokens restores exactly 50 and continues like
    the cold run, and one that is exactly those 50 tokens is served right too."""
    cached, cold = engines
    first = _prompt(100, 900)
    _gen(cached, first, seed=4, endpoints=(21, 50, 77))
    follow = first[:50] + _prompt(19, 901)
    hit = _gen(cached, follow, seed=6, endpoints=(50,))
    assert hit.finish.cached_tokens == 50
    assert hit.tokens == _gen(cold, follow, seed=6).tokens
    exact = _gen(cached, first[:50], seed=8)
    assert exact.tokens == _gen(cold, first[:50], seed=8).tokens


def test_agent_loop_resumes_each_turn_after_the_previous_output(engines):
    """The agent loop: each prompt is the previous prompt, the model's own output, a tool result
    and a header, submitted the moment the previous turn finished. Every turn resumes from the
    previous turn's terminal checkpoint (prompt and whole output, less the last sampled token,
    which was never consumed) and continues exactly like the cold run."""
    cached, cold = engines
    history = _prompt(40, 950)
    ends = [40]
    boundary = 0
    for turn in range(3):
        prompt = history + _prompt(5, 960 + turn)  # the assistant header
        out = _gen(cached, prompt, seed=20 + turn, endpoints=tuple(ends))
        assert out.finish.cached_tokens == boundary
        assert out.tokens == _gen(cold, prompt, seed=20 + turn).tokens
        boundary = len(prompt) + len(out.tokens) - 1
        history = prompt + out.tokens  # the assistant's message ends here
        ends.append(len(history))
        history = history + _prompt(30, 970 + turn)  # the tool result
        ends.append(len(history))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_one_call_admission_and_capture_equal_the_separate_calls(tiny, family):
    """A request admitted alone runs its page writes, admit, state init or checkpoint restore
    and tail copy as the one `admission` execution, and a step's checkpoints (snapshots and
    their tail pages) run as the one `capture` execution. The same agent loop and branches
    through an engine without those executions (the separate calls) give the same tokens, the
    same logprobs and bit-identical device state."""
    bundle = tiny.bundle(family)
    fused, separate = (
        Engine(bundle, EngineConfig(device="cpu", num_pages=160, prefix_cache=True)).start()
        for _ in range(2)
    )
    try:
        runs = {"admission": 0, "capture": 0}
        for name in runs:
            separate.runner.calls.pop(name)
            call = fused.runner.calls[name]

            def counted(name: str = name, replay=call.run) -> None:
                runs[name] += 1
                replay()

            call.run = counted  # type: ignore[method-assign]
        outs: dict[str, list[_Out]] = {"fused": [], "separate": []}
        for name, eng in (("fused", fused), ("separate", separate)):
            history, ends = _prompt(37, 40), [37]
            for turn in range(3):
                prompt = history + _prompt(5, 41 + turn)
                out = _gen(eng, prompt, seed=turn, endpoints=tuple(ends))
                outs[name].append(out)
                history = prompt + out.tokens + _prompt(21, 50 + turn)
                ends += [len(prompt) + len(out.tokens), len(history)]
            for b in range(2):  # branches from the first turn's end
                outs[name].append(_gen(eng, history[: ends[1]] + _prompt(9, 60 + b), seed=b,
                                       endpoints=tuple(ends[:2])))  # fmt: skip
        assert runs["admission"] == 5  # every request was admitted alone, four from a checkpoint
        assert runs["capture"] >= 5  # each one's prompt end and terminal checkpoint at least
        assert sum(o.finish.cached_tokens for o in outs["fused"]) > 0
        for a, b in zip(outs["fused"], outs["separate"], strict=True):
            assert a.tokens == b.tokens
            assert a.logprobs == b.logprobs
            assert a.finish.cached_tokens == b.finish.cached_tokens
        ra, rb = fused.runner, separate.runner
        for key in vars(ra.state):
            assert torch.equal(getattr(ra.state, key), getattr(rb.state, key)), key
        for ka, kb in zip(ra.kv.k_pages + ra.kv.v_pages, rb.kv.k_pages + rb.kv.v_pages):
            assert torch.equal(ka, kb)
        if ra.pool is not None and rb.pool is not None:
            # which snapshot row a checkpoint gets depends on when the client's next submit
            # meets the engine's steps, so rows are compared as a set, each bit-exact
            def rows(pool) -> list[bytes]:
                parts = [pool.consumed[:, None], pool.hidden, *(t.flatten(1) for t in pool.tensors)]
                return sorted(
                    b"".join(p[i].contiguous().view(torch.uint8).numpy().tobytes() for p in parts)
                    for i in range(pool.num_rows)
                )

            assert rows(ra.pool) == rows(rb.pool)
    finally:
        fused.shutdown()
        separate.shutdown()
