"""Gated DeltaNet hybrids (qwen3_next, qwen3_5) through the runner vs the canonical forward.

fp32 on CPU. The canonical forward processes the whole sequence with Transformers' own chunked
torch fallback (64-token chunks from position 0). The prepared path runs each prefill chunk
from its own start, so every split point changes the recurrence's association, and decode runs
the per-token recurrence. Measured worst relative L2 of the logits (230-token prompts, splits at
1..200, 8 decode steps): at a split point 6.0e-7, at the end of the prompt after a split 2.4e-6
(qwen3_next) / 1.6e-6 (qwen3_5), teacher-forced decode 1.4e-6 / 2.0e-6. Bound asserted: 1e-5,
the dense recipe's and ~4x the worst measured; that margin is fp32 rounding (eps 6e-8) over a
few hundred sequential state updates. A wrong state is four orders of magnitude above it: one
token missing from the history gives 0.12-0.16, another request's state > 1e-3
(test_stale_state_is_visible).

Snapshot -> restore -> continue repeats the same arithmetic on the same shapes, so it is
asserted bit-exact against an uninterrupted run; padded rows leave the pool bit-exact.
"""

from __future__ import annotations

import pytest
import torch
from runner_harness import Harness, reference_logits, rel_l2

from prep.bundle import read_manifest

TOL = 1e-5
SNAPSHOTS = 4


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def model(request, tiny):
    """One runner per model for the module (rows are released between tests)."""
    from transformers import AutoModelForCausalLM

    mt = request.param
    bundle = tiny.bundle(mt)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint(mt), dtype=torch.float32, attn_implementation="eager"
    )
    return bundle, hf, _harness(bundle)


@pytest.fixture
def setup(model):
    _, hf, h = model
    for row in list(h.pages):
        h.release(row)
    return hf, h


def _harness(bundle, rows: int = 8) -> Harness:
    """A runner whose pool also has snapshot rows, sized from the manifest's declared layout
    (what the daemon's memory plan will decide)."""
    h = Harness(bundle, rows=rows, snapshots=SNAPSHOTS)
    assert h.r.ex.pool is not None and h.r.ex.pool.num_snapshot_rows == SNAPSHOTS
    return h


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _state_call(h: Harness, name: str, **index: list[int]) -> None:
    """Run a prepared state-maintenance call through its staged row-index buffers."""
    call = h.r.calls[name]
    st = call.stage()
    for key, values in index.items():
        st[key].zero_()
        st[key][: len(values)] = torch.tensor(values)
    call.upload()
    call.run()


def _pool_copy(h: Harness) -> list[torch.Tensor]:
    p = h.r.ex.pool
    return [t.clone() for t in (*p.tensors, p.consumed, p.hidden)]


def _pool_now(h: Harness) -> list[torch.Tensor]:
    p = h.r.ex.pool
    return [*p.tensors, p.consumed, p.hidden]


def test_manifest_declares_attention_and_state_layers(model):
    bundle, hf, _ = model
    g = read_manifest(bundle).geometry
    types = hf.config.layer_types
    assert g.attention_layers == [i for i, t in enumerate(types) if t == "full_attention"]
    linear = [i for i, t in enumerate(types) if t == "linear_attention"]
    assert sorted({s.layer for s in g.state_tensors}) == linear
    rec = [s for s in g.state_tensors if s.name == "recurrent"]
    assert all(s.dtype == "float32" and s.shape == [4, 16, 16] for s in rec)


def test_chunked_prefill_split_anywhere(setup):
    hf, h = setup
    prompt = _prompt(230, 1)
    ref = reference_logits(hf, prompt)
    for split in (1, 3, 4, 5, 37, 63, 64, 65, 128, 129, 200):
        h.admit(1, prompt)
        h.prefill(1, 0, split, sample=False)
        assert rel_l2(h.logits(1), ref[split - 1]) < TOL, split
        h.prefill(1, split, len(prompt) - split, sample=True)
        assert rel_l2(h.logits(1), ref[-1]) < TOL, split
        h.release(1)


def test_many_small_chunks_then_decode(setup):
    hf, h = setup
    prompt = _prompt(150, 5)
    ref = reference_logits(hf, prompt)
    h.admit(2, prompt)
    for start, n in ((0, 2), (2, 1), (3, 60), (63, 2), (65, 85)):
        h.prefill(2, start, n, sample=start + n == len(prompt))
        assert rel_l2(h.logits(2), ref[start + n - 1]) < TOL, start
    for tok in _prompt(5, 6):  # teacher-forced decode steps
        h.decode([2], forced={2: tok})
        assert rel_l2(h.logits(2), reference_logits(hf, h.seq[2][:-1])[-1]) < TOL


def test_batched_decode_mixed_lengths_rows_and_reuse(setup):
    hf, h = setup
    lens = {1: 5, 3: 16, 4: 33, 7: 70}
    for row, n in lens.items():
        h.admit(row, _prompt(n, row))
        h.prefill(row, 0, n, sample=True)
    orders = [[1, 3, 4, 7], [7, 1], [4], [3, 7, 1], [1, 4, 3]]
    for step, rows in enumerate(orders):
        forced = {r: (step * 31 + r * 7) % 500 + 3 for r in rows}
        h.decode(rows, forced=forced)
        for r in rows:
            assert rel_l2(h.logits(r), reference_logits(hf, h.seq[r][:-1])[-1]) < TOL, (step, r)
    # row reuse: admit re-initialises the recurrent state of row 3
    h.release(3)
    fresh = _prompt(20, 99)
    h.admit(3, fresh)
    h.prefill(3, 0, 20, sample=True)
    assert rel_l2(h.logits(3), reference_logits(hf, fresh)[-1]) < TOL
    h.decode([3, 1], forced={3: 11, 1: 12})
    for r in (3, 1):
        assert rel_l2(h.logits(r), reference_logits(hf, h.seq[r][:-1])[-1]) < TOL


def test_stale_state_is_visible(setup):
    """The tolerance can see a wrong state: a row starting from another request's state."""
    hf, h = setup
    h.admit(5, _prompt(40, 1))
    h.prefill(5, 0, 40, sample=False)
    fresh = _prompt(20, 2)
    h.admit(1, fresh)
    for t in h.r.ex.pool.tensors:
        t[1] = t[5]
    h.prefill(1, 0, 20, sample=True)
    assert rel_l2(h.logits(1), reference_logits(hf, fresh)[-1]) > 1e-3


def test_snapshot_restore_continue_equals_uninterrupted(setup):
    hf, h = setup
    prompt = _prompt(120, 3)
    cut = 37  # not a page (16) or chunk (64) boundary
    first_snap = h.r.ex.pool.first_snapshot_row
    # uninterrupted on row 2
    h.admit(2, prompt)
    h.prefill(2, 0, cut, sample=False)
    h.prefill(2, cut, len(prompt) - cut, sample=True)
    want_prefill = h.logits(2).clone()
    h.decode([2], forced={2: 17})
    want_decode = h.logits(2).clone()
    # interrupted on row 1: snapshot at `cut`, diverge, restore, continue
    h.admit(1, prompt)
    h.prefill(1, 0, cut, sample=False)
    hidden_at_cut = h.r.state.hidden[1].clone()
    _state_call(h, "state_snapshot", src=[1], dst=[first_snap + 2], consumed=[cut])
    assert int(h.r.ex.pool.consumed[first_snap + 2]) == cut
    h.decode([1], forced={1: 99})  # diverge: state, KV and consumed move past the snapshot
    h.decode([1], forced={1: 98})
    assert int(h.r.state.consumed[1]) == cut + 2
    _state_call(h, "state_restore", src=[first_snap + 2], dst=[1])
    assert int(h.r.state.consumed[1]) == cut
    assert torch.equal(h.r.state.hidden[1], hidden_at_cut)
    h.seq[1] = list(prompt)
    h.prefill(1, cut, len(prompt) - cut, sample=True)
    assert torch.equal(h.logits(1), want_prefill)
    h.decode([1], forced={1: 17})
    assert torch.equal(h.logits(1), want_decode)
    assert rel_l2(want_decode, reference_logits(hf, h.seq[1][:-1])[-1]) < TOL


def test_restore_into_another_row_branches_independently(setup):
    hf, h = setup
    prefix = _prompt(48, 4)  # three full pages: the branch shares them read-only
    first_snap = h.r.ex.pool.first_snapshot_row
    h.admit(1, prefix)
    h.prefill(1, 0, 48, sample=False)
    _state_call(h, "state_snapshot", src=[1], dst=[first_snap], consumed=[48])
    branches = {1: _prompt(10, 5), 6: _prompt(10, 6)}
    h.admit(6, prefix + branches[6])
    _state_call(h, "state_restore", src=[first_snap], dst=[6])
    from flared.engine.plan import PageTableWrite, StepPlan

    full = h.pages[1][: 48 // h.ps]  # the complete pages only (row 1 holds one page ahead)
    shared = tuple(PageTableWrite(6, i, p) for i, p in enumerate(full))
    h.r.execute(StepPlan(1000, page_table_writes=shared))
    h.pages[6] = list(full)
    h.seq[1] = prefix + branches[1]
    h.prefill(1, 48, 10, sample=True)
    h.prefill(6, 48, 10, sample=True)
    for row, suffix in branches.items():
        ref = reference_logits(hf, prefix + suffix)[-1]
        assert rel_l2(h.logits(row), ref) < TOL, row
    h.decode([6, 1], forced={6: 7, 1: 8})
    for row in branches:
        assert rel_l2(h.logits(row), reference_logits(hf, h.seq[row][:-1])[-1]) < TOL


def test_padded_rows_leave_the_pool_unchanged(setup):
    _, h = setup
    for row, n in ((1, 10), (2, 4), (5, 7)):
        h.admit(row, _prompt(n, row))
        h.prefill(row, 0, n, sample=True)
    before = _pool_copy(h)
    h.decode([1, 2, 5])  # capacity 4: one padded row
    after = _pool_now(h)
    for b, a in zip(before, after):
        for row in range(a.shape[0]):
            if row not in (1, 2, 5):
                assert torch.equal(a[row], b[row]), row
    # all-padding maintenance calls and a padded prefill (row 0) are exact no-ops
    before = _pool_copy(h)
    _state_call(h, "state_init", rows=[])
    _state_call(h, "state_snapshot", src=[], dst=[], consumed=[])
    _state_call(h, "state_restore", src=[], dst=[])
    # invalid pairs are skipped too: a live row as snapshot target, a snapshot as restore target
    _state_call(h, "state_snapshot", src=[1], dst=[2], consumed=[10])
    _state_call(h, "state_restore", src=[2], dst=[h.r.ex.pool.first_snapshot_row])
    call = h.r.calls["prefill128"]  # a prefill of padding only: row 0, nothing valid
    st = call.stage()
    for key in ("tokens", "positions", "row", "num_valid"):
        st[key].zero_()
    st["slots"].fill_(-1)
    call.upload()
    call.run()
    for b, a in zip(before, _pool_now(h)):
        assert torch.equal(a, b)
    h.r.ex.pool.check_integrity()


def test_finished_rows_keep_their_state(setup):
    _, h = setup
    h.admit(1, _prompt(6, 1), max_tokens=1)
    h.prefill(1, 0, 6, sample=True)  # finishes on its first token
    h.admit(2, _prompt(6, 2))
    h.prefill(2, 0, 6, sample=True)
    before = _pool_copy(h)
    h.decode([1, 2])
    for b, a in zip(before, _pool_now(h)):
        assert torch.equal(a[1], b[1])


def test_state_init_resets_a_live_row(setup):
    _, h = setup
    h.admit(3, _prompt(30, 3))
    h.prefill(3, 0, 30, sample=False)
    _state_call(h, "state_init", rows=[3])
    p = h.r.ex.pool
    for spec, t in zip(p.specs, p.tensors):
        assert bool((t[3] == spec.fill).all()), spec


def test_dense_catalog_has_no_state_executions(tiny):
    h = Harness(tiny.bundle("qwen3"))
    assert h.r.ex.pool is None
    assert not any(name.startswith("state_") for name in h.r.calls)


# Checkpoints as published (vision-language wrappers, one tensor per expert, MTP heads, shards)
# hold the same weights as the in-memory layout above: the prepared model must give the same
# logits bit for bit, and match the canonical forward of the published class itself (for
# Qwen3.5, the vision-language class run on text). Measured worst relative L2 against it over
# a 77-token split, the prompt end and 4 teacher-forced decode steps: 2.0e-6 (qwen3_next),
# 1.7e-6 (qwen3_5), 2.1e-6 (qwen3_5_moe); asserted: TOL.


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def published(request, tiny, tmp_path_factory):
    import transformers

    from prep.prepare import PrepConfig, prepare
    from prep.tiny import make_tiny_checkpoint

    mt = request.param
    root = tmp_path_factory.mktemp(f"published-{mt}")
    ckpt = make_tiny_checkpoint(root / "ckpt", mt, published=True)
    prepare(PrepConfig(checkpoint=ckpt, out=root / "bundle", compile=False, device="cpu",
                       max_context_tokens=512, max_prefill_chunk_tokens=256))  # fmt: skip
    m = read_manifest(root / "bundle")
    assert m.source is not None
    hf_class = getattr(transformers, m.source.architecture)  # e.g. the vision-language class
    hf = hf_class.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    return tiny.bundle(mt), root / "bundle", hf


def _run(bundle, prompt: list[int], forced: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Logits after a split prefill and teacher-forced decode steps."""
    h = Harness(bundle)
    h.admit(1, prompt)
    out = []
    for start, n in ((0, 77), (77, len(prompt) - 77)):
        h.prefill(1, start, n, sample=start + n == len(prompt))
        out.append(h.logits(1).clone())
    for tok in forced:
        h.decode([1], forced={1: tok})
        out.append(h.logits(1).clone())
    return out, h.seq[1]


def test_published_checkpoint_serves_the_same_logits(published):
    mem_bundle, pub_bundle, hf = published
    prompt, forced = _prompt(140, 11), _prompt(4, 12)
    want, _ = _run(mem_bundle, prompt, forced)
    got, seq = _run(pub_bundle, prompt, forced)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), i
    ref = reference_logits(hf, seq[:-1])  # the published class's own forward, text only
    ends = [76, len(prompt) - 1] + [len(prompt) + i for i in range(len(forced))]
    for pos, logits in zip(ends, got, strict=True):
        assert rel_l2(logits, ref[pos]) < TOL, pos
