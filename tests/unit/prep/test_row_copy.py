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


SCATTER_SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import row_copy
    from prep.components.row_copy import scatter_rows_into
    from prep.components.state_pool import NULL_ROW, scatter_rows

    row_copy.SCATTER_BLOCK = 16  # several programs per row, the last one partial
    torch.manual_seed(0)
    cases = [
        (torch.randn(7, 2, 3, 5), torch.float32),      # recurrent-state rows (30 elements)
        (torch.randn(7, 12, 3).bfloat16(), torch.float32),  # conv rows, fp32 values rounded
        (torch.randint(0, 1 << 40, (7,)), torch.int64),     # consumed counts: 1-element rows
    ]
    rows = torch.tensor([3, NULL_ROW, 1, NULL_ROW, 6])  # padding entries between real ones
    for pool, vdtype in cases:
        values = torch.randn(rows.shape[0], *pool.shape[1:]).to(vdtype) * 100
        got, want = pool.clone(), pool.clone()
        scatter_rows_into(got, rows, values, NULL_ROW)
        scatter_rows(want, rows, values)  # CPU: the indexing path
        assert torch.equal(got, want), pool.dtype
        for r, v in ((3, 0), (1, 2), (6, 4)):
            assert torch.equal(got[r], values[v].to(pool.dtype))
        for r in (0, 2, 4, 5):  # the null row and rows not named stay bit-identical
            assert torch.equal(got[r], pool[r])
    # row-strided values (a transposed history) are gathered, not misread
    pool = torch.zeros(4, 3, 2)
    values = torch.randn(2, 2, 3).transpose(1, 2)  # [2, 3, 2], not contiguous
    scatter_rows_into(pool, torch.tensor([2, 1]), values, NULL_ROW)
    assert torch.equal(pool[2], values[0]) and torch.equal(pool[1], values[1])
    print("ok")
    """
)


def test_row_scatter_interpreted_matches_indexing_path():
    """The one-launch scatter the state pool uses on CUDA writes what the indexing path
    writes, bit for bit, converting values to the pool's dtype; padding entries touch nothing."""
    run_interpreted(SCATTER_SCRIPT)


def test_compiled_layers_share_the_state_rows_instead_of_copying_them_per_layer():
    """`flare::scatter_rows` takes the step's state rows (computed once in the traced step)
    as the compiler stored them: every layer's call reads the same buffer, where the compiler's
    default layout constraint made a copy, recomputed from the request state, per call. The
    pools end as in eager execution."""
    import torch
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from prep.components.state_pool import NULL_ROW, scatter_rows

    layers = 4

    def step(pools: list[torch.Tensor], rows: torch.Tensor, active: torch.Tensor) -> None:
        state_rows = torch.where(active, rows, NULL_ROW)
        for i, pool in enumerate(pools):
            scatter_rows(pool, state_rows, torch.full((rows.shape[0], 3), float(i + 1)))

    rows, active = torch.tensor([2, 5, 1]), torch.tensor([True, False, True])
    want = [torch.zeros(8, 3) for _ in range(layers)]
    step(want, rows, active)
    got = [torch.zeros(8, 3) for _ in range(layers)]
    with inductor_config.patch(force_disable_caches=True):
        _, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), got, rows, active)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    call = code[code.index("def call(") :]
    row_args = {
        part.split(",")[1].strip()
        for part in call.split("torch.ops.flare.scatter_rows.default(")[1:]
    }
    assert len(row_args) == 1, row_args
