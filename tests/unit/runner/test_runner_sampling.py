"""In-graph sampling: counter RNG, filter semantics (ties kept), goodness of fit, penalties."""

from __future__ import annotations

import math

import torch

from prep.components.sampling import (
    CANDIDATES,
    TOPK_CHUNK,
    RowParams,
    apply_penalties,
    chunked_topk,
    filtered_candidates,
    filtered_probs_sorted,
    sample,
    takes_candidates,
    uniform_from_counter,
)


def _params(n: int, **kw) -> RowParams:
    base = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                presence_penalty=0.0, frequency_penalty=0.0, seed=0, counter=0)  # fmt: skip
    base.update(kw)
    ints = {"top_k", "seed", "counter"}
    return RowParams(**{
        k: (v if isinstance(v, torch.Tensor) else torch.full((n,), v, dtype=torch.int64 if k in ints else torch.float32))
        for k, v in base.items()
    })  # fmt: skip


def test_counter_rng_is_uniform_and_stream_stable():
    n = 20000
    u = uniform_from_counter(torch.full((n,), 12345), torch.arange(n))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Kolmogorov-Smirnov distance against U(0,1): critical value at alpha=1e-3 is 1.95/sqrt(n)
    s, _ = torch.sort(u)
    ecdf = torch.arange(1, n + 1, dtype=torch.float64) / n
    assert float((ecdf - s).abs().max()) < 1.95 / math.sqrt(n)
    # deterministic in (seed, counter) alone, distinct across seeds
    again = uniform_from_counter(torch.tensor([12345, 12345]), torch.tensor([7, 7]))
    assert torch.equal(again[0], u[7]) and torch.equal(again[1], u[7])
    other = uniform_from_counter(torch.full((n,), 12346), torch.arange(n))
    assert float((other - u).abs().mean()) > 0.2
    big = uniform_from_counter(torch.tensor([-(2**63), 2**63 - 1]), torch.tensor([0, 2**40]))
    assert bool(((big >= 0) & (big < 1)).all())


def _reference_keep(p: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Plain loops over one row: the documented semantics, ties included."""
    v = p.tolist()
    order = sorted(range(len(v)), key=lambda i: -v[i])
    keep = set(range(len(v)))
    if top_k > 0:
        kth = v[order[min(top_k, len(v)) - 1]]
        keep = {i for i in keep if v[i] >= kth}
    total = sum(v[i] for i in keep)
    mass, cutoff = 0.0, None
    for i in order:
        if i not in keep:
            continue
        if mass / total < top_p:
            cutoff = v[i]
        mass += v[i]
    keep = {i for i in keep if v[i] >= cutoff}
    pmax = max(v)
    keep = {i for i in keep if v[i] >= min_p * pmax}
    out = torch.zeros(len(v), dtype=torch.bool)
    out[list(keep)] = True
    return out


def test_filters_match_reference_semantics_including_ties():
    g = torch.Generator().manual_seed(0)
    cases = [
        (5, 1.0, 0.0),
        (0, 0.8, 0.0),
        (3, 0.5, 0.0),
        (0, 1.0, 0.2),
        (10, 0.9, 0.05),
        (1, 1.0, 0.0),
    ]
    for top_k, top_p, min_p in cases:
        logits = torch.randn(1, 40, generator=g)
        logits[0, 3] = logits[0, 7] = logits[0, 9] = logits.max() + 0.5  # a three-way tie on top
        logits[0, 11] = logits[0, 12] = 0.25  # ties in the middle
        params = _params(1, top_k=top_k, top_p=top_p, min_p=min_p)
        kept, ids = filtered_probs_sorted(logits, params)
        mask = torch.zeros(40, dtype=torch.bool)
        mask[ids[0][kept[0] > 0]] = True
        probs = torch.softmax(logits, -1)[0]
        assert torch.equal(mask, _reference_keep(probs, top_k, top_p, min_p)), (top_k, top_p, min_p)
    # top_k=1 with a tie keeps every tied token (never truncated to a fixed count)
    assert int(mask.sum()) >= 3 or top_k != 1


def test_sampling_goodness_of_fit():
    torch.manual_seed(0)
    vocab, n = 30, 40000
    logits = torch.randn(vocab) * 1.5
    params = dict(temperature=0.7, top_k=12, top_p=0.9, min_p=0.02)
    p = _params(n, seed=99, counter=torch.arange(n), **params)
    hist = torch.zeros(n, vocab, dtype=torch.int32)
    tokens, _, _, _ = sample(logits.expand(n, -1).clone(), hist, p, None, 1)
    _assert_fits(tokens, logits, params)


def _assert_fits(tokens: torch.Tensor, logits: torch.Tensor, params: dict) -> None:
    """Chi-square goodness of fit of the drawn tokens against the distribution the sorted
    path keeps (filtered_probs_sorted over the whole vocabulary), which never yields a
    filtered-out token."""
    vocab, n = logits.shape[-1], tokens.shape[0]
    kept, ids = filtered_probs_sorted(logits[None], _params(1, **params))
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[ids[0]] = kept[0].double() / kept[0].double().sum()
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert int(counts[expected == 0].sum()) == 0  # never a filtered-out token
    support = expected > 0
    e = expected[support] * n
    chi2 = float(((counts[support] - e) ** 2 / e).sum())
    df = int(support.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df), (chi2, df)  # ~p > 1e-4 for a chi-square(df)


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    hist = torch.tensor([[2, 1, 0, 0]], dtype=torch.int32)
    out = apply_penalties(
        logits,
        hist,
        _params(1, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
    )
    assert torch.allclose(
        out, torch.tensor([[2.0 / 2 - 0.5 - 0.5, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0]])
    )


def test_banned_tokens_never_sampled_and_logprobs_are_raw():
    n, vocab = 2000, 16
    logits = torch.zeros(n, vocab)
    logits[:, 0] = 5.0
    banned = torch.zeros(n, vocab, dtype=torch.bool)
    banned[:, 0] = True
    p = _params(n, temperature=2.0, counter=torch.arange(n))
    tok, lp, top_ids, top_lp = sample(
        logits, torch.zeros(n, vocab, dtype=torch.int32), p, banned, 3
    )
    assert not bool((tok == 0).any())
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(lp, raw.gather(1, tok[:, None]).squeeze(1))
    assert bool((top_ids[:, 0] == 0).all()) and torch.allclose(top_lp[:, 0], raw[:, 0])


def test_top_logprobs_of_rows_that_did_not_ask_are_zeros_and_change_nothing_else():
    """want_top: rows whose requests asked for top logprobs keep them (and every row its token
    and logprob) exactly as without it; the other rows' top logprobs and ids are zeros (on
    CUDA their top-k does no work)."""
    g = torch.Generator().manual_seed(3)
    n, vocab = 4, 3000
    logits = torch.randn(n, vocab, generator=g) * 3
    hist = torch.randint(0, 2, (n, vocab), generator=g, dtype=torch.int32)
    p = _params(n, top_k=torch.tensor([20, 0, 20, 0]), repetition_penalty=1.2, seed=9,
                counter=torch.arange(n))  # fmt: skip
    want = torch.tensor([True, False, False, True])
    for paths in ("both", "candidates"):
        full = sample(logits, hist, p, None, 5, paths)
        part = sample(logits, hist, p, None, 5, paths, want)
        assert torch.equal(part[0], full[0]) and torch.equal(part[1], full[1])
        assert torch.equal(part[2][want], full[2][want])
        assert torch.equal(part[3][want], full[3][want])
        assert not part[2][~want].any() and not part[3][~want].any()


def test_grammar_mask_in_a_mixed_batch(tiny):
    """A masked row samples only allowed tokens; an unmasked row in the same batch is unchanged."""
    from runner_harness import Harness

    from flared.engine.plan import DecodeOp, StepPlan

    vocab = 512
    allowed = [7, 19, 300]
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    for t in allowed:
        word, bit = divmod(t, 32)
        mask[word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    ref, mixed = Harness(tiny.bundle("qwen3")), Harness(tiny.bundle("qwen3"))
    for h in (ref, mixed):
        for row in (1, 2):
            h.admit(row, list(range(5, 25 + row)), temperature=1.5)
            h.prefill(row, 0, 20 + row, sample=True)
    for step in range(8):
        ref.decode([1, 2])
        plan = StepPlan(1000 + step, decode=DecodeOp((1, 2), ("r1", "r2")))
        res = mixed.r.wait(mixed.r.submit(plan, masks={2: mask}))
        by_row = {t.row: t.token_id for t in res.decoded}
        assert by_row[2] in allowed
        assert by_row[1] == ref.seq[1][-1]
        mixed.seq[1].append(by_row[1])
    # the runner skips uploading an all-ones mask the device already holds: after a masked
    # step, the next unmasked one must upload it (the device mask is all ones again), and
    # the one after may skip it
    device_mask = mixed.r.calls["decode2"].inputs["mask"]
    assert not bool((device_mask == -1).all())
    for step in range(2):
        mixed.r.wait(mixed.r.submit(StepPlan(2000 + step, decode=DecodeOp((1, 2), ("r1", "r2")))))
        assert bool((device_mask == -1).all())


def test_chunked_topk_has_the_librarys_values():
    g = torch.Generator().manual_seed(1)
    for v, k in ((151_936, 20), (5_000, 64), (3 * TOPK_CHUNK, 1), (2 * TOPK_CHUNK, 7)):
        x = torch.randn(3, v, generator=g)
        x[1] = torch.randint(0, 50, (v,), generator=g).float()  # ties everywhere
        x[2, : v // 2] = float("-inf")  # banned tokens
        vals, ids = chunked_topk(x, k)
        ref, _ = torch.topk(x, k, dim=-1)
        assert torch.equal(vals, ref), (v, k)
        assert torch.equal(x.gather(1, ids), vals)  # the ids point at those values
        assert all(len(set(r.tolist())) == k for r in ids)  # k distinct tokens per row


def test_candidate_filters_match_reference_semantics_including_ties():
    """The candidate path keeps exactly what the documented semantics keep, whenever the
    tokens those keep are among the candidates (top-k on and at most the width)."""
    g = torch.Generator().manual_seed(0)
    for vocab in (40, 300):
        for top_k, top_p, min_p, t in [
            (5, 1.0, 0.0, 1.0), (3, 0.5, 0.0, 0.7), (10, 0.9, 0.05, 1.3), (1, 1.0, 0.0, 1.0),
            (CANDIDATES, 0.95, 0.0, 1.0), (20, 0.3, 0.1, 0.5),
        ]:  # fmt: skip
            logits = torch.randn(1, vocab, generator=g)
            logits[0, 3] = logits[0, 7] = logits[0, 9] = logits.max() + 0.5  # tie on top
            logits[0, 11] = logits[0, 12] = logits[0, 13] = 0.25  # ties in the middle
            params = _params(1, top_k=top_k, top_p=top_p, min_p=min_p, temperature=t)
            kept, ids = filtered_candidates(logits, params, min(CANDIDATES, vocab))
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[ids[0][kept[0] > 0]] = True
            probs = torch.softmax(logits / t, -1)[0]
            want = _reference_keep(probs, top_k, top_p, min_p)
            assert torch.equal(mask, want), (vocab, top_k, top_p, min_p, t)
            full, fids = filtered_probs_sorted(logits / t, params)  # the same kept set
            assert set(fids[0][full[0] > 0].tolist()) == set(mask.nonzero()[:, 0].tolist())


def test_a_row_takes_its_path_by_its_own_parameters():
    """Mixed batch: top-k off, top-k within the candidates, top-k beyond them. Each row's token
    equals the row sampled alone, and an execution built with the candidate path alone gives
    the candidate rows the same tokens."""
    g = torch.Generator().manual_seed(3)
    vocab, n = 500, 6
    logits = torch.randn(n, vocab, generator=g) * 2
    hist = torch.zeros(n, vocab, dtype=torch.int32)
    hist[:, :5] = 1
    top_k = torch.tensor([0, 20, CANDIDATES, CANDIDATES + 1, 1, 40])
    p = _params(n, top_k=top_k, top_p=0.9, temperature=0.8, seed=torch.arange(n) + 7,
                counter=torch.full((n,), 11), repetition_penalty=1.3)  # fmt: skip
    tok, lp, _, _ = sample(logits, hist, p, None, 5)
    assert takes_candidates(top_k).tolist() == [False, True, True, False, True, True]
    for i in range(n):
        one = RowParams(**{f: getattr(p, f)[i : i + 1] for f in p.__dataclass_fields__})
        alone, lp1, _, _ = sample(logits[i : i + 1], hist[i : i + 1], one, None, 5)
        assert int(alone) == int(tok[i]) and torch.equal(lp1, lp[i : i + 1]), i
    sel = takes_candidates(top_k)
    sub = RowParams(**{f: getattr(p, f)[sel] for f in p.__dataclass_fields__})
    lean, _, _, _ = sample(logits[sel], hist[sel], sub, None, 5, paths="candidates")
    assert torch.equal(lean, tok[sel])


def test_candidate_path_goodness_of_fit_over_a_vocabulary_wider_than_it():
    torch.manual_seed(0)
    vocab, n = 2_000, 40_000
    logits = torch.randn(vocab) * 2.0
    params = dict(temperature=0.9, top_k=30, top_p=0.8, min_p=0.01)
    p = _params(n, seed=5, counter=torch.arange(n), **params)
    tokens, _, _, _ = sample(
        logits.expand(n, -1).clone(), torch.zeros(n, vocab, dtype=torch.int32), p, None, 1,
        paths="candidates",
    )  # fmt: skip
    _assert_fits(tokens, logits, params)
