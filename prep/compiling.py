"""Compile settings shared by preparation (which warms the cache) and the runner (which reuses it).

The Inductor cache lives in the bundle. A cached graph is only reusable if the traced shapes
match, and the page count of the KV storage is decided by the daemon's memory plan, not at prep
time, so the page dimension is marked dynamic (the pages only flow into opaque custom ops) while
every other shape stays static: one compiled variant per prepared capacity.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

COMPILE_CACHE_DIR = "compile_cache"
# manifest mode -> which executions run the compiled decoder stack
# "decode-sampling": decode also compiles its sampling and state commit (a second region).
# "forward-sampling": every execution compiled, its decoder stack and its sampling/commit.
# "regional": decode as decode-sampling; prefill runs each decoder layer compiled (one traced
#     layer per layer kind and capacity serves every layer: regional compilation), and prefill
#     and resume sampling compiled. Compiled prefill at a fraction of whole-stack compile time.
FORWARD_MODES = {
    "none": "none",
    "decode-forward": "decode",
    "decode-sampling": "decode+sampling",
    "forward": "all",
    "forward-sampling": "all+sampling",
    "regional": "decode+sampling+layers",
    # every execution through decoder layers compiled once per layer kind and shape (decode
    # without the whole-stack fusion across layers): the quickest compiled bundle to prepare
    "layers": "layers",
}


def compile_cache_env(bundle: Path) -> dict[str, str]:
    cache = bundle / COMPILE_CACHE_DIR
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }


def configure(bundle: Path) -> None:
    """Point Inductor at the bundle's cache and make compilation static per capacity."""
    os.environ.update(compile_cache_env(bundle))
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False
    # the KV pages and pool rows are buffers bound to each layer's modules (regional
    # compilation); their marked-dynamic row dimension must stay dynamic there too
    torch._dynamo.config.force_nn_module_property_static_shapes = False
    torch._dynamo.config.force_parameter_static_shapes = False


def mark_pages_dynamic(pages: list[torch.Tensor]) -> None:
    for t in pages:
        torch._dynamo.mark_dynamic(t, 0)
