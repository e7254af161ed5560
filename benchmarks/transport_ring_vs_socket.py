"""Ring (sealed memfd + coalesced doorbell) vs plain Unix-socket frames for token events.

Two processes, the real shm_protocol pieces on both sides. The producer encodes one TokenDelta
per stream per "step" (as the daemon does after an engine step) and delivers the step's batch
either through Outbox -> RingWriter (the step's events as one array record: one copy, one head
store) plus a doorbell only when the reader declared it was going to sleep, or as
length-prefixed frames in one sendall (the batching a socket user has: one send per step).
Doorbells: "ring" = a byte on the session's doorbell pipe, the reader taking the records before
the byte (what the daemon and client do); "ring-frame" = an EventsReady frame on the socket
(sessions that did not ask for the pipe); "ring-anticipate" = the pipe, plus the client's
anticipation (shm_protocol/cadence.py: a timerfd wakes the reader just before the next expected
step, which then polls the ring for a bounded window with its sleep withdrawn).
The consumer uses the client's decoders: FrameBuffer for frames, RingReader.drain plus the
event-array decoder for the ring. Latency per event: CLOCK_MONOTONIC stamped before encoding,
compared after decoding in the other process; `send_us_p50` is the producer's part of it (stamp
-> its last write or doorbell returned), so the rest is the reader's wake-up. `consumer_cpu_s` is the reader's CPU time (the
anticipation's polling shows there).

Modes:  paced   --steps steps, one every --step-ms (a decode cadence): per-event delivery
                latency
        flood   --flood-steps steps back to back: events/s throughput (and latency under load)
The producer starts once the consumer process is waiting. All transports run in the same
invocation, alternating, for 1/4/64 streams (64 streams: a sixteenth of the steps); each row is
the median over --repeats runs of that configuration. `--spin-us` makes the ring reader poll the
ring that long after each batch before it declares a sleep (the client does not; its
anticipation is the ring-anticipate transport).

    python benchmarks/transport_ring_vs_socket.py [--steps 2000] [--flood-steps 20000]
        [--step-ms 2] [--repeats 5]
        [--spin-us 0] [--phases] [--transports ring,ring-anticipate,ring-frame,socket]
        [--out benchmarks/results/transport_ring_vs_socket.jsonl]

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shm_protocol import doorbell
from shm_protocol import messages as m
from shm_protocol.cadence import Cadence, WakeTimer, poll_until
from shm_protocol.codec import (
    HEADER,
    FrameBuffer,
    client_decoder,
    daemon_decoder,
    encode_body,
    encode_frame,
    ring_event_decoder,
)
from shm_protocol.doorbell import DoorbellPipe
from shm_protocol.outbox import Outbox
from shm_protocol.ring import COMPILED_PUBLISH, NOT_WRITTEN, RingReader, RingWriter
from shm_protocol.segment import Segment, create_ring_segment, map_ring_segment

RING_BYTES = 1 << 18
WAIT_TIMEOUT_S = 0.05  # the consumer's doorbell wait; on expiry it re-checks the ring


def produce(sock: socket.socket, seg: Segment | None, bell: DoorbellPipe | None, streams: int,
            steps: int, step_s: float, phases: bool = False) -> dict[str, float]:  # fmt: skip
    """The daemon's side (flared/server/session.py: Session.publish_one for one stream,
    enqueue + Session.flush for more). Also times each step's sending (stamp -> the last write
    or doorbell returned): latency minus that is the wake-up. `phases`: also the mean µs per
    step of encoding, writing (Outbox.publish_alone, or enqueue + Outbox.flush_check, each
    publishing and checking the sleep word in one writer call; or sendall) and the doorbell
    (the pipe byte or frame when the reader sleeps), with two more clock reads per step."""
    outbox = Outbox(RingWriter(seg.view, seg.capacity), 1 << 16) if seg else None
    frames = FrameBuffer(client_decoder(), 1 << 20)
    doorbells = 0
    rids = [f"r{i}" for i in range(streams)]
    next_t = time.perf_counter()
    send_ns: list[int] = []
    clock = time.perf_counter_ns
    encode_ns = write_ns = check_ns = 0
    for step in range(steps):
        t_stamp = time.perf_counter_ns()
        stamp = str(t_stamp)
        tok = [step % 500]
        payloads = [encode_body(m.TokenDelta(rid, tok, stamp)) for rid in rids]
        if phases:
            t_encoded = clock()
            encode_ns += t_encoded - t_stamp
        if outbox is None:
            sock.sendall(b"".join([HEADER.pack(len(p)) + p for p in payloads]))
            if phases:
                write_ns += clock() - t_encoded
        else:
            # as Session.publish_one / enqueue + flush: a step's only event in one ring call
            wake = outbox.publish_alone(payloads[0]) if streams == 1 else NOT_WRITTEN
            if wake != NOT_WRITTEN:
                head, blocked, wake = outbox.writer.head, False, wake == 1
            else:
                for rid, p in zip(rids, payloads):
                    outbox.enqueue(rid, p, False)
                head, blocked, wake = outbox.flush_check()
            if phases:
                t_written = clock()
                write_ns += t_written - t_encoded
            if wake:
                if bell is not None:
                    bell.ring()
                else:
                    sock.sendall(encode_frame(m.EventsReady(head, blocked)))
                doorbells += 1
            while blocked:  # announce the full ring, wait for the consumer's Advance
                sock.sendall(encode_frame(m.EventsReady(head, blocked)))
                frames.feed(sock.recv(4096))
                head, blocked = outbox.flush()
                doorbells += 1
            if phases:
                check_ns += clock() - t_written
        send_ns.append(clock() - t_stamp)
        if step_s:
            next_t += step_s
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    send_ns.sort()
    out = {"doorbells": doorbells, "send_us_p50": send_ns[len(send_ns) // 2] / 1e3}
    if phases:
        out.update(encode_us=encode_ns / steps / 1e3, write_us=write_ns / steps / 1e3,
                   check_us=check_ns / steps / 1e3)  # fmt: skip
    return out


class _Consumer:
    """The client's side (libflare_client/_connection.py), as a blocking loop."""

    def __init__(self, sock: socket.socket, seg: Segment | None, bell_fd: int, total: int,
                 spin_s: float, anticipate: bool) -> None:  # fmt: skip
        self.sock, self.bell_fd, self.total, self.spin_s = sock, bell_fd, total, spin_s
        self.reader = RingReader(seg.view, seg.capacity) if seg else None
        self.timer = WakeTimer.create() if anticipate else None
        self.cadence = Cadence() if seg else None  # as the client: every ring session learns
        self.poll_until = 0.0
        self.dec = daemon_decoder()
        self.ring_dec = ring_event_decoder()
        self.frames = FrameBuffer(self.dec, 1 << 24)
        self.lat: list[int] = []
        self.wakeups = 0
        self.timer_wakes = self.poll_hits = 0  # anticipation: windows opened, batches caught

    def take(self) -> None:
        assert self.reader is not None
        now = time.perf_counter_ns
        records = self.reader.drain()
        for rec in records:
            for d in self.ring_dec.decode(rec):
                self.lat.append(now() - int(d.text))  # type: ignore[union-attr]
        if records and self.cadence is not None:  # after the events are out
            self.cadence.observe(self.reader.published_at())

    def drain_and_declare(self) -> None:
        """Take records until the ring stays empty across the sleep declaration (and the spin,
        when there is one)."""
        assert self.reader is not None
        while len(self.lat) < self.total:
            self.take()
            if self.spin_s and len(self.lat) < self.total:
                end = time.perf_counter() + self.spin_s
                while not self.reader.pending() and time.perf_counter() < end:
                    pass
                if self.reader.pending():
                    continue
            linger = self.cadence.linger() if self.cadence is not None else 0.0
            if linger and poll_until(self.reader, time.monotonic() + linger):
                continue  # as the client: a fast stream's next batch landed while we polled
            if self.reader.prepare_sleep():
                break
        if self.timer is not None and self.cadence is not None:
            window = self.cadence.window(time.monotonic())
            if window is None:
                self.timer.disarm()
            else:
                self.timer.arm_at(window[0])
                self.poll_until = window[1]

    def on_timer(self) -> None:
        """What the client's Connection._on_timer does."""
        assert self.reader is not None and self.timer is not None
        if not self.timer.clear():
            return  # re-armed since it was reported ready: not this window's wake-up
        self.reader.wake()
        self.timer_wakes += 1
        self.poll_hits += poll_until(self.reader, self.poll_until)
        self.drain_and_declare()

    def run(self) -> None:
        """Waits in epoll with both fds registered once, as the client's asyncio loop does."""
        ring = self.reader is not None
        ep = select.epoll()
        ep.register(self.sock, select.EPOLLIN)
        if self.bell_fd >= 0:
            ep.register(self.bell_fd, select.EPOLLIN)
        timer_fd = -1
        if self.timer is not None:
            timer_fd = self.timer.fd
            ep.register(timer_fd, select.EPOLLIN)
        sock_fd = self.sock.fileno()
        if ring:
            self.drain_and_declare()
        while len(self.lat) < self.total:
            ready = [fd for fd, _ in ep.poll(WAIT_TIMEOUT_S)]
            if not ready:
                if ring:
                    self.drain_and_declare()  # the wait timed out: re-check the ring
                continue
            self.wakeups += 1
            if timer_fd in ready and self.bell_fd not in ready:
                self.on_timer()
            if self.bell_fd in ready:  # records first, then the byte, then declare
                self.take()
                doorbell.reset(self.bell_fd)
                self.drain_and_declare()
            if sock_fd in ready:
                self.on_frames(self.sock.recv(1 << 16))
        ep.close()

    def on_frames(self, data: bytes) -> None:
        assert data, "the producer closed the socket early"
        now = time.perf_counter_ns
        for msg in self.frames.feed(data):
            if isinstance(msg, m.EventsReady):
                self.drain_and_declare()
                if msg.writer_blocked:
                    self.sock.sendall(encode_frame(m.Advance()))
            else:
                self.lat.append(now() - int(msg.text))  # type: ignore[union-attr]


def measure(transport: str, streams: int, steps: int, step_s: float,
            spin_s: float, phases: bool = False) -> dict[str, float]:  # fmt: skip
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ring = transport.startswith("ring")
    fd, seg = create_ring_segment("flare-bench", RING_BYTES) if ring else (-1, None)
    bell = DoorbellPipe() if transport in ("ring", "ring-anticipate") else None
    res_r, res_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # consumer: maps the ring from the inherited fd, as a client does
        a.close()
        os.close(ready_r)
        cseg = map_ring_segment(os.dup(fd), RING_BYTES) if fd >= 0 else None
        bell_fd = -1
        if bell is not None:
            os.close(bell.write_fd)
            bell_fd = bell.read_fd
        c = _Consumer(b, cseg, bell_fd, streams * steps, spin_s, transport == "ring-anticipate")
        os.write(ready_w, b"r")  # the producer starts once the consumer waits
        c.run()
        lat = sorted(x / 1e3 for x in c.lat)
        out = {
            "events": len(lat),
            "t_end_ns": time.perf_counter_ns(),
            "wakeups": c.wakeups,
            "timer_wakes": c.timer_wakes,
            "poll_hits": c.poll_hits,
            "lat_p50_us": lat[len(lat) // 2],
            "lat_p99_us": lat[int(len(lat) * 0.99)],
            "lat_mean_us": statistics.fmean(lat),
            "consumer_cpu_s": time.process_time(),
        }
        os.write(res_w, json.dumps(out).encode())
        os._exit(0)
    b.close()
    if bell is not None:
        bell.close_read_end()
    os.close(res_w)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"r", "the consumer did not start"
    os.close(ready_r)
    t0 = time.perf_counter_ns()
    cpu0 = time.process_time()
    prod = produce(a, seg, bell, streams, steps, step_s, phases)
    prod["producer_cpu_s"] = time.process_time() - cpu0
    raw = b""
    while chunk := os.read(res_r, 1 << 16):
        raw += chunk
    os.waitpid(pid, 0)
    os.close(res_r)
    a.close()
    if seg is not None:
        seg.close()
        os.close(fd)
    if bell is not None:
        bell.close()
    res: dict[str, float] = json.loads(raw)
    res["seconds"] = (res.pop("t_end_ns") - t0) / 1e9
    res["events_per_s"] = res["events"] / res["seconds"]
    res.update(prod)
    return res


def median_row(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=2000, help="paced steps at 1-4 streams (fewer at 64)"
    )
    p.add_argument("--flood-steps", type=int, default=20000, help="flood steps at 1-4 streams")
    p.add_argument("--step-ms", type=float, default=2.0, help="paced mode step interval")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", default="1,4,64")
    p.add_argument("--spin-us", type=float, default=0.0, help="ring reader's spin before sleep")
    p.add_argument("--phases", action="store_true",
                   help="the producer's encode / write / doorbell-check µs per step")  # fmt: skip
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument("--transports", type=lambda s: s.split(","), default=["ring", "socket"],
                   help="ring (doorbell pipe), ring-anticipate (pipe + the client's "
                        "anticipation), ring-frame, socket")  # fmt: skip
    args = p.parse_args()
    rows = []
    host = platform.node()
    for streams in [int(s) for s in args.streams.split(",")]:
        for mode, step_s in (("paced", args.step_ms / 1e3), ("flood", 0.0)):
            n = args.steps if mode == "paced" else args.flood_steps
            steps = max(50, n // max(1, streams // 4))
            runs: dict[str, list[dict[str, float]]] = {t: [] for t in args.transports}
            for i in range(args.repeats):
                order = args.transports if i % 2 == 0 else args.transports[::-1]
                for transport in order:  # alternate: same conditions for all
                    runs[transport].append(
                        measure(transport, streams, steps, step_s, args.spin_us / 1e6, args.phases)
                    )
            for transport, rs in runs.items():
                row = {"bench": "transport_raw", "mode": mode, "transport": transport,
                       "streams": streams, "steps": steps, "repeats": args.repeats,
                       "step_ms": args.step_ms if mode == "paced" else 0.0,
                       "spin_us": args.spin_us if transport != "socket" else 0.0,
                       "host": host, "cpus": os.cpu_count(), "stat": "median",
                       "loadavg_1m": round(os.getloadavg()[0], 2),
                       "compiled_publish": COMPILED_PUBLISH, **median_row(rs)}  # fmt: skip
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with args.out.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    print()
    print(f"{'mode':6} {'streams':>7} {'transport':16} {'p50 us':>9} {'p99 us':>9} "
          f"{'send us':>8} {'events/s':>11} {'wakeups':>8} {'doorbells':>9} {'reader cpu s':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['mode']:6} {r['streams']:>7} {r['transport']:16} {r['lat_p50_us']:>9.1f} "
              f"{r['lat_p99_us']:>9.1f} {r['send_us_p50']:>8.1f} {r['events_per_s']:>11.0f} {r['wakeups']:>8.0f} "
              f"{r.get('doorbells', 0):>9.0f} {r['consumer_cpu_s']:>12.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
