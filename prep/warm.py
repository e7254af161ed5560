"""Warm the bundle's compile cache: `python -m prep.warm BUNDLE DEVICE`.

Runs in its own process (the cache location is fixed when torch starts) over a minimal state
(one page per capacity, the largest decode capacity's rows) and exits, taking the compiler's
memory with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from prep.bundle import read_manifest
from prep.calls import auto_prefill_fresh, build_call_specs, with_products
from prep.compiling import FORWARD_MODES, configure, mark_pages_dynamic
from prep.components.fused import (
    FOLDED_ROWS_MAX,
    auto_single_attention,
    auto_single_gemm,
    set_decode_gemm,
    set_single_attention,
)
from prep.components.paged_attention import PagedKVCache
from prep.components.triton_attention import TritonAttentionBackend
from prep.executions import Executions, RequestState
from prep.model import DTYPES, build_model, load_config, load_weights
from prep.rss import peak_rss_bytes


def main(bundle: Path, device_name: str, report: Path | None = None) -> None:
    """Warm every execution of `bundle`; then write this process's peak resident memory (bytes)
    to `report`, where given (prep prints it)."""
    m = read_manifest(bundle)
    device = torch.device(device_name)
    geo, cat = m.geometry, m.catalog
    dtype = DTYPES[m.dtype]
    model = build_model(load_config(bundle), device, dtype, m.layout)
    load_weights(model, [bundle / f for f in sorted({t.file for t in m.tensors})])
    num_pages = 2
    shape = (num_pages + 1, geo.page_size, geo.num_kv_heads, geo.head_dim)
    kv = PagedKVCache(
        [torch.zeros(shape, dtype=dtype, device=device) for _ in geo.attention_layers],
        [torch.zeros(shape, dtype=dtype, device=device) for _ in geo.attention_layers],
        geo.page_size,
    )
    max_pages = -(-cat.max_context_tokens // geo.page_size) + 1
    state = RequestState.allocate(
        max(cat.decode_capacities), geo.vocab_size, geo.hidden_size, max_pages,
        cat.max_stop_token_ids, m.frontend.eos_token_ids, dtype, device,
    )  # fmt: skip
    configure(bundle, device.type)
    mark_pages_dynamic([*kv.k_pages, *kv.v_pages])
    backend = (
        TritonAttentionBackend() if device.type == "cuda" and geo.sliding_window is None else None
    )
    recurrent = None  # the runner's binding (flared.runner.runner): the same traced graphs
    if backend is not None and geo.state_tensors:
        from prep.components.gdn_triton import TritonGDN

        recurrent = TritonGDN()
    single = warm_decode_products(model, device.type)
    ex = Executions(
        model, state, kv, {layer: i for i, layer in enumerate(geo.attention_layers)},
        cat.max_context_tokens, cat.max_top_logprobs, backend,
        compile_forward=FORWARD_MODES[m.compile.mode], recurrent_backend=recurrent,
    )  # fmt: skip
    # what the runner builds by default beside them: prefill{C}_fresh (prefill_fresh = "auto")
    fresh = auto_prefill_fresh(device.type == "cuda", backend is not None)
    specs = build_call_specs(
        ex, cat, device, geo.vocab_size, single_row=single != "none", fresh_prefill=fresh
    )
    for spec in specs:
        with_products(spec.name, spec.fn, single)()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if report is not None:
        report.write_text(str(peak_rss_bytes()))


def warm_decode_products(model: torch.nn.Module, device_type: str) -> str:
    """Set the decode products a daemon with the default engine options runs (decode GEMM
    "skinny", `decode_single_gemm = "auto"`), so the warm-up traces and caches the graphs the
    runner will: on CUDA the weights folded and the one-row executions for requests without a
    seed. -> the single-row kind ("none" elsewhere)."""
    single = auto_single_gemm(device_type == "cuda", "skinny")
    set_decode_gemm(model, "skinny", FOLDED_ROWS_MAX, single)
    set_single_attention(auto_single_attention(device_type == "cuda"))
    return single


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]) if len(sys.argv) > 3 else None)
