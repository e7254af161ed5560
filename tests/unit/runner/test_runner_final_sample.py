"""A prefill execution samples nothing: the prompt's first token comes from the sample that
follows its last chunk (final_sample, or final_sample_lean where the row takes its candidates),
drawn from the saved hidden vector of the chunk's last token.

fp32 on CPU: the draw must be the one the row's own parameters make, whichever execution ran
it, and a chunk that does not end its prompt must leave the row's sampling state untouched.
"""

from __future__ import annotations

import pytest
import torch

from prep.calls import FINAL_SAMPLE, LEAN_SUFFIX
from tests.unit.runner.runner_harness import Harness, reference_logits, rel_l2

LEAN = FINAL_SAMPLE + LEAN_SUFFIX


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def harness(tiny):
    return Harness(tiny.bundle("qwen3"), rows=8)


def _runs(h: Harness) -> dict[str, int]:
    return {k: v for k, v in h.r.steps.sample_runs.items() if v}


def test_a_chunk_samples_nothing_and_the_last_one_is_followed_by_the_sample(harness, tiny):
    from transformers import AutoModelForCausalLM

    h = harness
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3"), dtype=torch.float32, attn_implementation="eager"
    )
    prompt = _prompt(70, 3)
    h.admit(1, prompt, top_k=20, seed=11)
    st = h.r.state
    fields = ("pending", "generated", "counter", "finished", "hist")
    before = {n: getattr(st, n)[1].clone() for n in fields}
    runs = dict(h.r.steps.sample_runs)
    res = h.prefill(1, 0, 40, sample=False)
    assert res.prefilled is None
    for n in fields:  # no draw, no histogram count, no counter step
        assert torch.equal(getattr(st, n)[1], before[n]), n
    assert int(st.consumed[1]) == 40
    assert h.r.steps.sample_runs == runs  # nothing sampled
    # the saved hidden vector is the chunk's last token's: its logits are Transformers'
    ref = reference_logits(hf, prompt)
    assert rel_l2(h.logits(1), ref[39]) < 1e-5
    res = h.prefill(1, 40, 30, sample=True)
    assert rel_l2(h.logits(1), ref[-1]) < 1e-5
    tok = res.prefilled
    assert tok is not None and tok.valid
    assert h.r.steps.sample_runs[LEAN] == runs[LEAN] + 1  # top-k 20: the candidate path
    assert h.r.steps.sample_runs[FINAL_SAMPLE] == runs[FINAL_SAMPLE]
    assert int(st.pending[1]) == tok.token_id
    assert int(st.generated[1]) == 1 and int(st.counter[1]) == 1
    assert int(st.hist[1, tok.token_id]) == before["hist"][tok.token_id] + 1
    # its logprob is the raw distribution's at the sampled token
    lp = torch.log_softmax(ref[-1], dim=-1)[tok.token_id]
    assert tok.logprob == pytest.approx(float(lp), rel=1e-5, abs=1e-6)
    h.release(1)


@pytest.mark.parametrize("top_k", [20, 0])
def test_either_final_sample_execution_draws_the_rows_own_token(harness, top_k):
    """Rows of one prompt and seed: one through the execution its parameters pick, one through
    final_sample (the sort over the vocabulary beside the candidates: each row takes the path
    of its own parameters inside it). The same token, logprob and top logprobs."""
    h = harness
    prompt = _prompt(50, 4)
    got = {}
    for seed in (1, 2, 3):
        for row, lean in ((2, True), (3, False)):
            h.admit(row, prompt, top_k=top_k, seed=seed, logprobs=5)
            if not lean:
                h.r.steps.candidate_rows.discard(row)  # as if it needed the sorted path
            runs = dict(h.r.steps.sample_runs)
            tok = h.prefill(row, 0, len(prompt), sample=True).prefilled
            name = LEAN if lean and top_k else FINAL_SAMPLE
            assert h.r.steps.sample_runs[name] == runs[name] + 1
            got[row] = (tok.token_id, tok.logprob, tok.top_logprobs)
            h.release(row)
        assert got[2] == got[3], seed
        assert len(got[2][2]) == 5


def test_a_finished_row_is_not_sampled_again(harness):
    """A prefill of a row whose request already finished (a max_tokens of 1 met by the first
    token) changes nothing: the sample after it is inactive, as the chunk's own was."""
    h = harness
    prompt = _prompt(20, 5)
    h.admit(4, prompt, top_k=20, seed=1, max_tokens=1)
    tok = h.prefill(4, 0, 20, sample=True).prefilled
    assert tok.valid and int(tok.finish_reason) != 0
    st = h.r.state
    fields = ("pending", "generated", "counter", "finished", "hist", "hidden")
    before = {n: getattr(st, n)[4].clone() for n in fields}
    h.seq[4] = prompt + prompt[:8]
    again = h.prefill(4, 20, 8, sample=True).prefilled
    assert not again.valid
    for n in fields:
        assert torch.equal(getattr(st, n)[4], before[n]), n
    h.release(4)
