"""Prepared paged attention: the one module the dense recipe replaces.

It is installed as a Transformers attention implementation, so projections, q/k norms and RoPE
stay the canonical Transformers code; this function receives rotated q/k/v, writes k/v into
caller-owned pages through an explicit slot mapping, and attends over the request's pages.

Metadata contract (all tensors are static buffers owned by the runner):

    slot_mapping [T] int64   physical slot page*page_size+offset of each query token's k/v;
                             negative (PAD_SLOT) = write nothing (redirected to the trash page)
    q_pos        [T] int64   absolute position of each query token
    q_row        [T] int64   index of the token's request within the batch, 0..B-1
    page_table   [B, P] int64 physical pages of each batch request (NO_PAGE = -1 unused)
    mode         "prefill": B == 1, T tokens of one request; "decode": T == B, one per request

The PyTorch reference below runs everywhere; on CUDA the runner may bind FlashInfer kernels
through `AttentionBackend` with the same contract.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from prep.components import SHARED_STEP_INPUTS

ATTN_IMPLEMENTATION = "flare_paged"


@dataclass
class PagedKVCache:
    """Caller-owned KV storage: per attention layer [num_pages + 1, page_size, kv_heads, head_dim].

    The last page (index num_pages) is the trash page that padding writes go to.
    """

    k_pages: list[torch.Tensor]
    v_pages: list[torch.Tensor]
    page_size: int

    @property
    def trash_page(self) -> int:
        return self.k_pages[0].shape[0] - 1


@dataclass
class AttentionMeta:
    mode: str
    slot_mapping: torch.Tensor
    q_pos: torch.Tensor
    q_row: torch.Tensor
    page_table: torch.Tensor
    cache: PagedKVCache
    layer_slots: dict[int, int]  # Transformers layer_idx -> index into cache lists
    backend: Any = None  # optional accelerated backend with .run(k_pages, v_pages, q, meta, ...)
    extra: dict[str, Any] = field(default_factory=dict)
    seq_lens: torch.Tensor | None = None  # decode: q_pos + 1, computed once for every layer
    # decode: the step runs the one-row execution of a request without a seed (the runner's
    # `decode_single_gemm`); decoder layers may then take products that round differently
    single_row: bool = False
    # prefill: the chunk starts its request's prompt (position 0, no cached prefix), so every
    # key it attends to is its own: the runner's `prefill{C}_fresh` executions (prefill_fresh)
    # attend causally over the chunk's own keys through torch's attention (cuDNN on CUDA)
    fresh: bool = False

    def lengths(self) -> torch.Tensor:
        """Each decode row's length once its token is written (q_pos + 1): the step's own
        tensor where the execution computed it once, else computed here (a traced forward
        would then compute it again for every layer)."""
        return self.seq_lens if self.seq_lens is not None else self.q_pos + 1


@torch.library.custom_op(
    "flare::write_kv", mutates_args=("k_cache", "v_cache"), tags=SHARED_STEP_INPUTS
)
def write_kv_pages(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    key: torch.Tensor, value: torch.Tensor,
) -> None:  # fmt: skip
    """Scatter key/value [T, Hkv, D] into pages [N+1, PS, Hkv, D] at slot_mapping [T].

    An opaque in-place op on purpose: traced as plain index_copy_ on a graph input, the compiler
    functionalises it into a copy of the whole page storage per layer per step.
    """
    trash = (k_cache.shape[0] - 1) * k_cache.shape[1]
    slots = torch.where(slot_mapping >= 0, slot_mapping, trash)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


@write_kv_pages.register_fake
def _(k_cache, v_cache, slot_mapping, key, value):  # type: ignore[no-untyped-def]
    return None


def layer_pages(module: torch.nn.Module, meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """The (k, v) page storage of the attention layer `module`: the buffers `bind_layer_pages`
    attached to it, else a lookup by its layer index (an unbound module, e.g. in a unit test).

    Bound buffers keep the layer index out of traced code: compiled once, one decoder layer's
    code serves every layer (regional compilation) instead of specialising on each index."""
    k = getattr(module, "flare_k_pages", None)
    if k is not None:
        return k, module.flare_v_pages
    layer_idx = getattr(module, "layer_idx", None)
    slot = meta.layer_slots[int(layer_idx)] if layer_idx is not None else 0
    return meta.cache.k_pages[slot], meta.cache.v_pages[slot]


def bind_layer_pages(layers: Any, cache: PagedKVCache, layer_slots: dict[int, int]) -> None:
    """Attach each attention layer's KV pages to its attention module (`self_attn`, the name
    every supported Transformers decoder layer uses) as non-persistent buffers."""
    for idx, slot in layer_slots.items():
        attn = getattr(layers[idx], "self_attn", None)
        if attn is None:
            raise ValueError(f"decoder layer {idx} declares paged attention but has no self_attn")
        attn.register_buffer("flare_k_pages", cache.k_pages[slot], persistent=False)
        attn.register_buffer("flare_v_pages", cache.v_pages[slot], persistent=False)


def write_kv(
    meta: AttentionMeta, k_cache: torch.Tensor, v_cache: torch.Tensor,
    key: torch.Tensor, value: torch.Tensor,
) -> None:  # fmt: skip
    # key/value: [T, Hkv, D]
    writer = getattr(meta.backend, "write", None)
    if writer is not None:
        writer(k_cache, v_cache, meta.slot_mapping, key, value)
    else:
        write_kv_pages(k_cache, v_cache, meta.slot_mapping, key, value)


def cudnn_attention() -> bool:
    """Whether torch can run cuDNN's fused attention here (a build with cuDNN, its attention
    backend on): where `prefill_fresh = "auto"` builds the prefill{C}_fresh executions."""
    return bool(torch.backends.cudnn.is_available() and torch.backends.cuda.cudnn_sdp_enabled())


@torch.library.custom_op("flare::causal_own_keys", mutates_args=())
def causal_own_keys(
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk that starts its prompt over its own keys: q [T, Hq, D],
    key / value [T, Hkv, D] (rotated; any row strides) -> [T, Hq, D]. Query t sees keys 0..t,
    so padding rows past the chunk's tokens (at the end) never reach a real query. On CUDA
    through cuDNN's fused attention (measured 1.3-1.5x the paged prefill kernel on 4,096-token
    chunks, H100: benchmarks/prefill_attention.py --sdpa); elsewhere torch's default."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads = (q[None].transpose(1, 2), key[None].transpose(1, 2), value[None].transpose(1, 2))
    with contextlib.ExitStack() as stack:
        if q.is_cuda:
            stack.enter_context(sdpa_kernel(SDPBackend.CUDNN_ATTENTION))
        out = F.scaled_dot_product_attention(
            *heads, is_causal=True, scale=scale, enable_gqa=q.shape[1] != key.shape[1]
        )
    return out[0].transpose(0, 1).contiguous()


@causal_own_keys.register_fake
def _(q, key, value, scale):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, trash: int) -> torch.Tensor:
    # cache: [N+1, ps, Hkv, D]; pages: [..., P] -> [..., P*ps, Hkv, D]
    safe = torch.where(pages >= 0, pages, trash)
    g = cache[safe]
    return g.reshape(*pages.shape[:-1], -1, *cache.shape[2:])


def reference_attention(
    meta: AttentionMeta,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    query: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """query: [T, Hq, D] -> out [T, Hq, D], attending to pages already holding this step's k/v."""
    trash = cache_k.shape[0] - 1  # the trash page
    t, hq, d = query.shape
    hkv = cache_k.shape[2]
    group = hq // hkv
    qf = query.float().view(t, hkv, group, d)
    if meta.mode == "prefill":
        k = _gather_pages(cache_k, meta.page_table[0], trash).float()  # [L, Hkv, D]
        v = _gather_pages(cache_v, meta.page_table[0], trash).float()
        scores = torch.einsum("thgd,lhd->thgl", qf, k) * scaling  # [T, Hkv, g, L]
    else:
        k = _gather_pages(cache_k, meta.page_table, trash).float()  # [B, L, Hkv, D]
        v = _gather_pages(cache_v, meta.page_table, trash).float()
        k = k[meta.q_row]
        v = v[meta.q_row]
        scores = torch.einsum("thgd,tlhd->thgl", qf, k) * scaling
    length = scores.shape[-1]
    key_pos = torch.arange(length, device=query.device)
    visible = key_pos[None, :] <= meta.q_pos[:, None]  # [T, L]
    if sliding_window is not None:
        visible = visible & (key_pos[None, :] > meta.q_pos[:, None] - sliding_window)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if meta.mode == "prefill":
        out = torch.einsum("thgl,lhd->thgd", probs, v)
    else:
        out = torch.einsum("thgl,tlhd->thgd", probs, v)
    return out.reshape(t, hq, d).to(query.dtype)


def flare_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    flare_meta: AttentionMeta | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention-interface entry point.

    query: [1, Hq, T, D]; key/value: [1, Hkv, T, D] -> ([1, T, Hq, D], None)
    """
    if flare_meta is None:
        raise RuntimeError("flare_paged attention called without flare_meta metadata")
    k_cache, v_cache = layer_pages(module, flare_meta)
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    v = value[0].transpose(0, 1)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    fused = getattr(flare_meta.backend, "write_and_decode", None)
    if fused is not None and flare_meta.mode == "decode" and sliding_window is None:
        return fused(k_cache, v_cache, q, k, v, flare_meta, scale).unsqueeze(0), None
    write_kv(flare_meta, k_cache, v_cache, k, v)
    if flare_meta.fresh and flare_meta.mode == "prefill" and sliding_window is None:
        return causal_own_keys(q, k, v, scale).unsqueeze(0), None
    if flare_meta.backend is not None:
        out = flare_meta.backend.run(k_cache, v_cache, q, flare_meta, scale, sliding_window)
    else:
        out = reference_attention(flare_meta, k_cache, v_cache, q, scale, sliding_window)
    return out.unsqueeze(0), None


def register() -> None:
    """Register the implementation with Transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, flare_paged_attention)
