"""Drive a ModelRunner directly with hand-written plans (no scheduler), for exact tests."""

from __future__ import annotations

import itertools

import torch

from flared.engine.plan import AdmitOp, DecodeOp, PageTableWrite, PrefillOp, RequestParams, StepPlan
from flared.runner.runner import ModelRunner, RunnerPlan


class Harness:
    def __init__(self, bundle, num_pages: int = 96, rows: int = 8, **kw) -> None:
        self.r = ModelRunner(
            bundle,
            RunnerPlan(
                "cpu",
                num_pages,
                rows,
                compile=kw.get("compile", False),
                cuda_graphs=False,
                num_snapshot_rows=kw.get("snapshots", 0),
                attention_backend=kw.get("attention_backend", "reference"),
                decode_gemm=kw.get("decode_gemm", "skinny"),
                decode_folded_rows=kw.get("decode_folded_rows", 16),
                decode_single_gemm=kw.get("decode_single_gemm", "none"),
                decode_single_attention=kw.get("decode_single_attention", "two"),
                prefill_fresh=kw.get("prefill_fresh", False),
            ),
        )
        self.ps = self.r.page_size
        self.steps = itertools.count()
        self.free_pages = list(range(num_pages))[::-1]
        self.pages: dict[int, list[int]] = {}
        self.seq: dict[int, list[int]] = {}

    def _grow(self, row: int, upto_pos: int) -> tuple[PageTableWrite, ...]:
        have = self.pages.setdefault(row, [])
        writes = []
        while len(have) * self.ps <= upto_pos:
            p = self.free_pages.pop()
            writes.append(PageTableWrite(row, len(have), p))
            have.append(p)
        return tuple(writes)

    def release(self, row: int) -> None:
        writes = tuple(PageTableWrite(row, i, -1) for i in range(len(self.pages.get(row, []))))
        self.free_pages.extend(self.pages.pop(row, []))
        self.r.execute(StepPlan(next(self.steps), page_table_writes=writes))

    def admit(self, row: int, prompt: list[int], **params) -> None:
        p = RequestParams(**{"seed": row, "max_tokens": 1000, **params})
        self.seq[row] = list(prompt)
        self.r.execute(
            StepPlan(next(self.steps), admits=(AdmitOp(f"r{row}", row, tuple(prompt), p),))
        )

    def prefill(self, row: int, start: int, n: int, sample: bool):
        toks = self.seq[row][start : start + n]
        writes = self._grow(row, start + n)
        slots = tuple(
            self.pages[row][q // self.ps] * self.ps + q % self.ps for q in range(start, start + n)
        )
        res = self.r.execute(StepPlan(next(self.steps), page_table_writes=writes,
                                      prefill=PrefillOp(f"r{row}", row, tuple(toks), start, slots, sample)))  # fmt: skip
        if sample:
            self.seq[row].append(res.prefilled.token_id)
        return res

    def decode(self, rows: list[int], forced: dict[int, int] | None = None):
        """One decode step; `forced` overwrites pending tokens first (teacher forcing)."""
        writes: tuple = ()
        for row in rows:
            writes += self._grow(row, len(self.seq[row]))
            if forced and row in forced:
                self.r.state.pending[row] = forced[row]
                self.seq[row][-1] = forced[row]
        res = self.r.execute(StepPlan(next(self.steps), page_table_writes=writes,
                                      decode=DecodeOp(tuple(rows), tuple(f"r{r}" for r in rows))))  # fmt: skip
        for tok in res.decoded:
            if tok.valid:
                self.seq[tok.row].append(tok.token_id)
        return res

    def logits(self, row: int) -> torch.Tensor:
        """Logits of the last consumed token of `row`, from its saved final hidden vector."""
        return self.r.ex.lm_head(self.r.state.hidden[row : row + 1]).float()[0]


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def check_fresh_routing(h: Harness, hf, monkeypatch, rows=(2, 3, 4)) -> None:  # type: ignore[no-untyped-def]
    """A runner built with prefill_fresh (FRESH_MIN_TOKENS at its prefill capacity of 128):
    chunks of 120 and 126 tokens from position 0 take prefill128_fresh, one of 100 the paged
    prefill128. Counted at run time, the own-keys attention calls torch's fused attention once
    per layer, the paged path never (compiled, each execution must keep its own version of the
    decoder code it shares with the other); every chunk's logits match Transformers (1e-5)."""
    import torch.nn.functional as F

    fused_calls = []
    sdpa = F.scaled_dot_product_attention

    def counted(*a, **kw):  # type: ignore[no-untyped-def]
        fused_calls.append(1)
        return sdpa(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    layers = len(h.r.model.base_model.layers)
    for row, n, fresh in zip(rows, (120, 100, 126), (True, False, True), strict=True):
        prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(row)).tolist()
        h.admit(row, prompt)
        fused_calls.clear()
        h.prefill(row, 0, n, sample=False)
        assert len(fused_calls) == (layers if fresh else 0), (row, len(fused_calls))
        assert rel_l2(h.logits(row), reference_logits(hf, prompt)[-1]) < 1e-5, row
