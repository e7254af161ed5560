"""flare prep of a checkpoint as published (one tensor per expert) vs the same weights stacked.

    python benchmarks/prep_published.py --work /tmp/fpp [--layers 2] [--experts 512] [--rounds 1]

Builds a random bf16 Qwen3-Next-shaped hybrid twice from one seed (per-layer shapes of the 80B-A3B
model: hidden 2048, experts of 512, vocab 151936; a few layers): in Transformers' in-memory
layout (stacked experts, one file) and as published (one tensor per expert, shards with an
index, a multi-token-prediction head). Preps each in a child process (CPU, bf16, no compile) and
prints JSON lines per round and layout: wall seconds, weight bytes, source tensors, peak RSS
growth over prep (the kernel's VmHWM, reset once prep's modules are imported) against the
weights and against the largest source tensor; then the medians side by side and whether the
two bundles' weight files are byte-identical. CPU only: runs on any machine with the venv.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_CHILD = """
import json, math, sys, time
from pathlib import Path
from prep.model import build_meta_model, load_config
from prep.prepare import PrepConfig, prepare
from prep.recipes import read_checkpoint
from prep.sources import scan_checkpoint
from prep.rss import peak_rss_bytes as hwm
ck, out = Path(sys.argv[1]), Path(sys.argv[2])
build_meta_model(read_checkpoint(load_config(ck)).config)  # imports: not measured
open('/proc/self/clear_refs', 'w').write('5')  # peak RSS := current RSS
base, t0 = hwm(), time.perf_counter()
m = prepare(PrepConfig(checkpoint=ck, out=out, device='cpu', dtype='bfloat16', compile=False,
                       max_context_tokens=4096, max_prefill_chunk_tokens=512))
wall = time.perf_counter() - t0
sizes = [math.prod(t.shape) * {'F32': 4}.get(t.dtype, 2) for t in scan_checkpoint(ck)]
print(json.dumps({"wall_s": wall, "peak_rss_growth_bytes": hwm() - base,
                  "weight_bytes": m.weight_bytes, "source_tensors": m.source.num_tensors,
                  "num_stacked": m.source.num_stacked, "largest_source_tensor_bytes": max(sizes),
                  "not_loaded": sum(len(n.tensors) for n in m.source.not_loaded)}))
"""


def _shape(layers: int, experts: int) -> dict[str, object]:
    kinds = ["linear_attention", "full_attention"]
    return dict(
        hidden_size=2048, num_hidden_layers=layers,
        layer_types=[kinds[i % 2] for i in range(layers)],
        num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, num_experts=experts, num_experts_per_tok=10,
        moe_intermediate_size=512, shared_expert_intermediate_size=512,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    from prep.tiny import make_tiny_checkpoint

    overrides = _shape(args.layers, args.experts)
    ckpts = {}
    for layout, published in (("in_memory", False), ("published", True)):
        d = args.work / f"ckpt-{layout}"
        if not (d / "config.json").is_file():
            make_tiny_checkpoint(d, "qwen3_next", dtype="bfloat16", vocab_size=151936,
                                 config_overrides=overrides, published=published)  # fmt: skip
        ckpts[layout] = d
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ckpts}
    for r in range(args.rounds):
        for layout, ck in ckpts.items():
            out = args.work / f"bundle-{layout}"
            child = subprocess.run([sys.executable, "-c", _CHILD, str(ck), str(out)],
                                   capture_output=True, text=True, check=True)  # fmt: skip
            row = json.loads(child.stdout.strip().splitlines()[-1])
            row["growth_vs_weights"] = row["peak_rss_growth_bytes"] / row["weight_bytes"]
            row["growth_vs_largest_tensor"] = (
                row["peak_rss_growth_bytes"] / row["largest_source_tensor_bytes"]
            )
            runs[layout].append(row)
            print(json.dumps({"kind": "prep_published_round", "round": r, "layout": layout,
                              "layers": args.layers, "experts": args.experts, **row}))  # fmt: skip
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in runs.items()}
    same = filecmp.cmp(args.work / "bundle-in_memory" / "weights" / "model.safetensors",
                       args.work / "bundle-published" / "weights" / "model.safetensors",
                       shallow=False)  # fmt: skip
    print(json.dumps({
        "kind": "prep_published_summary", "layers": args.layers, "experts": args.experts,
        "rounds": args.rounds, "bundles_identical": same,
        "median": med,
        "wall_ratio_published_vs_in_memory": med["published"]["wall_s"] / med["in_memory"]["wall_s"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
