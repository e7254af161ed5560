"""Shared GPU test steps: prefill prompts through a runner, replay decode steps with changing
inputs, and compare the saved hidden vectors' logits with Transformers in bf16 and fp32."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


def tiny_cuda_bundle(root: Path, model_type: str, overrides: dict[str, Any]) -> tuple[Path, Path]:
    """(checkpoint, bundle): a tiny random checkpoint prepared for CUDA in bf16, uncompiled."""
    from prep.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(root / "ckpt", model_type, config_overrides=overrides)
    bundle = root / "bundle"
    subprocess.run(
        [sys.executable, "-m", "prep", str(ckpt), "--out", str(bundle), "--device", "cuda",
         "--dtype", "bfloat16", "--max-context", "1024", "--prefill-chunk", "256",
         "--page-size", "16", "--no-compile"],
        check=True,
    )  # fmt: skip
    return ckpt, bundle


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 with the reference norm as denominator."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def worst_logits_error(
    r: Any,
    hf: Any,
    hf32: Any,
    prompts: dict[int, list[int]],
    pages: dict[int, list[int]],
    chunk: int,
    decode_steps: int,
    alone: bool = False,
) -> tuple[float, float]:
    """(worst rel L2 of the runner vs fp32 Transformers, worst of bf16 Transformers vs fp32)
    over every decode step; prompts prefill in chunks of at most `chunk` tokens (the state
    carries across chunk boundaries), rows decode together with their sampled tokens.
    `alone`: requests without a seed (RequestParams.reproducible False), each decoding in a
    step of its own (the runner's one-row executions where it built them)."""
    from flared.engine.plan import (
        AdmitOp,
        DecodeOp,
        PageTableWrite,
        PrefillOp,
        RequestParams,
        StepPlan,
    )

    ps = r.page_size
    writes = tuple(PageTableWrite(row, i, p) for row, ids in pages.items()
                   for i, p in enumerate(ids))  # fmt: skip
    # ignore_eos: a row that samples its end of sequence stops generating (its hidden vector
    # stays at the last token it consumed), and comparing it with Transformers on a sequence
    # grown by the finished row's placeholder tokens measures nothing but that (rel L2 ~1.3)
    params = {
        row: RequestParams(seed=row, max_tokens=50, reproducible=not alone, ignore_eos=True)
        for row in prompts
    }
    admits = tuple(AdmitOp(f"r{row}", row, tuple(p), params[row])
                   for row, p in prompts.items())  # fmt: skip
    step = 0
    seqs: dict[int, list[int]] = {}
    for row, prompt in prompts.items():
        for a in range(0, len(prompt), chunk):
            b = min(a + chunk, len(prompt))
            slots = tuple(pages[row][i // ps] * ps + i % ps for i in range(a, b))
            first = step == 0
            res = r.execute(StepPlan(step, writes if first else (), admits if first else (),
                                     prefill=PrefillOp(f"r{row}", row, tuple(prompt[a:b]), a,
                                                       slots, b == len(prompt))))  # fmt: skip
            step += 1
        seqs[row] = [*prompt, res.prefilled.token_id]
    worst16, worst = 0.0, 0.0
    batches = [(row,) for row in prompts] if alone else [tuple(prompts)]
    for _, rows in itertools.product(range(decode_steps), batches):  # changing inputs
        res = r.execute(StepPlan(step, decode=DecodeOp(rows, tuple(f"r{x}" for x in rows))))
        step += 1
        for row in rows:
            mine = r.ex.lm_head(r.state.hidden[row : row + 1]).float()[0]
            with torch.no_grad():
                ids = torch.tensor([seqs[row]], device="cuda")
                ref16 = hf(ids).logits[0, -1].float()
                ref32 = hf32(ids).logits[0, -1]
            worst16 = max(worst16, rel_l2(ref16, ref32))
            worst = max(worst, rel_l2(mine, ref32))
        for tok in res.decoded:
            assert tok.valid, tok  # every compared row still generating
            seqs[tok.row].append(tok.token_id)
    return worst, worst16
