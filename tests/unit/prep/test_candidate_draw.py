"""The candidate path's two-launch draw (prep/components/candidate_draw.py), run by Triton's
interpreter on CPU.

Against the operations it replaces (sampling._filter_sorted + sample_from_sorted over the same
64 candidates in the same order): the same token for rows of every filter setting, with tied
logits and banned tokens; a row's token is its own; `sample` takes the kernel only where asked
(`candidate_draw = "kernel"`) and draws the same tokens through it. Small rows and chunks keep
the interpreter fast (the served shape, 151,936 tokens in 4,096-value chunks, is the GPU's).
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import candidate_draw, sampling, triton_topk
    from prep.components.candidate_draw import WIDTH, draw_into
    from prep.components.sampling import (
        RowParams, _filter_sorted, sample, sample_from_sorted, uniform_from_counter)

    g = torch.Generator().manual_seed(0)
    CHUNK = 128
    assert WIDTH == sampling.CANDIDATES  # the kernel's width is the candidate path's

    def candidates(x):
        top = torch.empty(x.shape[0], WIDTH)
        ids = torch.empty(x.shape[0], WIDTH, dtype=torch.int64)
        triton_topk.topk_into(top, ids, x, WIDTH, CHUNK)  # the candidates, in the kernel's order
        return top, ids

    def reference(top, ids, p, u):
        scaled = top / p.temperature[:, None]
        sp = torch.exp(scaled - scaled[:, :1])
        kept = _filter_sorted(sp, p.top_k.clamp(min=1, max=WIDTH), p)
        return sample_from_sorted(kept, ids, u), kept

    def run(x, p, u):
        token = torch.empty(x.shape[0], dtype=torch.int64)
        draw_into(token, x, p.temperature, p.top_k, p.top_p, p.min_p, u, chunk=CHUNK)
        return token

    n, v = 6, 300
    x = torch.randn(n, v, generator=g) * 3
    x[0, : v // 2] = float("-inf")  # banned tokens
    x[1] = torch.randint(0, 6, (v,), generator=g).float()  # ties across the k-th and top-p cut
    p = RowParams(
        temperature=torch.tensor([0.7, 1.0, 1.3, 2.5, 1.0, 4.0]),
        top_k=torch.tensor([20, 30, 50, 64, 1, 70]),  # 70 clamps to the width
        top_p=torch.tensor([0.95, 0.8, 1.0, 0.9, 0.9, 0.99]),
        min_p=torch.tensor([0.0, 0.0, 0.01, 0.05, 0.0, 0.02]),
        repetition_penalty=torch.ones(n), presence_penalty=torch.zeros(n),
        frequency_penalty=torch.zeros(n), seed=torch.arange(n) * 7919,
        counter=torch.arange(n, dtype=torch.int64),
    )
    u = uniform_from_counter(p.seed, p.counter)
    top, ids = candidates(x)
    want, kept = reference(top, ids, p, u)
    got = run(x, p, u)
    assert torch.equal(got, want), (got, want)
    for r in range(n):  # every token drawn is one the filters keep
        assert float(kept[r][ids[r] == got[r]].max()) > 0, r
    assert all(int((kept[r] > 0).sum()) > 1 for r in (1, 2, 3, 5))  # draws, not argmaxes
    assert int(got[4]) == int(torch.argmax(x[4]))  # top-k 1: the most likely token
    # uniforms at the ends of [0, 1): the first and the last kept token
    head = RowParams(**{f: getattr(p, f)[1:4] for f in p.__dataclass_fields__})
    for edge in (0.0, 1.0 - 2.0**-48):
        ue = torch.full((3,), edge, dtype=torch.float64)
        assert torch.equal(run(x[1:4], head, ue), reference(top[1:4], ids[1:4], head, ue)[0])
    # with the top-k's middle stage (two chunks per program): the same candidates, the same draw
    grouped = torch.empty(n, dtype=torch.int64)
    draw_into(grouped, x, p.temperature, p.top_k, p.top_p, p.min_p, u, chunk=CHUNK, group=2)
    assert torch.equal(grouped, got), (grouped, got)
    # a row's token is its own: alone, it draws what it drew beside the others
    row = RowParams(**{f: getattr(p, f)[2:3] for f in p.__dataclass_fields__})
    assert int(run(x[2:3].clone(), row, u[2:3])[0]) == int(got[2])

    # sample(): the kernel only where asked; through it the same tokens as the operations
    # (no ties here, so the library's and the kernel's candidate order agree)
    y = torch.randn(3, v, generator=g) * 2
    hist = torch.zeros(3, v, dtype=torch.int32)
    hist[:, :40] = 1
    q = RowParams(**{f: getattr(p, f)[:3] for f in p.__dataclass_fields__})
    q.repetition_penalty = torch.tensor([1.1, 1.0, 1.3])
    ops = sample(y, hist, q, None, 3, "candidates")
    assert not sampling.draws_in_kernel(y, WIDTH)  # not asked
    sampling.set_candidate_draw("kernel")
    assert not sampling.draws_in_kernel(y, WIDTH)  # CPU rows: the operations, even when asked
    candidate_draw.serves = lambda x, width: width == WIDTH  # as a CUDA row would be
    assert sampling.draws_in_kernel(y, WIDTH)
    calls = []
    real = candidate_draw.draw_into
    candidate_draw.draw_into = lambda *a, **k: (calls.append(1), real(*a, **k, chunk=CHUNK))
    through = sample(y, hist, q, None, 3, "candidates")
    assert calls == [1]
    assert torch.equal(through[0], ops[0]), (through[0], ops[0])
    assert all(torch.equal(a, b) for a, b in zip(through[1:], ops[1:]))
    try:
        sampling.set_candidate_draw("fast")
    except ValueError as exc:
        assert "candidate_draw" in str(exc)
    else:
        raise AssertionError("an unknown draw was accepted")

    # shapes it does not serve
    for bad in (torch.randn(2, 40), torch.randn(2, 300, dtype=torch.float64)):
        try:
            run(bad, RowParams(**{f: getattr(p, f)[:2] for f in p.__dataclass_fields__}), u[:2])
        except ValueError as exc:
            assert "candidate draw" in str(exc), exc
        else:
            raise AssertionError(bad.shape)
    print("ok")
    """
)


@pytest.mark.slow
def test_candidate_draw_interpreted_matches_the_operations_it_replaces():
    run_interpreted(SCRIPT)
