"""A Gated DeltaNet hybrid bundle served by a real daemon on CPU.

`flare prep` of the tiny qwen3_5 checkpoint, a `flare run` child, requests through the client:
every generated token's logprob equals the canonical Transformers forward's log-softmax at that
position (teacher-forced over prompt + generated tokens), so the served recurrent state is the
model's; a repeated seeded request reproduces its tokens; a second concurrent request in the
same decode batch does not disturb the first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import Daemon, is_baseline, wait_baseline

from libflare_client import Client, SamplingParams

LOGPROB_TOL = 1e-4  # fp32 log-softmax of logits agreeing to ~1e-6 relative (unit tests)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from prep.__main__ import main as prep_main
    from prep.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("hybrid")
    ckpt = make_tiny_checkpoint(root / "tiny-qwen3_5", "qwen3_5")
    bundle = root / "tiny-qwen3_5.bundle"
    args = ["--out", str(bundle), "--device", "cpu", "--max-context", "256"]
    args += ["--prefill-chunk", "128", "--decode-capacities", "1,2", "--no-compile"]
    assert prep_main([str(ckpt), *args]) == 0
    return ckpt, bundle


@pytest.fixture(scope="module")
def daemon(hybrid: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(hybrid[1], tmp_path_factory.mktemp("hybrid-daemon")).wait_ready(timeout_s=600)
    yield d
    assert d.stop() == 0, d.log()


def _teacher_logprobs(ckpt: Path, tokens: list[int], n_prompt: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, tokens[i]]) for i in range(n_prompt, len(tokens))]


def test_served_tokens_follow_the_canonical_model(daemon: Daemon, hybrid) -> None:
    ckpt, _ = hybrid
    prompt = list(range(20, 90))  # 70 tokens: one prefill chunk, then decode
    s = SamplingParams(seed=5, temperature=1.0)
    other: dict[str, object] = {}

    def neighbour() -> None:  # a concurrent request, likely in the same decode batches
        with Client(daemon.socket) as c2:
            other["r"] = c2.generate(prompt_token_ids=list(range(200, 230)), max_tokens=30,
                                     sampling=SamplingParams(seed=9), ignore_eos=True)  # fmt: skip

    with Client(daemon.socket) as c:
        kw = dict(max_tokens=10, sampling=s, ignore_eos=True, logprobs=1)
        a = c.generate(prompt_token_ids=prompt, **kw)
        th = threading.Thread(target=neighbour)
        th.start()
        b = c.generate(prompt_token_ids=prompt, **kw)
        th.join(timeout=300)
    assert "r" in other
    assert a.finish_reason == "length" and len(a.token_ids) == 10
    assert b.token_ids == a.token_ids
    want = _teacher_logprobs(ckpt, prompt + a.token_ids, len(prompt))
    got = [lp.logprob for lp in a.logprobs]
    assert got == pytest.approx(want, abs=LOGPROB_TOL)
    assert is_baseline(wait_baseline(daemon.socket))


def test_declared_message_ends_are_checkpoints_over_the_wire(daemon: Daemon) -> None:
    """A token-id request declares where its messages end (`message_ends`); a later request
    sharing the prompt up to one of them resumes from that exact checkpoint (a hybrid keeps
    nothing else there: not the prompt end, not the terminal state). Misplaced ends and ends
    on a messages request are typed errors, and the daemon keeps serving."""
    from libflare_client import InvalidRequest

    first = list(range(100, 200))  # 100 tokens, a message ending at 60
    branch = first[:60] + list(range(300, 330))
    kw = dict(max_tokens=4, sampling=SamplingParams(seed=2), ignore_eos=True)
    with Client(daemon.socket) as c:
        plain = c.generate(prompt_token_ids=list(range(400, 500)), **kw)
        assert plain.usage.cached_tokens == 0
        a = c.generate(prompt_token_ids=first, message_ends=[60], **kw)
        assert a.usage.cached_tokens == 0
        b = c.generate(prompt_token_ids=branch, **kw)
        assert b.usage.cached_tokens == 60
        undeclared = c.generate(prompt_token_ids=[*range(400, 460), 1, 2, 3], **kw)
        assert undeclared.usage.cached_tokens == 0  # no end was declared at 60 there
        for ends in ([100], [0], [70, 40], [-1]):
            with pytest.raises(InvalidRequest):
                c.generate(prompt_token_ids=first, message_ends=ends, **kw)
        with pytest.raises(InvalidRequest, match="message_ends"):
            c.generate(messages=[{"role": "user", "content": "hi"}], message_ends=[3], **kw)
        assert c.generate(prompt_token_ids=first, **kw).usage.cached_tokens > 0
    assert is_baseline(wait_baseline(daemon.socket))
