"""The one-row decode step's attention and o projection in one launch
(prep.components.attention_o) on the GPU in bf16: against its two phases launched apart
(bitwise), against the attention op and the o product it replaces (bf16 rounding), and
replayed from a CUDA graph with new inputs (bitwise the eager launch)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PS = 64


def _inputs(g, hq: int, hkv: int, d: int, hidden: int, ctx: int, pages: int = 80) -> dict:
    bf = torch.bfloat16
    table = torch.randperm(pages, generator=g, device="cuda")[:72].view(1, 72).int()
    pos = ctx - 1
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([inv, inv]) * pos

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(bf)

    return dict(
        qkv=rnd(1, (hq + 2 * hkv) * d), k=rnd(pages + 1, PS, hkv, d), v=rnd(pages + 1, PS, hkv, d),
        table=table, lens=torch.tensor([ctx], dtype=torch.int32, device="cuda"),
        slot=(table[0, pos // PS].long() * PS + pos % PS).view(1),
        qn=(torch.rand(d, generator=g, device="cuda") + 0.5).to(bf),
        kn=(torch.rand(d, generator=g, device="cuda") + 0.5).to(bf),
        cos=emb.cos()[None].to(bf), sin=emb.sin()[None].to(bf),
        w=rnd(hidden, hq * d) / (hq * d) ** 0.5, res=rnd(1, hidden),
        wq=rnd((hq + 2 * hkv) * d, hidden) / hidden**0.5,
    )  # fmt: skip


def _full(x: dict, hq: int) -> torch.Tensor:
    """The q|k|v product, attention and o product of the layer input x["res"] in one launch."""
    from prep.components.attention_o import decode_qkv_attention_o

    return decode_qkv_attention_o(
        x["res"], x["wq"], 1e-6, x["k"], x["v"], x["table"], x["lens"], 0.088, x["slot"], hq,
        x["qn"], x["kn"], 1e-6, 1e-6, x["cos"], x["sin"], x["w"],
    )  # fmt: skip


def _one(x: dict, hq: int) -> torch.Tensor:
    from prep.components.attention_o import decode_attention_o_from_qkv

    return decode_attention_o_from_qkv(
        x["qkv"], x["k"], x["v"], x["table"], x["lens"], 0.088, x["slot"], hq, x["qn"], x["kn"],
        1e-6, 1e-6, x["cos"], x["sin"], x["w"], x["res"],
    )  # fmt: skip


@pytest.mark.parametrize("shape", [(16, 8, 128, 2048), (32, 8, 128, 4096)])
def test_one_launch_matches_its_phases_and_the_two_ops_in_bf16_and_replays(shape, monkeypatch):
    """Qwen3-1.7B's and Qwen3-8B's attention and o shapes, rows of 1-4,100 keys: the one
    launch is resident (128 programs) and bitwise its two phases launched apart; the pages it
    writes are bitwise decode_attention_from_qkv's and its output within bf16 rounding of that
    op's attention through the o product plus the residual; a CUDA graph of it replayed with
    another row's inputs copied in is bitwise the eager launch on them."""
    from prep.components import attention_o as ao
    from prep.components.triton_decode import DECODE_SPLITS, decode_attention_from_qkv

    hq, hkv, d, hidden = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    for ctx in (1, 65, 640, 4100):
        x = _inputs(g, hq, hkv, d, hidden, ctx)
        k0, v0 = x["k"].clone(), x["v"].clone()
        got = _one(x, hq)
        assert ao._RESIDENT and all(  # the one launch ran: every program resident at once
            n * torch.cuda.get_device_properties(0).multi_processor_count >= hkv * DECODE_SPLITS
            for n in ao._RESIDENT.values()
        )
        k1, v1 = x["k"].clone(), x["v"].clone()
        x["k"], x["v"] = k0.clone(), v0.clone()
        with monkeypatch.context() as m:
            m.setattr(ao, "_fits", lambda *a: False)
            phases = _one(x, hq)
        assert torch.equal(got, phases) and torch.equal(x["k"], k1) and torch.equal(x["v"], v1)
        x["k"], x["v"] = k0.clone(), v0.clone()
        att = decode_attention_from_qkv(
            x["qkv"], x["k"], x["v"], x["table"], x["lens"], 0.088, x["slot"], hq, x["qn"],
            x["kn"], 1e-6, 1e-6, x["cos"], x["sin"],
        )  # fmt: skip
        assert torch.equal(x["k"], k1) and torch.equal(x["v"], v1)
        want = (x["res"].float() + att.view(1, -1).float() @ x["w"].float().T).to(torch.bfloat16)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"shape {shape} ctx {ctx}: rel L2 vs the two ops {err:.1e}")
        assert err < 1e-2, (ctx, err)
        # the q|k|v product in the launch too, against the folded GEMV and then the op above;
        # its phases apart bitwise
        from prep.components import skinny_gemm

        x["k"], x["v"] = k0.clone(), v0.clone()
        with skinny_gemm.gemv_products():
            qkv = skinny_gemm.skinny_folded(x["res"], x["wq"], True, 1e-6, False, None)
        want = _one({**x, "qkv": qkv}, hq)
        x["k"], x["v"] = k0.clone(), v0.clone()
        full = _full(x, hq)
        x["k"], x["v"] = k0.clone(), v0.clone()
        with monkeypatch.context() as m:
            m.setattr(ao, "_fits", lambda *a: False)
            assert torch.equal(_full(x, hq), full), ctx
        err = ((full.float() - want.float()).norm() / want.float().norm()).item()
        print(f"shape {shape} ctx {ctx}: q|k|v in the launch, rel L2 vs the GEMV's {err:.1e}")
        assert err < 1e-2, (ctx, err)
    # a graph captured on one row's buffers, replayed after another row's inputs are copied in
    # (with and without the q|k|v product in the launch)
    for op in (_one, _full):
        x = _inputs(g, hq, hkv, d, hidden, 700)
        op(x, hq)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(x, hq)
        for ctx in (1300, 9, 700):
            new = _inputs(g, hq, hkv, d, hidden, ctx)
            eager_k, eager_v = new["k"].clone(), new["v"].clone()
            want = op({**new, "k": eager_k, "v": eager_v}, hq)
            for name, t in new.items():
                x[name].copy_(t)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want) and torch.equal(x["k"], eager_k), (op.__name__, ctx)
