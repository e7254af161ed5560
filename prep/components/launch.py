"""Programmatic dependent launch (PDL) for Flare's decode kernels: one process-wide switch.

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
running (once every program of that kernel has called `gdc_launch_dependents` or exited). It
must call `gdc_wait` before it touches memory an earlier kernel may write or still read: the
wait returns once the previous grid has completed and its writes are visible. What a kernel
does before the wait overlaps the previous kernel's tail (its launch, its program setup, and for
the skinny GEMM an L2 prefetch of weights, which nothing writes during a step). Every Flare
kernel launched with PDL waits before its first access to activations, so ordering stays
transitive along the stream, and the trigger is harmless before a kernel launched without PDL.

Where a kernel triggers its dependents' launch (`set_pdl`'s `trigger`): "start" (first thing,
as launched before: each kernel lets the next be scheduled at once, so a chain of kernels can
fill the SMs with programs waiting on one another and their L2 prefetches), "after_wait" (once
the previous grid completed: at most one kernel waits ahead of the running one; the default)
or "end" (after the main loop, before the final stores: the next kernel is scheduled while this
one's last programs finish). The kernels take it as their PDL constexpr: 0 off, 1 / 2 / 3.

SM90 and newer only; elsewhere `enabled()` is False and the kernels are launched as before.

Also here: where L2 is warmed with a weight while the memory is otherwise idle
(`set_attention_prefetch`; the kernels' `triton_decode.prefetch_l2`): the decode attention of
a short row is a chain of dependent loads that leaves the memory nearly idle, and the o
projection that follows streams its weight cold.

Also here: the zeroed counters through which the last program of a group of split programs
(decode attention's key splits, the skinny GEMM's K splits) finds out it is the last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

PDL_TRIGGERS = {"start": 1, "after_wait": 2, "end": 3}
_STATE: dict[str, bool | str] = {"pdl": False, "trigger": "after_wait"}
_CAPABLE: dict[int, bool] = {}


def set_pdl(enabled: bool, trigger: str | None = None) -> None:
    """The runner's `decode_pdl` (and `decode_pdl_trigger`): launch the decode kernels with
    PDL from now on, each triggering its dependents at `trigger` (kept when None)."""
    if trigger is not None:
        _STATE["trigger"] = _checked_trigger(trigger)
    _STATE["pdl"] = bool(enabled)


def _checked_trigger(trigger: str) -> str:
    if trigger not in PDL_TRIGGERS:
        raise ValueError(f"PDL trigger must be one of {', '.join(PDL_TRIGGERS)}, got {trigger!r}")
    return trigger


@contextlib.contextmanager
def switched(switches: dict[str, Any], **values: Any) -> Iterator[None]:
    """switches updated with `values` for the launches inside, as they were after (also when
    they raise): process-wide launch switches that one execution's warm-up and capture alone
    take."""
    was = {key: switches[key] for key in values}
    switches.update(values)
    try:
        yield
    finally:
        switches.update(was)


def switched_on(switches: dict[str, Any], key: str) -> contextlib.AbstractContextManager[None]:
    """switches[key] = True for the launches inside, as it was after (`switched`)."""
    return switched(switches, **{key: True})


def pdl_launches(trigger: str | None = None) -> contextlib.AbstractContextManager[None]:
    """PDL on for the launches inside, each triggering its dependents at `trigger` (the one
    `set_pdl` chose when None), both switches as they were after: the runner's one-row
    executions of `decode_single_pdl`, warmed up and captured inside, so their graphs keep
    the dependent launches and no other execution's do."""
    if trigger is None:
        return switched(_STATE, pdl=True)
    return switched(_STATE, pdl=True, trigger=_checked_trigger(trigger))


def pdl_mode(
    device: torch.device, requested: bool | None = None, trigger: str | None = None
) -> int:
    """A launch's PDL constexpr: 0 without PDL (`enabled`), else the trigger's code (1 start,
    2 after the wait, 3 at the end): `trigger`, or the process-wide one when None."""
    if not enabled(device, requested):
        return 0
    return PDL_TRIGGERS[str(trigger or _STATE["trigger"])]


def enabled(device: torch.device, requested: bool | None = None) -> bool:
    """Whether a launch on `device` uses PDL: `requested`, or the process-wide switch when it
    is None, and only on a CUDA device of compute capability 9 or newer."""
    if not (_STATE["pdl"] if requested is None else requested) or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _CAPABLE.get(index)
    if capable is None:
        capable = _CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return capable


# where the decode attention warms the next product's weight in L2 (the runner's
# `decode_attention_prefetch`): not at all, before its own loads, after its partials, or
# "auto": after its partials where the weight has at least AUTO_PREFETCH_BYTES (measured on an
# H100, benchmarks/results/2026-12-06-h100-decode-attention-prefetch.jsonl: the 8B shape's 32
# MiB o weight, warmed after the partials, decodes 0.3-1.9% faster at c1-c4 in two runs; the
# 1.7B shape's 8 MiB one within -0.8 / +0.7%, and warmed before the attention's own loads,
# 1-2% slower)
ATTENTION_PREFETCH = {"off": 0, "start": 1, "end": 2, "auto": 2}
AUTO_PREFETCH_BYTES = 16 << 20
_PREFETCH: dict[str, str] = {"attention": "auto"}


def set_attention_prefetch(where: str) -> None:
    """Process-wide, before decode graphs are captured: where each decode attention launch
    prefetches the o projection's weight into L2 (ATTENTION_PREFETCH; "auto" by default)."""
    if where not in ATTENTION_PREFETCH:
        raise ValueError(
            f"attention prefetch must be one of {', '.join(ATTENTION_PREFETCH)}, got {where!r}"
        )
    _PREFETCH["attention"] = where


def attention_prefetch(device: torch.device, weight_bytes: int) -> int:
    """The decode attention's PREFETCH constexpr on `device` for a next weight of
    `weight_bytes`: 0 off (and off the GPU, and under "auto" for a weight below
    AUTO_PREFETCH_BYTES), 1 at the start, 2 after its partials."""
    where = _PREFETCH["attention"]
    if device.type != "cuda" or (where == "auto" and weight_bytes < AUTO_PREFETCH_BYTES):
        return 0
    return ATTENTION_PREFETCH[where]


def prefetch_words(w: torch.Tensor | None) -> torch.Tensor | None:
    """w as a flat int32 view for `prefetch_l2` (None where it cannot be: w absent, empty, not
    contiguous, or of an odd byte count)."""
    if w is None or not w.numel() or not w.is_contiguous() or (w.numel() * w.element_size()) % 4:
        return None
    return w.view(-1).view(torch.int32)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy of it where the elements of its last dimension are not
    adjacent: the kernels step over rows by their strides and over a row's elements one by one.
    The ops tagged `SHARED_STEP_INPUTS` take their inputs as the compiler laid them out (in
    practice contiguous, with any stride on a dimension of size one)."""
    return t if t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def rotary_rows(
    cos: torch.Tensor, sin: torch.Tensor, n: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [n, d] in one layout whose rows a kernel steps over with cos's row stride
    (a single row: any strides)."""
    if tuple(cos.shape) != (n, d) or tuple(sin.shape) != (n, d):
        raise ValueError(
            f"rotary cos/sin must be [{n}, {d}] each, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    cos, sin = unit_stride(cos), unit_stride(sin)
    if n > 1 and sin.stride(0) != cos.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    return cos, sin


def write_tokens_per_program(heads: int, d: int) -> int:
    """Tokens per program of the kernels that move whole [heads, D] rows of a prefill chunk
    (the KV write, the own-keys heads): about 4,096 elements of each tensor per program."""
    return max(1, 4096 // ((1 << max(0, heads - 1).bit_length()) * d))  # heads padded to 2^n


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot`'s input precision for operands of `dtype`: "ieee" for fp32, whose products the
    NVIDIA backend otherwise rounds to TF32 (10-bit mantissas, ~1e-3 relative error, where an
    fp32 execution dtype asks for fp32 arithmetic); None (the backend's default) for bf16 and
    fp16, whose products are exact in either mode."""
    return "ieee" if dtype == torch.float32 else None


COUNTERS_MIN = 1024
_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_OUTGROWN_COUNTERS: list[torch.Tensor] = []  # kept alive: graphs captured earlier point at them


def zeroed_counters(owner: str, device: torch.device, n: int) -> torch.Tensor | None:
    """At least `n` int32 counters on `device` for `owner`'s kernels, all zero between launches
    (the program that counts last resets its counter), allocated once outside any CUDA graph
    capture and reused by every layer and every graph: launches on one stream never overlap,
    and under PDL each waits for the previous grid before touching them. None while a capture
    is under way and the cached buffer is too small. A buffer that a larger launch outgrows
    stays allocated (graphs captured with it replay its address; freed, the allocator could
    hand it to anything while their kernels still count in it)."""
    key = (owner, device)
    have = _COUNTERS.get(key)
    if have is not None and have.numel() >= n:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    size = max(COUNTERS_MIN, 1 << max(0, n - 1).bit_length())
    if have is not None:
        _OUTGROWN_COUNTERS.append(have)
    _COUNTERS[key] = have = torch.zeros(size, dtype=torch.int32, device=device)
    return have
