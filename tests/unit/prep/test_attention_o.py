"""The one-row decode step's attention and o projection in one launch
(prep.components.attention_o), through Triton's interpreter on CPU: the op against the
attention kernel it extends plus the canonical o projection and residual add, and a runner
whose lone request without a seed takes it while every other step does not."""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

OP_SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import attention_o as ao
    from prep.components import skinny_gemm
    from prep.components import triton_attention as ta

    def paged_row(length, ps, n):
        pt = torch.full((1, -(-length // ps) + 1), -1)
        pt[0, : -(-length // ps)] = torch.randperm(n)[: -(-length // ps)]
        pos = length - 1
        return pt, torch.tensor([length]), (pt[0, pos // ps] * ps + pos % ps).view(1)

    torch.manual_seed(0)
    # GQA 4 / 1 / 2, head dims 32-64, pages of 16 and 64, q/k norms or none; a row of one key,
    # one that opens a key block, one whose blocks outnumber the splits; o outputs that fill
    # the programs' row tiles unevenly (48 over 32 programs: 2 rows each, the last 8 idle)
    cases = [(8, 2, 32, 16, True, 48, 300), (4, 4, 64, 64, False, 96, 1),
             (4, 2, 32, 16, True, 40, 65), (2, 2, 32, 16, True, 64, 16 * 16 * 3 + 5)]
    for hq, hkv, d, ps, norm, n_out, length in cases:
        n = 80
        pt, seq, slots = paged_row(length, ps, n)
        qkv = torch.randn(1, (hq + 2 * hkv) * d)
        qn, kn = (torch.rand(d) + 0.5, torch.rand(d) + 0.5) if norm else (None, None)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        emb = torch.cat([inv, inv]) * (length - 1)
        cos, sin = emb.cos()[None], emb.sin()[None]
        base_k, base_v = torch.randn(n + 1, ps, hkv, d), torch.randn(n + 1, ps, hkv, d)
        w = torch.randn(n_out, hq * d) / (hq * d) ** 0.5
        res = torch.randn(1, n_out)
        k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
        att = ta.decode_attention_from_qkv(qkv, k1, v1, pt, seq, d**-0.5, slots, hq, qn, kn,
                                           1e-6, 1e-6, cos, sin)
        want = res + torch.nn.functional.linear(att.reshape(1, -1), w)
        got = ao.decode_attention_o_from_qkv(qkv, k2, v2, pt, seq, d**-0.5, slots, hq, qn, kn,
                                             1e-6, 1e-6, cos, sin, w, res)
        # the pages bitwise (the same write), the output within fp32 rounding of the sum order
        assert torch.equal(k1, k2) and torch.equal(v1, v2), (hq, hkv, d)
        err = ((got - want).norm() / want.norm()).item()
        assert got.shape == (1, n_out) and err < 1e-6, (hq, hkv, d, err)
        # the q|k|v product in the launch too: x's RMSNorm with its weight folded into wq
        hidden = n_out
        x = torch.randn(1, hidden)
        wq = torch.randn((hq + 2 * hkv) * d, hidden) / hidden**0.5
        qkv = skinny_gemm.folded_reference(x, wq, 1e-5, False, None)
        k3, v3, k4, v4 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
        want = ao.decode_attention_o_from_qkv(qkv, k3, v3, pt, seq, d**-0.5, slots, hq, qn, kn,
                                              1e-6, 1e-6, cos, sin, w, x)
        got = ao.decode_qkv_attention_o(x, wq, 1e-5, k4, v4, pt, seq, d**-0.5, slots, hq, qn,
                                        kn, 1e-6, 1e-6, cos, sin, w)
        assert (k4 - k3).norm() <= 1e-6 * k3.norm() and (v4 - v3).norm() <= 1e-6 * v3.norm()
        err = ((got - want).norm() / want.norm()).item()
        assert got.shape == (1, hidden) and err < 1e-5, (hq, hkv, d, "qkv", err)
    # refused: two rows, an o weight of the wrong width
    pt, seq, slots = paged_row(5, 16, 8)
    qkv = torch.randn(2, 8 * 32)
    k, v = torch.randn(9, 16, 2, 32), torch.randn(9, 16, 2, 32)
    cs = torch.ones(1, 32)
    for bad in ((qkv, torch.randn(48, 4 * 32)), (qkv[:1], torch.randn(48, 3 * 32))):
        try:
            ao.decode_attention_o_from_qkv(bad[0], k, v, pt, seq, 0.1, slots, 4, None, None,
                                           1e-6, 1e-6, cs, cs, bad[1], torch.randn(1, 48))
        except ValueError:
            continue
        raise AssertionError("accepted")
    print("ok")
    """
)


@pytest.mark.slow
def test_attention_and_o_in_one_launch_interpreted_match_the_two_ops():
    """Pages bitwise, output within fp32 rounding: the op is decode_attention_from_qkv, then
    residual + attention @ o^T (interpreted: the two phases as two launches of its kernel)."""
    run_interpreted(OP_SCRIPT, timeout_s=600)


def test_o_tiles_cover_the_outputs_over_the_programs():
    pytest.importorskip("triton")
    from prep.components.attention_o import CHUNK_ELEMENTS, o_tiles

    assert o_tiles(2048, 128, 2048) == (16, CHUNK_ELEMENTS // 16)  # Qwen3-1.7B: 2 chunks
    assert o_tiles(4096, 128, 4096) == (32, CHUNK_ELEMENTS // 32)  # Qwen3-8B: 8 chunks
    assert o_tiles(48, 32, 256) == (2, 256)  # a chunk never wider than K (a power of two)
    assert o_tiles(2560, 128, 2048) == (32, CHUNK_ELEMENTS // 32)  # 20 rows -> 32, 80 programs
    for n, p, k in ((2048, 128, 2048), (5000, 128, 4096), (7, 64, 96)):
        rows, chunk = o_tiles(n, p, k)
        assert rows * p >= n and rows & (rows - 1) == 0 and chunk & (chunk - 1) == 0


RUNNER_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {runner_dir!r})
    from runner_harness import Harness, rel_l2
    from prep.components import attention_o

    def counting(name):  # the op's calls (their rows) recorded in a list
        calls, real = [], getattr(attention_o, name)
        def counted(*args):
            calls.append(args[0].shape[0])
            return real(*args)
        setattr(attention_o, name, counted)
        return calls

    launches = counting("decode_attention_o_from_qkv")
    full = counting("decode_qkv_attention_o")

    bundle = {bundle!r}
    # the switch is process-wide: the reference runner (two launches) first
    ref = Harness(bundle, rows=2)
    tri = Harness(bundle, rows=2, attention_backend="triton", decode_single_gemm="folded",
                  decode_single_attention="one")
    layers = tri.r.model.config.num_hidden_layers
    # row 1: no seed (a lone step runs decode1_single); row 2: seeded
    for h in (tri, ref):
        for row, n, p in ((1, 9, dict(reproducible=False)), (2, 40, dict())):
            prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(row))
            h.admit(row, prompt.tolist(), **p)
            h.prefill(row, 0, n, sample=True)
    for step, (rows, fused) in enumerate([([1], True), ([2], False), ([2, 1], False), ([1], True)]):
        forced = {{r: (step * 13 + r) % 500 + 3 for r in rows}}
        launches.clear()
        tri.decode(rows, forced=forced)
        ref.decode(rows, forced=forced)
        assert launches == ([1] * layers if fused else []), (step, launches)
        for r in rows:
            assert rel_l2(tri.logits(r), ref.logits(r)) < 1e-5, (step, r)
    # switched off, the lone request's step runs the attention and its o product again
    attention_o.set_enabled(False)
    launches.clear()
    tri.decode([1], forced={{1: 7}})
    ref.decode([1], forced={{1: 7}})
    assert launches == [] and rel_l2(tri.logits(1), ref.logits(1)) < 1e-5
    attention_o.set_enabled(True)
    # with the q|k|v product in the launch too
    attention_o.set_qkv(True)
    for step, rows in enumerate([[1], [2, 1], [1]]):
        forced = {{r: (step * 7 + r) % 500 + 3 for r in rows}}
        full.clear()
        launches.clear()
        tri.decode(rows, forced=forced)
        ref.decode(rows, forced=forced)
        assert full == ([1] * layers if rows == [1] else []) and launches == [], (step, full)
        for r in rows:
            assert rel_l2(tri.logits(r), ref.logits(r)) < 1e-5, ("qkv", step, r)
    attention_o.set_qkv(False)
    print("ok")
    """
)


@pytest.mark.slow
def test_a_lone_request_without_a_seed_decodes_through_the_one_launch_interpreted(tiny):
    """A runner with the Triton backend, decode_single_gemm="folded" and
    decode_single_attention="one" (then "qkv", and the switch off): the one-row steps of a
    request without a seed run every layer's attention and o projection as one launch, the
    seeded and two-row steps do not, and all of them decode the reference backend's logits
    (fp32, teacher-forced)."""
    from pathlib import Path

    runner_dir = str(Path(__file__).resolve().parents[1] / "runner")
    bundle = str(tiny.bundle("qwen3", max_context_tokens=128, max_prefill_chunk_tokens=64))
    run_interpreted(RUNNER_SCRIPT.format(runner_dir=runner_dir, bundle=bundle), timeout_s=900)


@pytest.mark.parametrize("with_qkv", [False, True])
@pytest.mark.parametrize("shape", ["qwen3-1.7b", "qwen3-8b"])
def test_one_launch_as_compiled_for_sm90_holds_its_tiles_without_spills(shape, with_qkv):
    """The one-launch form (phase 0) for SM90 at the served shapes (8 KV heads of 128, 16 or 32
    query heads, o 2,048 or 4,096 square), with and without the q|k|v phase: every value stays
    in registers (no local memory; one program of NUM_WARPS warps fits an SM's registers, so
    the 128 programs are resident on 132 SMs), the head barrier's arrival, the merge's count and
    the grid barrier's arrival are acquire-release adds, and what other programs wrote (q|k|v,
    the attention output) is read past L1 after them."""
    import re

    from test_triton_frontend import _ptrs, _stack_and_registers, compile_sm90

    from prep.components import attention_o as ao
    from prep.components.triton_decode import DECODE_SPLITS

    hq, n = (16, 2048) if shape == "qwen3-1.7b" else (32, 4096)
    rows, chunk = ao.o_tiles(n, 8 * DECODE_SPLITS, hq * 128)
    rows_q, chunk_q = ao.o_tiles((hq // 8 + 2) * 128, DECODE_SPLITS, n)
    types = (
        _ptrs("bf16", "Q", "K", "V", "ATT", "Kin", "Vin", "QN", "KN", "COS", "SIN", "W", "R", "Y",
              "X", "WQ", "QKV")
        | _ptrs("i64", "PT", "LEN", "SLOTS") | _ptrs("i32", "CNT", "SYNC", "WW", "HSYNC")
        | _ptrs("fp32", "Mx", "Sm", "Acc")
        | {"scale": "fp32", "eps_q": "fp32", "eps_k": "fp32", "eps_x": "fp32"}
    )  # fmt: skip
    consts = dict(
        GROUP=hq // 8, GPAD=16, D=128, PS=64, BLOCK_N=64, SPLITS=DECODE_SPLITS, QK_NORM=True,
        ROPE=True, DOT_PRECISION=None, KO=hq * 128, ROWS=rows, CHUNK=chunk, PHASE=0, WARM=0,
        WITH_QKV=with_qkv, HKV=8, HIDDEN=n, ROWS_Q=rows_q, CHUNK_Q=chunk_q,
    )  # fmt: skip
    try:
        kernel = compile_sm90(ao._attention_o_kernel, types, consts, set(), num_warps=ao.NUM_WARPS)
    except RuntimeError as exc:  # a Triton build without the NVIDIA toolchain
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc))
        raise
    spilled, regs, usage = _stack_and_registers(kernel)
    assert spilled == 0, usage  # no stack or local memory
    assert regs * 32 * ao.NUM_WARPS <= 65536, regs  # one program fits an SM's registers
    ptx = kernel.asm["ptx"]
    body = ptx[ptx.index(".entry") :]
    adds = [m.start() for m in re.finditer(r"atom\.global\.gpu\.acq_rel\.add", body)]
    # the head's barrier (with the q|k|v phase), the merge's count, the grid barrier's arrival
    assert len(adds) == (3 if with_qkv else 2), len(adds)
    assert "ld.global.cg" in body[adds[-1] :]  # the attention output, written by other SMs
    if with_qkv:  # q, the new key and value: written by the head's other programs
        assert "ld.global.cg" in body[adds[0] : adds[1]]


def test_an_mps_share_scales_the_sms_a_persistent_launch_counts_on(monkeypatch):
    """Under MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE the client's kernels run on that share
    of the SMs while the device reports all of them: a grid barrier counting on all would wait
    forever for programs that cannot start. usable_sms scales the count (unreadable: none)."""
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from prep.components import skinny_mlp

    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(skinny_mlp.torch.cuda, "get_device_properties", lambda d: props)
    dev = skinny_mlp.torch.device("cuda", 0)
    for share, want in (("", 132), ("100", 132), ("50", 66), ("25.5", 33), ("0", 0), ("x", 0)):
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", share)
        assert skinny_mlp.usable_sms(dev) == want, share
