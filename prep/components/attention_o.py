"""A one-row decode step's attention and o projection in one launch.

At one decode row a layer's attention is a short chain of dependent loads (the row's length,
its page table, a block of keys and values, the split programs' merge) that leaves the memory
nearly idle for several microseconds, and the o projection after it is a weight stream of
8-32 MiB whose launch, ramp and drain cost more than its bytes (an 8 MiB product wholly in L2
still took ~5 us on an H100: benchmarks/results/2026-12-06-h100-decode-attention-prefetch.jsonl).
Here the attention's programs (`triton_decode._decode_partial` as `decode_attention_from_qkv`
runs it: q/k norms, rotary embedding, the new token's KV write, the split attention and the
last program's merge) go on to the o projection after a grid-wide barrier
(`skinny_mlp.grid_barrier`): program p owns output rows [p R, (p + 1) R) and loads their first
weight chunk before it arrives, so the weight stream starts while the last merges run and the
product pays no launch of its own. The residual add is its epilogue. `decode_qkv_attention_o`
runs the layer's q|k|v product in the same launch too: each KV head's SPLITS programs compute
its query, key and value rows from the layer input over the weight with the RMSNorm folded in
(as the folded GEMV: 1/rms from the input's sum of squares) and meet at a barrier of their own
before the attention reads them. The runner's `decode_single_attention` (two | one | qkv,
prep.components.fused.set_single_attention) chooses.

The barriers need every program resident at once (grid (1, Hkv, SPLITS): 128 programs for 8
KV heads, one per SM of an H100 or H200): the ops read the compiled kernel's residency and the
SMs they may count on (`skinny_mlp.usable_sms`), and otherwise, or while a capture lacks the
barriers' counters, or under Triton's interpreter (programs one after another), launch the
phases as separate launches of the same kernel, bitwise the same results.

Measured on an H100 (benchmarks/results/2026-12-07-h100-attention-o.jsonl, per layer, cold
weights in a graph): slower than the two served launches, 15.46 against 14.55 us for the 1.7B
shape at 640 keys, 27.69 against 25.77 for the 8B; the phases apart are slower already (the o
phase's 16-row tiles over 128 programs against the register GEMV's), and the barrier saves at
most ~0.4 us against a kernel boundary. Hence opt-in (`decode_single_attention`, auto "two").

Arithmetic: the attention output is `decode_attention_from_qkv`'s, rounded to the dtype as the
canonical attention's output is; each o output row is an fp32 sum over K (lane-wise over the
chunks, then across the lanes), rounded to the dtype, plus the residual in fp32, rounded again
(`residual + o_proj(attn)`). The summation order differs from the skinny products', so a row's
result depends on running through this launch: it is for the one-row executions of requests
without a seed (`AttentionMeta.single_row`), which promise nothing about batch invariance.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from prep.components import SHARED_STEP_INPUTS, launch
from prep.components.skinny_mlp import grid_barrier, grid_sync, resident_per_sm, usable_sms
from prep.components.triton_decode import DECODE_SPLITS, _decode_partial, decode_keys

NUM_WARPS = 8
# o weight elements a program holds per chunk (two chunks in flight: 64 KiB of bf16 an SM)
CHUNK_ELEMENTS = 16384
_STATE: dict[str, int] = {"on": 0, "warm": 0, "qkv": 0}  # fused.set_single_attention
# the programs an SM holds of each compiled shape: (device, constants) -> count
_RESIDENT: dict[tuple, int] = {}


def set_enabled(on: bool) -> None:
    """Whether one-row decode steps run their attention and o projection as this one launch
    (read when a layer is traced or run, so set it before the runner warms up and captures;
    off: `decode_attention_from_qkv` then the o product, as before)."""
    _STATE["on"] = int(bool(on))


def enabled() -> bool:
    return bool(_STATE["on"])


def set_qkv(on: bool) -> None:
    """Whether the one launch also runs the layer's q|k|v product before the attention
    (`decode_qkv_attention_o`; read when a layer is traced or run, like `set_enabled`)."""
    _STATE["qkv"] = int(bool(on))


def with_qkv() -> bool:
    return bool(_STATE["qkv"])


def o_tiles(n: int, programs: int, k: int) -> tuple[int, int]:
    """(output rows per program: a power of two covering n over `programs`; K columns per
    chunk: CHUNK_ELEMENTS over those rows, a power of two, at most K's)."""
    rows = triton.next_power_of_2(-(-n // programs))
    chunk = min(triton.next_power_of_2(k), max(16, CHUNK_ELEMENTS // rows))
    return rows, chunk


@triton.jit
def _first_chunk(W, rows, r_ok, s_w, K: tl.constexpr, CHUNK: tl.constexpr):
    """Rows `rows` of W [*, K], columns [0, CHUNK) (zeros past K and where not r_ok), and the
    rows' base pointers: the first chunk of `_rows_dot`, loaded before whatever it waits on."""
    base = W + rows[:, None].to(tl.int64) * s_w
    cols = tl.arange(0, CHUNK)
    return tl.load(base + cols[None, :], mask=r_ok[:, None] & (cols < K)[None, :], other=0.0), base


@triton.jit
def _rows_dot(
    X, base, w, r_ok, K: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    X_CACHE: tl.constexpr,
):  # fmt: skip
    """(fp32 sums over K of W's rows times x, and x's fp32 sum of squares) for the rows at
    `base` (`_first_chunk`), whose first chunk `w` is already loaded: each chunk's weight loads
    go out before the previous chunk is used, the products accumulate lane-wise and are summed
    across the lanes once."""
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
    ss = tl.zeros((CHUNK,), dtype=tl.float32)
    for k0 in range(0, K, CHUNK):
        nxt = k0 + CHUNK + cols
        w_next = tl.load(base + nxt[None, :], mask=r_ok[:, None] & (nxt < K)[None, :], other=0.0)
        kk = k0 + cols
        x = tl.load(X + kk, mask=kk < K, other=0.0, cache_modifier=X_CACHE).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        ss += x * x
        w = w_next
    return tl.sum(acc, 1), tl.sum(ss, 0)


@triton.jit
def _attention_o_kernel(
    Q, K, V, PT, LEN, Mx, Sm, Acc, ATT, CNT, SLOTS, Kin, Vin, QN, KN, COS, SIN, W, WW, R, Y,
    SYNC, X, WQ, QKV, HSYNC, scale, trash, eps_q, eps_k, eps_x, n_out, w_words,
    s_qh, s_kp, s_ks, s_kh, s_pt, s_mh, s_ah, s_as, s_oh, s_kih, s_vih, s_cos, s_w, s_wq,
    GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, QK_NORM: tl.constexpr, ROPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KO: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    PHASE: tl.constexpr, WARM: tl.constexpr = 0, WITH_QKV: tl.constexpr = False,
    HKV: tl.constexpr = 1, HIDDEN: tl.constexpr = 1, ROWS_Q: tl.constexpr = 1,
    CHUNK_Q: tl.constexpr = 1,
):  # fmt: skip
    # PHASE 0: every phase, with a barrier after each; else one phase: 1 the q|k|v product
    # (WITH_QKV), 2 the attention (into ATT), 3 the o product (from ATT). WARM 2: the
    # attention's programs ask L2 for the o weight (int32 words WW) once their partials are
    # stored (each about its own rows).
    # WITH_QKV: program (h, s) first computes rows s * ROWS_Q, ... of kv head h's q|k|v rows
    # (its GROUP query heads, its key and value head) from X (the layer's input, whose RMSNorm
    # weight is folded into WQ: 1/rms from X's sum of squares, eps_x) into QKV, rounded; the
    # SPLITS programs of each head then meet at a barrier of their own (HSYNC + 2 h), and the
    # attention reads its q, key and value from QKV past L1.
    h = tl.program_id(1)
    prog = h * SPLITS + tl.program_id(2)
    grid = tl.num_programs(1) * SPLITS
    if WITH_QKV and (PHASE == 0 or PHASE == 1):
        local = tl.program_id(2) * ROWS_Q + tl.arange(0, ROWS_Q)
        q_ok = local < (GROUP + 2) * D
        grow = tl.where(  # the head's query rows, then its key's, then its value's
            local < GROUP * D, h * GROUP * D + local,
            tl.where(local < (GROUP + 1) * D, (GROUP * HKV + h) * D + local - GROUP * D,
                     (GROUP * HKV + HKV + h) * D + local - (GROUP + 1) * D),
        )  # fmt: skip
        wq, base = _first_chunk(WQ, grow, q_ok, s_wq, HIDDEN, CHUNK_Q)
        dots, ss = _rows_dot(X, base, wq, q_ok, HIDDEN, ROWS_Q, CHUNK_Q, "")
        out = (dots * tl.rsqrt(ss / HIDDEN + eps_x)).to(QKV.dtype.element_ty)  # as the GEMV's
        tl.store(QKV + grow, out, mask=q_ok)
        if PHASE == 0:
            grid_barrier(HSYNC + 2 * h, HSYNC + 2 * h + 1, SPLITS)  # the head's rows stored
    if PHASE == 0 or PHASE == 2:
        _decode_partial(
            Q, K, V, PT, LEN, Mx, Sm, Acc, ATT, CNT, SLOTS, Kin, Vin, QN, KN, COS, SIN, WW,
            scale, trash, eps_q, eps_k, w_words,
            0, s_qh, s_kp, s_ks, s_kh, s_pt, 0, s_mh, 0, s_ah, s_as, 0, s_oh, 0, s_kih, 0,
            s_vih, s_cos,
            GROUP=GROUP, GPAD=GPAD, D=D, PS=PS, BLOCK_N=BLOCK_N, SPLITS=SPLITS, PDL=0,
            LAST_MERGES=True, WRITE_KV=True, QK_NORM=QK_NORM, ROPE=ROPE,
            DOT_PRECISION=DOT_PRECISION, PREFETCH=WARM, CACHE=".cg" if WITH_QKV else "",
        )  # fmt: skip
    if PHASE == 0 or PHASE == 3:
        rows = prog * ROWS + tl.arange(0, ROWS)
        r_ok = rows < n_out
        w, base = _first_chunk(W, rows, r_ok, s_w, KO, CHUNK)
        if PHASE == 0:
            grid_barrier(SYNC, SYNC + 1, grid)  # every merge's ATT stores precede the loads
        dots, _ = _rows_dot(ATT, base, w, r_ok, KO, ROWS, CHUNK, ".cg")
        out = dots.to(Y.dtype.element_ty)  # o_proj's output, rounded
        res = tl.load(R + rows, mask=r_ok, other=0.0)
        tl.store(Y + rows, (out.to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty),
                 mask=r_ok)  # fmt: skip


@torch.library.custom_op(
    "flare::paged_decode_attention_o_from_qkv",
    mutates_args=("k_cache", "v_cache"),
    tags=SHARED_STEP_INPUTS,
)
def decode_attention_o_from_qkv(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, slots: torch.Tensor, num_q_heads: int,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps_q: float, eps_k: float,
    cos: torch.Tensor, sin: torch.Tensor, o_weight: torch.Tensor, residual: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """residual [1, N] + o_weight [N, Hq * D] @ the attention of one decode row from its q|k|v
    output qkv [1, (Hq + 2 Hkv) * D] (as `triton_decode.decode_attention_from_qkv`: q/k norms
    or none, rotary embedding cos / sin [1, D], the new key and value written to `slots`), in
    one launch where its programs fit the SMs at once. -> [1, N]."""
    attn = _Attention(k_cache, v_cache, page_table, seq_lens, scale, slots, num_q_heads,
                      q_norm, k_norm, eps_q, eps_k, cos, sin)  # fmt: skip
    return _launch(attn, qkv, None, o_weight, residual)


@torch.library.custom_op(
    "flare::paged_decode_qkv_attention_o",
    mutates_args=("k_cache", "v_cache"),
    tags=SHARED_STEP_INPUTS,
)
def decode_qkv_attention_o(
    x: torch.Tensor, qkv_weight: torch.Tensor, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    slots: torch.Tensor, num_q_heads: int, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, eps_q: float, eps_k: float, cos: torch.Tensor,
    sin: torch.Tensor, o_weight: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """x + o_weight @ the attention of one decode row whose layer input is x [1, H]: the q|k|v
    product over qkv_weight [(Hq + 2 Hkv) * D, H], whose RMSNorm weight is folded in (1/rms of
    x with `eps`, as the folded GEMV computes it), then `decode_attention_o_from_qkv`'s
    attention and o product, in one launch where its programs fit the SMs at once (each KV
    head's programs meet at a barrier of their own after its q|k|v rows). -> [1, H]."""
    attn = _Attention(k_cache, v_cache, page_table, seq_lens, scale, slots, num_q_heads,
                      q_norm, k_norm, eps_q, eps_k, cos, sin)  # fmt: skip
    return _launch(attn, None, (x, qkv_weight, eps), o_weight, x)


class _Attention:
    """The attention's arguments of both ops."""

    def __init__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
        seq_lens: torch.Tensor, scale: float, slots: torch.Tensor, num_q_heads: int,
        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps_q: float, eps_k: float,
        cos: torch.Tensor, sin: torch.Tensor,
    ) -> None:  # fmt: skip
        if k_cache.stride() != v_cache.stride():
            raise ValueError("the k and v pages must share one layout")
        self.k, self.v, self.scale, self.hq = k_cache, v_cache, scale, num_q_heads
        self.table, self.lens = launch.unit_stride(page_table), launch.unit_stride(seq_lens)
        self.slots = launch.unit_stride(slots)
        self.norms = (q_norm, k_norm) if q_norm is not None and k_norm is not None else None
        self.eps_q, self.eps_k = eps_q, eps_k
        self.cos, self.sin = launch.rotary_rows(cos, sin, 1, k_cache.shape[3])


def _launch(
    a: _Attention, qkv: torch.Tensor | None,
    qkv_in: tuple[torch.Tensor, torch.Tensor, float] | None,
    o_weight: torch.Tensor, residual: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    ps, hkv, d = a.k.shape[1], a.k.shape[2], a.k.shape[3]
    n, ko = o_weight.shape
    width = (a.hq + 2 * hkv) * d
    x, wq, eps_x = qkv_in if qkv_in is not None else (residual, o_weight, 0.0)
    if qkv_in is not None:
        if tuple(wq.shape) != (width, x.shape[-1]) or wq.stride(1) != 1:
            raise ValueError(
                f"q|k|v weight {tuple(wq.shape)} does not fit {a.hq} + 2 x {hkv} heads of {d} "
                f"over x with {x.shape[-1]} columns (unit stride along K)"
            )
        x = x.contiguous()
        qkv = torch.empty((1, width), dtype=x.dtype, device=x.device)
    assert qkv is not None
    if qkv.shape[0] != 1 or residual.shape[0] != 1:
        raise ValueError(f"one decode row only, got {max(qkv.shape[0], residual.shape[0])}")
    if ko != a.hq * d or tuple(residual.shape) != (1, n) or o_weight.stride(1) != 1:
        raise ValueError(
            f"o weight {tuple(o_weight.shape)} and residual {tuple(residual.shape)} do not fit "
            f"{a.hq} heads of {d} (unit stride along K)"
        )
    heads = qkv.view(1, -1, d)
    q, key, value = heads.split([a.hq, hkv, hkv], dim=1)
    if heads.stride(-1) != 1:
        q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
    group = a.hq // hkv
    splits = DECODE_SPLITS
    grid = hkv * splits
    dev = qkv.device
    mx = torch.empty((1, a.hq, splits), dtype=torch.float32, device=dev)
    sm = torch.empty_like(mx)
    acc = torch.empty((1, a.hq, splits, d), dtype=torch.float32, device=dev)
    att = torch.empty((1, a.hq, d), dtype=qkv.dtype, device=dev)
    y = torch.empty((1, n), dtype=qkv.dtype, device=dev)
    counters = launch.zeroed_counters("decode_attention", dev, hkv)
    if counters is None:
        raise RuntimeError(
            "decode attention counters were not allocated before graph capture "
            "(run the launch once outside the capture first)"
        )
    residual = residual.contiguous()
    qn, kn = a.norms if a.norms is not None else (q, q)
    words = launch.prefetch_words(o_weight)
    warm = _STATE["warm"] if words is not None else 0
    rows, chunk = o_tiles(n, grid, ko)
    rows_q, chunk_q = o_tiles((group + 2) * d, splits, x.shape[-1])
    sync = grid_sync(dev) if dev.type == "cuda" else None
    head_sync = None  # a [GEN, CNT] pair per KV head, for the q|k|v phase's barriers
    if dev.type == "cuda" and qkv_in is not None:
        head_sync = grid_sync(dev, hkv, owner="attention_o_heads")

    def run(phase: int, warmup: bool = False) -> object:
        args = (
            q, a.k, a.v, a.table, a.lens, mx, sm, acc, att, counters, a.slots, key, value, qn,
            kn, a.cos, a.sin, o_weight, words if warm and words is not None else a.lens,
            residual, y, sync if sync is not None else counters, x, wq, qkv,
            head_sync if head_sync is not None else counters,
            a.scale, a.k.shape[0] - 1, a.eps_q, a.eps_k, eps_x, n,
            words.numel() if warm and words is not None else 0,
            q.stride(1), a.k.stride(0), a.k.stride(1), a.k.stride(2), a.table.stride(0),
            mx.stride(1), acc.stride(1), acc.stride(2), att.stride(1), key.stride(1),
            value.stride(1), a.cos.stride(0), o_weight.stride(0), wq.stride(0),
        )  # fmt: skip
        consts = dict(
            GROUP=group, GPAD=max(16, triton.next_power_of_2(group)), D=d, PS=ps,
            BLOCK_N=decode_keys(ps), SPLITS=splits, QK_NORM=a.norms is not None, ROPE=True,
            DOT_PRECISION=launch.dot_precision(a.k.dtype), KO=ko, ROWS=rows, CHUNK=chunk,
            PHASE=phase, WARM=warm if phase in (0, 2) else 0, WITH_QKV=qkv_in is not None,
            HKV=hkv, HIDDEN=x.shape[-1], ROWS_Q=rows_q, CHUNK_Q=chunk_q, num_warps=NUM_WARPS,
        )  # fmt: skip
        if warmup:
            return _attention_o_kernel.warmup(*args, grid=(1, hkv, splits), **consts)
        return _attention_o_kernel[(1, hkv, splits)](*args, **consts)

    shape = (n, ko, hkv, d, ps, group, a.norms is not None, warm, qkv.dtype, NUM_WARPS,
             CHUNK_ELEMENTS, qkv_in is not None, x.shape[-1])  # fmt: skip
    one = sync is not None and (qkv_in is None or head_sync is not None)
    if one and _fits(dev, shape, grid, run):
        run(0)
    else:
        for phase in (1, 2, 3) if qkv_in is not None else (2, 3):
            run(phase)
    return y


def single_row(
    module: torch.nn.Module, meta: Any, qkv: torch.Tensor | None, residual: torch.Tensor,
    qkv_weight: torch.Tensor | None, eps: float, num_q_heads: int,
    norms: tuple[torch.Tensor, torch.Tensor, float, float] | None, cos: torch.Tensor,
    sin: torch.Tensor, scale: float,
) -> torch.Tensor | None:  # fmt: skip
    """The Triton backend's `attend_o`: `decode_attention_o_from_qkv` from `qkv`, or with qkv
    None `decode_qkv_attention_o` of the layer input `residual` over `qkv_weight`, for the
    layer `module` of a one-row decode step of a request without a seed; None where the
    switches (`set_enabled`, `set_qkv`), the step or the o projection (a bias) do not allow it."""
    from prep.components.paged_attention import AttentionMeta, layer_pages

    assert isinstance(meta, AttentionMeta)
    o_proj = getattr(module, "o_proj", None)
    rows = (qkv if qkv is not None else residual).shape[0]
    if (
        not enabled()
        or (qkv is None and (not with_qkv() or qkv_weight is None))
        or meta.mode != "decode"
        or not meta.single_row
        or rows != 1
        or not isinstance(o_proj, torch.nn.Linear)
        or o_proj.bias is not None
    ):
        return None
    k_cache, v_cache = layer_pages(module, meta)
    qn, kn, eps_q, eps_k = norms if norms is not None else (None, None, 0.0, 0.0)
    common = (k_cache, v_cache, meta.page_table, meta.lengths(), scale, meta.slot_mapping,
              num_q_heads, qn, kn, eps_q, eps_k, cos, sin, o_proj.weight)  # fmt: skip
    if qkv is not None:
        return decode_attention_o_from_qkv(qkv, *common, residual)
    assert qkv_weight is not None
    return decode_qkv_attention_o(residual, qkv_weight, eps, *common)


def _fits(device: torch.device, key: tuple, grid: int, run: object) -> bool:
    """Whether the `grid` programs of the one-launch form are resident on `device` at once
    (the compiled kernel's registers and shared memory; read once per shape)."""
    k = (device, *key)
    per_sm = _RESIDENT.get(k)
    if per_sm is None:
        kernel = run(0, warmup=True)  # type: ignore[operator]
        per_sm = _RESIDENT[k] = resident_per_sm(kernel, NUM_WARPS, device)
    return grid <= per_sm * usable_sms(device)


def set_warm(where: int) -> None:
    """0: no L2 warming of the o weight; 2: the attention's programs ask L2 for it once their
    partials are stored (an experiment's switch, read at launch)."""
    if where not in (0, 2):
        raise ValueError(f"warm must be 0 or 2, got {where}")
    _STATE["warm"] = where


@decode_attention_o_from_qkv.register_fake
def _(qkv, k_cache, v_cache, page_table, seq_lens, scale, slots, num_q_heads, q_norm, k_norm,  # type: ignore[no-untyped-def]
      eps_q, eps_k, cos, sin, o_weight, residual):  # fmt: skip
    return residual.new_empty((1, o_weight.shape[0]))


@decode_qkv_attention_o.register_fake
def _(x, qkv_weight, eps, k_cache, v_cache, page_table, seq_lens, scale, slots, num_q_heads,  # type: ignore[no-untyped-def]
      q_norm, k_norm, eps_q, eps_k, cos, sin, o_weight):  # fmt: skip
    return x.new_empty((1, o_weight.shape[0]))
