"""The prefix cache through the scheduler and the fake device: hits, captures, branches,
restores, full-prompt hits, cancellation, pressure and preemption with checkpoints.

The fake device samples from the consumed history (`content_sampling`), so a continuation after
a restore matches a cold one only if every restored page, tail copy and state row is exact.
"""

from collections import deque
from typing import Any

import pytest
from engine_fakes import FakeDevice, Transcript, assert_drained, create_scheduler, drive

from flared.engine.digests import PrefixDigests
from flared.engine.plan import NO_PAGE, FinishReason, RequestParams, StepResult
from flared.engine.scheduler import Scheduler
from flared.engine.seeds import derive_seed

CACHE: dict[str, Any] = {"num_snapshot_rows": 16, "max_num_rows": 2}  # budget 8
X = list(range(100, 140))  # a 40-token conversation prefix


def params(max_tokens: int = 6, seed: int = 7) -> RequestParams:
    return RequestParams(max_tokens=max_tokens, seed=seed)


def setup(**overrides: Any) -> tuple[Scheduler, FakeDevice]:
    sched = create_scheduler(**{**CACHE, **overrides})
    return sched, FakeDevice(sched.config, content_sampling=True)


def run(
    sched: Scheduler,
    device: FakeDevice,
    rid: str,
    prompt: list[int],
    p: RequestParams | None = None,
    endpoints: tuple[int, ...] = (),
    depth: int = 1,
) -> Transcript:
    sched.submit(rid, prompt, p or params(), endpoints)
    return drive(sched, device, depth=depth)


def cold(prompt: list[int], p: RequestParams | None = None, **overrides: Any) -> list[int]:
    """The stream of `prompt` on a fresh engine without a cache."""
    sched = create_scheduler(**{**CACHE, **overrides, "num_snapshot_rows": 0})
    device = FakeDevice(sched.config, content_sampling=True)
    return run(sched, device, "cold", prompt, p).tokens["cold"]


def plans_of(device: FakeDevice, rid: str, start: int = 0) -> list[Any]:
    return [
        p
        for p in device.plans[start:]
        if any(a.request_id == rid for a in p.admits)
        or (p.prefill is not None and p.prefill.request_id == rid)
        or any(s.request_id == rid for s in p.snapshots)
    ]


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("delta", [-1, 0, 1])
@pytest.mark.parametrize("pages", [1, 2])
def test_prefix_lengths_around_page_boundaries(page_size: int, delta: int, pages: int) -> None:
    k = pages * page_size + delta
    sched, device = setup(page_size=page_size)
    first = run(sched, device, "a", X, endpoints=(k,))
    a_pages: dict[int, int] = {}
    for w in (w for p in device.plans for w in p.page_table_writes if w.page_id != NO_PAGE):
        a_pages.setdefault(w.index, w.page_id)
    mark = len(device.plans)
    tail = [7, 8, 9]
    t = run(sched, device, "b", X[:k] + tail)
    b_plans = device.plans[mark:]
    (restore,) = [r for p in b_plans for r in p.restores]
    assert restore.num_tokens == k  # the exact endpoint, not rounded to a page
    assert (restore.tail_copy is not None) == (k % page_size != 0)
    # b's page table once its admission's writes apply (writes are diffs: entries its row
    # already held from a are not written again)
    table: dict[tuple[int, int], int] = {}
    for plan in device.plans[: mark + 1]:
        for w in plan.page_table_writes:
            table[(w.row, w.index)] = w.page_id
    b_row = b_plans[0].admits[0].row
    shared = {i: p for (row, i), p in table.items() if row == b_row and p != NO_PAGE}
    assert all(shared[i] == a_pages[i] for i in range(k // page_size))  # complete pages shared
    if restore.tail_copy is not None:
        assert restore.tail_copy.dst_page == shared[k // page_size] != a_pages[k // page_size]
    prefills = [p.prefill for p in b_plans if p.prefill is not None]
    assert prefills[0].start_pos == k and sum(len(op.token_ids) for op in prefills) == 3
    (admit,) = b_plans[0].admits
    assert admit.prompt_token_ids == tuple(X[:k] + tail)  # the histogram sees the whole prompt
    assert t.finishes["b"].cached_tokens == k
    assert t.tokens["b"] == cold(X[:k] + tail, page_size=page_size)
    assert first.finishes["a"].cached_tokens == 0
    assert sched.stats()["prefix_hit_tokens_total"] == k
    assert_drained(sched, device)


def test_full_prompt_hit_samples_from_the_saved_hidden_vector() -> None:
    sched, device = setup()
    run(sched, device, "a", X)
    mark = len(device.plans)
    forward = device.num_forward_tokens
    t = run(sched, device, "b", X, params(max_tokens=5, seed=3))
    b_plans = device.plans[mark:]
    assert b_plans[0].resume is not None and b_plans[0].resume.request_ids == ("b",)
    assert all(p.prefill is None for p in b_plans)  # no forward over a consumed token
    assert device.num_forward_tokens - forward == 4  # the 4 decodes after the resumed sample
    assert t.tokens["b"] == cold(X, params(max_tokens=5, seed=3))
    assert t.finishes["b"].cached_tokens == len(X)
    stats = sched.stats()
    assert stats["prefix_full_hits_total"] == 1 and stats["prefix_hit_tokens_total"] == 40
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_appended_turn_resumes_from_the_terminal_checkpoint(depth: int) -> None:
    sched, device = setup()
    a = run(sched, device, "a", X, params(max_tokens=5), depth=depth)
    out = a.tokens["a"]
    turn2 = X + out + [1, 2, 3, 4]  # the reply, then a tool result
    mark = len(device.plans)
    t = run(sched, device, "b", turn2, depth=depth)
    (restore,) = [r for p in device.plans[mark:] for r in p.restores]
    assert restore.num_tokens == len(X) + 4  # terminal: the last sampled token was pending
    assert t.finishes["b"].cached_tokens == len(X) + 4
    assert t.tokens["b"] == cold(turn2)
    assert sched.stats()["prompt_tokens_total"] == len(X) + 5  # only the new suffix recomputed
    assert_drained(sched, device)


def test_a_turn_borrows_its_history_pages_without_touching_their_counts() -> None:
    """The next turn maps the previous turn's chain pages through the checkpoint it pins: no
    reference of its own on them at admission, none dropped at release, so an agent's turn
    costs page bookkeeping for its new pages only. Under page pressure a running request takes
    references of its own before its pin is dropped (the chain may then be retired)."""
    sched, device = setup(page_size=4)
    res = sched._resources
    a = run(sched, device, "a", X, params(max_tokens=5))
    turn2 = X + a.tokens["a"] + [1, 2, 3, 4]
    sched.submit("b", turn2, params(max_tokens=5))
    pending = deque([device.execute(sched.plan())])  # b's admission step
    (b,) = sched._running
    chain = sched._cache.store.chain_pages(b.anchor)[: b.num_borrowed]
    assert b.num_borrowed == (len(X) + 4) // 4  # the terminal checkpoint's complete pages
    assert b.pages[: b.num_borrowed] == chain
    assert all(res.refcount(p) == 1 for p in chain)  # the checkpoint's reference alone
    assert all(res.refcount(p) >= 1 for p in b.pages[b.num_borrowed :])  # its own (+ captures)
    sched.check_integrity()
    transcript = Transcript()
    transcript.add(sched.complete(pending.popleft()))  # its capture publishes
    # page pressure: b's pin goes, after b took references of its own
    assert sched._cache.drop_anchors(sched._running)
    assert b.num_borrowed == 0 and b.anchor is None
    assert all(res.refcount(p) == 2 for p in chain)
    sched.check_integrity()
    assert sched.reset_prefix_cache() >= 1  # retire every unpinned checkpoint
    assert all(res.refcount(p) == 1 for p in chain)  # b still maps its history
    sched.check_integrity()
    t = drive(sched, device, transcript=transcript)
    assert t.tokens["b"] == cold(turn2, params(max_tokens=5), page_size=4)
    assert_drained(sched, device)


def hashed_lengths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From here on, the length of every token run the prefix digests hash, in order."""
    extended: list[int] = []
    extend = PrefixDigests.extend

    def spy(self: PrefixDigests, tokens: Any) -> None:
        extended.append(len(tokens))
        extend(self, tokens)

    monkeypatch.setattr(PrefixDigests, "extend", spy)
    return extended


def test_a_next_turn_hashes_only_its_new_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next turn starts from the block digests of the history that just finished: only the
    tokens after it are hashed, and the hit and its continuation are unchanged."""
    sched, device = setup()
    history = list(range(100, 300))  # three whole 64-token blocks and a tail
    a = run(sched, device, "a", history, params(max_tokens=5))
    turn2 = history + a.tokens["a"] + [1, 2, 3, 4]
    extended = hashed_lengths(monkeypatch)
    t = run(sched, device, "b", turn2)
    # the lookup hashes from the last whole block of the shared history on
    assert extended and extended[0] == len(turn2) - (len(history) + 4) // 64 * 64
    assert max(extended) < 64  # no block of the shared history was hashed again
    assert t.finishes["b"].cached_tokens == len(history) + 4
    assert t.tokens["b"] == cold(turn2)
    assert_drained(sched, device)


def test_a_branch_hashes_only_what_follows_its_shared_trunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched, device = setup()
    trunk = list(range(100, 240))  # two whole blocks and a partial one
    run(sched, device, "a", trunk + [7] * 90, params(max_tokens=3))
    run(sched, device, "noise", [5] * 70, params(max_tokens=3))  # a newer, unrelated history
    extended = hashed_lengths(monkeypatch)
    branch = trunk + [8] * 80
    t = run(sched, device, "b", branch)
    assert extended[0] == len(branch) - len(trunk) // 64 * 64
    assert t.tokens["b"] == cold(branch)
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_branches_continue_independently_after_restore(depth: int) -> None:
    sched, device = setup()
    run(sched, device, "parent", X, endpoints=(21,), depth=depth)
    prompts = {"left": [*X[:21], 1, 1, 1, 1, 1], "right": [*X[:21], 2, 2]}
    for rid, prompt in prompts.items():
        sched.submit(rid, prompt, params(max_tokens=9, seed=5))
    mark = len(device.plans)
    t = drive(sched, device, depth=depth)
    restores = [r for p in device.plans[mark:] for r in p.restores]
    assert sorted(r.request_id for r in restores) == ["left", "right"]
    assert {r.snapshot for r in restores} == {restores[0].snapshot}  # one shared ancestor
    assert len({r.tail_copy.dst_page for r in restores if r.tail_copy}) == 2  # private tails
    for rid, prompt in prompts.items():
        assert t.tokens[rid] == cold(prompt, params(max_tokens=9, seed=5))
    # each branch continues: its next turn hits its own terminal checkpoint
    nxt = prompts["left"] + t.tokens["left"] + [3]
    t2 = run(sched, device, "left2", nxt, depth=depth)
    assert t2.finishes["left2"].cached_tokens == len(prompts["left"]) + 8
    assert t2.tokens["left2"] == cold(nxt)
    assert_drained(sched, device)


def test_restore_into_a_row_used_before_at_the_same_position() -> None:
    sched, device = setup(max_num_rows=1)
    run(sched, device, "a", X, endpoints=(30,))
    other = [9] * 35  # row 1 now holds another history past position 30
    run(sched, device, "other", other)
    mark = len(device.plans)
    prompt = [*X[:30], 4, 4, 4, 4, 4, 4]
    t = run(sched, device, "b", prompt)
    (restore,) = [r for p in device.plans[mark:] for r in p.restores]
    assert restore.row == 1 and restore.num_tokens == 30
    assert t.tokens["b"] == cold(prompt, max_num_rows=1)
    assert_drained(sched, device)


def test_selected_endpoints_clip_prefill_and_unselected_do_not() -> None:
    # budget 3 (6 rows / 2): terminal, prompt and one message endpoint near the middle
    sched, device = setup(num_snapshot_rows=6, max_prefill_chunk_tokens=64)
    run(sched, device, "a", X, endpoints=(5, 18, 33))
    chunks = [len(p.prefill.token_ids) for p in device.plans if p.prefill is not None]
    assert chunks == [18, 22]  # 18 is nearest to the target 20; 5 and 33 share a chunk
    snaps = sorted(s.num_tokens for p in device.plans for s in p.snapshots)
    assert snaps == [18, 40, 45]  # message, prompt, terminal (40 + 6 - 1)
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_without_recurrent_state_one_chunk_holds_several_captures(depth: int) -> None:
    # the same budget as above, but checkpoints are pages: nothing clips the 40-token chunk
    sched, device = setup(num_snapshot_rows=6, max_prefill_chunk_tokens=64, recurrent_state=False)
    run(sched, device, "a", X, endpoints=(5, 18, 33), depth=depth)
    chunks = [len(p.prefill.token_ids) for p in device.plans if p.prefill is not None]
    assert chunks == [40]
    snaps = sorted(s.num_tokens for p in device.plans for s in p.snapshots)
    assert snaps == [18, 40, 45]
    # a request sharing the first 18 tokens restores the checkpoint taken inside the chunk
    tail = list(range(500, 509))
    t = run(sched, device, "b", X[:18] + tail, depth=depth)
    assert t.finishes["b"].cached_tokens == 18
    assert t.tokens["b"] == cold(X[:18] + tail, recurrent_state=False)
    assert_drained(sched, device)


def test_a_checkpoint_inside_a_chunk_never_serves_a_full_prompt_hit() -> None:
    # its saved hidden vector is that of the chunk's last token, not of token 18
    sched, device = setup(num_snapshot_rows=6, max_prefill_chunk_tokens=64, recurrent_state=False)
    run(sched, device, "a", X, endpoints=(18,))
    resumes = device.num_resumes
    b = run(sched, device, "b", X[:18], params(max_tokens=4, seed=3)).tokens["b"]
    assert device.num_resumes == resumes  # no sample from that snapshot
    assert b == cold(X[:18], params(max_tokens=4, seed=3), recurrent_state=False)
    # b's own prompt boundary has the same key, so no second checkpoint is taken there: a
    # prompt ending exactly at such an endpoint is recomputed (chat prompts end after it)
    t = run(sched, device, "c", X[:18], params(max_tokens=4, seed=3))
    assert device.num_resumes == resumes and t.tokens["c"] == b
    assert_drained(sched, device)


def test_duplicate_publication_keeps_the_computed_pages() -> None:
    # depth 2: b's prompt and terminal captures are planned before a's (same keys) publish
    sched, device = setup(max_prefill_chunk_tokens=64)
    for rid in ("a", "b"):
        sched.submit(rid, X, params(max_tokens=4))
    t = drive(sched, device, depth=2)
    assert t.tokens["a"] == t.tokens["b"] == cold(X, params(max_tokens=4))
    stats = sched.stats()
    assert stats["checkpoints_duplicate_total"] == 2
    assert stats["checkpoints"] == 2  # the prompt (40) and the terminal (43), each key once
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_cancel_with_captures_in_flight_and_reuse_the_id(depth: int) -> None:
    sched, device = setup(max_prefill_chunk_tokens=8)
    sched.submit("a", X, params(max_tokens=30), (8, 16, 24))
    pending: deque[StepResult] = deque()
    transcript = Transcript()
    for _ in range(3):  # prefill chunks ending at 8, 16, 24, each with a capture
        while len(pending) < depth:
            pending.append(device.execute(sched.plan()))
        transcript.add(sched.complete(pending.popleft()))
        sched.check_integrity()
    transcript.add(sched.cancel("a"))
    sched.check_integrity()
    sched.submit("a", [*X[:16], 3, 3], params())  # the same id again, at once
    drive(sched, device, depth=depth, transcript=Transcript(), pending=pending)
    hits = [r for p in device.plans for r in p.restores]
    assert [r.num_tokens for r in hits] == [16]
    assert sched.stats()["requests_cancelled_total"] == 1
    assert_drained(sched, device)


def test_snapshot_pressure_thins_chains_then_evicts_leaves() -> None:
    sched, device = setup(num_snapshot_rows=4, max_num_rows=1)  # budget 4
    for i in range(6):
        prompt = [i] * 10 + X
        run(sched, device, f"r{i}", prompt, endpoints=(10, 20, 30))
        sched.check_integrity()
    stats = sched.stats()
    assert stats["snapshot_pressure_total"] > 0 and stats["snapshot_pressure_evictions_total"] > 0
    assert stats["checkpoints_thinned_total"] > 0 and stats["checkpoints_evicted_total"] > 0
    assert stats["snapshots_used"] <= 4
    # the newest conversation's endpoints survive: its terminal checkpoint still hits
    t = run(sched, device, "again", [5] * 10 + X + [1])
    assert t.finishes["again"].cached_tokens > 0
    assert_drained(sched, device)


def test_page_pressure_evicts_cached_pages_before_admission_waits() -> None:
    sched, device = setup(num_pages=16, page_size=4, max_num_rows=1)
    for i in range(5):
        t = run(sched, device, f"r{i}", [i] * 40, params(max_tokens=3))
        assert t.finishes[f"r{i}"].reason is FinishReason.LENGTH
    stats = sched.stats()
    assert stats["page_pressure_total"] > 0 and stats["page_pressure_evictions_total"] > 0
    assert stats["pages_cached"] + stats["pages_free"] == 16
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_publishes_the_terminal_checkpoint_and_resumes(depth: int) -> None:
    # 6 pages of 4: r0 (1 prompt token, 2 pages) never grows; r1 (12 prompt tokens, 4 pages)
    # cannot grow into a 5th page and, being the newest, preempts itself: its checkpoint keeps
    # its 4 pages, it waits for r0 and resumes from that checkpoint.
    sched = create_scheduler(num_pages=6, page_size=4, max_num_rows=2, num_snapshot_rows=16)
    device = FakeDevice(sched.config, content_sampling=True)
    sched.submit("r0", [1], RequestParams(max_tokens=6, seed=1))
    sched.submit("r1", list(range(20, 32)), RequestParams(max_tokens=6, seed=2, min_tokens=5))
    t = drive(sched, device, depth=depth)
    stats = sched.stats()
    assert stats["preemptions_total"] == stats["preemption_checkpoints_total"] == 1
    assert t.finishes["r0"].completion_tokens == 6 and t.finishes["r1"].completion_tokens == 6
    (readmit,) = [a for p in device.plans for a in p.admits if len(a.prompt_token_ids) > 12]
    (restore,) = [r for p in device.plans for r in p.restores]
    generated = len(readmit.prompt_token_ids) - 12
    assert readmit.prompt_token_ids == tuple(range(20, 32)) + tuple(t.tokens["r1"][:generated])
    assert restore.num_tokens == 12 + generated - 1  # everything but the pending token
    # the RNG restarts from the derived seed; remaining budgets shrink, penalties continue
    # (the histogram is rebuilt from prompt + outputs)
    assert readmit.params.seed == derive_seed(2, generated)
    assert readmit.params.max_tokens == 6 - generated
    assert readmit.params.min_tokens == max(0, 5 - generated)
    assert sched.stats()["prompt_tokens_total"] == 1 + 12 + 1  # one token recomputed
    assert_drained(sched, device)


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_under_heavy_pressure_still_completes_everyone(depth: int) -> None:
    sched = create_scheduler(num_pages=10, page_size=4, max_num_rows=4, num_snapshot_rows=16)
    device = FakeDevice(sched.config, content_sampling=True)
    prompts = {f"r{i}": [10 + i] * (3 + i) for i in range(4)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.submit(rid, prompt, RequestParams(max_tokens=22, seed=i, min_tokens=5))
    transcript = drive(sched, device, depth=depth)
    stats = sched.stats()
    assert stats["preemptions_total"] > 0 and stats["preemption_checkpoints_total"] > 0
    for rid in prompts:
        assert transcript.finishes[rid].completion_tokens == 22
    assert_drained(sched, device)


def test_disabled_cache_plans_no_checkpoint_operations() -> None:
    sched = create_scheduler()
    device = FakeDevice(sched.config)
    run(sched, device, "a", X, endpoints=(10,))
    run(sched, device, "b", X)
    assert not any(p.restores or p.snapshots or p.resume for p in device.plans)
    assert sched.stats()["snapshots_total"] == 0
    assert_drained(sched, device)


def test_a_checkpoint_is_published_only_when_its_step_completes() -> None:
    """A capture becomes visible to lookups when its step completes. Before that, a step planned
    after the capture's may already restore from it (steps run in order, so the snapshot is
    written before the restore reads it): a request that would hit it is admitted at once."""
    sched, device = setup(max_prefill_chunk_tokens=64)
    sched.submit("a", X, params(max_tokens=3))
    first = sched.plan()  # a's whole prompt, with its prompt capture at 40
    assert [s.num_tokens for s in first.snapshots] == [40]
    (ckpt,) = sched._cache.store.checkpoints()
    sched.submit("b", X, params(max_tokens=3))
    second = sched.plan()  # b restores from the capture still in flight: a full-prompt hit
    assert [a.request_id for a in second.admits] == ["b"]
    assert [(r.snapshot, r.num_tokens) for r in second.restores] == [(ckpt.snapshot, 40)]
    assert second.resume is not None and not ckpt.published
    sched.check_integrity()
    t = Transcript()
    t.add(sched.complete(device.execute(first)))
    assert ckpt.published and sched._cache.store.contains_key(ckpt.key)
    t.add(sched.complete(device.execute(second)))
    sched.submit("c", [*X[:20], 1, 2, 3], params(max_tokens=3))  # shares no checkpoint: admitted
    drive(sched, device, transcript=t)
    assert t.finishes["b"].cached_tokens == 40  # a full-prompt hit once published
    assert t.finishes["c"].cached_tokens == 0
    assert t.tokens["b"] == cold(X, params(max_tokens=3), max_prefill_chunk_tokens=64)
    assert_drained(sched, device)


def test_the_next_turn_restores_from_the_terminal_capture_in_flight() -> None:
    """The previous turn's terminal capture is planned in the step after its finish; the next
    turn, already waiting, is admitted in the very next step from that capture while it is
    still pending: no empty step and no wait for the capture's completion."""
    sched, device = setup()
    p = params(max_tokens=4)
    sched.submit("a", X, p)
    t = Transcript()
    while "a" not in t.finishes:
        t.add(sched.complete(device.execute(sched.plan())))
    out = t.tokens["a"]
    nxt = [*X, *out, 5, 6, 7, 8, 9]
    sched.submit("b", nxt, p, (len(X) + len(out),))
    capture = sched.plan()  # a's terminal capture; b waits (its snapshot is written last here)
    (snap,) = capture.snapshots
    assert snap.request_id == "a" and not capture.admits
    admit = sched.plan()  # planned while the capture step is still in flight
    assert [a.request_id for a in admit.admits] == ["b"]
    (restore,) = admit.restores
    assert (restore.snapshot, restore.num_tokens) == (snap.snapshot, snap.num_tokens)
    assert admit.prefill is not None and admit.prefill.start_pos == snap.num_tokens
    sched.check_integrity()
    t.add(sched.complete(device.execute(capture)))
    t.add(sched.complete(device.execute(admit)))
    drive(sched, device, transcript=t)
    assert t.finishes["b"].cached_tokens == len(X) + len(out) - 1
    assert t.tokens["b"] == cold(nxt, p)
    assert_drained(sched, device)


def test_a_pending_checkpoint_sharing_its_key_is_not_restored_from() -> None:
    """Two requests prefill one prompt in consecutive steps, both in flight: each captures it,
    and the second capture will be discarded as a duplicate when its step completes. Neither
    serves an admission before publication (see the next test); a third request admitted after
    the first publication hits it, and the duplicate goes when its step completes."""
    sched, device = setup(max_prefill_chunk_tokens=64, max_num_rows=3)
    sched.submit("a", X, params(max_tokens=3))
    sched.submit("b", X, params(max_tokens=3, seed=8))
    first, second = sched.plan(), sched.plan()
    assert [s.request_id for s in (*first.snapshots, *second.snapshots)] == ["a", "b"]
    sched.submit("c", X, params(max_tokens=3, seed=9))
    store = sched._cache.store
    assert len({c.key for c in store.pending()}) == 1 and len(store.pending()) == 2
    t = Transcript()
    t.add(sched.complete(device.execute(first)))
    third = sched.plan()  # a's capture is published now: c hits it
    assert [a.request_id for a in third.admits] == ["c"]
    sched.check_integrity()
    t.add(sched.complete(device.execute(second)))  # b's capture: a duplicate, discarded
    t.add(sched.complete(device.execute(third)))
    drive(sched, device, transcript=t)
    assert sched.stats()["checkpoints_duplicate_total"] == 1
    assert t.finishes["c"].cached_tokens == 40
    assert t.tokens["c"] == cold(X, params(max_tokens=3, seed=9), max_prefill_chunk_tokens=64)
    assert_drained(sched, device)


def test_no_pending_checkpoint_of_a_shared_key_is_offered() -> None:
    """lookup_pending itself: while two pending checkpoints hold one key it offers neither."""
    sched, _ = setup(max_prefill_chunk_tokens=64)
    sched.submit("a", X, params(max_tokens=3))
    sched.submit("b", X, params(max_tokens=3, seed=8))
    sched.plan(), sched.plan()
    store = sched._cache.store
    assert len(store.pending()) == 2
    a = sched._running[0]
    digests = sched._cache._digests(a, len(X))
    assert store.lookup_pending(digests, len(X), 0, step_id=10) is None


@pytest.mark.parametrize("depth", [1, 2])
def test_the_next_turn_waits_for_the_previous_turns_terminal_checkpoint(depth: int) -> None:
    """An agent submits its next turn (the previous prompt and output, then more) the moment
    the previous turn finishes, while that turn's terminal capture is still owed (a step in
    flight still references it) or in flight: the turn waits until that capture is planned and
    resumes after the whole previous output, not at its prompt."""
    sched, device = setup()
    p = params(max_tokens=4)
    sched.submit("a", X, p)
    t = Transcript()
    flight: deque[Any] = deque()
    while "a" not in t.finishes:  # stop right at a's finish, its terminal capture not planned
        while len(flight) < depth and sched.has_work():
            flight.append(sched.plan())
        t.add(sched.complete(device.execute(flight.popleft())))
    out = t.tokens["a"]
    nxt = [*X, *out, 5, 6, 7, 8, 9]
    sched.submit("b", nxt, p, (len(X) + len(out),))
    assert any(r.capture_terminal for r in sched._releasing)  # owed, not yet planned
    assert len(flight) == depth - 1  # at depth 2 a step planned before a's finish is in flight
    pending = deque(device.execute(plan) for plan in flight)
    drive(sched, device, transcript=t, depth=depth, pending=pending)
    assert t.finishes["b"].cached_tokens == len(X) + len(out) - 1  # the terminal boundary
    assert t.tokens["b"] == cold(nxt, p)
    assert_drained(sched, device)


def test_cached_tokens_count_the_first_admission_only() -> None:
    # r1 is preempted mid-generation and readmitted with a hit on its own checkpoint; its
    # usage still reports what its first admission reused (nothing)
    sched = create_scheduler(num_pages=6, page_size=4, max_num_rows=2, num_snapshot_rows=16)
    device = FakeDevice(sched.config, content_sampling=True)
    sched.submit("r0", [1], RequestParams(max_tokens=6, seed=1))
    sched.submit("r1", list(range(20, 32)), RequestParams(max_tokens=6, seed=2))
    t = drive(sched, device)
    assert sched.stats()["prefix_hits_total"] == 1
    assert t.finishes["r1"].cached_tokens == 0
    assert_drained(sched, device)
