"""Compile settings shared by preparation (which warms the cache) and the runner (which reuses it).

The Inductor cache lives in the bundle. A cached graph is only reusable if the traced shapes
match, and the page count of the KV storage is decided by the daemon's memory plan, not at prep
time, so the page dimension is marked dynamic (the pages only flow into opaque custom ops) while
every other shape stays static: one compiled variant per prepared capacity.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from prep.bundle import CompileInfo

COMPILE_CACHE_DIR = "compile_cache"
# Inductor inlines a pointwise expression into each of its readers until the expression holds
# this many ops, then stores it once instead. torch 2.13 raised its CPU limit to 50 (30 on GPUs);
# on the CPU decode graphs, where the reference paged attention's page gathers feed many readers,
# the longer inlined bodies made lowering several times the work: a tiny two-layer model's decode
# compile took 2.5x as long (benchmarks/cpu_compile.py). CPU executions keep the GPU's limit;
# None leaves Inductor's default.
CPU_REALIZE_OPCOUNT: int | None = 30
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


# the modules that register Flare's custom ops (those that need Triton are skipped without it)
OP_MODULES = (
    "prep.components.paged_attention", "prep.components.state_pool", "prep.components.sampling",
    "prep.executions", "prep.components.triton_attention", "prep.components.triton_topk",
    "prep.components.skinny_gemm", "prep.components.skinny_mlp", "prep.components.gdn_triton",
)  # fmt: skip


def ops_fingerprint(ops: Iterable[tuple[str, Iterable[str]]]) -> str:
    """A digest of (op name, its tags) pairs, in any order."""
    text = ";".join(sorted(f"{name}:{','.join(sorted(tags))}" for name, tags in ops))
    return hashlib.sha256(text.encode()).hexdigest()


def flare_ops() -> list[tuple[str, list[str]]]:
    """Every registered `flare::` op with its tags and its schema (an argument added to an op
    changes what compiled code must pass it), after importing OP_MODULES."""
    for module in OP_MODULES:
        with contextlib.suppress(ImportError):  # no Triton: its ops never compile here either
            importlib.import_module(module)
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("flare::")]
    ns = torch.ops.flare
    ops = []
    for n in names:
        op = getattr(ns, n.split("::", 1)[1]).default
        ops.append((n, [str(t) for t in op.tags] + [f"schema={op._schema}"]))
    return ops


class FlareOpsKey(CustomGraphPass):
    """A post-grad pass that changes nothing: its uuid, part of the compile cache's key, names
    Flare's custom ops with their tags and schemas. The key does not otherwise include an op's tags, though
    they change the lowering (`prep.components.SHARED_STEP_INPUTS`): without this a bundle
    compiled before a tag changed would replay its old code (correct, but with the per-layer
    copies the tag removes) instead of compiling anew."""

    _uuid: str | None = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        if FlareOpsKey._uuid is None:
            FlareOpsKey._uuid = "flare-ops-" + ops_fingerprint(flare_ops())
        return FlareOpsKey._uuid


def configure(bundle: Path, device_type: str) -> None:
    """Point Inductor at the bundle's cache and make compilation static per capacity (and, on
    CPU, keep inlined expressions as short as on a GPU: CPU_REALIZE_OPCOUNT)."""
    os.environ.update(compile_cache_env(bundle))
    if device_type == "cpu":
        torch._inductor.config.realize_opcount_threshold = CPU_REALIZE_OPCOUNT
    torch._inductor.config.post_grad_custom_pre_pass = FlareOpsKey()
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.automatic_dynamic_shapes = False
    # the KV pages and pool rows are buffers bound to each layer's modules (regional
    # compilation); their marked-dynamic row dimension must stay dynamic there too
    torch._dynamo.config.force_nn_module_property_static_shapes = False
    torch._dynamo.config.force_parameter_static_shapes = False


def mark_pages_dynamic(pages: list[torch.Tensor]) -> None:
    for t in pages:
        torch._dynamo.mark_dynamic(t, 0)


def cache_mismatch(info: CompileInfo, device_type: str, torch_version: str) -> str | None:
    """Why a compiled bundle's cache will not serve this runner as prep left it (None where it
    will): compiled for another device kind (its executions then run uncompiled), or by another
    torch (Inductor's keys include the version: every execution compiles again at start)."""
    if not info.enabled:
        return None
    if info.device_kind != device_type:
        return (
            f"the bundle was compiled for {info.device_kind}; on {device_type} its executions run "
            f"uncompiled (prep it with --device {device_type} to compile them)"
        )
    if info.torch_version != torch_version:
        return (
            f"the bundle was compiled with torch {info.torch_version} and this is torch "
            f"{torch_version}: its compile cache misses, so this start compiles every execution "
            "again (minutes); prep the bundle with this torch to start fast"
        )
    return None
