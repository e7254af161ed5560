"""The catalog as callables: one static-input closure per prepared execution.

Shared by preparation (to warm the compile cache) and by the daemon's runner (to compile and
capture). Each spec owns its static device inputs and, for sampling executions, its device
completion record.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from prep.bundle import Catalog
from prep.components import launch
from prep.components.fused import single_row_products
from prep.executions import INT_PARAMS, Completion, Executions

# page-table writes per call: at least a whole admission (a full-context prompt's pages plus
# one), so a step stages them once instead of replaying a small call many times
MIN_PAGE_WRITE_CAPACITY = 64
# decode{b}_lean: the decode execution for batches whose live rows all sample from their
# candidates (prep.components.sampling: top-k on and at most CANDIDATES), without the sort over
# the vocabulary that decode{b} runs for the others
LEAN_SUFFIX = "_lean"
# decode1{,_lean}_single: the one-row decode executions for a request without a seed, built
# when the runner's `decode_single_gemm` asks for them (AttentionMeta.single_row)
SINGLE_SUFFIX = "_single"
# prefill{C}_fresh: the prefill execution for a chunk that starts its prompt, whose attention
# runs over the chunk's own keys (AttentionMeta.fresh), built for capacities of at least
# FRESH_MIN_TOKENS when the runner's `prefill_fresh` asks (below, the attention is too small
# a part of the chunk for the heads' extra pass to pay: the 1.7B shape's 2,048-token chunk
# still attends faster through the paged kernel, H100, README)
FRESH_SUFFIX = "_fresh"
FRESH_MIN_TOKENS = 2048
# the sample that follows a prompt's last prefill chunk (a prefill execution samples nothing):
# `resume` over that one row, with completion records of its own (a step may also resume other
# rows), and its _lean twin for a row that samples from its candidates
FINAL_SAMPLE = "final_sample"


def fresh_chunk_min(capacity: int) -> int:
    """The fewest tokens a chunk that starts its prompt needs to take prefill{capacity}_fresh:
    7/8 of the capacity (the fused attention runs the whole padded capacity, the paged kernel
    only the chunk's tokens)."""
    return capacity - capacity // 8


def auto_prefill_fresh(cuda: bool, triton_backend: bool) -> bool:
    """`prefill_fresh = "auto"`: on with CUDA, the Triton attention backend and cuDNN's fused
    attention (measured faster than the paged kernel on SM90: README); the runner's plan and
    prep's warm-up follow this one rule."""
    from prep.components.paged_attention import cudnn_attention

    return cuda and triton_backend and cudnn_attention()


PAGE_COPY_CAPACITY = 8  # page copies per call (checkpoint tail pages); padding = trash→trash
STATE_OP_CAPACITY = 8  # rows per state-maintenance call; unused entries are NULL_ROW (0)


@dataclass
class CallSpec:
    name: str
    fn: Callable[[], None]
    inputs: dict[str, torch.Tensor]
    completion: Completion | None


def with_products(
    name: str, fn: Callable[[], None], single: str, pdl: bool = False, trigger: str | None = None
) -> Callable[[], None]:
    """fn as execution `name` runs: a one-row execution for requests without a seed inside the
    products of `single` (fused.single_row_products, read when each product launches, so its
    warm-up and a CUDA graph captured inside keep them) and, with `pdl`, with its Flare kernels
    launched with programmatic dependent launch, each triggering its dependents at `trigger`
    (launch.pdl_launches, read the same way; the runner's `decode_single_pdl` and
    `decode_single_pdl_trigger`); every other execution as it is."""
    if not name.endswith(SINGLE_SUFFIX):
        return fn

    def run() -> None:
        with single_row_products(single), launch.pdl_launches(trigger) if pdl else nullcontext():
            fn()

    return run


def build_call_specs(
    ex: Executions, catalog: Catalog, device: torch.device, vocab_size: int,
    single_row: bool = False, fresh_prefill: bool = False,
) -> list[CallSpec]:  # fmt: skip
    """The catalog's executions; `single_row` adds decode1_single and decode1_lean_single
    (where the catalog has decode capacity 1), `fresh_prefill` prefill{C}_fresh for every
    prefill capacity C of at least FRESH_MIN_TOKENS."""
    k = max(catalog.max_top_logprobs, 1)
    mask_words = -(-vocab_size // 32)

    def all_allowed(n: int) -> torch.Tensor:
        return torch.full((n, mask_words), -1, dtype=torch.int32, device=device)

    def i64(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.int64, device=device)

    specs: list[CallSpec] = []
    for b in catalog.decode_capacities:
        variants = [("", "both", False), (LEAN_SUFFIX, "candidates", False)]
        if single_row and b == 1:
            variants += [(s + SINGLE_SUFFIX, p, True) for s, p, _ in variants]
        for suffix, paths, single in variants:
            out = Completion.allocate(b, k, device)
            inp = {"rows": i64(b), "mask": all_allowed(b)}

            def decode(
                inp: dict[str, torch.Tensor] = inp, out: Completion = out, paths: str = paths,
                single: bool = single,
            ) -> None:  # fmt: skip
                ex.decode(inp["rows"], out, inp["mask"], paths, single)

            specs.append(CallSpec(f"decode{b}{suffix}", decode, inp, out))
        # resume{b}{,_lean} (sampling from a saved hidden vector) before admit: warm-up runs
        # in list order, and the warm admit (row 0, zeros) leaves row 0 with temperature 0
        # until reset
        specs += [_resume_spec(ex, f"resume{b}{s}", b, p, k, all_allowed, i64, device)
                  for s, p in (("", "both"), (LEAN_SUFFIX, "candidates"))]  # fmt: skip
    specs += [_resume_spec(ex, FINAL_SAMPLE + s, 1, p, k, all_allowed, i64, device)
              for s, p in (("", "both"), (LEAN_SUFFIX, "candidates"))]  # fmt: skip
    for c in catalog.prefill_capacities:
        for suffix, fresh in [("", False)] + [(FRESH_SUFFIX, True)] * (
            fresh_prefill and c >= FRESH_MIN_TOKENS
        ):
            inp = {
                "tokens": i64(c), "positions": i64(c), "slots": i64(c), "row": i64(1),
                "num_valid": i64(1),
            }  # fmt: skip
            inp["slots"].fill_(-1)

            def prefill(inp: dict[str, torch.Tensor] = inp, fresh: bool = fresh) -> None:
                ex.prefill(
                    inp["tokens"], inp["positions"], inp["slots"], inp["row"], inp["num_valid"],
                    fresh,
                )  # fmt: skip

            specs.append(CallSpec(f"prefill{c}{suffix}", prefill, inp, None))
    # the prompt last and -1 (no token) beyond the prompt: a runner may upload only the
    # packed inputs up to the end of the longest prompt the device buffer still holds
    ainp = {
        "row": i64(1), "fparams": torch.zeros(6, dtype=torch.float32, device=device),
        "iparams": i64(len(INT_PARAMS)), "stop_ids": i64(max(catalog.max_stop_token_ids, 1)),
        "prompt": torch.full((catalog.max_context_tokens,), -1, dtype=torch.int64, device=device),
    }  # fmt: skip

    def admit() -> None:
        ex.admit(ainp["row"], ainp["prompt"], ainp["fparams"], ainp["iparams"], ainp["stop_ids"])

    specs.append(CallSpec("admit", admit, ainp, None))
    page_writes = max(
        MIN_PAGE_WRITE_CAPACITY, -(-catalog.max_context_tokens // ex.kv.page_size) + 2
    )
    pinp = {n: i64(page_writes) for n in ("rows", "index", "pages")}

    def pages() -> None:
        ex.write_pages(pinp["rows"], pinp["index"], pinp["pages"])

    specs.append(CallSpec("pages", pages, pinp, None))
    trash = ex.kv.trash_page
    cinp = {n: torch.full((PAGE_COPY_CAPACITY,), trash, dtype=torch.int64, device=device)
            for n in ("src", "dst")}  # fmt: skip

    def copy_pages() -> None:
        ex.copy_pages(cinp["src"], cinp["dst"])

    specs.append(CallSpec("copy_pages", copy_pages, cinp, None))
    if ex.pool is not None:
        specs.extend(_state_specs(ex, i64))
    specs.append(_admission_spec(ex, ainp, page_writes, device))
    return specs


def _resume_spec(
    ex: Executions, name: str, b: int, paths: str, k: int,
    all_allowed: Callable[[int], torch.Tensor], i64: Callable[..., torch.Tensor],
    device: torch.device,
) -> CallSpec:  # fmt: skip
    """`resume` over b rows as the execution `name`, sampling by `paths`."""
    out = Completion.allocate(b, k, device)
    inp = {"rows": i64(b), "mask": all_allowed(b)}

    def resume() -> None:
        ex.resume(inp["rows"], out, inp["mask"], paths)

    return CallSpec(name, resume, inp, out)


def _admission_spec(
    ex: Executions, like: dict[str, torch.Tensor], page_writes: int, device: torch.device
) -> CallSpec:
    """One request's whole admission as one execution: page-table writes, the admit, the
    recurrent state's initialisation or the restore of a checkpoint into the row, and the
    restored tail page's copy. The same operations as `pages`, `admit`, `state_init` /
    `state_restore` and `copy_pages` in that order, staged with one upload and run as one
    replay (an agent's next turn is admitted this way). Padding as in those calls: writes
    (NULL_ROW, 0, -1), init / restore rows NULL_ROW, copies trash -> trash."""
    inp = {name: t.clone() for name, t in like.items() if name != "prompt"}  # the admit's
    for name, n, fill in (
        ("write_rows", page_writes, 0), ("write_index", page_writes, 0),
        ("write_pages", page_writes, -1), ("init_row", 1, 0), ("restore_src", 1, 0),
        ("restore_dst", 1, 0), ("copy_src", 1, ex.kv.trash_page),
        ("copy_dst", 1, ex.kv.trash_page),
    ):  # fmt: skip
        inp[name] = torch.full((n,), fill, dtype=torch.int64, device=device)
    inp["prompt"] = like["prompt"].clone()  # last, as in `admit`

    def admission() -> None:
        ex.write_pages(inp["write_rows"], inp["write_index"], inp["write_pages"])
        ex.admit(inp["row"], inp["prompt"], inp["fparams"], inp["iparams"], inp["stop_ids"],
                 fill_state=False)  # fmt: skip
        if ex.pool is not None:
            ex.state_init(inp["init_row"])
            ex.state_restore(inp["restore_src"], inp["restore_dst"])
        ex.copy_pages(inp["copy_src"], inp["copy_dst"])

    return CallSpec("admission", admission, inp, None)


def _state_specs(ex: Executions, i64: Callable[..., torch.Tensor]) -> list[CallSpec]:
    """Executions over the recurrent-state pool, driven by device row-index buffers."""
    n = STATE_OP_CAPACITY
    init_inp = {"rows": i64(n)}
    snap_inp = {"src": i64(n), "dst": i64(n), "consumed": i64(n)}
    restore_inp = {"src": i64(n), "dst": i64(n)}

    def init() -> None:
        ex.state_init(init_inp["rows"])

    def snapshot() -> None:
        ex.state_snapshot(snap_inp["src"], snap_inp["dst"], snap_inp["consumed"])

    def restore() -> None:
        ex.state_restore(restore_inp["src"], restore_inp["dst"])

    trash = ex.kv.trash_page
    cap_inp = {"src": i64(n), "dst": i64(n), "consumed": i64(n)}
    cap_inp |= {name: torch.full_like(cap_inp["src"], trash) for name in ("copy_src", "copy_dst")}

    def capture() -> None:
        """`state_snapshot` then `copy_pages` (the snapshots' tail pages) as one execution:
        the checkpoints a step takes, staged with one upload and run as one replay."""
        ex.state_snapshot(cap_inp["src"], cap_inp["dst"], cap_inp["consumed"])
        ex.copy_pages(cap_inp["copy_src"], cap_inp["copy_dst"])

    return [
        CallSpec("state_init", init, init_inp, None),
        CallSpec("state_snapshot", snapshot, snap_inp, None),
        CallSpec("state_restore", restore, restore_inp, None),
        CallSpec("capture", capture, cap_inp, None),
    ]
