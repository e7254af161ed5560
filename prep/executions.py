"""The prepared executions and the persistent request state they read and write.

Each execution is a static-shaped function of (model, persistent state, staged inputs) that
writes caller-owned storage and a completion record; the runner compiles it, captures it as a
CUDA graph on CUDA, and replays it with new inputs. Nothing here allocates persistent storage
after `RequestState.allocate`.

Region map of request rows (first dimension of every RequestState tensor):
    row 0             NULL_ROW: decode padding reads it; executions never change its values
    rows 1..R         live request rows

Models with recurrent layers also have a state pool (prep.components.state_pool): live pool row
r is request row r's recurrent state, and snapshot rows follow the live rows. Decode and prefill
name the pool rows they read and write explicitly (NULL_ROW for padding and finished rows);
admit initialises the row; `state_init`, `state_snapshot` and `state_restore` maintain rows from
index buffers.

Completion record of an execution with N sample rows ([N] unless noted):
    token int64, valid bool, reason int64 (FinishReason codes), logprob fp32,
    top_ids [N, K] int64, top_logprobs [N, K] fp32
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from prep.components.gated_deltanet import RecurrentMeta
from prep.components.paged_attention import AttentionMeta, PagedKVCache, bind_layer_pages
from prep.components.sampling import RowParams, disallowed_by_bitmask, sample
from prep.components.state_pool import StatePool, scatter_rows


@torch.library.custom_op("flare::copy_kv_pages", mutates_args=("k_cache", "v_cache"))
def copy_kv_pages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
) -> None:
    """k_cache[dst[i]] = k_cache[src[i]] (and v); in place and opaque to the compiler, like
    flare::write_kv (traced, the page storage would be copied whole)."""
    k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
    v_cache.index_copy_(0, dst, v_cache.index_select(0, src))


@copy_kv_pages.register_fake
def _(k_cache, v_cache, src, dst):  # type: ignore[no-untyped-def]
    return None


NULL_ROW = 0
PAD_SLOT = -1
NO_PAGE = -1
# Codes match flared.engine.plan.FinishReason (prep never imports flared; a test pins both).
REASON_NONE, REASON_EOS, REASON_STOP, REASON_LENGTH, REASON_CAPACITY = 0, 1, 2, 3, 5

FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")  # fmt: skip
INT_PARAMS = ("top_k", "seed", "max_tokens", "min_tokens", "ignore_eos", "top_logprobs")


@dataclass
class RequestState:
    """Persistent device storage indexed by request row."""

    pending: torch.Tensor  # [R+1] int64  sampled, not yet consumed token
    consumed: torch.Tensor  # [R+1] int64  tokens whose KV is written
    generated: torch.Tensor  # [R+1] int64
    finished: torch.Tensor  # [R+1] bool
    counter: torch.Tensor  # [R+1] int64  RNG draws made
    temperature: torch.Tensor  # [R+1] fp32 (and the other float params)
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    top_k: torch.Tensor  # [R+1] int64 (and the other int params)
    seed: torch.Tensor
    max_tokens: torch.Tensor
    min_tokens: torch.Tensor
    ignore_eos: torch.Tensor
    top_logprobs: torch.Tensor  # [R+1] int64  top logprobs the request asked for (0: none)
    stop_ids: torch.Tensor  # [R+1, S] int64, -1 = unused
    hist: torch.Tensor  # [R+1, V] int32 penalty histogram: prompt once + each output once
    page_table: torch.Tensor  # [R+1, P] int64
    hidden: torch.Tensor  # [R+1, H] final hidden vector of the last consumed token
    eos_ids: torch.Tensor  # [E] int64 model EOS ids

    @staticmethod
    def allocate(
        num_rows: int,
        vocab: int,
        hidden: int,
        max_pages: int,
        max_stop: int,
        eos_ids: list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> RequestState:
        r = num_rows + 1

        def z(*shape: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        return RequestState(
            pending=z(r), consumed=z(r), generated=z(r), finished=z(r, dt=torch.bool),
            counter=z(r),
            temperature=torch.ones(r, device=device), top_p=torch.ones(r, device=device),
            min_p=z(r, dt=torch.float32), repetition_penalty=torch.ones(r, device=device),
            presence_penalty=z(r, dt=torch.float32), frequency_penalty=z(r, dt=torch.float32),
            top_k=z(r), seed=z(r), max_tokens=z(r), min_tokens=z(r),
            ignore_eos=z(r, dt=torch.bool), top_logprobs=z(r),
            stop_ids=torch.full((r, max(max_stop, 1)), -1, dtype=torch.int64, device=device),
            hist=z(r, vocab, dt=torch.int32),
            page_table=torch.full((r, max_pages), NO_PAGE, dtype=torch.int64, device=device),
            hidden=z(r, hidden, dt=dtype),
            eos_ids=torch.tensor(eos_ids or [-1], dtype=torch.int64, device=device),
        )  # fmt: skip

    def nbytes(self) -> int:
        return sum(getattr(self, f.name).nbytes for f in fields(self))


@dataclass
class Completion:
    token: torch.Tensor
    valid: torch.Tensor
    reason: torch.Tensor
    logprob: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    @staticmethod
    def allocate(n: int, k: int, device: torch.device, pin: bool = False) -> Completion:
        def e(*shape: int, dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device, pin_memory=pin)

        return Completion(
            e(n, dt=torch.int64), e(n, dt=torch.bool), e(n, dt=torch.int64),
            e(n, dt=torch.float32), e(n, k, dt=torch.int64), e(n, k, dt=torch.float32),
        )  # fmt: skip

    def copy_from(self, other: Completion, non_blocking: bool = False) -> None:
        # one call for every field: each torch call from Python releases and retakes the GIL
        names = [f.name for f in fields(self)]
        torch._foreach_copy_(
            [getattr(self, n) for n in names], [getattr(other, n) for n in names],
            non_blocking=non_blocking,
        )  # fmt: skip


class Executions:
    """The step functions over one model, one KV cache and one request state."""

    def __init__(
        self,
        model: torch.nn.Module,
        state: RequestState,
        kv: PagedKVCache,
        layer_slots: dict[int, int],
        max_context_tokens: int,
        num_top_logprobs: int,
        backend: Any = None,
        compile_forward: str = "none",  # "none" or "+"-joined parts, see below
        state_pool: StatePool | None = None,
        recurrent_backend: Any = None,
    ) -> None:
        self.model = model
        self.base = model.base_model  # canonical decoder stack (embeddings .. final norm)
        # compile_forward: "none", or "+"-joined parts (prep.compiling.FORWARD_MODES):
        #   decode    the decoder stack of decode executions compiled whole
        #   all       ... and of prefill executions too
        #   layers    each decoder layer compiled (regional: one traced layer per layer kind
        #             and shape serves every layer, which reads its own storage from bound
        #             buffers); a decode stack compiled whole inlines them
        #   sampling  sampling + commit as its own compiled region (decode; with all or layers,
        #             prefill and resume too): Inductor fuses its ~200 small eager kernels
        parts = set(compile_forward.split("+")) - {"none"}
        unknown = parts - {"decode", "all", "layers", "sampling"}
        if unknown:
            raise ValueError(f"unknown compile parts {sorted(unknown)} in {compile_forward!r}")
        whole = "all" in parts
        compiled: Any = (
            torch.compile(self.base, dynamic=False) if parts & {"decode", "all"} else None
        )
        if "layers" in parts:
            for layer in self.base.layers:
                layer.compile(dynamic=False)
        self._base_decode: Any = compiled if compiled is not None else self.base
        self._base_prefill: Any = compiled if whole else self.base
        sampling = "sampling" in parts
        commit: Any = torch.compile(self._commit, dynamic=False) if sampling else self._commit
        self._commit_decode: Any = commit
        self._commit_other: Any = commit if parts & {"all", "layers"} else self._commit
        # a decode step's inputs from the request state: about twenty one-element kernels when
        # run eagerly inside the step's graph (each a launch, ramp and drain of its own), two or
        # three compiled
        self._decode_inputs: Any = (
            torch.compile(self._step_inputs, dynamic=False) if parts else self._step_inputs
        )
        self.lm_head = model.get_output_embeddings()
        self.state = state
        self.kv = kv
        self.layer_slots = layer_slots
        self.max_context_tokens = max_context_tokens
        self.k = max(num_top_logprobs, 1)
        self.backend = backend
        self.recurrent_backend = recurrent_backend  # None: the PyTorch reference
        self._page_rows: Any = None  # CUDA: KV page copies in one launch (row_copy.RowCopier)
        self.pool = state_pool if state_pool is not None else _default_pool(model, state, kv)
        # every layer reads its own storage from buffers bound to its modules, never through
        # its layer index: one traced decoder layer then serves all layers of its kind
        bind_layer_pages(self.base.layers, kv, layer_slots)
        if self.pool is not None:
            self.pool.bind_layers(self.base.layers)
        if self.pool is not None and compile_forward != "none":
            for t in self.pool.tensors:  # the pool's row count is the daemon's choice
                torch._dynamo.mark_dynamic(t, 0)

    # -- forward -------------------------------------------------------------------------
    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMeta,
        state_rows: torch.Tensor,
        num_valid: torch.Tensor,
    ) -> Any:
        # tokens, positions: [T]; state_rows [B] pool rows (NULL_ROW: read null, write nothing);
        # num_valid [1] -> hidden [T, H] after the final norm
        fn = self._base_decode if meta.mode == "decode" else self._base_prefill
        extra: dict[str, Any] = {}
        if self.pool is not None:
            extra["flare_state"] = RecurrentMeta(
                meta.mode, state_rows, num_valid, self.pool, self.recurrent_backend
            )
        out = fn(
            input_ids=tokens[None],
            position_ids=positions[None],
            use_cache=False,
            flare_meta=meta,
            **extra,
        )
        return out.last_hidden_state[0]

    # -- sampling and request-state commit -------------------------------------------------
    def _commit(
        self,
        rows: torch.Tensor,
        active: torch.Tensor,
        hidden: torch.Tensor,
        consumed_after: torch.Tensor,
        out: Completion,
        save_hidden: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        paths: str = "both",
    ) -> None:
        """Sample one token per row and commit it to the request state where `active`
        (`paths`: prep.components.sampling.sample's).

        rows [N], active [N] bool, hidden [N, H], consumed_after [N]: consumed count once this
        execution's tokens are written (the sampled token's position). `save_hidden` [N] bool:
        rows whose final hidden vector (of their last consumed token) is stored.
        """
        st = self.state
        logits = self.lm_head(hidden).float()  # [N, V]
        params = RowParams(
            temperature=st.temperature[rows], top_k=st.top_k[rows], top_p=st.top_p[rows],
            min_p=st.min_p[rows], repetition_penalty=st.repetition_penalty[rows],
            presence_penalty=st.presence_penalty[rows],
            frequency_penalty=st.frequency_penalty[rows], seed=st.seed[rows],
            counter=st.counter[rows],
        )  # fmt: skip
        gen = st.generated[rows]
        vocab = logits.shape[-1]
        stop = st.stop_ids[rows]  # [N, S]
        eos = st.eos_ids[None, :].expand(rows.shape[0], -1)  # [N, E]
        enforce_min = (gen < st.min_tokens[rows])[:, None]
        ban_ids = torch.cat([eos, stop], dim=1)
        ban_ok = (ban_ids >= 0) & enforce_min
        # an OR over (possibly repeated) ids: scatter_add of 0/1 then > 0 stays exact
        banned = (
            torch.zeros_like(logits).scatter_add(1, ban_ids.clamp(0, vocab - 1), ban_ok.float()) > 0
        )
        if token_mask is not None:  # grammar: [N, ceil(V/32)] int32, all ones = unconstrained
            banned = banned | disallowed_by_bitmask(token_mask, vocab)
        token, logprob, top_ids, top_lp = sample(
            logits, st.hist[rows], params, banned, self.k, paths, st.top_logprobs[rows] > 0
        )
        new_gen = gen + 1
        is_eos = (token[:, None] == st.eos_ids[None, :]).any(1) & ~st.ignore_eos[rows]
        is_stop = (token[:, None] == stop).any(1)
        reason = torch.full_like(token, REASON_NONE)
        reason = torch.where(consumed_after + 1 >= self.max_context_tokens, REASON_CAPACITY, reason)
        reason = torch.where(new_gen >= st.max_tokens[rows], REASON_LENGTH, reason)
        reason = torch.where(is_stop, REASON_STOP, reason)
        reason = torch.where(is_eos, REASON_EOS, reason)
        a = active.long()
        st.pending[rows] = torch.where(active, token, st.pending[rows])
        st.generated[rows] = gen + a
        st.counter[rows] = st.counter[rows] + a
        st.finished[rows] = st.finished[rows] | (active & (reason != REASON_NONE))
        st.hidden[rows] = torch.where(
            save_hidden[:, None], hidden.to(st.hidden.dtype), st.hidden[rows]
        )
        st.hist.index_put_((rows, token), a.to(st.hist.dtype), accumulate=True)
        out.token.copy_(token)
        out.valid.copy_(active)
        out.reason.copy_(torch.where(active, reason, REASON_NONE))
        out.logprob.copy_(logprob)
        out.top_ids.copy_(top_ids[:, : out.top_ids.shape[1]])
        out.top_logprobs.copy_(top_lp[:, : out.top_logprobs.shape[1]])

    # -- executions ---------------------------------------------------------------------------
    def decode(
        self,
        rows: torch.Tensor,
        out: Completion,
        token_mask: torch.Tensor | None = None,
        paths: str = "both",
        single_row: bool = False,
    ) -> None:
        """rows [B] int64 (NULL_ROW = padding): consume each row's pending token, sample the next.

        token_mask [B, ceil(V/32)] int32: per-row grammar bitmask (all ones = unconstrained).
        paths "candidates": an execution for batches whose live rows all sample from their
        candidates (sampling.takes_candidates): no sort over the vocabulary. single_row: the
        execution for one row of a request without a seed (AttentionMeta.single_row)."""
        active, tokens, fwd_pos, slots, pos, q_row, table, lens, state_rows, num_valid = (
            self._decode_inputs(rows)
        )
        meta = AttentionMeta(
            mode="decode", slot_mapping=slots, q_pos=pos, q_row=q_row, page_table=table,
            cache=self.kv, layer_slots=self.layer_slots, backend=self.backend, seq_lens=lens,
            single_row=single_row,
        )  # fmt: skip
        hidden = self._forward(tokens, fwd_pos, meta, state_rows, num_valid)
        self._commit_decode(rows, active, hidden, lens, out, active, token_mask, paths)

    def _step_inputs(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A decode step's inputs from the request state for rows [B], and the rows' consumed
        counts advanced (the forward reads positions from here, never the state): active,
        tokens, the forward's positions (0 for padding), slots (PAD_SLOT: no write), q_pos,
        q_row, page table [B, P], lengths (q_pos + 1), state rows (NULL_ROW for padding) and
        the live row count [] (each [B] unless said)."""
        st = self.state
        ps = self.kv.page_size
        active = (rows != NULL_ROW) & ~st.finished[rows]
        pos = st.consumed[rows]
        table = st.page_table[rows]
        page = table.gather(1, (pos // ps).clamp(max=table.shape[1] - 1)[:, None]).squeeze(1)
        slots = torch.where(active & (page >= 0), page * ps + pos % ps, PAD_SLOT)
        st.consumed[rows] = pos + active.long()
        return (
            active, st.pending[rows], torch.where(active, pos, 0), slots, pos,
            torch.arange(rows.shape[0], device=rows.device), table, pos + 1,
            torch.where(active, rows, NULL_ROW), active.sum(),
        )  # fmt: skip

    def prefill(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        row: torch.Tensor,
        num_valid: torch.Tensor,
        fresh: bool = False,
    ) -> None:
        """One chunk of one request. tokens/positions/slots [C]; row, num_valid [1].
        fresh: the execution for a chunk that starts its prompt (AttentionMeta.fresh).

        A chunk samples nothing: it advances the row's consumed count and saves the final
        hidden vector of its last token, and the chunk that ends a prompt is followed by
        `resume` over that row, which samples from the saved vector exactly as the chunk would
        have (the same logits, state and draw). So no chunk pays for a sample it discards, and
        the prompt's first token takes the candidate path's execution where its row does."""
        st = self.state
        meta = AttentionMeta(
            mode="prefill", slot_mapping=slots, q_pos=positions,
            q_row=torch.zeros_like(positions), page_table=st.page_table[row],
            cache=self.kv, layer_slots=self.layer_slots, backend=self.backend, fresh=fresh,
        )  # fmt: skip
        live = ~st.finished[row]
        state_rows = torch.where(live, row, NULL_ROW)
        hidden = self._forward(tokens, positions, meta, state_rows, num_valid)  # [C, H]
        last = hidden.index_select(0, (num_valid - 1).clamp(min=0))  # [1, H]
        st.consumed[row] = st.consumed[row] + num_valid
        st.hidden[row] = torch.where(live[:, None], last.to(st.hidden.dtype), st.hidden[row])

    def admit(
        self,
        row: torch.Tensor,
        prompt: torch.Tensor,
        fparams: torch.Tensor,
        iparams: torch.Tensor,
        stop_ids: torch.Tensor,
        fill_state: bool = True,
    ) -> None:
        """Initialise a live row. row [1]; prompt [L] (-1 padded); fparams [6]; iparams [6]; stop [S].
        fill_state=False leaves the row's recurrent state to the caller (a restore follows)."""
        st = self.state
        vocab = st.hist.shape[1]
        valid = prompt >= 0
        counts = torch.zeros(vocab, dtype=st.hist.dtype, device=prompt.device)
        counts = counts.index_add(0, prompt.clamp(0, vocab - 1), valid.to(st.hist.dtype))
        st.hist[row] = counts[None]
        zero = torch.zeros_like(row)
        for t in (st.pending, st.consumed, st.generated, st.counter):
            t[row] = zero
        st.finished[row] = zero.bool()
        for i, name in enumerate(FLOAT_PARAMS):
            getattr(st, name)[row] = fparams[i : i + 1]
        st.top_k[row] = iparams[0:1]
        st.seed[row] = iparams[1:2]
        st.max_tokens[row] = iparams[2:3]
        st.min_tokens[row] = iparams[3:4]
        st.ignore_eos[row] = iparams[4:5].bool()
        st.top_logprobs[row] = iparams[5:6]
        st.stop_ids[row] = stop_ids[None]
        if self.pool is not None and fill_state:  # the row starts from the initial state
            self.pool.fill_rows(row)

    def resume(
        self,
        rows: torch.Tensor,
        out: Completion,
        token_mask: torch.Tensor | None = None,
        paths: str = "both",
    ) -> None:
        """rows [B] (NULL_ROW = padding): sample each row's next token from its saved final
        hidden vector, with no forward pass: the prompt's first token after its last prefill
        chunk, or after a full-prompt checkpoint hit restored the vector. `paths` as decode's."""
        st = self.state
        active = (rows != NULL_ROW) & ~st.finished[rows]
        hidden = st.hidden[rows]
        self._commit_other(
            rows, active, hidden, st.consumed[rows], out, torch.zeros_like(active), token_mask,
            paths,
        )  # fmt: skip

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """KV page src[i] -> page dst[i] in every attention layer; padding pairs are
        (trash, trash). Destinations are distinct and never a source of the same call."""
        if self.kv.k_pages[0].is_cuda:  # one launch over every layer (CUDA)
            if self._page_rows is None:
                from prep.components.row_copy import RowCopier

                self._page_rows = RowCopier()
            pages = [*self.kv.k_pages, *self.kv.v_pages]
            if self._page_rows.copy(pages, src, dst, skip=self.kv.trash_page):
                return
        for k, v in zip(self.kv.k_pages, self.kv.v_pages, strict=True):
            copy_kv_pages(k, v, src, dst)

    def write_pages(self, rows: torch.Tensor, index: torch.Tensor, pages: torch.Tensor) -> None:
        """page_table[rows[i], index[i]] = pages[i]; padding entries target (NULL_ROW, 0)."""
        self.state.page_table[rows, index] = pages

    # -- state-pool maintenance (static: index buffers padded with NULL_ROW) ------------------
    def state_init(self, rows: torch.Tensor) -> None:
        """Initialise live pool rows [N] (entries outside the live region are skipped)."""
        pool = self._need_pool()
        live = (rows >= 1) & (rows <= pool.num_live_rows)
        pool.fill_rows(torch.where(live, rows, NULL_ROW))

    def state_snapshot(self, src: torch.Tensor, dst: torch.Tensor, consumed: torch.Tensor) -> None:
        """Copy live rows src [N] into snapshot rows dst [N], recording consumed [N] tokens and
        the row's saved final hidden vector (an exact checkpoint of those rows).

        `consumed` comes from the plan: the row has consumed at least that many tokens. Where it
        consumed more in this step (a checkpoint inside a chunk, for models without recurrent
        state), the hidden vector belongs to a later token and the scheduler never samples from
        it. Pairs whose src is not live or whose dst is not a snapshot row are skipped."""
        pool = self._need_pool()
        st = self.state
        ok = (src >= 1) & (src <= pool.num_live_rows)
        ok = ok & (dst >= pool.first_snapshot_row) & (dst < pool.num_rows)
        src, dst = torch.where(ok, src, NULL_ROW), torch.where(ok, dst, NULL_ROW)
        pool.copy_rows(src, dst)
        scatter_rows(pool.consumed, dst, consumed)
        scatter_rows(pool.hidden, dst, st.hidden.index_select(0, src))

    def state_restore(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy snapshot rows src [N] into live rows dst [N]; the request rows dst get the
        snapshot's consumed count and final hidden vector. Invalid pairs are skipped."""
        pool = self._need_pool()
        st = self.state
        ok = (src >= pool.first_snapshot_row) & (src < pool.num_rows)
        ok = ok & (dst >= 1) & (dst <= pool.num_live_rows)
        src, dst = torch.where(ok, src, NULL_ROW), torch.where(ok, dst, NULL_ROW)
        pool.copy_rows(src, dst)
        scatter_rows(st.consumed, dst, pool.consumed.index_select(0, src))
        scatter_rows(st.hidden, dst, pool.hidden.index_select(0, src))

    def _need_pool(self) -> StatePool:
        if self.pool is None:
            raise RuntimeError("this model declares no recurrent state")
        return self.pool


def _default_pool(
    model: torch.nn.Module, state: RequestState, kv: PagedKVCache
) -> StatePool | None:
    """The pool a caller did not pass: the recipe's declared layout, one live row per request
    row and no snapshot rows (state snapshots need the caller to size a pool)."""
    from prep import recipes

    config = model.config
    specs = recipes.resolve(config).geometry(config, kv.page_size).state_tensors
    if not specs:
        return None
    return StatePool.allocate(
        specs, state.pending.shape[0] - 1, 0, state.hidden.shape[1], state.hidden.dtype,
        state.pending.device,
    )  # fmt: skip
