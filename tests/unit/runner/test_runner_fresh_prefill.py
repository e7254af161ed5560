"""prefill{C}_fresh: a prefill chunk that starts its prompt attends over its own keys (torch's
fused attention; cuDNN's on CUDA) instead of the paged kernel.

On CPU the executions run the reference backend's path with the same routing (the layers see
AttentionMeta.fresh), so what is pinned here is which chunks take them, that the logits after
each chunk still match the canonical Transformers forward (fp32: the parity bound, 1e-5
relative L2) and that the KV pages hold what the paged path writes. The Triton op behind them
on CUDA is interpreted against the paged kernel in tests/unit/prep/test_triton_attention.py.
"""

from __future__ import annotations

import pytest
import torch
from runner_harness import Harness, reference_logits, rel_l2

from flared.engine_config import EngineConfig
from flared.llm_engine import Engine
from flared.runner.sizing import plan_runner
from prep import calls
from prep.executions import Executions

TOL = 1e-5


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_only_a_chunk_that_starts_its_prompt_and_nearly_fills_its_capacity_runs_fresh(
    tiny, monkeypatch
):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(calls, "FRESH_MIN_TOKENS", 256)
    fresh_flags: list[bool] = []
    prefill = Executions.prefill

    def spy(self, *args, **kw):  # type: ignore[no-untyped-def]
        fresh_flags.append(bool(args[5] if len(args) > 5 else kw.get("fresh", False)))
        return prefill(self, *args, **kw)

    monkeypatch.setattr(Executions, "prefill", spy)
    bundle = tiny.bundle("qwen3")  # prefill capacities up to 256, context 512
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3"), dtype=torch.float32, attn_implementation="eager"
    )
    h, plain = Harness(bundle, prefill_fresh=True), Harness(bundle)
    fresh_calls = sorted(n for n in h.r.calls if n.endswith(calls.FRESH_SUFFIX))
    assert fresh_calls == ["prefill256_fresh"]  # capacities under FRESH_MIN_TOKENS: none
    assert not any(n.endswith(calls.FRESH_SUFFIX) for n in plain.r.calls)
    prompt = _prompt(300, 1)
    ref = reference_logits(hf, prompt)
    for harness in (h, plain):
        harness.admit(1, prompt)
        fresh_flags.clear()
        harness.prefill(1, 0, 240, sample=False)  # starts the prompt, 240 >= 7/8 of 256
        assert rel_l2(harness.logits(1), ref[239]) < TOL
        harness.prefill(1, 240, 60, sample=True)  # after the first chunk: its keys are paged
        assert rel_l2(harness.logits(1), ref[-1]) < TOL
        assert fresh_flags == [harness is h, False]
    # the same KV write on either path: the first layer's pages bit for bit (later layers'
    # inputs carry the attention's fp32 rounding)
    assert torch.equal(h.r.kv.k_pages[0], plain.r.kv.k_pages[0])
    assert torch.equal(h.r.kv.v_pages[0], plain.r.kv.v_pages[0])
    for a, b in zip(h.r.kv.k_pages, plain.r.kv.k_pages, strict=True):
        assert rel_l2(a.float(), b.float()) < TOL
    # a chunk under 7/8 of its capacity: the fused attention would run all 256 rows
    short = _prompt(200, 2)
    h.admit(2, short)
    fresh_flags.clear()
    h.prefill(2, 0, 200, sample=False)
    assert fresh_flags == [False]
    assert rel_l2(h.logits(2), reference_logits(hf, short)[-1]) < TOL
    runs = {name: n for name, n in h.r.steps.prefill_runs.items() if n}
    assert runs == {"prefill256_fresh": 1, "prefill128": 1, "prefill256": 1}, runs


def test_the_engine_counts_fresh_chunks_and_plans_prefill_fresh(tiny, monkeypatch):
    """Engine stats' prefill_chunks_by_execution; `prefill_fresh` auto is off on CPU (cuDNN's
    attention is a CUDA path), on / off are taken as given, anything else refused."""
    monkeypatch.setattr(calls, "FRESH_MIN_TOKENS", 256)
    bundle = tiny.bundle("qwen3")
    assert plan_runner(bundle, EngineConfig(device="cpu")).prefill_fresh is False
    assert plan_runner(bundle, EngineConfig(device="cpu", prefill_fresh="on")).prefill_fresh
    with pytest.raises(ValueError, match="prefill_fresh must be auto, on or off"):
        plan_runner(bundle, EngineConfig(device="cpu", prefill_fresh="cudnn"))
    with Engine(bundle, EngineConfig(device="cpu", prefill_fresh="on")) as eng:
        out = eng.generate(_prompt(250, 3), max_tokens=4, ignore_eos=True)
        assert len(out.token_ids) == 4
        runs = {k: v for k, v in eng.stats()["prefill_chunks_by_execution"].items() if v}
        assert runs == {"prefill256_fresh": 1}, runs


def _unmasked(q, k, v, scale):  # type: ignore[no-untyped-def]
    """Attention over every key of the chunk, the causal mask lost (padding rows included)."""
    heads = (x.transpose(0, 1)[None].float() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(*heads, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(q.dtype).contiguous()


def _refused(q, k, v, scale):  # type: ignore[no-untyped-def]
    raise RuntimeError("No available kernel. Aborting execution.")  # as torch's SDPA says it


@pytest.mark.parametrize("broken", ["zeros", "unmasked", "raises"])
def test_a_fresh_prefill_that_disagrees_with_the_paged_one_is_dropped_at_startup(
    tiny, monkeypatch, caplog, broken
):
    """The runner's startup check runs each prefill{C}_fresh beside prefill{C} on a synthetic
    chunk: a fused attention that computes something else (zeros; or every key, the causal
    mask lost, which leaves a full chunk's last row right but no other) loses its
    executions, with a warning, and chunks that would have taken them take the paged kernel,
    still matching Transformers; a correct one is kept (the other tests). One the platform
    refuses (raises on its first run) is dropped the same way instead of failing the start.
    The state the check touched is reset: the request then starts from clean pages and rows."""
    from transformers import AutoModelForCausalLM

    from prep.components import paged_attention

    monkeypatch.setattr(calls, "FRESH_MIN_TOKENS", 256)
    wrong = {"unmasked": _unmasked, "raises": _refused}.get(
        broken, lambda q, k, v, s: torch.zeros_like(q)
    )
    monkeypatch.setattr(paged_attention, "causal_own_keys", wrong)
    bundle = tiny.bundle("qwen3")
    with caplog.at_level("WARNING", logger="flared.runner"):
        h = Harness(bundle, prefill_fresh=True)
    assert h.r.fresh_dropped == ["prefill256_fresh"]
    assert not any(n.endswith(calls.FRESH_SUFFIX) for n in h.r.calls)
    if broken == "raises":
        assert "prefill256_fresh failed its first run (RuntimeError: No available" in caplog.text
    else:
        assert "prefill256_fresh disagrees with prefill256" in caplog.text
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3"), dtype=torch.float32, attn_implementation="eager"
    )
    prompt = _prompt(250, 4)
    h.admit(1, prompt)
    h.prefill(1, 0, 250, sample=False)
    assert rel_l2(h.logits(1), reference_logits(hf, prompt)[-1]) < TOL
    runs = {name: n for name, n in h.r.steps.prefill_runs.items() if n}
    assert runs == {"prefill256": 1}, runs
    with Engine(bundle, EngineConfig(device="cpu", prefill_fresh="on")) as eng:
        assert eng.stats()["prefill_fresh_dropped"] == ["prefill256_fresh"]
