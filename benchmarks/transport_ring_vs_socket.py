"""Ring (sealed memfd + coalesced socket doorbell) vs plain Unix-socket frames for token events.

Two processes, the real shm_protocol pieces on both sides. The producer encodes one TokenDelta
per stream per "step" (as the daemon does after an engine step) and delivers the step's batch
either through Outbox -> RingWriter (one copy, one head store) plus an EventsReady doorbell
only when the reader declared it was going to sleep, or as length-prefixed frames in one
sendall (the batching a socket user has: one send per step). The consumer uses the client's
decoders: FrameBuffer for frames, RingReader.drain (zero-copy slices of one private copy) for
the ring; the same msgspec decoder decodes every event on both paths. Latency per event:
CLOCK_MONOTONIC stamped before encoding, compared after decoding in the other process.

Modes:  paced   one step every --step-ms (a decode cadence): per-event delivery latency
        flood   steps back to back: events/s throughput (and latency under load)
Both transports run in the same invocation, alternating, for 1/4/64 streams; each row is the
median over --repeats runs of that configuration. `--transports ring,ring-eventfd,socket` adds
the ring with an eventfd doorbell instead of the EventsReady frame, for comparison.

    python benchmarks/transport_ring_vs_socket.py [--steps 2000] [--step-ms 2] [--repeats 5]
        [--spin-us 50] [--out benchmarks/results/transport_ring_vs_socket.jsonl]

Prints one JSON line per configuration (and appends them to --out), then a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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
from shm_protocol.segment import Segment, create_ring_segment, map_ring_segment

RING_BYTES = 1 << 18
WAIT_TIMEOUT_S = 0.05  # the consumer's doorbell wait; on expiry it re-checks the ring


def produce(sock: socket.socket, seg: Segment | None, efd: int, streams: int, steps: int,
            step_s: float) -> dict[str, int]:  # fmt: skip
    outbox = Outbox(RingWriter(seg.view, seg.capacity), 1 << 16) if seg else None
    frames = FrameBuffer(client_decoder(), 1 << 20)
    doorbells = 0
    rids = [f"r{i}" for i in range(streams)]
    next_t = time.perf_counter()
    for step in range(steps):
        stamp = str(time.perf_counter_ns())
        tok = [step % 500]
        payloads = [encode_body(m.TokenDelta(rid, tok, stamp)) for rid in rids]
        if outbox is None:
            sock.sendall(b"".join([HEADER.pack(len(p)) + p for p in payloads]))
        else:
            for rid, p in zip(rids, payloads):
                outbox.enqueue(rid, p, False)
            head, blocked = outbox.flush()
            if outbox.writer.reader_slept() or blocked:
                if efd >= 0 and not blocked:
                    os.eventfd_write(efd, 1)
                else:
                    sock.sendall(encode_frame(m.EventsReady(head, blocked)))
                doorbells += 1
            while blocked:  # wait for the consumer's Advance, as the daemon does
                frames.feed(sock.recv(4096))
                head, blocked = outbox.flush()
                sock.sendall(encode_frame(m.EventsReady(head, blocked)))
                doorbells += 1
        if step_s:
            next_t += step_s
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    return {"doorbells": doorbells}


def consume(sock: socket.socket, seg: Segment | None, efd: int, total: int,
            spin_s: float) -> dict[str, Any]:  # fmt: skip
    reader = RingReader(seg.view, seg.capacity) if seg else None
    dec = daemon_decoder()
    frames = FrameBuffer(dec, 1 << 24)
    lat: list[int] = []
    now = time.perf_counter_ns
    wakeups = 0

    def take_ring() -> None:
        assert reader is not None
        for rec in reader.drain():
            d = dec.decode(rec)
            lat.append(now() - int(d.text))  # type: ignore[union-attr]

    while len(lat) < total:
        if reader is not None:
            take_ring()
            if spin_s and len(lat) < total:  # spin briefly: the next batch may be close
                end = time.perf_counter() + spin_s
                while not reader.pending() and time.perf_counter() < end:
                    pass
                if reader.pending():
                    continue
            if not reader.prepare_sleep():
                continue  # records arrived while declaring the sleep
        ready, _, _ = select.select([sock, efd] if efd >= 0 else [sock], [], [], WAIT_TIMEOUT_S)
        if not ready:
            continue  # timed out: re-check the ring
        if efd in ready:
            os.eventfd_read(efd)
            wakeups += 1
            if sock not in ready:
                continue
        data = sock.recv(1 << 16)
        wakeups += 1
        if not data:
            break
        for msg in frames.feed(data):
            if isinstance(msg, m.EventsReady):
                take_ring()
                if msg.writer_blocked:
                    sock.sendall(encode_frame(m.Advance()))
            else:
                lat.append(now() - int(msg.text))  # type: ignore[union-attr]
    t_end = now()
    lat_us = sorted(x / 1e3 for x in lat)
    return {"events": len(lat), "lat_us": lat_us, "t_end_ns": t_end, "wakeups": wakeups}


def measure(transport: str, streams: int, steps: int, step_s: float,
            spin_s: float) -> dict[str, float]:  # fmt: skip
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ring = transport.startswith("ring")
    fd, seg = create_ring_segment("flare-bench", RING_BYTES) if ring else (-1, None)
    efd = os.eventfd(0, os.EFD_CLOEXEC) if transport == "ring-eventfd" else -1
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # consumer: maps the ring from the inherited fd, as a client does
        a.close()
        cseg = map_ring_segment(os.dup(fd), RING_BYTES) if fd >= 0 else None
        out = consume(b, cseg, efd, streams * steps, spin_s)
        lat = out.pop("lat_us")
        out.update(
            lat_p50_us=lat[len(lat) // 2],
            lat_p99_us=lat[int(len(lat) * 0.99)],
            lat_mean_us=statistics.fmean(lat),
        )
        os.write(res_w, json.dumps(out).encode())
        os._exit(0)
    b.close()
    os.close(res_w)
    t0 = time.perf_counter_ns()
    prod = produce(a, seg, efd, streams, steps, step_s)
    raw = b""
    while chunk := os.read(res_r, 1 << 16):
        raw += chunk
    os.waitpid(pid, 0)
    os.close(res_r)
    a.close()
    if seg is not None:
        seg.close()
        os.close(fd)
    if efd >= 0:
        os.close(efd)
    res: dict[str, float] = json.loads(raw)
    res["seconds"] = (res.pop("t_end_ns") - t0) / 1e9
    res["events_per_s"] = res["events"] / res["seconds"]
    res.update(prod)
    return res


def median_row(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="steps at 1-4 streams (fewer at 64)")
    p.add_argument("--step-ms", type=float, default=2.0, help="paced mode step interval")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", default="1,4,64")
    p.add_argument("--spin-us", type=float, default=50.0, help="ring reader's spin before sleep")
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument("--transports", type=lambda s: s.split(","), default=["ring", "socket"],
                   help="ring (socket doorbell, as the daemon), ring-eventfd, socket")  # fmt: skip
    args = p.parse_args()
    rows = []
    host = platform.node()
    for streams in [int(s) for s in args.streams.split(",")]:
        steps = max(50, args.steps // max(1, streams // 4))
        for mode, step_s in (("paced", args.step_ms / 1e3), ("flood", 0.0)):
            runs: dict[str, list[dict[str, float]]] = {t: [] for t in args.transports}
            for i in range(args.repeats):
                order = args.transports if i % 2 == 0 else args.transports[::-1]
                for transport in order:  # alternate: same conditions for all
                    runs[transport].append(
                        measure(transport, streams, steps, step_s, args.spin_us / 1e6)
                    )
            for transport, rs in runs.items():
                row = {"bench": "transport_raw", "mode": mode, "transport": transport,
                       "streams": streams, "steps": steps, "repeats": args.repeats,
                       "step_ms": args.step_ms if mode == "paced" else 0.0,
                       "spin_us": args.spin_us if transport != "socket" else 0.0,
                       "host": host, "cpus": os.cpu_count(), "stat": "median",
                       "loadavg_1m": round(os.getloadavg()[0], 2),
                       **median_row(rs)}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with args.out.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print()
    print(f"{'mode':6} {'streams':>7} {'transport':12} {'p50 us':>9} {'p99 us':>9} "
          f"{'events/s':>11} {'wakeups':>8} {'doorbells':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['mode']:6} {r['streams']:>7} {r['transport']:12} {r['lat_p50_us']:>9.1f} "
              f"{r['lat_p99_us']:>9.1f} {r['events_per_s']:>11.0f} {r['wakeups']:>8.0f} "
              f"{r.get('doorbells', 0):>9.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
