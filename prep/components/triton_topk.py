"""The k largest values of each row of a vocabulary-long row, in two launches.

Sampling takes a row's top 64 shaped logits (the candidate path) and its top logprobs every
decode step. The library's top-k of a [N, 151,936] tensor, even split into 1,024-wide runs
first (`sampling.library_topk`), costs 27-42 µs per launch on an H100 (a
single-block radix select per run): 137 µs of a Qwen3-1.7B-shaped step's 2.16 ms of kernels
for its two top-k's. Here each value and its index are packed into one int64 key whose signed
order is (value, lower index first), so a top-k is a bitonic `tl.topk` of keys in registers:

    stage 1  grid (N, ceil(V / CHUNK)): each program keys its CHUNK values and keeps the top
             KP (k rounded up to a power of two, at least MIN_KP), descending, in `cand`
             [N, chunks, KP]
    stage 2  grid (N,): one program per row keeps the top KP of its chunks x KP candidates
             and writes the first k values (fp32, bitwise the input's) and their indices

With GROUP > 0 a middle stage runs between them, grid (N, ceil(chunks / GROUP)): each program
keeps the top KP keys of GROUP chunks' candidates, so stage 1 can take shorter chunks (more
programs, each sorting fewer keys: CHUNK = 1,024 gives a 151,936-token row 149 programs where
4,096 gives 38 for 132 SMs) and stage 2 still merges few keys (10 groups x 64 at GROUP 16),
for one launch more. A sort's work grows as n log^2 n in its keys, so the bitonic sorts of
stage 1 and 2 (4,096 keys each at the defaults) are what these shorten. Exact either way: the
top KP of a union is the top KP of its parts' top KPs. On by default (CHUNK 1,024, GROUP 16):
on an H100 the compiled candidate path took 50.6 µs a step at one row against 86.5 with the
two launches (66.4 against 111.8 at four rows; the same tokens:
`benchmarks/results/2026-12-06-h100-sampling-cost-grouped-no-top.jsonl`). `set_levels` switches
the levels process-wide (`set_levels(4096, 0)`: the two launches), read when a caller is
traced; `benchmarks/sampling_cost.py`'s `-two-launch` variants time the two-launch form.

Key: the value's fp32 bits as a signed int32 s, with the magnitude bits flipped for negative
values (so signed order is float order, -inf lowest) and every NaN made the largest (as the
library orders NaN), times 2^32, plus (2^32 - 1 - index): among equal values the lower index
wins (-0.0 orders below +0.0, which the library counts equal). Padding keys (past V, or past
a row's candidates) are INT64_MIN, below every real key. The values are exactly the
library's; among equal values the indices are the lowest ones (deterministic; the library's
choice among ties is unspecified). A row's result depends on that row alone, whatever the
batch beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prep.components import SHARED_STEP_INPUTS

CHUNK = 1024  # stage 1's values per program: 149 programs per 151,936-token row
GROUP = 16  # chunks per program of the middle stage (0: none, see above)
MAX_STAGE2 = 8192  # stage 2's keys per row at the most (registers of one program)
MAX_K = 64
MIN_KP = 16  # tl.topk of 1 reduces its hypercube to a scalar and fails to build (Triton 3.6)
PAD_KEY = tl.constexpr(-(2**63))  # below every value's key (whose int32 part is > -2^31)


@triton.jit
def _keys(x, idx):
    bits = x.to(tl.int32, bitcast=True)
    s = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    s = tl.where(x != x, 0x7FFFFFFF, s)  # NaN: the largest, as the library orders it
    return s.to(tl.int64) * 4294967296 + (4294967295 - idx.to(tl.int64))


@triton.jit
def _chunk_topk_kernel(
    X, CAND, V, s_x, WANT, CHUNK: tl.constexpr, KP: tl.constexpr, HAS_WANT: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    c = tl.program_id(1)
    if HAS_WANT:  # noqa: SIM102 - without WANT no load may be emitted (a constexpr branch)
        if tl.load(WANT + row) == 0:  # a row nobody asked for: no work
            return
    offs = c * CHUNK + tl.arange(0, CHUNK)
    ok = offs < V
    x = tl.load(X + row * s_x + offs, mask=ok, other=0.0)
    key = tl.where(ok, _keys(x, offs), PAD_KEY)
    top = tl.topk(key, KP)
    tl.store(CAND + (row * tl.num_programs(1) + c) * KP + tl.arange(0, KP), top)


@triton.jit
def _group_topk_kernel(
    CAND, OUT, n_cand, WANT, G: tl.constexpr, KP: tl.constexpr, HAS_WANT: tl.constexpr
):  # fmt: skip
    """The middle stage: program (row, g) keeps the top KP of chunks [g G, (g + 1) G)'s
    candidates (CAND [N, chunks, KP], n_cand = chunks x KP) in OUT [N, groups, KP]."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    if HAS_WANT:  # noqa: SIM102 - as in _chunk_topk_kernel
        if tl.load(WANT + row) == 0:
            return
    offs = g * (G * KP) + tl.arange(0, G * KP)
    key = tl.load(CAND + row * n_cand + offs, mask=offs < n_cand, other=PAD_KEY)
    top = tl.topk(key, KP)
    tl.store(OUT + (row * tl.num_programs(1) + g) * KP + tl.arange(0, KP), top)


@triton.jit
def _merge_topk_kernel(
    CAND, VALS, IDX, n_cand, k, s_v, s_i, WANT, NP: tl.constexpr, KP: tl.constexpr,
    HAS_WANT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    o = tl.arange(0, KP)
    if HAS_WANT:  # noqa: SIM102 - as in _chunk_topk_kernel
        if tl.load(WANT + row) == 0:  # zeros, as `sampling.chunked_topk` gives such rows
            tl.store(VALS + row * s_v + o, tl.zeros([KP], tl.float32), mask=o < k)
            tl.store(IDX + row * s_i + o, tl.zeros([KP], tl.int64), mask=o < k)
            return
    offs = tl.arange(0, NP)
    key = tl.load(CAND + row * n_cand + offs, mask=offs < n_cand, other=PAD_KEY)
    top = tl.topk(key, KP)
    s = (top >> 32).to(tl.int32)
    bits = tl.where(s < 0, s ^ 0x7FFFFFFF, s)
    idx = 4294967295 - (top & 4294967295)
    tl.store(VALS + row * s_v + o, bits.to(tl.float32, bitcast=True), mask=o < k)
    tl.store(IDX + row * s_i + o, idx, mask=o < k)


def set_levels(chunk: int, group: int) -> None:
    """Stage 1's values per program and the middle stage's chunks per program (0: no middle
    stage), process-wide from here on (read when a caller is traced: a change retraces)."""
    global CHUNK, GROUP
    if chunk < MIN_KP or chunk & (chunk - 1) or group < 0 or group & (group - 1):
        raise ValueError(f"chunk and group must be powers of two (group 0: none), got "
                         f"{chunk}, {group}")  # fmt: skip
    CHUNK, GROUP = chunk, group


def plan(
    v: int, k: int, chunk: int | None = None, group: int | None = None
) -> tuple[int, int, int] | None:
    """(chunks, KP, stage 2's padded key count) for rows of v values and top k, or None where
    this kernel does not serve the shape (k above MAX_K or past one chunk's values, or more
    candidates than one program keeps). chunk, group: CHUNK and GROUP where None."""
    chunk = CHUNK if chunk is None else chunk
    group = GROUP if group is None else group
    if not 0 < k <= MAX_K:
        return None
    kp = max(MIN_KP, triton.next_power_of_2(k))
    chunks = triton.cdiv(v, chunk)
    if kp > chunk or v < kp or group * kp > MAX_STAGE2:
        return None
    parts = triton.cdiv(chunks, group) if group > 1 else chunks
    np_ = triton.next_power_of_2(parts * kp)
    return (chunks, kp, np_) if np_ <= MAX_STAGE2 else None


def chunk_candidates(
    x: torch.Tensor, k: int, chunk: int | None = None, want: torch.Tensor | None = None,
    group: int | None = None,
) -> tuple[torch.Tensor, int]:  # fmt: skip
    """Stage 1 (and with a group, the middle stage) over x [N, V] fp32 (unit stride along V):
    each chunk's (group's) top KP keys, descending -> (cand [N, parts, KP] int64, stage 2's
    padded key count NP). `chunk` (a power of two) is the values per program, `group` the
    chunks per middle-stage program (CHUNK and GROUP where None); `want` [N] bool: rows whose
    candidates are needed (the others' programs return at once, their candidates unwritten).
    Raises ValueError for a shape `plan` does not serve."""
    chunk = CHUNK if chunk is None else chunk
    group = GROUP if group is None else group
    n, v = x.shape
    p = plan(v, k, chunk, group)
    if p is None or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"triton top-k serves fp32 rows with k <= {MAX_K}: got {x.dtype} "
                         f"[{n}, {v}] stride {x.stride()} k={k}")  # fmt: skip
    chunks, kp, np_ = p
    cand = torch.empty((n, chunks, kp), dtype=torch.int64, device=x.device)
    has_want = want is not None
    if want is not None and (want.shape != (n,) or want.dtype != torch.bool):
        raise ValueError(f"want must be [{n}] bool, got {want.dtype} {list(want.shape)}")
    flags = want if want is not None else x
    _chunk_topk_kernel[(n, chunks)](
        x, cand, v, x.stride(0), flags, CHUNK=chunk, KP=kp, HAS_WANT=has_want, num_warps=8
    )  # fmt: skip
    if group > 1:
        parts = triton.cdiv(chunks, group)
        out = torch.empty((n, parts, kp), dtype=torch.int64, device=x.device)
        _group_topk_kernel[(n, parts)](
            cand, out, chunks * kp, flags, G=group, KP=kp, HAS_WANT=has_want, num_warps=8
        )  # fmt: skip
        cand = out
    return cand, np_


def topk_into(
    vals: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, k: int, chunk: int | None = None,
    want: torch.Tensor | None = None, group: int | None = None,
) -> None:  # fmt: skip
    """vals [N, k] fp32, idx [N, k] int64 <- the top k of each row of x [N, V] fp32
    (unit stride along V), descending; `chunk` (a power of two) is stage 1's values per
    program and `group` the middle stage's chunks per program (CHUNK and GROUP where None);
    `want` [N] bool: rows whose top k is needed, the others get zeros (values and indices) for
    almost no work. Raises ValueError for a shape `plan` does not serve."""
    cand, np_ = chunk_candidates(x, k, chunk, want, group)
    kp = cand.shape[2]
    _merge_topk_kernel[(x.shape[0],)](
        cand, vals, idx, cand[0].numel(), k, vals.stride(0), idx.stride(0),
        want if want is not None else x, NP=np_, KP=kp, HAS_WANT=want is not None,
        num_warps=8,
    )  # fmt: skip


@torch.library.custom_op("flare::topk", mutates_args=(), tags=SHARED_STEP_INPUTS)
def topk(
    x: torch.Tensor, k: int, want: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [N, V] fp32, descending, and their indices;
    zeros for rows where `want` [N] bool is False."""
    x = x.contiguous()
    vals = torch.empty((x.shape[0], k), dtype=torch.float32, device=x.device)
    idx = torch.empty((x.shape[0], k), dtype=torch.int64, device=x.device)
    topk_into(vals, idx, x, k, want=want.contiguous() if want is not None else None)
    return vals, idx


@topk.register_fake
def _(
    x: torch.Tensor, k: int, want: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty((x.shape[0], k)), x.new_empty((x.shape[0], k), dtype=torch.int64)
