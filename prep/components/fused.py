"""Execution layouts that fuse sibling projections, and the linear layer decode runs through.

Fusing q/k/v (and gate/up) into one weight turns three (two) weight streams per layer into one:
fewer kernels and longer streams, which is what decode at a handful of rows is bound by.

The bundle keeps the checkpoint's tensor names. A fused weight is one parameter, and each
source tensor is loaded straight into its row range (a view), so preparation and loading never
hold a second copy. `weight_targets` is the single map from stored names to destination tensors
used by tensor accounting (prep) and by loading (flared).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from prep.components import launch

try:  # Triton comes with CUDA torch; without it every product is F.linear
    from prep.components import skinny_gemm
except ImportError:  # pragma: no cover - depends on the install
    skinny_gemm = None  # type: ignore[assignment]


class PreparedLinear(nn.Linear):
    """nn.Linear whose decode-sized products (<= 16 rows on CUDA) run the skinny GEMM; every
    other shape (prefill chunks, CPU) is F.linear exactly. `skinny = False` keeps F.linear
    everywhere (the runner's `decode_gemm="cublas"`)."""

    skinny = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.skinny or skinny_gemm is None:
            return nn.functional.linear(x, self.weight, self.bias)
        return skinny_gemm.linear(x, self.weight, self.bias)


DECODE_GEMMS = ("skinny", "fused", "folded", "cublas", "mlp", "gemv")
# the decode rows a skinny product takes (prep.recipes.dense_modules routes no more to it)
FOLDED_ROWS_MAX = 16 if skinny_gemm is None else skinny_gemm.MAX_ROWS


# decode_single_gemm: the products of a decode step that runs one request without a seed
SINGLE_GEMMS = ("none", "folded", "gemv", "folded-gemv")


def set_decode_gemm(
    model: nn.Module, kind: str, folded_rows: int = FOLDED_ROWS_MAX, single: str = "none"
) -> None:
    """ "skinny" (the default), "fused" (skinny, and decode layers that qualify run their norms,
    SiLU * up and residual adds inside the products: prep.recipes.dense_modules; correct but
    measured 2.4x slower on the H200, the prologues stall the weight stream: an experiment, not
    for serving), "folded" (the same four launches per layer over weights with the norms folded
    in and gate|up interleaved, so every product keeps the plain K loop; rewrites those layers'
    weights in place, once), "cublas", or "mlp" (skinny, and each SiLU MLP of decode rows in one
    launch: prep.components.skinny_mlp; level with skinny served, H100), or "gemv" (skinny, with
    the products of at most 8,192 output rows and columns as the GEMV:
    prep.components.skinny_gemv; faster alone at one row, slower at four, H100; a process-wide
    switch), for every PreparedLinear, decoder layer and MLP. With "folded", `folded_rows`
    (1-16) bounds the decode steps that run the folded layers; larger ones run the canonical
    layers over the same folded weights, whose products are the skinny ones (folded measured
    faster at batch 1 and slower at 2 for the Qwen3-8B shape, H100). Below the largest decode
    capacity a row's arithmetic then depends on how many rows its step runs (the folded and the
    skinny layers round differently), so a seeded request's tokens may differ alone and beside
    others: a trade of batch invariance for batch-1 speed, never the default.

    `single` keeps that promise and still takes the faster one-row products where nobody asked
    for it: with kind "skinny", the runner's one-row executions for requests without a seed
    (AttentionMeta.single_row) run "folded" layers (the weights are then folded at load, and
    every other step runs the skinny products over them), "gemv" products (the runner runs
    those executions inside `single_row_products`) or both, "folded-gemv" (the folded layers'
    products as the GEMV with their epilogues where it covers them); "none" adds nothing."""
    if kind not in DECODE_GEMMS:
        raise ValueError(f"unknown decode GEMM {kind!r} (choose {', '.join(DECODE_GEMMS)})")
    if not 1 <= folded_rows <= FOLDED_ROWS_MAX:
        raise ValueError(f"folded_rows must be 1-{FOLDED_ROWS_MAX}, got {folded_rows}")
    if single not in SINGLE_GEMMS:
        raise ValueError(f"unknown single-row GEMM {single!r} (choose {', '.join(SINGLE_GEMMS)})")
    if single != "none" and kind != "skinny":
        raise ValueError(f"single-row GEMM {single!r} needs decode GEMM 'skinny', not {kind!r}")
    single_folded = single in ("folded", "folded-gemv")
    if single_folded:  # folded weights; the folded layers only for single-row executions
        kind, folded_rows = "folded", 0
    for mod in model.modules():
        if isinstance(mod, PreparedLinear):
            mod.skinny = kind != "cublas"
        set_decode = getattr(mod, "_flare_set_decode", None)
        if set_decode is not None:
            set_decode(kind, folded_rows, single_folded=single_folded)
        set_mlp = getattr(mod, "_flare_set_mlp", None)
        if set_mlp is not None:
            set_mlp(kind == "mlp")
    if skinny_gemm is not None:
        skinny_gemm.set_gemv(kind == "gemv")
    if kind == "folded" and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the folding's temporaries, before storage is planned


def auto_single_gemm(cuda: bool, gemm: str) -> str:
    """`decode_single_gemm = "auto"`: "folded-gemv" on CUDA beside decode GEMM "skinny" (served
    on an H100, a lone request without a seed: Qwen3-1.7B shape 1.937 against 2.159 ms, 8B 6.193
    against 6.318), else "none". Prep's compile warm-up prepares the same (prep.warm)."""
    return "folded-gemv" if cuda and gemm == "skinny" else "none"


# decode_single_attention: how the one-row executions above run a layer's attention and o
# projection (prep.components.attention_o; only the folded layers of decode_single_gemm
# "folded" / "folded-gemv" on the Triton attention backend take it): "two" launches (the
# attention, then the o product), "one" (both in one launch with a grid barrier between), or
# "qkv" (the q|k|v product in that launch too)
SINGLE_ATTENTIONS = ("two", "one", "qkv")
# measured on an H100 (benchmarks/results/2026-12-07-h100-attention-o.jsonl): one launch 15.46
# against 14.55 us a 1.7B layer at 640 keys, 27.69 against 25.77 for the 8B; qkv slower too
AUTO_SINGLE_ATTENTION = "two"


def auto_single_attention(cuda: bool) -> str:
    """`decode_single_attention = "auto"`: AUTO_SINGLE_ATTENTION on CUDA, "two" elsewhere
    (prep's compile warm-up sets the same, so the daemon finds its graphs cached)."""
    return AUTO_SINGLE_ATTENTION if cuda else "two"


def set_single_attention(mode: str) -> None:
    """The runner's `decode_single_attention` (SINGLE_ATTENTIONS), process-wide and read when
    a layer is traced or run: set before the runner warms up and captures."""
    if mode not in SINGLE_ATTENTIONS:
        raise ValueError(
            f"unknown single-row attention {mode!r} (choose {', '.join(SINGLE_ATTENTIONS)})"
        )
    try:
        from prep.components import attention_o
    except ImportError:  # pragma: no cover - without Triton there is no one launch to choose
        return
    attention_o.set_enabled(mode != "two")
    attention_o.set_qkv(mode == "qkv")


def single_row_products(single: str) -> contextlib.AbstractContextManager[None]:
    """What a one-row execution for a request without a seed runs inside (set_decode_gemm's
    `single`): for "gemv" and "folded-gemv", `skinny_linear` and `skinny_folded` take the
    register GEMV for the products it covers, read when the product launches (so a CUDA graph
    captured inside keeps it); else nothing."""
    if single in ("gemv", "folded-gemv") and skinny_gemm is not None:
        return skinny_gemm.gemv_products()
    return contextlib.nullcontext()


def set_decode_pdl(enabled: bool, trigger: str | None = None) -> None:
    """Launch the decode kernels (skinny GEMMs, decode attention, KV writes) with programmatic
    dependent launch (SM90 and newer; nothing changes elsewhere): each is scheduled while the
    kernel before it drains, and a skinny GEMM starts streaming its weights then; `trigger`:
    where each lets the next be scheduled (start | after_wait | end; None keeps the current).
    Process-wide (prep.components.launch)."""
    launch.set_pdl(enabled, trigger)


def set_decode_split_k(enabled: bool, device: torch.device | None = None) -> None:
    """Split K over several programs per output tile for decode products with at most 8,192
    output rows (prep.components.skinny_gemm `split_config`): more, shorter weight streams
    where one program per tile leaves SMs idle or unevenly loaded, sized to `device`'s
    multiprocessors (132, an H100's or H200's, off CUDA). Process-wide; set before the runner
    warms up and captures."""
    if skinny_gemm is None:
        return
    sms = 132
    if enabled and device is not None and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    skinny_gemm.set_split_k(enabled, sms)


def prepare_linears(model: nn.Module) -> None:
    """Switch every nn.Linear of the model to PreparedLinear (same parameters, same names)."""
    for mod in model.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = PreparedLinear


def fuse_linears(parts: list[nn.Linear], names: list[str]) -> PreparedLinear:
    """One linear whose output rows are the concatenation of `parts` (same input size and bias
    presence), uninitialised, on the parts' device and dtype. Remembers which rows each source
    tensor fills."""
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        raise ValueError(f"cannot fuse {names}: different input sizes")
    has_bias = [p.bias is not None for p in parts]
    if any(has_bias) and not all(has_bias):
        raise ValueError(f"cannot fuse {names}: only some of them have a bias")
    w = first.weight
    fused = PreparedLinear(
        first.in_features,
        sum(p.out_features for p in parts),
        bias=all(has_bias),
        device=w.device,
        dtype=w.dtype,
    )
    fused.requires_grad_(False)
    ranges: list[tuple[str, int, int]] = []
    start = 0
    for name, p in zip(names, parts, strict=True):
        ranges.append((name, start, start + p.out_features))
        start += p.out_features
    fused._flare_sources = ranges  # type: ignore[assignment]
    return fused


def source_ranges(mod: nn.Module) -> list[tuple[str, int, int]]:
    return list(getattr(mod, "_flare_sources", []))


def weight_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Stored tensor name -> the tensor it is copied into: parameters and persistent buffers by
    their own names, except fused weights, which are addressed by their sources' names (row
    views of the fused parameter). Tied parameters appear under each of their names."""
    targets: dict[str, torch.Tensor] = {}
    fused_params: set[str] = set()
    for prefix, mod in model.named_modules(remove_duplicate=False):
        ranges = source_ranges(mod)
        if not ranges:
            continue
        parent = prefix.rpartition(".")[0]
        for pname in ("weight", "bias"):
            t = getattr(mod, pname, None)
            if t is None:
                continue
            fused_params.add(f"{prefix}.{pname}")
            for src, a, b in ranges:
                targets[f"{parent}.{src}.{pname}" if parent else f"{src}.{pname}"] = t[a:b]
    for name, p in model.named_parameters(remove_duplicate=False):
        if name not in fused_params:
            targets[name] = p
    for name, buf in model.named_buffers(remove_duplicate=False):
        mod_name, _, short = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if short not in getattr(mod, "_non_persistent_buffers_set", set()):
            targets[name] = buf
    return targets
