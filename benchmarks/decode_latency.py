"""Decode ITL / throughput, cold TTFT, replay floor and bandwidth floor, side by side with
Transformers `generate`, in one run on one GPU.

    python benchmarks/decode_latency.py --shape qwen3-1.7b --work /tmp/flare-bench
    python benchmarks/decode_latency.py --shape qwen3-8b --bundle B --baselines none

Prints one JSON object per measurement, then a table. Sampling: T=1, top-k 20, top-p 0.95.
Each `--variants` entry is measured by an engine in a process of its own (see
`measure_in_child`); `--bundle B` measures the first variant's GEMM on B in this process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.agent_trace import step_delta, step_totals, step_trace
from benchmarks.shapes import make_checkpoint

RESULTS: list[dict] = []
OUT_FILE: list[Path] = []


def emit(**rec: object) -> None:
    """Print one JSON line and append it to --out at once (a run cut short keeps its results)."""
    RESULTS.append(rec)
    line = json.dumps(rec)
    print(line, flush=True)
    for f in OUT_FILE:
        with f.open("a") as fh:
            fh.write(line + "\n")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 10."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / statistics.median(times[3:])


def prep_bundle(
    ckpt: Path, bundle: Path, chunk: int, ctx: int, capacities: str = "1,2,4,8",
    canonical: bool = False, compile: bool = True,
) -> None:  # fmt: skip
    if (bundle / "manifest.json").is_file():
        return
    subprocess.run(
        [sys.executable, "-m", "prep", str(ckpt), "--out", str(bundle), "--device", "cuda",
         "--dtype", "bfloat16", "--max-context", str(ctx), "--prefill-chunk", str(chunk),
         "--page-size", "64", "--decode-capacities", capacities,
         *([] if compile else ["--no-compile"]),
         *(["--canonical-layout"] if canonical else [])],
        check=True,
    )  # fmt: skip


def run_concurrency(
    eng, prompt_len: int, gen: int, c: int, seed0: int, seeded: bool = True
) -> dict:
    from flared.engine.events import TokenEvent
    from flared.requests import SamplingParams

    times: dict[int, list[float]] = {i: [] for i in range(c)}
    done = threading.Barrier(c + 1)
    t_submit: dict[int, float] = {}

    def sink_for(i: int):
        def sink(ev) -> None:
            if isinstance(ev, TokenEvent):
                now = time.perf_counter()
                times[i].extend([now] * len(ev.tokens))
            else:
                threading.Thread(target=done.wait).start()

        return sink

    g = torch.Generator().manual_seed(seed0)
    for i in range(c):
        prompt = torch.randint(10, 150000, (prompt_len,), generator=g).tolist()
        t_submit[i] = time.perf_counter()
        eng.submit(prompt, sink_for(i), max_tokens=gen, ignore_eos=True,
                   sampling=SamplingParams(temperature=1.0, top_k=20, top_p=0.95,
                                           seed=seed0 + i if seeded else None))  # fmt: skip
    done.wait(timeout=600)
    itls = [b - a for i in range(c) for a, b in zip(times[i][1:-1], times[i][2:])] or [0.0]
    start = min(t_submit.values())
    end = max(t[-1] for t in times.values())
    return {
        "itl_ms_p50": 1e3 * statistics.median(itls),
        "itl_ms_p99": 1e3 * sorted(itls)[int(0.99 * (len(itls) - 1))],
        "ttft_ms_p50": 1e3 * statistics.median(times[i][0] - t_submit[i] for i in range(c)),
        "tokens_per_s": sum(len(t) for t in times.values()) / (end - start),
    }


def measure_ttft(eng, plen: int, seed: int) -> dict:
    """One cold prompt of `plen` tokens (a prompt stream of its own: `seed`), two tokens:
    its TTFT, the prefix it hit, the prefill executions it ran, its steps (device time, host
    submit time and idle gaps beside its TTFT, summed and one by one: which chunk, decode or
    empty step took the time) and the device milliseconds of its prefill chunks."""
    before = step_totals(eng)
    hits = eng.stats().get("prefix_hit_tokens_total", 0)
    chunks0 = dict(eng.stats().get("prefill_chunks_by_execution", {}))
    with step_trace(eng) as trace:
        res = run_concurrency(eng, plen, 2, 1, seed0=seed)
    chunks = eng.stats().get("prefill_chunks_by_execution", {})
    return {
        "ttft_ms": res["ttft_ms_p50"],
        "prefix_hit_tokens": eng.stats().get("prefix_hit_tokens_total", 0) - hits,
        "prefill_executions": {
            k: v - chunks0.get(k, 0) for k, v in chunks.items() if v > chunks0.get(k, 0)
        },
        "steps": step_delta(before, step_totals(eng)),
        "step_trace": trace,
        "chunk_device_ms": [
            s["device_ms"] for s in trace if s["prefill_tokens"] and "device_ms" in s
        ],
    }


def ttft_rounds(eng, lengths: list[int], rounds: int) -> dict[int, list[dict]]:
    """`measure_ttft` of every length, `rounds` times: each round starts one length later, so
    no length is always measured right after the same one (a 4,095-token prompt measured only
    after the 4,096-token one read 7% slower on an H100), and every prompt is cold (a stream
    of its own per length and round). -> length: its runs in round order."""
    runs: dict[int, list[dict]] = {plen: [] for plen in lengths}
    for rnd in range(rounds if lengths else 0):
        k = rnd % len(lengths)
        for plen in lengths[k:] + lengths[:k]:
            runs[plen].append(measure_ttft(eng, plen, seed=7 + plen + 100_003 * rnd))
    return runs


def replay_floor(eng, c: int, n: int = 200, seeded: bool = True) -> float:
    """Back-to-back replays of the decode graph for rows 1..c: the captured computation alone.
    The graph the measured requests run: top-k 20 samples from candidates (decode{b}_lean;
    decode1_lean_single for one request without a seed where the engine built it)."""
    r = eng.runner
    name = f"decode{min(x for x in r.manifest.catalog.decode_capacities if x >= c)}_lean"
    if c == 1 and not seeded and f"{name}_single" in r.calls:
        name += "_single"
    call = r.calls[name]
    call.inputs["rows"].zero_()
    call.inputs["rows"][:c] = torch.arange(1, c + 1)
    with torch.cuda.stream(r.stream):
        for _ in range(10):
            call.run()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(r.stream)
        for _ in range(n):
            call.run()
        e.record(r.stream)
    e.synchronize()
    return s.elapsed_time(e) / n


def hf_generate(ckpt: Path, prompt_len: int, gen: int, static: bool) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    ids = torch.randint(10, 150000, (1, prompt_len), device="cuda")
    kw = dict(do_sample=True, temperature=1.0, top_k=20, top_p=0.95, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    out = {}
    for n in (2, gen):  # two lengths: per-token cost = difference / extra tokens
        for _ in range(2 if static else 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            torch.cuda.synchronize()
            out[n] = time.perf_counter() - t
    del model
    torch.cuda.empty_cache()
    return {"itl_ms": 1e3 * (out[gen] - out[2]) / (gen - 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/flare-bench"))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument(
        "--compile", default="bundle",
        help="the engine's compile mode (default: what prep compiled, as flared serves it)",
    )  # fmt: skip
    ap.add_argument(
        "--bundle", type=Path, default=None,
        help="measure this prepared bundle (of --shape) instead of preparing one per variant",
    )  # fmt: skip
    ap.add_argument("--baselines", default="eager")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--variants", default="fused:skinny",
        help="comma list of LAYOUT:GEMM[:FLAG...] (layout fused|canonical, gemm "
        "skinny|fused|folded|cublas|mlp|gemv; flags pdl|pdlstart|pdlend: programmatic dependent "
        "launch, each kernel triggering the next after its wait / first / after its main loop; "
        "splitk: decode products of <= 8,192 outputs split K; l2off|l2start|l2end: the attention's "
        "warming of o's weight; fN: folded layers up to N rows; sfolded|sgemv|sfoldedgemv: "
        "decode_single_gemm; pfoff: prefill_fresh off; drawk: candidate_draw kernel; topk2: the top-k in two launches; "
        "ao2|ao1|aoqkv: one-row steps' attention and o product in two launches, one, or one with "
        "their q|k|v product; spdl|nospdl|spdlwait|spdlstart: the one-row steps with PDL "
        "triggered at the end (the default), without it, after the wait, first thing; aw8 / ak32: decode "
        "attention in 8 warps / over 32-key blocks), "
        "each measured in this run",
    )  # fmt: skip
    ap.add_argument("--ttft", default="512,4096")
    ap.add_argument(
        "--ttft-repeats", type=int, default=3,
        help="rounds over the --ttft lengths, each prompt cold (a stream of its own) and each "
        "round starting one length later; a length's ttft_ms is the median of its rounds",
    )  # fmt: skip
    ap.add_argument("--label", help="the engine label of a --bundle measurement")
    ap.add_argument("--decode-capacities", default="1,2,4,8")
    ap.add_argument(
        "--prefill-chunk", type=int, default=4096,
        help="the prepared bundle's prefill chunk limit (capacities 128 .. it): 512 prepares "
        "fewer prefill executions for a decode-only run (--ttft \"\"); TTFT 4,096 wants 4096",
    )  # fmt: skip
    ap.add_argument(
        "--unseeded", action="store_true",
        help="requests without a seed (the engine draws one): a lone request may then run the "
        "one-row executions of decode_single_gemm (variant flags snone|sfolded|sgemv|sfoldedgemv)",
    )  # fmt: skip
    ap.add_argument(
        "--seeding", choices=["seeded", "unseeded", "both"], default=None,
        help="the decode requests' seeds (default seeded; --unseeded is 'unseeded'); 'both' "
        "measures each concurrency seeded, then without a seed, in one engine (the unseeded "
        "records' engine label ends -unseeded)",
    )  # fmt: skip
    ap.add_argument("--step-wait", choices=["spin", "block"], default="spin",
                    help="the engine's wait for a step's completion event")  # fmt: skip
    ap.add_argument(
        "--no-compile", action="store_true",
        help="prepare without torch.compile (eager executions in CUDA graphs: development only; "
        "the default is the prep's own compile mode, what flared serves)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.seeding is None:
        args.seeding = "unseeded" if args.unseeded else "seeded"
    if args.out:
        OUT_FILE.append(args.out)

    work = args.work / args.shape
    bw = copy_bandwidth()
    if args.bundle is not None:  # the first variant's GEMM on the given bundle
        first = args.variants.split(",")[0]
        _, gemm, flags = parse_variant(first)
        label = args.label or f"flare-bundle-{gemm}{variant_suffix(first)}"
        measure_engine(args, args.bundle, label, gemm, bw, flags)
    ckpt = None if args.bundle is not None and args.baselines == "none" else (
        make_checkpoint(args.shape, work / "ckpt")
    )  # fmt: skip
    for variant in [] if args.bundle is not None else args.variants.split(","):
        assert ckpt is not None
        layout, gemm, flags = parse_variant(variant)
        bundle = work / f"bundle-{layout}"
        t = time.perf_counter()
        prep_bundle(
            ckpt, bundle, chunk=args.prefill_chunk, ctx=8192, capacities=args.decode_capacities,
            canonical=layout == "canonical", compile=not args.no_compile,
        )  # fmt: skip
        emit(kind="prep", shape=args.shape, layout=layout, seconds=time.perf_counter() - t)
        label = f"flare-{layout}-{gemm}{variant_suffix(variant)}"
        measure_in_child(args, bundle, variant, label)
    for b in [] if ckpt is None else args.baselines.split(","):
        if b in ("eager", "static"):
            emit(kind="decode", engine=f"transformers-{b}", shape=args.shape, concurrency=1,
                 **hf_generate(ckpt, args.prompt, 64 if b == "eager" else args.gen, b == "static"))  # fmt: skip
    emit(kind="device", name=torch.cuda.get_device_name(), copy_bandwidth_tb_s=bw / 1e12)
    print("\n| engine | c | ITL p50 ms | ITL p99 ms | tok/s | replay floor ms | bw floor ms |")
    for r in RESULTS:
        if r["kind"] == "decode":
            print(f"| {r['engine']} | {r['concurrency']} | {r.get('itl_ms_p50', r.get('itl_ms', 0)):.3f} | "
                  f"{r.get('itl_ms_p99', 0):.3f} | {r.get('tokens_per_s', 0):.0f} | "
                  f"{r.get('replay_floor_ms', 0):.3f} | {r.get('bandwidth_floor_ms', 0):.3f} |")  # fmt: skip


# a variant's flags -> the engine options they set (pdl: the default trigger, after the wait)
VARIANT_FLAGS: dict[str, dict[str, object]] = {
    "pdl": {"decode_pdl": True},
    "pdlstart": {"decode_pdl": True, "decode_pdl_trigger": "start"},
    "pdlend": {"decode_pdl": True, "decode_pdl_trigger": "end"},
    # the one-row steps of a request without a seed with PDL (measured with --unseeded; the
    # default, triggered at the end), without it, or triggered after the wait / first thing
    "spdl": {"decode_single_pdl": True},
    "nospdl": {"decode_single_pdl": False},
    "spdlwait": {"decode_single_pdl": True, "decode_single_pdl_trigger": "after_wait"},
    "spdlstart": {"decode_single_pdl": True, "decode_single_pdl_trigger": "start"},
    "splitk": {"decode_split_k": True},
    "l2off": {"decode_attention_prefetch": "off"},
    "l2start": {"decode_attention_prefetch": "start"},
    "l2end": {"decode_attention_prefetch": "end"},
    **{f"f{n}": {"decode_folded_rows": n} for n in (1, 2, 4, 8, 16)},  # folded up to n rows
    # one-row steps of a request without a seed (measured with --unseeded; default auto)
    "snone": {"decode_single_gemm": "none"},
    # a prompt's first chunk through the paged attention kernel (default auto: own keys, cuDNN)
    "pfoff": {"prefill_fresh": "off"},
    # the candidate path's top-k, filters and draw in one two-launch kernel (default ops)
    "drawk": {"candidate_draw": "kernel"},
    # the top-k in two launches over 4,096-value chunks, the form its middle stage replaced as
    # the default (prep/components/triton_topk.py; not an engine option: set in the measuring
    # process before the engine starts)
    "topk2": {"_topk_levels": (4096, 0)},
    # the decode attention: its programs in 8 warps instead of 4 (triton_decode.DECODE_WARPS),
    # or over 32-key blocks instead of 64 (DECODE_KEYS_MAX); set in the measuring process
    # before the engine starts, not engine options
    "aw8": {"_attention_warps": 8},
    "ak32": {"_attention_keys": 32},
    # one-row steps of a request without a seed: each layer's attention and o product in two
    # launches, in one (prep/components/attention_o.py), or with the q|k|v product in it too
    # (decode_single_attention; a value other than the prep's default compiles at start)
    "ao2": {"decode_single_attention": "two"},
    "ao1": {"decode_single_attention": "one"},
    "aoqkv": {"decode_single_attention": "qkv"},
    "sfolded": {"decode_single_gemm": "folded"},
    "sgemv": {"decode_single_gemm": "gemv"},
    "sfoldedgemv": {"decode_single_gemm": "folded-gemv"},
}


def parse_variant(variant: str) -> tuple[str, str, dict[str, object]]:
    """LAYOUT:GEMM[:FLAG...] -> (layout, decode_gemm, the engine options its flags set)."""
    parts = variant.split(":")
    extra = parts[2:]
    options: dict[str, object] = {}
    for flag in extra:
        if flag not in VARIANT_FLAGS or options.keys() & VARIANT_FLAGS[flag].keys():
            raise SystemExit(
                f"variant {variant!r} is not LAYOUT:GEMM[:FLAG...] with one of each of "
                "pdl|pdlstart|pdlend, splitk, l2off|l2start|l2end, f1|f2|f4|f8|f16 and "
                "snone|sfolded|sgemv|sfoldedgemv, pfoff, drawk, topk2, ao2|ao1|aoqkv, "
                "spdl|nospdl|spdlwait|spdlstart, aw8, ak32"
            )
        options.update(VARIANT_FLAGS[flag])
    if len(parts) < 2:
        raise SystemExit(f"variant {variant!r} is not LAYOUT:GEMM[:FLAG...]")
    return parts[0], parts[1], options


def variant_suffix(variant: str) -> str:
    return "".join(f"-{flag}" for flag in variant.split(":")[2:])


def measure_in_child(args, bundle: Path, variant: str, label: str) -> None:
    """measure_engine in a process of its own, its records emitted here: an engine's device
    memory goes back to the driver only when its process exits, so a second engine in this
    process would be planned against what the first left (an 8B bundle's second variant did
    not fit beside the first)."""
    cmd = [
        sys.executable, __file__, "--shape", args.shape, "--bundle", str(bundle),
        "--variants", variant, "--label", label, "--baselines", "none",
        "--prompt", str(args.prompt), "--gen", str(args.gen), "--concurrency", args.concurrency,
        "--compile", args.compile, "--ttft", args.ttft, "--ttft-repeats", str(args.ttft_repeats),
        "--seeding", args.seeding,
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec["kind"] != "device":  # this process reports the device once
                emit(**rec)


def measure_engine(args, bundle: Path, label: str, gemm: str, bw: float, flags: dict) -> None:
    from flared.llm_engine import Engine, EngineConfig

    flags = dict(flags)
    from prep.components import triton_decode

    if (warps := flags.pop("_attention_warps", None)) is not None:
        triton_decode.DECODE_WARPS = warps  # type: ignore[assignment]
    if (keys := flags.pop("_attention_keys", None)) is not None:
        triton_decode.DECODE_KEYS_MAX = keys  # type: ignore[assignment]
    if (levels := flags.pop("_topk_levels", None)) is not None:
        from prep.components import triton_topk

        triton_topk.set_levels(*levels)  # type: ignore[misc]
    t = time.perf_counter()
    cfg = EngineConfig(
        device="cuda", compile=args.compile, max_num_rows=8, decode_gemm=gemm,
        step_wait=args.step_wait, **flags,
    )  # fmt: skip
    eng = Engine(bundle, cfg).start()
    emit(kind="startup", engine=label, shape=args.shape, seconds=time.perf_counter() - t,
         compile=args.compile, prefill_fresh_check=dict(eng.runner.fresh_check),
         prefill_fresh_dropped=list(eng.runner.fresh_dropped))  # fmt: skip
    weight_bytes = eng.manifest.weight_bytes
    modes = {"seeded": [True], "unseeded": [False], "both": [True, False]}[args.seeding]
    for seeded, c in [(m, int(x)) for m in modes for x in args.concurrency.split(",")]:
        name = label + ("-unseeded" if args.seeding == "both" and not seeded else "")
        kv_read = (
            c
            * (args.prompt + args.gen // 2)
            * 2
            * 2
            * len(eng.manifest.geometry.attention_layers)
            * eng.manifest.geometry.num_kv_heads
            * eng.manifest.geometry.head_dim
        )
        floor = 1e3 * (weight_bytes + kv_read) / bw
        cpu0 = time.process_time()
        runs0 = eng.stats().get("decode_steps_by_execution", {})
        res = run_concurrency(eng, args.prompt, args.gen, c, seed0=100 * c, seeded=seeded)
        res["process_cpu_ms_per_step"] = 1e3 * (time.process_time() - cpu0) / args.gen
        runs = eng.stats().get("decode_steps_by_execution", {})
        # which decode executions served the run (decode1_lean_single: the one-row products)
        res["decode_executions"] = {
            n: v - runs0.get(n, 0) for n, v in runs.items() if v > runs0.get(n, 0)
        }
        emit(kind="decode", engine=name, shape=args.shape, concurrency=c, **res, bandwidth_floor_ms=floor,
             replay_floor_ms=replay_floor(eng, c, seeded=seeded), step_wait=args.step_wait,
             seeded=seeded)  # fmt: skip
    # the startup timing of each prefill capacity: what the scheduler cuts prompts by
    emit(kind="prefill_costs", engine=label, ms=dict(getattr(eng.runner, "prefill_ms", {})),
         fresh_bonus=dict(getattr(eng.runner, "fresh_bonus", {})))  # fmt: skip
    lengths = [int(x) for x in args.ttft.split(",") if x]
    runs = ttft_rounds(eng, lengths, args.ttft_repeats)
    for plen in lengths:
        rs = runs[plen]
        first = rs[0]
        # ttft_ms: the median over the rounds; the first round's steps and trace as before
        emit(kind="ttft", engine=label, shape=args.shape, prompt=plen,
             ttft_ms=statistics.median(r["ttft_ms"] for r in rs),
             ttft_ms_runs=[round(r["ttft_ms"], 3) for r in rs],
             chunk_device_ms_runs=[r["chunk_device_ms"] for r in rs],
             prefix_hit_tokens=sum(r["prefix_hit_tokens"] for r in rs),
             prefill_executions=first["prefill_executions"], steps=first["steps"],
             step_trace=first["step_trace"])  # fmt: skip
    emit(
        kind="engine_stats",
        **{k: v for k, v in eng.stats().items() if isinstance(v, (int, float, str, dict))},
    )
    eng.shutdown()
    del eng
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
