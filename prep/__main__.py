"""`python -m prep CHECKPOINT --out BUNDLE [...]` (the `flare prep` subcommand runs this)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from prep.errors import PrepError


def _caps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flare prep", description="Prepare a checkpoint into a bundle")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument(
        "--max-context", type=int, default=None, dest="max_context",
        help="context limit in tokens (default: the model's, at most 32768)",
    )  # fmt: skip
    p.add_argument("--prefill-chunk", type=int, default=512, dest="prefill_chunk")
    p.add_argument("--decode-capacities", type=_caps, default=(1, 2, 4, 8))
    p.add_argument(
        "--prefill-capacities", type=_caps, default=(), dest="prefill_capacities",
        help="extra prefill chunk capacities besides the powers of two from 128 up to the "
        "chunk limit (e.g. 384,768): less padding for chunks just above a power of two",
    )  # fmt: skip
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument(
        "--canonical-layout", action="store_true",
        help="keep every projection as its own weight (no fused q/k/v or gate/up)",
    )  # fmt: skip
    p.add_argument(
        "--compile-mode", default="auto",
        choices=["auto", "decode-forward", "decode-sampling", "forward", "forward-sampling",
                 "regional", "layers"],
        help="what is compiled: decode-forward = the decoder stack of decode executions; "
        "decode-sampling = also their sampling and state commit; forward = the decoder stack "
        "of every execution; forward-sampling = every execution whole; regional = "
        "decode-sampling, plus prefill through decoder layers compiled once per layer kind "
        "; layers = every execution through layers compiled once per layer kind "
        "(default auto: regional on CUDA, decode-forward on CPU)",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prep.prepare import PrepConfig, prepare

    cfg = PrepConfig(
        checkpoint=args.checkpoint,
        out=args.out,
        device=args.device,
        dtype=args.dtype,
        max_context_tokens=args.max_context,
        max_prefill_chunk_tokens=args.prefill_chunk,
        extra_prefill_capacities=tuple(args.prefill_capacities),
        decode_capacities=args.decode_capacities,
        page_size=args.page_size,
        compile=not args.no_compile,
        compile_mode=args.compile_mode,
        fused_layout=not args.canonical_layout,
    )
    t0 = time.perf_counter()
    stats: dict[str, int] = {}
    try:
        m = prepare(cfg, stats)
    except PrepError as exc:
        print(f"flare prep: error: {exc}", file=sys.stderr)
        return 2
    from prep.rss import peak_rss_bytes

    gib = 1024**3
    peak = peak_rss_bytes()  # this process's own (a parent's peak is not carried over)
    warm = stats.get("warm_peak_rss_bytes", 0)
    print(
        f"prepared {m.architecture} ({m.dtype}) -> {args.out} in {time.perf_counter() - t0:.1f}s: "
        f"decode {m.catalog.decode_capacities}, prefill {m.catalog.prefill_capacities}, "
        f"context {m.catalog.max_context_tokens}; weights {m.weight_bytes / gib:.2f} GiB, "
        f"peak host memory {peak / gib:.2f} GiB (compile warm-up process {warm / gib:.2f} GiB)"
    )
    src = m.source
    if src is not None:  # every checkpoint tensor: stored, stacked into a slice, or listed
        print(
            f"  checkpoint {src.architecture}: {src.num_tensors} tensors, {src.num_stored} stored, "
            f"{src.num_stacked} per-index tensors stacked into their parameters"
        )
        for nl in src.not_loaded:
            print(
                f"  not loaded: {len(nl.tensors)} tensors ({nl.source_bytes / 2**20:.1f} MiB): "
                f"{nl.reason}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
