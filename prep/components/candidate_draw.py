"""The candidate path's draw in two launches: top 64 of the shaped logits, filters, token.

The candidate path (prep/components/sampling.py) keeps a row's 64 most likely tokens, shapes
them (temperature, then top-k, top-p and min-p over their probabilities) and draws one by the
inverse CDF. Composed from tensor operations and compiled, that is Flare's top-k in two
launches and then small kernels over [N, 64] (the exponential, the filters' gathers and sums,
two scans through the library, the draw). On an H100 the whole compiled candidate path
(penalties, log-softmax and the top logprobs included) took 86 µs a step at one row
(`2026-12-06-h100-decode-profile-qwen3-1.7b-sampling-cost.jsonl`), about 4% of a
Qwen3-1.7B-shaped decode step; this kernel replaces the part from the candidates' top-k on.

Here stage 1 is the top-k's own (`triton_topk._chunk_topk_kernel`: each program keeps the top
64 keys of its 1,024 values, then, at the default levels, its middle stage keeps the top 64 of
16 chunks' candidates) and stage 2 is one program per row that merges those candidates and
does everything after in registers:

    top 64 keys -> values (bitwise the shaped logits) and token ids, descending
    sp    = exp(value / temperature - the first's)             (fp32; 0 for banned tokens)
    keep  = sp >= sp[k - 1]                                    (top-k, ties kept)
    keep &= exclusive prefix mass / kept mass < top_p, closed over ties with its last member
    keep &= sp >= min_p * sp[0]
    token = ids[#{cdf <= u * cdf[-1]}], cdf the fp64 prefix sum of the kept sp, clamped to the
            last kept token

the same formulas as `sampling.filtered_candidates` + `sampling.sample_from_sorted`, in the
same order and precision, and the division rounded as IEEE's (`div_rn`). The differences from
those operations on the same device: the scans and sums associate in another order and the
exponential is the kernel's, so a draw whose uniform lands within rounding of a CDF step, or a
top-p boundary within rounding of a prefix sum, may pick the neighbouring token. A row's token
depends on that row alone. Served when `candidate_draw = "kernel"` (engine option), on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prep.components import SHARED_STEP_INPUTS
from prep.components.triton_topk import PAD_KEY, chunk_candidates, plan

WIDTH = 64  # the candidate path's width (sampling.CANDIDATES)


@triton.jit
def _pick(x, o, i):
    """x[i] of a 1-D block x (o = its positions), as a scalar."""
    return tl.sum(tl.where(o == i, x, tl.zeros_like(x)), 0)


@triton.jit
def _draw_kernel(
    CAND, TOKEN, TEMP, TOP_K, TOP_P, MIN_P, U, n_cand, NP: tl.constexpr, KP: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, NP)
    key = tl.load(CAND + row * n_cand + offs, mask=offs < n_cand, other=PAD_KEY)
    top = tl.topk(key, KP)  # descending: the row's KP largest shaped logits
    s = (top >> 32).to(tl.int32)
    bits = tl.where(s < 0, s ^ 0x7FFFFFFF, s)
    value = bits.to(tl.float32, bitcast=True)
    ids = 4294967295 - (top & 4294967295)
    o = tl.arange(0, KP)
    scaled = tl.math.div_rn(value, tl.zeros_like(value) + tl.load(TEMP + row))
    sp = tl.exp(scaled - _pick(scaled, o, 0))
    zero = tl.zeros_like(sp)
    # top-k: at least the k-th probability (ties with it stay)
    k = tl.minimum(tl.maximum(tl.load(TOP_K + row), 1), KP)
    keep = sp >= _pick(sp, o, k - 1)
    # top-p over the kept set: a token stays while the mass before it is below top_p, and so
    # does every token tied with the last such one
    masked = tl.where(keep, sp, zero)
    excl = (tl.cumsum(masked, 0) - masked) / tl.sum(masked, 0)
    in_p = (excl < tl.load(TOP_P + row)) & keep
    last = tl.maximum(tl.sum(in_p.to(tl.int32), 0) - 1, 0)
    keep = keep & (sp >= _pick(sp, o, last))
    # min-p against the most likely token
    keep = keep & (sp >= tl.load(MIN_P + row) * _pick(sp, o, 0))
    kept = tl.where(keep, sp, zero)
    # inverse CDF in fp64 over the kept tokens, clamped to the last one kept
    cdf = tl.cumsum(kept.to(tl.float64), 0)
    target = tl.load(U + row) * _pick(cdf, o, KP - 1)
    i = tl.sum((cdf <= target).to(tl.int32), 0)
    i = tl.maximum(tl.minimum(i, tl.sum((kept > 0).to(tl.int32), 0) - 1), 0)
    tl.store(TOKEN + row, _pick(ids, o, i))


def serves(x: torch.Tensor, width: int) -> bool:
    """Whether the kernel draws among the `width` most likely of rows like x [N, V] (fp32 on
    CUDA, the candidate path's width, a vocabulary of at least that many)."""
    return x.is_cuda and width == WIDTH and _fits(x)


def _fits(x: torch.Tensor, chunk: int | None = None, group: int | None = None) -> bool:
    return x.dtype == torch.float32 and plan(x.shape[-1], WIDTH, chunk, group) is not None


def draw_into(
    token: torch.Tensor,
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
    chunk: int | None = None,
    group: int | None = None,
) -> None:
    """token [N] int64 <- each row's draw among the WIDTH most likely of x [N, V] fp32 (unit
    stride along V); temperature, top_p, min_p [N] fp32, top_k [N] int64 (clamped to 1 ..
    WIDTH), u [N] fp64 uniforms in [0, 1). `chunk` and `group`: the top-k's levels
    (triton_topk.CHUNK and GROUP where None). Raises ValueError for a shape the kernel does
    not serve."""
    if not _fits(x, chunk, group):
        raise ValueError(f"the candidate draw serves fp32 rows of at least {WIDTH} values: "
                         f"got {x.dtype} {list(x.shape)}")  # fmt: skip
    cand, np_ = chunk_candidates(x, WIDTH, chunk, group=group)  # KP = WIDTH, a power of two
    _draw_kernel[(x.shape[0],)](
        cand, token, temperature.float().contiguous(), top_k.contiguous(),
        top_p.float().contiguous(), min_p.float().contiguous(), u.double().contiguous(),
        cand[0].numel(), NP=np_, KP=WIDTH, num_warps=8,
    )  # fmt: skip


@torch.library.custom_op("flare::candidate_draw", mutates_args=(), tags=SHARED_STEP_INPUTS)
def candidate_draw(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Each row's token drawn among its WIDTH most likely shaped logits x [N, V] fp32."""
    x = x.contiguous()
    token = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    draw_into(token, x, temperature, top_k, top_p, min_p, u)
    return token


@candidate_draw.register_fake
def _(x, temperature, top_k, top_p, min_p, u):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[0], dtype=torch.int64)
