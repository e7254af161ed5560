"""Every Triton kernel of Flare through Triton's compiler front end for an SM90 target, on CPU.

Triton's interpreter runs a kernel as Python, so it accepts code the compiler rejects: a
variable redefined with another type or shape in one branch, a non-constexpr where a constexpr
is needed, a scalar/tensor mix the type checker refuses. The front end (AST -> TTIR) needs no
GPU, so each kernel is lowered here with argument types and constexprs as its launch sites pass
them (the shapes Flare serves: head dims 64-256, bf16 and fp32 data). A kernel that fails here
would fail the prep's warm-up on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from prep.components import (  # noqa: E402
    candidate_draw,
    gdn_triton,
    own_keys,
    row_copy,
    skinny_gemm,
    skinny_gemv,
    triton_attention,
    triton_decode,
    triton_topk,
)

SM90 = GPUTarget("cuda", 90, 32)


def lower(fn, types: dict[str, str], constexprs: dict[str, int], default: str = "i32") -> str:
    """TTIR of `fn`: `types` names pointer / float arguments (others default to i32)."""
    from triton._C.libtriton import ir

    names = fn.arg_names
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = defaults | constexprs  # constexprs a launch leaves at their defaults
    unknown = set(types) | set(constexprs)
    unknown -= set(names)
    assert not unknown, f"{fn.__name__} has no arguments {sorted(unknown)}"
    signature = {
        n: "constexpr" if n in constexprs else types.get(n, default) for n in names
    }  # fmt: skip
    backend = backends["nvidia"].compiler(SM90)
    options = backend.parse_options({})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src = ASTSource(fn, signature=signature, constexprs=constexprs)
    module = src.make_ir(
        SM90, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx
    )
    return str(module)


def _ptrs(dtype: str, *names: str) -> dict[str, str]:
    return {n: f"*{dtype}" for n in names}


def _gemv_case(block_n: int, block_k: int, splits: int, **constexprs: object) -> tuple:
    """The register GEMV over K = 6,144 in `splits` programs per tile of `block_n` rows."""
    return (
        skinny_gemv._gemv_kernel,
        _ptrs("bf16", "X", "W", "Y", "R") | _ptrs("fp32", "P") | _ptrs("i32", "CNT")
        | {"eps": "fp32"},
        {
            "K": 6144, "BLOCK_M": skinny_gemm.MAX_ROWS, "BLOCK_N": block_n, "BLOCK_K": block_k,
            "CHUNKS": 6144 // block_k // splits, "SPLIT_K": splits, "WIDE_W": False, "LINE": 64,
        } | constexprs,
    )  # fmt: skip


# _decode_partial's pointer and float arguments, and the served one-row launch's constexprs
# (a layer's attention from the q|k|v output: new token written, q/k norms, RoPE, merged by the
# last program; 8 KV heads of 128, pages of 64)
DECODE_TYPES = (
    _ptrs("bf16", "Q", "K", "V", "Out", "Kin", "Vin", "QN", "KN", "COS", "SIN")
    | _ptrs("i64", "PT", "LEN", "SLOTS")
    | {"eps_q": "fp32", "eps_k": "fp32"}
    | _ptrs("i32", "CNT", "PF")
    | _ptrs("fp32", "Mx", "Sm", "Acc")
    | {"scale": "fp32"}
)
SERVED_DECODE = {
    "GROUP": 4, "GPAD": 16, "D": 128, "PS": 64, "BLOCK_N": 64,
    "SPLITS": triton_attention.DECODE_SPLITS, "LAST_MERGES": True, "WRITE_KV": True,
    "QK_NORM": True, "ROPE": True,
}  # fmt: skip

CASES = {
    # the sampling's top-k and the candidate draw at the served shape: 151,936 tokens in 38
    # chunks of 4,096, 64 candidates each (stage 2 keeps 4,096 keys in registers)
    "topk_chunks": (
        triton_topk._chunk_topk_kernel,
        _ptrs("fp32", "X", "WANT") | _ptrs("i64", "CAND"),
        {"CHUNK": triton_topk.CHUNK, "KP": 64, "HAS_WANT": 0},
    ),
    "topk_merge": (
        triton_topk._merge_topk_kernel,
        _ptrs("i64", "CAND", "IDX") | _ptrs("fp32", "VALS", "WANT"),
        {"NP": 4096, "KP": 64, "HAS_WANT": 0},
    ),
    # the middle stage (triton_topk.GROUP): 16 chunks' 64 candidates per program
    "topk_groups": (
        triton_topk._group_topk_kernel,
        _ptrs("i64", "CAND", "OUT") | _ptrs("i1", "WANT"),
        {"G": 16, "KP": 64, "HAS_WANT": 1},
    ),
    # the top logprobs' top-k (k = 20) with the rows that asked (bool flags)
    "topk_chunks_want": (
        triton_topk._chunk_topk_kernel,
        _ptrs("fp32", "X") | _ptrs("i64", "CAND") | _ptrs("i1", "WANT"),
        {"CHUNK": triton_topk.CHUNK, "KP": 32, "HAS_WANT": 1},
    ),
    "topk_merge_want": (
        triton_topk._merge_topk_kernel,
        _ptrs("i64", "CAND", "IDX") | _ptrs("fp32", "VALS") | _ptrs("i1", "WANT"),
        {"NP": 2048, "KP": 32, "HAS_WANT": 1},
    ),
    "candidate_draw": (
        candidate_draw._draw_kernel,
        _ptrs("i64", "CAND", "TOKEN", "TOP_K")
        | _ptrs("fp32", "TEMP", "TOP_P", "MIN_P")
        | _ptrs("fp64", "U"),
        {"NP": 4096, "KP": 64},
    ),
    "copy_rows": (
        row_copy._copy_rows_kernel,
        _ptrs("i64", "PTRS", "WORDS", "STRIDE", "SRC", "DST") | {"skip": "i64"},
        {"BLOCK": row_copy.BLOCK_WORDS},
    ),
    **{
        f"scatter_rows_{dt}": (
            row_copy._scatter_rows_kernel,
            _ptrs(dt, "POOL", "VALUES") | _ptrs("i64", "ROWS"),
            {"BLOCK": row_copy.SCATTER_BLOCK},
        )
        for dt in ("fp32", "bf16")
    },
    "gdn_decode": (
        gdn_triton._gdn_decode_kernel,
        _ptrs("bf16", "X", "BETA", "OUT")
        | _ptrs("fp32", "G", "STATE")
        | _ptrs("i64", "ROWS")
        | {"scale": "fp32"},
        {"HK": 16, "HV": 32, "DK": 128, "DV": 128, "BLOCK_V": gdn_triton.BLOCK_V, "NULL": 0},
    ),
    **{
        f"gdn_conv_prefill_{dt}_d{d}": (
            gdn_triton._conv_prefill_kernel,
            _ptrs(dt, "X", "HIST", "W", "Q", "K", "V", "NEW_HIST")
            | _ptrs("i64", "NUM_VALID")
            | {"eps": "fp32"},
            {"KERNEL": 4, "D": d, "BLOCK_T": 16},
        )
        for dt in ("bf16", "fp32")
        for d in (64, 128)
    },
    **{
        f"decode_attention_d{d}_ps{ps}{f'_pdl{int(pdl)}' if pdl else ''}{'_last' if last else ''}"
        f"{'_write' if write else ''}{'_norm' if norm else ''}{'_rope' if rope else ''}": (
            triton_decode._decode_partial,
            DECODE_TYPES,
            {
                "GROUP": 4,
                "GPAD": 16,
                "D": d,
                "PS": ps,
                "BLOCK_N": triton_attention.decode_keys(ps),
                "SPLITS": triton_attention.DECODE_SPLITS,
                "PDL": pdl,
                "LAST_MERGES": last,
                "WRITE_KV": write,
                "QK_NORM": norm,
                "ROPE": rope,
            },
        )
        for d, ps in ((128, 16), (256, 64))
        for pdl, last, write, norm, rope in (
            (False, False, False, False, False),
            (True, False, False, False, False),
            (False, True, False, False, False),
            (True, True, True, False, False),
            (False, False, True, False, False),
            (True, True, True, True, True),
            (False, True, True, False, True),
            (2, True, True, True, True),  # the trigger after the wait
            (3, True, False, False, False),  # the trigger after the key loop
        )
    },
    **{
        f"decode_attention_prefetch{where}_pdl{pdl}": (
            triton_decode._decode_partial,
            DECODE_TYPES,
            SERVED_DECODE | {"PDL": pdl, "PREFETCH": where},
        )
        for where in (1, 2)
        for pdl in (0, 2)
    },
    **{
        f"decode_merge{f'_pdl{int(pdl)}' if pdl else ''}": (
            triton_decode._decode_merge,
            _ptrs("fp32", "Mx", "Sm", "Acc") | _ptrs("bf16", "Out"),
            {"D": 256, "SPLITS": triton_attention.DECODE_SPLITS, "PDL": pdl},
        )
        for pdl in (False, True, 2)
    },
    **{
        f"prefill_attention_d{d}_splits{s}": (
            triton_attention._prefill_kernel,
            _ptrs("bf16", "Q", "K", "V", "Out")
            | _ptrs("fp32", "Mx", "Sm", "Acc")
            | _ptrs("i64", "POS", "PT")
            | {"scale": "fp32"},
            {"GROUP": 4, "GPAD": 4, "D": d, "PS": 16, "BLOCK_M": 32, "BLOCK_N": n, "SPLITS": s},
        )
        for d, n in ((128, 128), (256, 64))
        for s in (1, 2)
    },
    **{
        f"prefill_attention_from_qkv_norm{int(norm)}": (  # q normed and rotated as it loads
            triton_attention._prefill_kernel,
            _ptrs("bf16", "Q", "K", "V", "Out", "QN", "COS", "SIN")
            | _ptrs("fp32", "Mx", "Sm", "Acc")
            | _ptrs("i64", "POS", "PT")
            | {"scale": "fp32", "eps_q": "fp32"},
            {
                "GROUP": 4,
                "GPAD": 4,
                "D": 128,
                "PS": 64,
                "BLOCK_M": 32,
                "BLOCK_N": 128,
                "SPLITS": 1,
                "QK_NORM": norm,
                "ROPE": True,
            },
        )
        for norm in (False, True)
    },
    "prefill_merge": (
        triton_attention._prefill_merge,
        _ptrs("fp32", "Mx", "Sm", "Acc") | _ptrs("bf16", "Out") | _ptrs("i64", "POS"),
        {"D": 256, "BLOCK_M": 32, "BLOCK_N": 64, "SPLITS": 2},
    ),
    **{
        f"write_kv{f'_pdl{int(pdl)}' if pdl else ''}": (
            triton_attention._write_kv_kernel,
            _ptrs("i64", "SLOTS") | _ptrs("bf16", "Kin", "Vin", "K", "V"),
            {"HKV": 8, "HPAD": 8, "PS": 16, "D": 128, "BLOCK_T": 4, "PDL": pdl},
        )
        for pdl in (False, True, 3)
    },
    **{
        f"write_kv_from_qkv_norm{int(norm)}": (  # keys normed and rotated before the store
            triton_attention._write_kv_kernel,
            _ptrs("i64", "SLOTS")
            | _ptrs("bf16", "Kin", "Vin", "K", "V", "KN", "COS", "SIN")
            | {"eps_k": "fp32"},
            {"HKV": 8, "HPAD": 8, "PS": 64, "D": 128, "BLOCK_T": 4, "QK_NORM": norm, "ROPE": True},
        )
        for norm in (False, True)
    },
    **{
        f"own_keys_heads_norm{int(norm)}{'_pdl' if pdl else ''}": (  # prefill_fresh's one launch
            own_keys._own_keys_kernel,
            _ptrs("i64", "SLOTS")
            | _ptrs("bf16", "QKV", "K", "V", "Qout", "Kout", "Vout", "QN", "KN", "COS", "SIN")
            | {"eps_q": "fp32", "eps_k": "fp32"},
            {"HQ": 32, "HQPAD": 32, "HKV": 8, "HKVPAD": 8, "PS": 64, "D": 128}
            | {"BLOCK_T": 1, "NORM": norm, "PDL": 2 if pdl else 0},
        )
        for norm, pdl in ((False, False), (True, True))
    },
    **{
        f"skinny_gemm_prologue{pro}{'_residual' if res else ''}{'_pairs' if pairs else ''}": (
            skinny_gemm._skinny_kernel,
            _ptrs("bf16", "X", "W", "Y", "NW", "R") | {"eps": "fp32"},
            {
                "K": 2048,
                "BLOCK_M": skinny_gemm.MAX_ROWS,
                "BLOCK_N": 32,
                "BLOCK_K": 256,
                "PROLOGUE": pro,
                "RESIDUAL": res,
                "SILU_PAIRS": pairs,
                "PDL": False,
                "PREFETCH_LINES": 0,
                "LINE": 64,
            },
        )
        for pro, res, pairs in (
            (0, False, False),
            (1, False, False),
            (2, True, False),
            (0, True, False),
            (3, False, False),
            (3, False, True),
            (0, False, True),
        )
    },
    **{
        f"skinny_gemm_pdl_prologue{pro}_prefetch{lines}": (
            skinny_gemm._skinny_kernel,
            _ptrs("bf16", "X", "W", "Y", "NW", "R") | {"eps": "fp32"},
            {
                "K": 4096,
                "BLOCK_M": skinny_gemm.MAX_ROWS,
                "BLOCK_N": 32,
                "BLOCK_K": 512,
                "PROLOGUE": pro,
                "RESIDUAL": pro == 0,
                "SILU_PAIRS": False,
                "PDL": True,
                "PREFETCH_LINES": lines,
                "LINE": 64,
            },
        )
        for pro, lines in ((0, 32), (3, 16), (0, 0))
    },
    **{
        f"skinny_gemm_pdl_trigger{mode}": (  # the trigger after the wait / after the K loop
            skinny_gemm._skinny_kernel,
            _ptrs("bf16", "X", "W", "Y", "NW", "R") | {"eps": "fp32"},
            {
                "K": 2048,
                "BLOCK_M": skinny_gemm.MAX_ROWS,
                "BLOCK_N": 16,
                "BLOCK_K": 256,
                "PDL": mode,
                "PREFETCH_LINES": 16,
                "LINE": 64,
            },
        )
        for mode in (2, 3)
    },
    **{
        f"skinny_gemm_split{splits}_prologue{pro}{'_pairs' if pairs else ''}"
        f"{'_pdl' if pdl else ''}": (  # K split over programs, the last one sums the partials
            skinny_gemm._skinny_kernel,
            _ptrs("bf16", "X", "W", "Y", "NW", "R")
            | _ptrs("fp32", "P")
            | _ptrs("i32", "CNT")
            | {"eps": "fp32"},
            {
                "K": 6144,
                "BLOCK_M": skinny_gemm.MAX_ROWS,
                "BLOCK_N": 16,
                "BLOCK_K": 256,
                "PROLOGUE": pro,
                "RESIDUAL": not pairs,
                "SILU_PAIRS": pairs,
                "PDL": pdl,
                "PREFETCH_LINES": 16 if pdl else 0,
                "LINE": 64,
                "SPLIT_K": splits,
                "K_SPLIT": 6144 // splits,
            },
        )
        for splits, pro, pairs, pdl in (
            (4, 0, False, False),
            (2, 3, True, False),
            (8, 0, False, True),
            (3, 2, False, False),
        )
    },
    **{  # the register GEMV's forms, split and not (the partial-sum helper)
        f"skinny_gemv_{form}_k{splits}": _gemv_case(
            16, 1024, splits, FORM=skinny_gemv.FORMS[form], L1_PREFETCH=form == "xl1"
        )
        for form in skinny_gemv.FORMS
        for splits in (1, 3)
    },
    **{  # the GEMV with the folded layers' epilogues (skinny_gemm.tile_epilogue)
        f"skinny_gemv_folded_{name}_k{splits}": _gemv_case(
            8, 2048, splits, PROLOGUE=pro, RESIDUAL=res, SILU_PAIRS=pairs
        )
        for name, pro, res, pairs in (
            ("norm", 3, False, False),
            ("norm_pairs", 3, False, True),
            ("residual", 0, True, False),
        )
        for splits in (1, 3)
    },
    **{  # the GEMV launched with PDL: the first chunk's weights load before the wait
        f"skinny_gemv_pdl{mode}_k{splits}": _gemv_case(
            8, 2048, splits, PDL=mode, PROLOGUE=3 if splits == 1 else 0, RESIDUAL=splits > 1
        )
        for mode in (1, 2, 3)
        for splits in (1, 3)
    },
    "skinny_gemm_wide_w": (  # a vocabulary head whose N * K reaches 2^31: 64-bit row offsets
        skinny_gemm._skinny_kernel,
        _ptrs("bf16", "X", "W", "Y", "NW", "R") | {"eps": "fp32"},
        {
            "K": 8192,
            "BLOCK_M": skinny_gemm.MAX_ROWS,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "PDL": True,
            "PREFETCH_LINES": 8,
            "LINE": 64,
            "WIDE_W": True,
        },
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_lowers_for_sm90(case):
    fn, types, constexprs = CASES[case]
    ttir = lower(fn, types, constexprs)
    assert f"tt.func public @{fn.__name__}" in ttir
    # the PDL trigger and wait (inline PTX in older Triton, TTIR ops in newer), and the L2
    # prefetch when asked for
    trigger = "griddepcontrol.launch_dependents" in ttir or "grid_dependency_launch" in ttir
    wait = "griddepcontrol.wait" in ttir or "grid_dependency_wait" in ttir
    assert trigger == wait == bool(constexprs.get("PDL"))
    if trigger:  # where it triggers the next launch: first (1), after its wait (2), at the end (3)
        # in the kernel's own body (its device functions' bodies follow it in the module)
        start = ttir.index(f"tt.func public @{fn.__name__}")
        end = ttir.find("tt.func", start + 1)
        body = ttir[start : end if end > 0 else len(ttir)]
        pos_t = max(
            body.find(m) for m in ("griddepcontrol.launch_dependents", "grid_dependency_launch")
        )
        pos_w = max(body.find(m) for m in ("griddepcontrol.wait", "grid_dependency_wait"))
        assert pos_t > 0 and pos_w > 0, case
        assert (pos_t < pos_w) == (int(constexprs["PDL"]) == 1), case
        if int(constexprs["PDL"]) == 3 and "scf.for" in body:
            assert pos_t > body.rfind("scf.for"), case  # after the main loop began
        if int(constexprs["PDL"]) == 3 and "._rows_pass" in body:  # the GEMV: after its passes
            ends = [body.find(f".{f}") for f in ("split_tile_sum", "tile_epilogue")]
            assert body.rfind("._rows_pass") < pos_t < min(e for e in ends if e > 0), case
    prefetches = constexprs.get("PREFETCH_LINES", 0) > 0 or constexprs.get("PREFETCH", 0) > 0
    assert ("prefetch.global.L2" in ttir) == prefetches


def test_prefetch_depth_is_the_pipeline_at_most_the_row_as_a_power_of_two():
    cfg = skinny_gemm.TileConfig(32, 512, 4, 4)
    assert skinny_gemm.prefetch_lines(4096, cfg, 2) == 32  # 4 x 512 bf16 = 2048 = 32 lines
    assert skinny_gemm.prefetch_lines(1024, cfg, 2) == 16  # the whole row
    assert skinny_gemm.prefetch_lines(3000, cfg, 2) == 32  # 2048 of 3000: 32 lines
    assert skinny_gemm.prefetch_lines(700, cfg, 4) == 16  # fp32: 32 per line, 21 -> 16
    assert skinny_gemm.prefetch_lines(16, cfg, 2) == 0  # less than a line


def test_the_front_end_rejects_what_the_interpreter_runs():
    """The reason this module exists: a variable redefined with another type in a branch runs in
    the interpreter and fails here (how a convolution kernel once reached the GPU broken)."""

    @triton.jit
    def redefines(X, n, BLOCK: triton.language.constexpr):
        offs = triton.language.arange(0, BLOCK)
        src = offs + 1
        if n > 0:
            src = triton.language.load(X) + offs * 0
        triton.language.store(X + offs, src)

    with pytest.raises(triton.compiler.errors.CompilationError, match="redefines"):
        lower(redefines, {"X": "*i64"}, {"BLOCK": 16})


def test_fp32_operands_multiply_in_fp32_not_tf32():
    """The NVIDIA backend's default dot precision is TF32, which rounds fp32 operands to 10-bit
    mantissas (~1e-3 relative error; the interpreter multiplies exactly, so no interpreted test
    sees it). Every kernel with a dot asks for IEEE products when its data is fp32, and keeps
    the default for bf16 (exact either way)."""
    import torch

    from prep.components.launch import dot_precision

    assert dot_precision(torch.float32) == "ieee"
    assert dot_precision(torch.bfloat16) is None and dot_precision(torch.float16) is None
    for name in (
        "skinny_gemm_prologue0",
        "skinny_gemm_prologue3_pairs",
        "decode_attention_d128_ps16",
        "decode_attention_d128_ps16_pdl1_last_write_norm_rope",
        "prefill_attention_d128_splits2",
    ):
        fn, types, constexprs = CASES[name]
        fp32 = {n: t.replace("bf16", "fp32") for n, t in types.items()}
        ieee = lower(fn, fp32, constexprs | {"DOT_PRECISION": dot_precision(torch.float32)})
        assert "tt.dot" in ieee and "inputPrecision = tf32" not in ieee, name
        assert "inputPrecision = tf32" in lower(fn, types, constexprs), name  # bf16: default


def compile_sm90(fn, types: dict[str, str], constexprs: dict, aligned: set[str], **options):
    """The kernel compiled for SM90 through ptxas (no GPU needed): pointers and `aligned`
    integers specialised as 16-divisible, as a launch with such arguments is. Register and
    spill checks must name the strides the served launch passes 16-divisible: without them the
    front end cannot prove a row's elements contiguous and aligned, loads each through its own
    64-bit address, and the report shows spills the launched kernel does not have (the decode
    attention: 255 registers and ~0.5 KiB of stack, against 128 and none as launched)."""
    from triton.compiler import ASTSource

    names = fn.arg_names
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = defaults | constexprs  # constexprs a launch leaves at their defaults
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and (n in aligned or types.get(n, "").startswith("*"))
    }
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=SM90, options=options)


@pytest.mark.parametrize(
    "n, k",
    [(2048, 2048), (2048, 6144), (4096, 2048), (6144, 4096), (4096, 4096)],
)
def test_split_k_programs_fit_one_wave_as_compiled_for_sm90(n, k):
    """decode_split_k's configuration for each projection shape, compiled for SM90: the
    shared memory the compiler gives a program is what `pipeline_smem_bytes` models (so the
    splits chosen from it are all resident at once), the weight tiles stream through cp.async,
    and the last program reads the partials past L1 after an acquire-release count."""
    import shutil

    from triton.backends.nvidia import compiler as nv

    if not hasattr(nv, "get_ptxas") and shutil.which("ptxas") is None:
        pytest.skip("no ptxas")
    c = skinny_gemm.split_config(n, k, skinny_gemm.tile_config(n, k), 132)
    assert c.split_k > 1
    splits, k_split = skinny_gemm.split_plan(k, c)
    types = _ptrs("bf16", "X", "W", "Y", "NW", "R") | _ptrs("fp32", "P") | _ptrs("i32", "CNT")
    consts = {
        "K": k, "BLOCK_M": skinny_gemm.MAX_ROWS, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
        "PROLOGUE": 0, "RESIDUAL": True, "SILU_PAIRS": False, "PDL": 2, "PREFETCH_LINES": 16,
        "LINE": 64, "DOT_PRECISION": None, "WIDE_W": False, "SPLIT_K": splits,
        "K_SPLIT": k_split,
    }  # fmt: skip
    try:
        kernel = compile_sm90(
            skinny_gemm._skinny_kernel, types | {"eps": "fp32"}, consts,
            {"N", "s_xm", "s_wn", "s_ym", "s_rm"}, num_warps=c.num_warps,
            num_stages=c.num_stages,
        )  # fmt: skip
    except RuntimeError as exc:  # a Triton build without the NVIDIA toolchain
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc))
        raise
    assert kernel.metadata.shared == skinny_gemm.pipeline_smem_bytes(c), c
    ptx = kernel.asm["ptx"]
    assert "cp.async.cg.shared.global" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx
    assert ptx.index("atom.global.gpu.acq_rel.add") < ptx.index("ld.global.cg")


@pytest.mark.parametrize("where", [0, 1, 2])
def test_decode_attention_prefetches_the_next_weight_where_asked(where):
    """PREFETCH 1 / 2 (launch.set_attention_prefetch "start" / "end"), compiled for SM90: the
    L2 prefetches of the next weight are issued before the first key load (1) or after the
    partial's stores and before the merge's count (2); 0 issues none."""
    import shutil

    from triton.backends.nvidia import compiler as nv

    if not hasattr(nv, "get_ptxas") and shutil.which("ptxas") is None:
        pytest.skip("no ptxas")
    consts = SERVED_DECODE | {"PDL": 0, "PREFETCH": where, "DOT_PRECISION": None}
    ptx = compile_sm90(triton_decode._decode_partial, DECODE_TYPES, consts, set(),
                       num_warps=4).asm["ptx"]  # fmt: skip
    body = ptx[ptx.index(".entry") :]
    if where == 0:
        assert "prefetch.global.L2" not in body
        return
    first = body.index("prefetch.global.L2")
    count = body.index("atom.global")  # the merge's count after the partials
    key_load = body.index("cp.async") if "cp.async" in body else body.index("ld.global")
    partial_store = body.rindex("st.global", 0, count)
    if where == 1:
        assert first < key_load
    else:
        assert partial_store < first < count


def test_the_decode_attention_holds_its_values_in_registers():
    """Compiled for SM90 as served (4 warps, 64-key blocks), in 8 warps (`aw8`) and over
    32-key blocks (`ak32`), the launch that writes its token (norms, RoPE, PDL) holds its
    values in registers at the served group sizes (Qwen3-1.7B: 2 query heads a KV head,
    Qwen3-8B: 4): no stack or local memory, and one program's registers fit an SM's. Compiled
    as the launch specialises its strides (all 16-divisible in the served layouts): without
    that, every key and value element is loaded on its own through its own 64-bit address,
    and 4 warps spill ~0.5 KiB a thread."""
    import shutil

    from triton.backends.nvidia import compiler as nv

    if not hasattr(nv, "get_ptxas") and shutil.which("ptxas") is None:
        pytest.skip("no ptxas")
    fn = triton_decode._decode_partial
    strides = {n for n in fn.arg_names if n.startswith("s_")}  # 16-divisible where served
    for group in (2, 4):
        for warps, keys in ((4, 64), (8, 64), (4, 32)):
            built = compile_sm90(
                fn, DECODE_TYPES, SERVED_DECODE | {"GROUP": group, "PDL": 3, "BLOCK_N": keys},
                strides, num_warps=warps,
            )  # fmt: skip
            spilled, regs, usage = _stack_and_registers(built)
            assert spilled == 0, (group, warps, keys, usage)
            assert regs * 32 * warps <= 65536, (group, warps, keys, regs)


def _stack_and_registers(kernel) -> tuple[int, int, str]:
    """(stack bytes, registers, the report) of a kernel compiled for SM90 (cuobjdump)."""
    import re
    import shutil
    import tempfile

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cuobjdump = tools / "cuobjdump" if (tools / "cuobjdump").exists() else shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("no cuobjdump")
    cubin = Path(tempfile.mkdtemp()) / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return stack + local, int(re.search(r"REG:(\d+)", usage).group(1)), usage


@pytest.mark.parametrize(
    "n, k, epilogue",
    [(4096, 2048, "norm"), (2048, 2048, "residual"), (2048, 6144, "residual"),
     (6144, 4096, "norm"), (4096, 4096, "residual")],
)  # fmt: skip
def test_the_served_gemvs_hold_their_values_in_registers(n, k, epilogue):
    """The register GEMV as the one-row steps launch it (gemv_config of the Qwen3-1.7B shape's
    q|k|v with the folded norm, o and down with the residual; the Qwen3-8B shape's q|k|v and
    o; PDL triggered at the end), compiled for SM90: no stack or local memory (a spilled
    GEMV re-reads its weight chunk's registers from L1), a program's registers within an SM's."""
    import shutil

    from triton.backends.nvidia import compiler as nv

    if not hasattr(nv, "get_ptxas") and shutil.which("ptxas") is None:
        pytest.skip("no ptxas")
    cfg = skinny_gemv.gemv_config(n, k)
    assert cfg is not None
    splits, chunks = skinny_gemv.gemv_plan(k, cfg)
    fn, types, consts = _gemv_case(
        cfg.block_n, cfg.block_k, splits, PDL=3, PROLOGUE=3 if epilogue == "norm" else 0,
        RESIDUAL=epilogue == "residual", FORM=skinny_gemv.FORMS[cfg.form],
    )  # fmt: skip
    consts |= {"K": k, "CHUNKS": chunks}
    kernel = compile_sm90(fn, types, consts, {"N", "s_xm", "s_wn", "s_ym", "s_rm"},
                          num_warps=cfg.num_warps, num_stages=1)  # fmt: skip
    spilled, regs, usage = _stack_and_registers(kernel)
    assert spilled == 0, usage
    assert regs * 32 * cfg.num_warps <= 65536, usage


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_the_gemv_loads_its_first_weights_before_its_pdl_wait(mode):
    """With PDL the register GEMV's first weight chunk (nothing writes weights during a step)
    is loaded before the wait for the previous grid, and everything else (x for the folded
    norm's pass and the rows' passes, the residual) after it: in the front end's order and,
    compiled for SM90, in the PTX (ptxas may not move a load across the wait)."""
    import shutil

    from triton.backends.nvidia import compiler as nv

    fn, types, constexprs = CASES[f"skinny_gemv_pdl{mode}_k1"]
    ttir = lower(fn, types, constexprs)
    wait = max(ttir.find(m) for m in ("griddepcontrol.wait", "grid_dependency_wait"))
    loads = [i for i in range(len(ttir)) if ttir.startswith("tt.load", i)]
    assert wait > 0 and len([i for i in loads if i < wait]) == 1, mode  # the weight chunk
    assert len([i for i in loads if i > wait]) >= 3  # the next chunk, x, the residual
    if not hasattr(nv, "get_ptxas") and shutil.which("ptxas") is None:
        pytest.skip("no ptxas")
    ptx = compile_sm90(fn, types, constexprs, {"N", "s_xm", "s_wn", "s_ym", "s_rm"},
                       num_warps=8, num_stages=1).asm["ptx"]  # fmt: skip
    body = ptx[ptx.index(".entry") :]
    assert body.index("ld.global") < body.index("griddepcontrol.wait") < body.rindex("ld.global")


def _jit_functions():
    from prep.components import attention_o, skinny_mlp

    mods = (candidate_draw, gdn_triton, own_keys, row_copy, skinny_gemm, skinny_gemv,
            triton_attention, triton_decode, triton_topk, attention_o, skinny_mlp)  # fmt: skip
    for mod in mods:
        for name, value in vars(mod).items():
            if (
                isinstance(value, triton.runtime.jit.JITFunction)
                and value.__module__ == mod.__name__
            ):
                yield f"{mod.__name__}.{name}", value


def test_device_function_calls_name_every_string_constexpr():
    """A call from one kernel to a device function passes each of the callee's string-valued
    constexprs itself: the Triton the GPU images ship (3.6) does not bind a callee's string
    default as a constexpr ("'str' object has no attribute 'type'" when the kernel compiles),
    while the Triton here does, so neither the interpreter nor the front end above would see it."""
    import ast

    calls, missing = 0, []
    for where, fn in _jit_functions():
        scope = fn.fn.__globals__
        for node in ast.walk(ast.parse(fn.src.lstrip())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            callee = scope.get(node.func.id)
            if not isinstance(callee, triton.runtime.jit.JITFunction):
                continue
            calls += 1
            named = {k.arg for k in node.keywords}
            for p in callee.params[len(node.args) :]:
                if p.name not in named and p.has_default and isinstance(p.default, str):
                    missing.append(f"{where} calls {node.func.id} without its {p.name}")
    assert not missing, missing
    assert calls >= 8  # the decode, prefill and own-keys kernels' calls were seen


OLDEST_TRITON = Path(__file__).resolve().parents[3] / ".venv" / "triton-oldest"
HERE = Path(__file__).resolve().parent
SM90_ELSEWHERE = [  # the one-launch kernels' SM90 compile tests, kept beside their kernels' tests
    f"{HERE / 'test_attention_o.py'}::test_one_launch_as_compiled_for_sm90_holds_its_tiles_without_spills",
    f"{HERE / 'test_skinny_mlp.py'}::test_skinny_mlp_barrier_as_compiled_for_sm90",
]


@pytest.mark.skipif(
    not OLDEST_TRITON.is_dir() or os.environ.get("FLARE_TRITON_FRONT_END") == "oldest",
    reason="no oldest Triton set up beside this one (setup.sh installs it without a GPU)",
)  # fmt: skip
def test_every_kernel_lowers_with_the_oldest_supported_triton_too():
    """This file's lowering tests again under the oldest Triton Flare supports (torch 2.11's,
    what GPU images ship), installed apart from the Triton the interpreter runs: a newer front
    end accepts code the older fails to compile (a device function's string default once broke
    every prefill kernel on the GPU while passing here)."""
    env = dict(os.environ, FLARE_TRITON_FRONT_END="oldest")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(OLDEST_TRITON), env.get("PYTHONPATH")]))
    version = subprocess.run(
        [sys.executable, "-c", "import triton; print(triton.__version__)"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()  # fmt: skip
    installed = {d.name.removesuffix(".dist-info").split("-")[1] for d in OLDEST_TRITON.glob("triton-*.dist-info")}  # fmt: skip
    assert installed == {version}, f"Triton {version} ran, not the one in {OLDEST_TRITON}"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, *SM90_ELSEWHERE],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    tail = run.stdout[-3000:]
    assert run.returncode == 0, f"under Triton {version}:\n{tail}"
    assert " passed" in tail and "failed" not in tail
