"""Host cost of launching a captured CUDA graph, by node count: what a prefill replay costs the
host at a turn boundary, when the device is idle and waits for the launch.

    python benchmarks/graph_launch.py [--out FILE]

Captures graphs of N small elementwise kernels (N = 1 .. 1,024) and times, per N: the host
time of `graph.replay()` alone (median of 200, the device kept busy ahead so the call never
waits), and the device idle-to-start latency from an event recorded right before the replay
on an idle stream to the first kernel's start, measured as the whole graph's wall time minus
its device time. Prints JSON lines and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl


def _graph(nodes: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1.0)
    torch.cuda.synchronize()
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    rows = []
    for nodes in (1, 16, 64, 256, 512, 1024):
        g = _graph(nodes, x)
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        host = []
        for _ in range(200):
            torch.mm(busy, busy)  # the device stays busy: replay() never waits on it
            t = time.perf_counter()
            g.replay()
            host.append(time.perf_counter() - t)
            if len(host) % 20 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        idle_wall, device = [], []
        for _ in range(50):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            idle_wall.append(time.perf_counter() - t)
            device.append(a.elapsed_time(b) / 1e3)
        rec = {
            "kind": "graph_launch", "nodes": nodes,
            "replay_host_us": 1e6 * statistics.median(host),
            "idle_wall_us": 1e6 * statistics.median(idle_wall),
            "device_us": 1e6 * statistics.median(device),
        }  # fmt: skip
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    print("| nodes | replay host us | idle wall us | device us |")
    for r in rows:
        print(f"| {r['nodes']} | {r['replay_host_us']:.1f} | {r['idle_wall_us']:.1f} "
              f"| {r['device_us']:.1f} |")  # fmt: skip
    jsonl.append(args.out, rows)


if __name__ == "__main__":
    main()
