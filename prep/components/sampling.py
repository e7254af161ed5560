"""In-graph sampling: penalties, temperature, top-k, top-p, min-p and a counter-based RNG.

Every function here is static-shaped and free of generator state, so it can run inside a
compiled forward and a captured CUDA graph. Each row draws from its own counter-based stream:
u = hash(seed, counter), so a request's tokens do not depend on its batch position or on which
other requests run beside it.

Two paths, the same semantics (`sample`'s `paths`): a row whose top-k is on and at most
CANDIDATES filters and draws among its CANDIDATES most likely tokens (found by a chunked top-k
of the shaped logits: no softmax, sort or scan over the vocabulary); every other row sorts its
whole distribution. A row's path depends on its own parameters only. An execution whose rows
all qualify may be built with the candidate path alone (paths="candidates"). The one loss: a
tie at the k-th probability that runs past the CANDIDATES-th token keeps only the ties within.

Filter semantics (applied in this order, like Transformers' warpers):
    penalties  over the per-row histogram (prompt counted once + each output token once):
               repetition: logit/r if logit > 0 else logit*r, for every token with count > 0;
               presence: logit -= p for count > 0; frequency: logit -= f * count.
    temperature (> 0, validated upstream), then softmax.
    top-k      keep tokens whose probability >= the k-th largest (ties are kept, never cut).
    top-p      on the renormalised top-k set: keep the smallest prefix of the sorted tokens whose
               mass reaches top_p, plus every token tied with its last member.
    min-p      keep tokens with probability >= min_p * max probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

try:  # Triton comes with CUDA torch; without it every top-k is the library's
    from prep.components import candidate_draw, triton_topk
except ImportError:  # pragma: no cover - depends on the install
    triton_topk = None  # type: ignore[assignment]
    candidate_draw = None  # type: ignore[assignment]

T = TypeVar("T", torch.Tensor, int)

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # x: int64 holding values in [0, 2^32); every product stays below 2^63.
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def uniform_from_counter(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[N] int64 seeds and counters -> [N] float64 uniforms in [0, 1), 48 bits of resolution."""
    lo = seed & _MASK32
    hi = (seed >> 32) & _MASK32
    c = counter & _MASK32
    a = _mix32(lo ^ _mix32(c ^ 0x9E3779B9))
    b = _mix32(hi ^ _mix32(a ^ 0x85EBCA6B))
    a2 = _mix32(a ^ _mix32(b ^ 0xC2B2AE35))
    bits = ((a2 & 0xFFFFFF) << 24) | (b & 0xFFFFFF)
    return bits.double() / float(1 << 48)


@dataclass
class RowParams:
    """Per-row sampling parameters gathered from device request state; every tensor is [N]."""

    temperature: torch.Tensor
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seed: torch.Tensor  # int64
    counter: torch.Tensor  # int64


_SCAN_CHUNK = 256


@torch.library.custom_op("flare::cumsum_last", mutates_args=())
def cumsum_last(x: torch.Tensor) -> torch.Tensor:
    """Inclusive cumsum over the last dim of [N, V], opaque to the compiler (Inductor's split
    scan over a vocabulary-sized row fails to generate code for some batch sizes).

    Two levels: scans within 256-wide chunks, then over the chunk totals. The library's
    single-level scan of a long row runs one block per row on CUDA when N > 1 (measured on the
    H200: 200-230 µs for [2, 151936]); the two-level form is a few µs."""
    n, v = x.shape
    if v <= _SCAN_CHUNK:
        return torch.cumsum(x, dim=-1)
    pad = (-v) % _SCAN_CHUNK
    xp = torch.nn.functional.pad(x, (0, pad)).view(n, -1, _SCAN_CHUNK)
    inner = torch.cumsum(xp, dim=-1)
    offsets = torch.cumsum(inner[:, :, -1], dim=-1) - inner[:, :, -1]
    return (inner + offsets[:, :, None]).view(n, -1)[:, :v].contiguous()


@cumsum_last.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def disallowed_by_bitmask(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Grammar mask contract: mask int32 [N, ceil(V/32)]; token t is allowed iff bit t & 31 of
    word t >> 5 is set (little-endian within a word). An all-ones row (-1 words) is
    unconstrained. -> bool [N, V], True where the token is forbidden."""
    bits = torch.arange(32, device=mask.device, dtype=torch.int32)
    allowed = ((mask.unsqueeze(-1) >> bits) & 1).reshape(mask.shape[0], -1)[:, :vocab]
    return allowed == 0


def apply_penalties(logits: torch.Tensor, hist: torch.Tensor, p: RowParams) -> torch.Tensor:
    # logits: [N, V] fp32; hist: [N, V] int32
    seen = hist > 0
    rep = p.repetition_penalty[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - p.presence_penalty[:, None] * seen.float()
    return logits - p.frequency_penalty[:, None] * hist.float()


def filtered_probs_sorted(logits: torch.Tensor, p: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (kept probabilities sorted descending, unnormalised, [N, V]; their token ids [N, V])."""
    vocab = logits.shape[-1]
    probs = torch.softmax(logits / p.temperature[:, None], dim=-1)
    sp, si = torch.sort(probs, dim=-1, descending=True)
    k = torch.where(p.top_k > 0, p.top_k.clamp(max=vocab), vocab)
    return _filter_sorted(sp, k, p), si


def _filter_sorted(sp: torch.Tensor, k: torch.Tensor, p: RowParams) -> torch.Tensor:
    """The filters over probabilities sorted descending, sp [N, W] (any positive scale per
    row: every filter is scale-invariant), k [N] in [1, W] -> sp with the dropped set to 0."""
    # top-k: threshold at the k-th largest probability; ties with it stay.
    kth = sp.gather(1, (k - 1)[:, None])
    keep = sp >= kth
    masked = sp * keep
    # top-p on the renormalised survivors (exclusive prefix mass < top_p keeps a token).
    total = masked.sum(dim=-1, keepdim=True)
    excl = (cumsum_last(masked) - masked) / total  # opaque to the compiler (see cumsum_last)
    in_p = (excl < p.top_p[:, None]) & keep
    last = (in_p.long().sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    cutoff = sp.gather(1, last)
    keep = keep & (sp >= cutoff)
    # min-p relative to the most likely token.
    keep = keep & (sp >= p.min_p[:, None] * sp[:, :1])
    return sp * keep


CANDIDATES = 64  # the candidate path's width: rows with 0 < top_k <= CANDIDATES take it
TOPK_CHUNK = 1024  # chunked_topk's first stage: the top k of each run of this many values
PATHS = ("both", "candidates")
# how the candidate path draws on CUDA: "ops" (filtered_candidates + sample_from_sorted,
# compiled) or "kernel" (prep/components/candidate_draw.py: the top-k, filters and draw in two
# launches); CPU rows always take the operations. Process-wide (set_candidate_draw), read when
# an execution is traced: a change retraces.
CANDIDATE_DRAWS = ("ops", "kernel")
_candidate_draw = "ops"


def set_candidate_draw(mode: str) -> None:
    """How the candidate path draws from here on (CANDIDATE_DRAWS; the engine option
    `candidate_draw`)."""
    global _candidate_draw
    if mode not in CANDIDATE_DRAWS:
        raise ValueError(
            f"candidate_draw must be one of {', '.join(CANDIDATE_DRAWS)}, got {mode!r}"
        )
    _candidate_draw = mode


def draws_in_kernel(shaped: torch.Tensor, width: int) -> bool:
    """Whether the candidate path of rows like `shaped` draws in Flare's kernel."""
    return (
        _candidate_draw == "kernel"
        and candidate_draw is not None
        and candidate_draw.serves(shaped, width)
    )


def chunked_topk(
    x: torch.Tensor, k: int, want: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [N, V], descending, and their indices: exactly
    torch.topk's values (among equal values the indices may differ). On CUDA (fp32, k <= 64)
    Flare's kernel (prep/components/triton_topk.py: chunks, their groups, a merge; the
    library's top-k costs 27-42 µs a launch); elsewhere `library_topk`. `want` [N] bool: rows whose top k is
    needed; the others get zeros (values and indices), and on CUDA cost almost nothing."""
    on_device = x.is_cuda and x.dtype == torch.float32 and triton_topk is not None
    if on_device and triton_topk.plan(x.shape[1], k) is not None:  # CPU rows never plan
        vals, idx = triton_topk.topk(x, k, want)
        return vals, idx
    vals, idx = library_topk(x, k)
    if want is not None:
        vals = torch.where(want[:, None], vals, 0.0)
        idx = torch.where(want[:, None], idx, 0)
    return vals, idx


def library_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked_topk from the library's top-k, in two stages: the top k of each TOPK_CHUNK-wide
    run, then of those candidates (the library's top-k of a vocabulary-long row is a
    multi-pass radix select over the whole row, about a dozen launches, while a short row's
    top-k is one launch)."""
    n, v = x.shape
    if v <= 2 * TOPK_CHUNK or k > TOPK_CHUNK:
        return torch.topk(x, k, dim=-1)
    pad = (-v) % TOPK_CHUNK
    xp = torch.nn.functional.pad(x, (0, pad), value=float("-inf")) if pad else x
    chunks = xp.shape[1] // TOPK_CHUNK
    vals, idx = torch.topk(xp.view(n, chunks, TOPK_CHUNK), k, dim=-1)  # [N, C, k]
    base = torch.arange(chunks, device=x.device, dtype=idx.dtype) * TOPK_CHUNK
    idx = (idx + base[None, :, None]).view(n, chunks * k)
    top, j = torch.topk(vals.view(n, chunks * k), k, dim=-1)
    return top, idx.gather(1, j)


def filtered_candidates(
    logits: torch.Tensor, p: RowParams, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """filtered_probs_sorted over each row's `width` most likely tokens (rows whose top-k is
    on and at most `width`): the same filters on the candidates' probabilities, which need no
    normalisation over the vocabulary (each filter is scale-invariant). -> (kept probabilities,
    unnormalised, descending, zeros after the kept set [N, width]; their token ids)."""
    top, ids = chunked_topk(logits, width)  # the same tokens as the top probabilities (T > 0)
    scaled = top / p.temperature[:, None]
    sp = torch.exp(scaled - scaled[:, :1])  # descending; exp(-inf) = 0 for banned tokens
    return _filter_sorted(sp, p.top_k.clamp(min=1, max=width), p), ids


def sample_from_sorted(kept: torch.Tensor, ids: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: kept [N, V] (descending, zeros after the kept set), u [N] -> ids [N]."""
    cdf = cumsum_last(kept.double())
    target = u[:, None] * cdf[:, -1:]
    idx = (cdf <= target).long().sum(dim=-1, keepdim=True)
    idx = torch.minimum(idx, (kept > 0).long().sum(dim=-1, keepdim=True) - 1)
    return ids.gather(1, idx).squeeze(1)


def takes_candidates(top_k: T) -> T:
    """Whether rows sample from their candidates (see the module docstring): [N] int64 ->
    [N] bool on the device, or one request's top-k -> bool on the host."""
    return (top_k > 0) & (top_k <= CANDIDATES)


def sample(
    logits: torch.Tensor,
    hist: torch.Tensor,
    params: RowParams,
    banned: torch.Tensor | None,
    num_top_logprobs: int,
    paths: str = "both",
    want_top: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [N, V] fp32 raw; banned: [N, V] bool tokens forbidden this step (min_tokens).
    paths: "both" (each row by its own parameters) or "candidates" (every row takes the
    candidate path: for executions whose live rows all qualify, `takes_candidates`).
    want_top [N] bool: rows whose top logprobs are read (their requests asked for them);
    the others get zeros there, and on CUDA skip that top-k's work. None: every row.

    -> token [N] int64, logprob [N] fp32, top_ids [N, K] int64, top_logprobs [N, K] fp32.
    Logprobs are log-softmax of the raw logits, before penalties, temperature and filters.
    """
    if paths not in PATHS:
        raise ValueError(f"unknown sampling paths {paths!r} (choose {', '.join(PATHS)})")
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    shaped = apply_penalties(logits, hist, params)
    if banned is not None:
        shaped = shaped.masked_fill(banned, float("-inf"))
    u = uniform_from_counter(params.seed, params.counter)
    width = min(CANDIDATES, logits.shape[-1])
    if draws_in_kernel(shaped, width):
        p = params
        token = candidate_draw.candidate_draw(shaped, p.temperature, p.top_k, p.top_p, p.min_p, u)
    else:
        kept, ids = filtered_candidates(shaped, params, width)
        token = sample_from_sorted(kept, ids, u)
    if paths == "both":
        kept, ids = filtered_probs_sorted(shaped, params)
        token = torch.where(takes_candidates(params.top_k), token, sample_from_sorted(kept, ids, u))
    logprob = raw_logprobs.gather(1, token[:, None]).squeeze(1)
    k = max(num_top_logprobs, 1)
    top_lp, top_ids = chunked_topk(raw_logprobs, k, want_top)
    return token, logprob, top_ids, top_lp
