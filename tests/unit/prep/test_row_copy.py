"""The one-launch row copy (snapshots, restores, tail pages), run by Triton's interpreter on CPU.

Words are moved, never converted, so copies are asserted bit-exact; skipped pairs (dst equal to
the skip index, or src == dst) and rows not named stay bit-identical.
"""

from __future__ import annotations

import textwrap

from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import row_copy
    from prep.components.row_copy import RowTable

    row_copy.BLOCK_WORDS = 64  # several programs per row at these sizes
    torch.manual_seed(0)
    rows = 9
    tensors = [
        torch.randn(rows, 4, 8, 8),                       # fp32 recurrent matrices
        torch.randn(rows, 12, 3).to(torch.bfloat16),      # bf16 convolution histories
        torch.randint(0, 1 << 40, (rows,)),               # int64 counters
        torch.randn(rows, 6).to(torch.bfloat16),          # 12-byte rows
        torch.randn(rows, 40, 2, 16).to(torch.bfloat16),  # KV-page-shaped rows
    ]
    before = [t.clone() for t in tensors]
    table = RowTable(tensors)
    src = torch.tensor([1, 2, 0, 5, 7])
    dst = torch.tensor([6, 8, 0, 5, 3])  # (0, 0) and (5, 5): padding pairs, skipped
    table.copy(src, dst, skip=0)
    for t, t0 in zip(tensors, before):
        expect = t0.clone()
        expect[6], expect[8], expect[3] = t0[1], t0[2], t0[7]
        assert torch.equal(t.view(rows, -1).view(torch.uint8) if t.dtype != torch.int64 else t,
                           expect.view(rows, -1).view(torch.uint8) if t.dtype != torch.int64 else expect)
    # dst == skip is skipped even when src differs (a NULL_ROW destination writes nothing)
    snap = [t.clone() for t in tensors]
    table.copy(torch.tensor([4]), torch.tensor([0]), skip=0)
    assert all(torch.equal(a, b) for a, b in zip(tensors, snap))
    try:
        RowTable([torch.zeros(3, 3, dtype=torch.bfloat16)])
    except ValueError as exc:
        assert "cannot be copied" in str(exc)
    else:
        raise AssertionError("6-byte rows accepted")
    print("ok")
    """
)


def test_row_copy_interpreted_is_exact():
    run_interpreted(SCRIPT)
