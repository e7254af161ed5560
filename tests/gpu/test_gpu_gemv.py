"""The register GEMV (prep.components.skinny_gemv) on the GPU in bf16: both forms against the
fp32 product, and a row's result bitwise the same alone, among 16 rows, at any place, replayed
from a CUDA graph or launched eagerly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    "cfg",
    [
        (8, 2048, 8, 1, "cores"),
        (16, 1024, 4, 3, "cores"),
        (8, 2048, 8, 2, "xl1"),
        (16, 1024, 8, 2, "dot"),
        (32, 1024, 8, 1, "dot"),
    ],
    ids=lambda c: f"{c[4]}{c[0]}x{c[1]}k{c[3]}",
)
def test_gemv_forms_match_fp32_and_rows_are_batch_invariant(cfg):
    from prep.components import launch
    from prep.components.skinny_gemv import GemvConfig, gemv_into

    c = GemvConfig(*cfg)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for n, k in [(2048, 2048), (2048, 6144), (1000, 3000)]:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
        y16 = torch.empty(16, n, device=dev, dtype=torch.bfloat16)
        gemv_into(y16, x, w, c)
        want = x.float() @ w.float().T
        err = ((y16.float() - want).norm() / want.norm()).item()
        assert err < 4e-3, (n, k, err)  # the bf16 output's rounding (2^-9 relative at most)
        for r in (0, 5, 15):
            y1 = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
            gemv_into(y1, x[r : r + 1], w, c)
            assert torch.equal(y1[0], y16[r]), (n, k, r)
        # replayed from a graph with changed inputs: the same bits as eager launches
        y4 = torch.empty(4, n, device=dev, dtype=torch.bfloat16)
        x4 = x[:4].clone()
        gemv_into(y4, x4, w, c)  # counters allocated before the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            gemv_into(y4, x4, w, c)
        x4.copy_(x[8:12])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y4, y16[8:12]), (n, k)
    if c.split_k > 1:
        counters = launch.zeroed_counters("skinny_split_k", dev, 1)
        assert counters is not None and not counters.any().item()
