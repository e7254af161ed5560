"""The one-launch decode MLP (prep.components.skinny_mlp): its two phases through Triton's
interpreter against the canonical MLP, and its grid barrier as compiled for SM90 (the barrier
itself needs every program resident at once, so it runs on a GPU only: tests/gpu)."""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from prep.components.skinny_mlp import MlpConfig, skinny_mlp_into

    torch.manual_seed(0)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def mlp(x, gate_up, down, inter):  # the canonical MLP
        gate, up = F.linear(x, gate_up).split(inter, dim=-1)
        return F.linear(F.silu(gate) * up, down)

    for m, hidden, inter in [(1, 64, 96), (3, 48, 40), (16, 256, 272), (5, 300, 17)]:
        x = torch.randn(m, hidden)
        gate_up, down = torch.randn(2 * inter, hidden) * 0.2, torch.randn(hidden, inter) * 0.2
        y = torch.empty(m, hidden)
        skinny_mlp_into(y, x, gate_up, down, persistent=False)
        want = mlp(x.double(), gate_up.double(), down.double(), inter)
        assert rel(y, want) < 1e-5, (m, hidden, inter, rel(y, want))
        # another program count: other tiles per program, the same arithmetic per row
        y3 = torch.empty(m, hidden)
        skinny_mlp_into(y3, x, gate_up, down, persistent=False, num_programs=3)
        assert torch.equal(y, y3), (m, hidden, inter)
        # down's K split over 2 / 3 items per output tile, summed in split order by the last:
        # the same bits for any program count, within fp32 of the unsplit sum
        for split in (2, 3):
            cfg = MlpConfig(block_n1=32, block_k1=32, block_n2=16, block_k2=16, split2=split)
            ys = [torch.empty(m, hidden) for _ in range(2)]
            for out, p in zip(ys, (None, 5)):
                skinny_mlp_into(out, x, gate_up, down, persistent=False, num_programs=p, cfg=cfg)
            assert torch.equal(ys[0], ys[1]), (m, hidden, inter, split)
            assert rel(ys[0], want) < 1e-5, (m, hidden, inter, split, rel(ys[0], want))
    # a row's result is its own: alone or beside other rows, at any place in the batch
    hidden, inter = 128, 80
    gate_up, down = torch.randn(2 * inter, hidden) * 0.2, torch.randn(hidden, inter) * 0.2
    x = torch.randn(16, hidden)
    ya = torch.empty(16, hidden)
    skinny_mlp_into(ya, x, gate_up, down, persistent=False)
    for i in (0, 7, 15):
        xb = torch.randn(i + 1, hidden) * 4
        xb[i] = x[i]
        yb = torch.empty(i + 1, hidden)
        skinny_mlp_into(yb, xb, gate_up, down, persistent=False)
        assert torch.equal(ya[i], yb[i]), i
    for bad in (
        (torch.randn(17, hidden), gate_up, down),  # more rows than a decode batch
        (torch.randn(2, hidden), gate_up[:-1], down),  # gate|up not 2 I rows
        (torch.randn(2, hidden + 1), gate_up, down),  # x does not fit
    ):
        refused = False
        try:
            skinny_mlp_into(torch.empty(bad[0].shape[0], hidden), *bad, persistent=False)
        except ValueError:
            refused = True
        assert refused
    print("ok")
    """
)


def test_skinny_mlp_phases_interpreted_match_the_canonical_mlp():
    """gate|up, SiLU(gate) * up and down in the kernel's two phases (one launch each here) ==
    the canonical MLP in float64 (fp32 data, 1e-5; the interpreter's bf16 dots are not
    reliable, so bf16 is pinned on the GPU); the same bits for any program count and for a row
    alone or among others; bad shapes refused."""
    run_interpreted(SCRIPT)


def test_skinny_mlp_barrier_as_compiled_for_sm90():
    """The one-launch form for SM90 (Qwen3-1.7B's MLP shape): the weight tiles stream through
    cp.async in both phases; before the barrier each program prefetches its down rows into L2;
    the barrier reads the sense counter with acquire before arriving, arrives with one
    acquire-release add, the last arriver resets the count and advances the sense with a
    release, the others spin on acquire loads; the second phase reads the intermediate past
    L1 (other SMs wrote it)."""
    import shutil

    from test_triton_frontend import _ptrs, compile_sm90
    from triton.backends.nvidia import compiler as nv

    from prep.components import skinny_mlp

    if not hasattr(nv, "get_ptxas") and shutil.which("ptxas") is None:
        pytest.skip("no ptxas")
    c = skinny_mlp.DEFAULT
    consts = {
        "HIDDEN": 2048, "INTER": 6144, "BLOCK_M": 16, "BLOCK_N1": c.block_n1,
        "BLOCK_K1": c.block_k1, "TILES1": 3, "BLOCK_N2": c.block_n2, "BLOCK_K2": c.block_k2,
        "ITEMS2": 3, "PHASE": 0, "SPLIT2": 3, "K_SPLIT2": 2048,
        "PREFETCH_LINES": skinny_mlp.PREFETCH_LINES, "LINE": 64, "DOT_PRECISION": None,
    }  # fmt: skip
    try:
        kernel = compile_sm90(
            skinny_mlp._mlp_kernel, _ptrs("bf16", "X", "WGU", "WD", "H", "Y")
            | _ptrs("i32", "GEN", "CNT", "TCNT") | _ptrs("fp32", "P"), consts,
            {"s_xm", "s_gw", "s_dw", "s_hm", "s_ym"},
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
    except RuntimeError as exc:  # a Triton build without the NVIDIA toolchain
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc))
        raise
    ptx = kernel.asm["ptx"]
    body = ptx[ptx.index(".entry") :]
    arrive = body.index("atom.global.gpu.acq_rel.add")
    first_read = body.index("ld.global.gpu.acquire")
    prefetch = body.index("prefetch.global.L2")
    assert prefetch < first_read < arrive
    assert "atom.global.gpu.relaxed.exch" in body[arrive:]
    ops = ("red.global.gpu.release.add", "atom.global.gpu.release.add")  # Triton 3.9 / 3.6
    release = min(i for i in (body.find(op, arrive) for op in ops) if i >= 0)
    spin = body.index("ld.global.gpu.acquire", arrive)
    assert release < spin or spin > arrive  # the waiters' loads come after their arrival
    assert "cp.async.cg.shared.global" in body[:arrive]  # gate|up's weight stream
    assert "cp.async.cg.shared.global" in body[arrive:]  # down's
    assert "ld.global.cg" in body[arrive:] or "cp.async.cg" in body[arrive:]
    # down's split items: each tile's counter counted with acquire-release after the partial,
    # reset by the last item (the one that sums the partials)
    tile_count = body.index("atom.global.gpu.acq_rel.add", arrive + 1)
    assert "atom.global.gpu.relaxed.exch" in body[tile_count:]


def test_decode_gemm_mlp_routes_decode_rows_of_silu_mlps_to_one_launch(tiny):
    """decode_gemm "mlp" turns on the one-launch MLP of every fused SiLU MLP (and any other
    kind turns it off); CPU tensors and rows beyond a decode batch keep the canonical path,
    so the model's outputs here are unchanged."""
    import torch

    from prep.bundle import read_manifest
    from prep.components.fused import set_decode_gemm
    from prep.model import build_model, load_config

    b = tiny.bundle("qwen3")
    model = build_model(load_config(b), "cpu", torch.float32, read_manifest(b).layout)
    mlps = [layer.mlp for layer in model.model.layers]
    assert not any(mlp.one_launch for mlp in mlps)
    set_decode_gemm(model, "mlp")
    assert all(mlp.one_launch for mlp in mlps)
    x = torch.randn(3, model.config.hidden_size)
    mlp = mlps[0]
    with torch.no_grad():
        torch.nn.init.normal_(mlp.gate_up_proj.weight, std=0.1)
        torch.nn.init.normal_(mlp.down_proj.weight, std=0.1)
        gate, up = torch.nn.functional.linear(x, mlp.gate_up_proj.weight).chunk(2, dim=-1)
        want = torch.nn.functional.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight)
        assert torch.equal(mlp(x), want)  # on CPU: the canonical path
    set_decode_gemm(model, "skinny")
    assert not any(mlp.one_launch for mlp in mlps)


def test_resident_programs_per_sm_follow_registers_shared_memory_and_warps(monkeypatch):
    """The persistent launch's grid never exceeds what every SM holds at once: registers are
    allocated per warp in 256s, each block's shared memory carries the driver's 1 KiB, and
    warps and blocks per SM cap it too (SM90 figures: 64 K registers, 228 KiB, 2,048 threads)."""
    from types import SimpleNamespace

    import torch

    from prep.components import skinny_mlp

    props = SimpleNamespace(
        regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
        max_threads_per_multi_processor=2048, multi_processor_count=132,
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)

    def kernel(n_regs: int, shared: int) -> SimpleNamespace:
        k = SimpleNamespace(n_regs=None, metadata=SimpleNamespace(shared=shared))

        def init() -> None:  # the binary loads lazily; only then is its register count known
            k.n_regs = n_regs

        k._init_handles = init
        return k

    dev = torch.device("cpu")
    assert skinny_mlp.resident_per_sm(kernel(128, 48 * 1024), 4, dev) == 4  # regs and smem: 4
    # 170 registers a thread: 5,440 a warp, allocated as 5,632: 2 blocks (3 unrounded)
    assert skinny_mlp.resident_per_sm(kernel(170, 48 * 1024), 4, dev) == 2
    assert skinny_mlp.resident_per_sm(kernel(64, 100 * 1024), 4, dev) == 2  # shared memory
    assert skinny_mlp.resident_per_sm(kernel(32, 0), 4, dev) == 16  # 2,048 threads of 128
    assert skinny_mlp.resident_per_sm(kernel(32, 0), 1, dev) == 32  # at most 32 blocks
    assert skinny_mlp.resident_per_sm(kernel(255, 230 * 1024), 8, dev) == 0  # does not fit
