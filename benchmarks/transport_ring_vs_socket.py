"""Ring (sealed memfd + socket doorbell) vs plain Unix-socket frames for token events.

Two processes, the real shm_protocol pieces on both sides: the producer encodes one TokenDelta
per stream per "step" (as the daemon does after an engine step) and delivers the batch either
through Outbox -> RingWriter -> one EventsReady doorbell, or as length-prefixed frames in one
sendall; the consumer reads with the client's code path (FrameBuffer, RingReader.drain, the
daemon-message decoder). Per event it records latency (CLOCK_MONOTONIC stamped at encode time,
compared at decode time in the other process).

Modes:  paced   one step every --step-ms (a decode cadence): per-token delivery latency
        flood   steps back to back: events/s throughput
Both transports run in the same invocation, alternating, for 1/4/64 streams.

    python benchmarks/transport_ring_vs_socket.py [--steps 2000] [--step-ms 2] [--repeats 3]

Prints one JSON line per measurement, then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shm_protocol import messages as m
from shm_protocol.codec import (
    HEADER,
    FrameBuffer,
    client_decoder,
    daemon_decoder,
    encode_body,
    encode_frame,
)
from shm_protocol.outbox import Outbox
from shm_protocol.ring import RingReader, RingWriter
from shm_protocol.segment import create_ring_segment, map_ring_segment

RING_BYTES = 1 << 18


def produce(sock: socket.socket, seg: object, transport: str, streams: int, steps: int,
            step_s: float) -> None:  # fmt: skip
    outbox = Outbox(RingWriter(seg.view, seg.capacity), 1 << 16) if seg else None  # type: ignore[attr-defined]
    frames = FrameBuffer(client_decoder(), 1 << 20)
    next_t = time.perf_counter()
    for step in range(steps):
        stamp = str(time.perf_counter_ns())
        payloads = [encode_body(m.TokenDelta(f"r{i}", [step % 500], stamp)) for i in range(streams)]
        if outbox is None:
            sock.sendall(b"".join(HEADER.pack(len(p)) + p for p in payloads))
        else:
            for i, p in enumerate(payloads):
                outbox.enqueue(f"r{i}", p, False)
            head, blocked = outbox.flush()
            sock.sendall(encode_frame(m.EventsReady(head, blocked)))
            while blocked:  # wait for the consumer's Advance, as the daemon does
                frames.feed(sock.recv(4096))
                head, blocked = outbox.flush()
                sock.sendall(encode_frame(m.EventsReady(head, blocked)))
        if step_s:
            next_t += step_s
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)


def consume(sock: socket.socket, seg: object, total: int) -> dict[str, float]:
    reader = RingReader(seg.view, seg.capacity) if seg else None  # type: ignore[attr-defined]
    dec = daemon_decoder()
    frames = FrameBuffer(dec, 1 << 24)
    lat: list[int] = []
    t0 = None
    while len(lat) < total:
        data = sock.recv(1 << 16)
        if not data:
            break
        for msg in frames.feed(data):
            if isinstance(msg, m.EventsReady):
                assert reader is not None
                time.perf_counter_ns()
                for rec in reader.drain():
                    d = dec.decode(rec)
                    lat.append(time.perf_counter_ns() - int(d.text))
                if msg.writer_blocked:
                    sock.sendall(encode_frame(m.Advance()))
            else:
                lat.append(time.perf_counter_ns() - int(msg.text))
            if t0 is None:
                t0 = time.perf_counter_ns() - lat[0]
    elapsed = (time.perf_counter_ns() - (t0 or 0)) / 1e9
    lat_us = sorted(x / 1e3 for x in lat)
    return {
        "events": len(lat),
        "seconds": elapsed,
        "events_per_s": len(lat) / elapsed,
        "lat_p50_us": lat_us[len(lat_us) // 2],
        "lat_p99_us": lat_us[int(len(lat_us) * 0.99)],
        "lat_mean_us": statistics.fmean(lat_us),
    }


def measure(transport: str, streams: int, steps: int, step_s: float) -> dict[str, float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd, seg = create_ring_segment("flare-bench", RING_BYTES) if transport == "ring" else (-1, None)
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # consumer: maps the ring from the inherited fd, like a client does
        a.close()
        cseg = map_ring_segment(os.dup(fd), RING_BYTES) if fd >= 0 else None
        out = consume(b, cseg, streams * steps)
        os.write(res_w, json.dumps(out).encode())
        os._exit(0)
    b.close()
    os.close(res_w)
    produce(a, seg, transport, streams, steps, step_s)
    raw = b""
    while chunk := os.read(res_r, 1 << 16):
        raw += chunk
    os.waitpid(pid, 0)
    os.close(res_r)
    a.close()
    if fd >= 0:
        os.close(fd)
    return json.loads(raw)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--step-ms", type=float, default=2.0, help="paced mode step interval")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", default="1,4,64")
    args = p.parse_args()
    rows = []
    for streams in [int(s) for s in args.streams.split(",")]:
        steps = max(50, args.steps // max(1, streams // 4))
        for mode, step_s in (("paced", args.step_ms / 1e3), ("flood", 0.0)):
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.repeats):
                for transport in ("ring", "socket"):  # alternate: same conditions for both
                    r = measure(transport, streams, steps, step_s)
                    key = "lat_p50_us" if mode == "paced" else "events_per_s"
                    prev = best.get(transport)
                    better = prev is None or (
                        r[key] < prev[key] if mode == "paced" else r[key] > prev[key]
                    )
                    if better:
                        best[transport] = r
            for transport, r in best.items():
                row = {"bench": "transport", "mode": mode, "transport": transport,
                       "streams": streams, "steps": steps, **r}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    print()
    print(f"{'mode':6} {'streams':>7} {'transport':9} {'p50 us':>9} {'p99 us':>9} {'events/s':>11}")
    for r in rows:
        print(f"{r['mode']:6} {r['streams']:>7} {r['transport']:9} {r['lat_p50_us']:>9.1f} "
              f"{r['lat_p99_us']:>9.1f} {r['events_per_s']:>11.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
