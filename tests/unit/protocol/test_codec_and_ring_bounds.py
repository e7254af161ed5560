"""Frame bounds and ring validation against hostile bytes (unit level; e2e repeats these
against a live daemon)."""

from __future__ import annotations

import struct
import time

import msgspec
import pytest

from shm_protocol import messages as m
from shm_protocol import ring
from shm_protocol.codec import (
    HEADER,
    FrameBuffer,
    ProtocolViolation,
    client_decoder,
    encode_frame,
)
from shm_protocol.ring import (
    DATA_OFFSET,
    HEAD_OFFSET,
    PUBLISHED_NS_OFFSET,
    SLEEPS_OFFSET,
    SLOT_BYTES,
    TAIL_OFFSET,
    RingCorrupt,
    RingReader,
    RingWriter,
    init_header,
    read_capacity,
)
from shm_protocol.segment import create_ring_segment, map_ring_segment

CAP = 4 * SLOT_BYTES


def _ring() -> tuple[memoryview, RingWriter, RingReader]:
    buf = memoryview(bytearray(DATA_OFFSET + CAP))
    init_header(buf, CAP)
    return buf, RingWriter(buf, CAP), RingReader(buf, CAP)


def test_frames_split_across_reads() -> None:
    data = encode_frame(m.Cancel("a")) + encode_frame(m.Ping(3))
    fb = FrameBuffer(client_decoder(), 1024)
    out = [msg for b in data for msg in fb.feed(bytes([b]))]
    assert out == [m.Cancel("a"), m.Ping(3)]
    assert fb.pending_bytes == 0


def test_oversized_length_prefix_is_rejected_before_the_body_arrives() -> None:
    fb = FrameBuffer(client_decoder(), 1024)
    with pytest.raises(ProtocolViolation, match="exceeds"):
        fb.feed(HEADER.pack(1025))


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x63\xa1x",  # unknown tag 99
        b"\x92\x03\x05",  # Cancel with an int request id
        b"\x9d\x02\xa2r1\xa3bad",  # Submit with a string max_tokens
        b"\x91\x41",  # TokenDelta tag in the client union
        b"\x90",  # empty array
        b"\x81\xa1a\x01",  # a map, not a tagged array
    ],
)
def test_garbage_and_wrong_types_raise_protocol_violation(body: bytes) -> None:
    fb = FrameBuffer(client_decoder(), 1024)
    with pytest.raises(ProtocolViolation):
        fb.feed(HEADER.pack(len(body)) + body)


@pytest.mark.parametrize("head", [SLOT_BYTES // 2, CAP + SLOT_BYTES, 2**64 - SLOT_BYTES])
def test_reader_rejects_impossible_head(head: int) -> None:
    buf, _w, r = _ring()
    struct.pack_into("<Q", buf, HEAD_OFFSET, head)
    with pytest.raises(RingCorrupt):
        r.pop()


def test_reader_rejects_record_longer_than_published() -> None:
    buf, w, r = _ring()
    assert w.try_push(b"abc")
    w.publish()
    struct.pack_into("<I", buf, DATA_OFFSET, 10_000)  # corrupt the length word
    with pytest.raises(RingCorrupt):
        r.pop()


@pytest.mark.parametrize("tail", [SLOT_BYTES * 2, 3, 2**63])
def test_writer_rejects_tail_beyond_head_or_backwards(tail: int) -> None:
    buf, w, _r = _ring()
    assert w.try_push(b"x")
    w.publish()
    struct.pack_into("<Q", buf, TAIL_OFFSET, tail)
    with pytest.raises(RingCorrupt):
        w.refresh_tail()


def test_full_ring_refuses_then_accepts_after_read() -> None:
    _buf, w, r = _ring()
    big = bytes(SLOT_BYTES * 2 - 4)
    assert w.try_push(big) and w.try_push(big)
    assert not w.try_push(b"")
    w.publish()
    assert r.pop() == big
    assert w.try_push(b"")


def test_sealed_memfd_segment_cannot_be_resized() -> None:
    import os

    fd, seg = create_ring_segment("flare-test", CAP)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 16)
        dup = os.dup(fd)
        client = map_ring_segment(dup, CAP)
        assert read_capacity(client.view) == CAP
        client.close()
    finally:
        os.close(fd)
        seg.close()


def test_indices_scribbled_before_the_sides_attach_are_not_trusted() -> None:
    buf = memoryview(bytearray(DATA_OFFSET + CAP))
    init_header(buf, CAP)
    struct.pack_into("<Q", buf, TAIL_OFFSET, 2**62)  # the client got there first
    struct.pack_into("<Q", buf, HEAD_OFFSET, 2**62)
    w, r = RingWriter(buf, CAP), RingReader(buf, CAP)
    assert w.free_bytes() == CAP
    with pytest.raises(RingCorrupt):
        r.pop()
    for _ in range(4):
        assert w.try_push(bytes(SLOT_BYTES - 4))
    with pytest.raises(RingCorrupt):  # full: now it must consult the (bogus) tail
        w.try_push(b"x")


@pytest.mark.parametrize("sleeps", [1, 2, 2**64 - 1, 2**64 - 2, 12345, 12346])
def test_hostile_sleeps_word_costs_at_most_one_doorbell_per_change(sleeps: int) -> None:
    buf, w, _r = _ring()
    assert w.try_push(b"x")
    w.publish()
    assert w.reader_slept()  # the first publish always rings
    assert not w.reader_slept()  # nothing declared since
    struct.pack_into("<Q", buf, SLEEPS_OFFSET, sleeps)  # any value: parity and change matter
    assert w.reader_slept() == bool(sleeps & 1)  # even: an awake (polling) reader
    assert not w.reader_slept()


def test_a_reader_that_woke_to_poll_gets_no_doorbell_until_it_declares_again() -> None:
    buf, w, r = _ring()
    assert w.try_push(b"a")
    w.publish()
    assert w.reader_slept()  # the first publish always rings
    assert [bytes(x) for x in r.drain()] == [b"a"]
    assert r.prepare_sleep() and r.asleep
    r.wake()  # polling for the next batch: the producer must not ring
    assert not r.asleep
    assert struct.unpack_from("<Q", buf, SLEEPS_OFFSET)[0] == 2
    assert w.try_push(b"b")
    w.publish()
    assert not w.reader_slept()
    assert [bytes(x) for x in r.drain()] == [b"b"]
    r.wake()  # already awake: no change
    assert struct.unpack_from("<Q", buf, SLEEPS_OFFSET)[0] == 2
    assert r.prepare_sleep()  # a new odd value: the next publish rings once
    assert struct.unpack_from("<Q", buf, SLEEPS_OFFSET)[0] == 3
    assert w.try_push(b"c")
    w.publish()
    assert w.reader_slept()
    assert not w.reader_slept()


def test_published_at_is_the_producers_monotonic_publish_time() -> None:
    _buf, w, r = _ring()
    before = time.monotonic()
    assert w.try_push(b"a")
    w.publish()
    after = time.monotonic()
    assert before - 1e-6 <= r.published_at() <= after + 1e-6


def test_push_array_writes_one_msgpack_array_record_or_nothing() -> None:
    _buf, w, r = _ring()
    payloads = [msgspec.msgpack.encode(x) for x in (1, "two", [3], b"four")]
    n = sum(map(len, payloads))
    assert w.push_array(payloads, n)
    w.publish()
    (record,) = r.drain()
    assert msgspec.msgpack.decode(record) == [1, "two", [3], b"four"]
    many = [msgspec.msgpack.encode(i) for i in range(20)]  # a 3-byte array header
    assert w.push_array(many, sum(map(len, many)))
    w.publish()
    assert msgspec.msgpack.decode(r.drain()[0]) == list(range(20))
    big = [bytes(CAP)]
    head = w.head
    assert not w.push_array(big, len(big[0]))  # does not fit: nothing written
    w.publish()
    assert w.head == head and r.drain() == []


@pytest.mark.parametrize("weak_order", [False, True])
def test_publish_array_is_push_publish_and_the_doorbell_check_in_one_call(
    weak_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One and two payloads (written in place), sixteen (a 3-byte array header), records that
    wrap the ring's end, one that does not fit (nothing written), and the doorbell answers of
    reader_slept: the first publish rings, an awake reader is not rung, a new sleep is."""
    monkeypatch.setattr(ring, "WEAK_ORDER", weak_order)
    _buf, w, r = _ring()
    enc = msgspec.msgpack.encode
    assert w.publish_array([enc("a")], 2) == 1  # the first publish always rings
    assert msgspec.msgpack.decode(r.drain()[0]) == ["a"]
    for i in range(12):  # 64-byte records around a 4-slot ring: every offset, wrapping
        items = [enc(i), enc("x" * (40 + i))][: 1 + i % 2]
        assert w.publish_array(items, sum(map(len, items))) == 0  # awake: no doorbell
        assert [msgspec.msgpack.decode(x) for x in r.drain()] == [[i, "x" * (40 + i)][: 1 + i % 2]]
    assert r.prepare_sleep()
    sixteen = [enc(i) for i in range(16)]
    assert w.publish_array(sixteen, 16) == 1  # a new sleep declaration: ring once
    assert w.publish_array([enc(None)], 1) == 0
    assert [msgspec.msgpack.decode(x) for x in r.drain()] == [list(range(16)), [None]]
    head = w.head
    assert w.publish_array([bytes(CAP)], CAP) == ring.NOT_WRITTEN
    assert w.head == head and r.drain() == []
    for _ in range(4):  # one slot each: the ring fills
        assert w.publish_array([enc("y" * 50)], 52) == 0
    assert w.publish_array([enc("y" * 50)], 52) == ring.NOT_WRITTEN  # full: the reader is behind
    assert len(r.drain()) == 4


def test_a_one_event_publish_writes_the_bytes_push_array_writes() -> None:
    """A single event is packed by one per-size struct (below 256 bytes) or the general path:
    either way the record's length word, array header and bytes equal push_array's, at sizes
    around the struct cache's limit and the slot size, from offsets that reach the ring's end."""
    cap = 1024
    for size in (0, 1, 58, 59, 60, 63, 64, 200, 255, 256, 257, 300):
        payload = bytes((size + i) % 251 for i in range(size))
        for lead in (0, 1, 14, 15):  # earlier records: the next one ends or wraps at the end
            rings = []
            for one_call in (True, False):
                buf = memoryview(bytearray(DATA_OFFSET + cap))
                init_header(buf, cap)
                w, r = RingWriter(buf, cap), RingReader(buf, cap)
                for _ in range(lead):
                    assert w.publish_array([b"\xc0"], 1) >= 0
                    r.drain()
                if one_call:
                    assert w.publish_array([payload], size) >= 0
                else:
                    assert w.push_array([payload], size, True)
                (record,) = r.drain()
                assert bytes(record) == bytes([0x91]) + payload, (size, lead)
                rings.append((bytes(buf[DATA_OFFSET:]), w.head))
            (ring_a, head_a), (ring_b, head_b) = rings
            assert head_a == head_b
            start, n = head_a - ((size + 5 + 63) & -64), size + 5  # the record, padding aside
            span = [(start + i) % cap for i in range(n)]
            assert [ring_a[i] for i in span] == [ring_b[i] for i in span], (size, lead)


def test_publish_array_validates_the_tail_it_reads() -> None:
    buf, w, _r = _ring()
    assert w.publish_array([b"\x01"], 1) == 1
    struct.pack_into("<Q", buf, TAIL_OFFSET, w.head + 2 * SLOT_BYTES)  # past the next publish
    with pytest.raises(RingCorrupt):
        w.publish_array([b"\x02"], 1)


def test_prepare_sleep_validates_the_head_it_reads() -> None:
    buf, _w, r = _ring()
    assert r.prepare_sleep()  # empty: sleep
    struct.pack_into("<Q", buf, HEAD_OFFSET, CAP + SLOT_BYTES)
    with pytest.raises(RingCorrupt):
        r.prepare_sleep()


def test_prepare_sleep_reports_records_published_before_the_declaration() -> None:
    buf, w, r = _ring()
    assert w.try_push(b"abc")
    w.publish()
    assert not r.prepare_sleep()  # do not sleep: there is something to take
    assert [bytes(x) for x in r.drain()] == [b"abc"]
    assert r.prepare_sleep()
    assert struct.unpack_from("<Q", buf, SLEEPS_OFFSET)[0] == 3  # each declaration a new odd


def test_push_batch_writes_the_prefix_that_fits_and_nothing_partial() -> None:
    _buf, w, r = _ring()
    small, big = b"s" * 10, bytes(2 * SLOT_BYTES - 4)
    assert w.push_batch([small, small, big, small]) == 3  # 64 + 64 + 128: the ring is full
    assert w.free_bytes() == 0
    assert w.push_batch([b""]) == 0
    w.publish()
    assert [bytes(x) for x in r.drain()] == [small, small, big]
    with pytest.raises(ValueError, match="exceeds"):
        w.push_batch([bytes(CAP)])


def test_corrupt_length_inside_a_batch_raises_and_keeps_the_tail() -> None:
    buf, w, r = _ring()
    assert w.push_batch([b"a", b"b", b"c"]) == 3
    w.publish()
    struct.pack_into("<I", buf, DATA_OFFSET + SLOT_BYTES, CAP)  # the second record's length
    with pytest.raises(RingCorrupt):
        r.drain()
    assert r.tail == 0 and struct.unpack_from("<Q", buf, TAIL_OFFSET)[0] == 0


def test_version_1_segment_is_refused() -> None:
    buf = memoryview(bytearray(DATA_OFFSET + CAP))
    init_header(buf, CAP)
    struct.pack_into("<H", buf, 4, 1)
    with pytest.raises(RingCorrupt, match="version"):
        read_capacity(buf)


def test_mapping_smaller_than_the_ring_is_refused() -> None:
    with pytest.raises(RingCorrupt):
        RingReader(memoryview(bytearray(DATA_OFFSET + CAP - 1)), CAP)


def test_the_compiled_publish_is_built_here() -> None:
    """setup.py builds `shm_protocol._ringfast` wherever a C compiler and the Python headers
    are found, as on every machine that runs this suite (the compiler's CPU code needs both):
    the tests below then exercise it rather than the fallback."""
    assert ring.COMPILED_PUBLISH, "shm_protocol._ringfast was not built (see setup.py)"


def _twin_rings(cap: int) -> list[tuple[memoryview, RingWriter, RingReader]]:
    rings = []
    for _ in range(2):
        buf = memoryview(bytearray(DATA_OFFSET + cap))
        init_header(buf, cap)
        rings.append((buf, RingWriter(buf, cap, max_payload_bytes=cap // 2), RingReader(buf, cap)))
    return rings


@pytest.mark.skipif(not ring.COMPILED_PUBLISH, reason="the compiled publish is not built")
@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_one_event_publish_equals_the_python_one(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random runs on twin rings, one published by `publish_one` (C), one by `publish_array`
    (Python): payloads of 0 .. 200 bytes (some over the payload limit), records that wrap the
    ring's end, a ring that fills because the reader falls behind, pushes left unpublished
    before a publish, and the reader sleeping, waking to poll and draining. Every answer, every
    record the reader gets, the writers' positions and the rings' headers (the timestamp aside)
    are the same (a record's padding is never read: the Python path may zero it, C leaves it)."""
    import random

    rnd = random.Random(seed)
    cap = 1024
    (buf_c, wc, rc), (buf_p, wp, rp) = _twin_rings(cap)
    for _ in range(3000):
        op = rnd.random()
        if op < 0.6:
            size = rnd.choice([0, 1, 2, 58, 59, 60, 64, 100, 200, rnd.randrange(0, 600)])
            payload = bytes(rnd.randrange(256) for _ in range(size))
            got = wc.publish_one(payload)
            with monkeypatch.context() as python_only:  # publish_array's own Python path
                python_only.setattr(ring, "_publish_one_c", None)
                want = wp.publish_array([payload], len(payload))
            assert got == want, (seed, size)
        elif op < 0.7:  # a record pushed unpublished: the next publish carries it
            payload = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 80)))
            assert wc.push_array([payload], len(payload)) == wp.push_array([payload], len(payload))
        elif op < 0.85:
            limit = rnd.choice([None, 1, 3])
            assert [bytes(x) for x in rc.drain(limit)] == [bytes(x) for x in rp.drain(limit)]
        elif op < 0.93:
            assert rc.prepare_sleep() == rp.prepare_sleep()
        else:
            rc.wake()
            rp.wake()
        assert (wc.head, wc._head, wc._tail, wc._sleeps_seen) == (
            wp.head, wp._head, wp._tail, wp._sleeps_seen,
        )  # fmt: skip
        words_c, words_p = bytearray(buf_c[:DATA_OFFSET]), bytearray(buf_p[:DATA_OFFSET])
        words_c[PUBLISHED_NS_OFFSET : PUBLISHED_NS_OFFSET + 8] = bytes(8)
        words_p[PUBLISHED_NS_OFFSET : PUBLISHED_NS_OFFSET + 8] = bytes(8)
        assert words_c == words_p
    wc.publish()
    wp.publish()
    assert [bytes(x) for x in rc.drain()] == [bytes(x) for x in rp.drain()]


@pytest.mark.skipif(not ring.COMPILED_PUBLISH, reason="the compiled publish is not built")
def test_the_compiled_publish_validates_the_tail_and_its_views() -> None:
    """A tail past the published head, or misaligned, read before the write (a full ring) or
    after the head store, raises RingCorrupt as the Python path does; views and state that are
    not a ring writer's are refused with ValueError, never written through."""
    for where in ("after", "before"):
        for bad in ("past", "misaligned"):
            buf, w, _r = _ring()
            assert w.publish_one(b"\x01") == 1
            if where == "before":  # fill the ring so the writer must re-read the tail first
                while w.publish_one(b"x" * 50) != ring.NOT_WRITTEN:
                    pass
            tail = w.head + 2 * SLOT_BYTES if bad == "past" else 1
            struct.pack_into("<Q", buf, TAIL_OFFSET, tail)
            head = w.head
            with pytest.raises(RingCorrupt):
                w.publish_one(b"\x02")
            assert w.head == (head if where == "before" else head + SLOT_BYTES)
    from shm_protocol._ringfast import publish_one

    buf, w, _r = _ring()
    with pytest.raises(ValueError):  # a header view too short
        publish_one(w._data, w._words[:4], b"x", 0, 0, 0, None, 100)
    with pytest.raises(ValueError):  # head past tail + capacity
        publish_one(w._data, w._words, b"x", CAP + SLOT_BYTES, 0, 0, None, 100)
    with pytest.raises(BufferError):  # a read-only view
        publish_one(bytes(CAP), w._words, b"x", 0, 0, 0, None, 100)
    assert bytes(buf[DATA_OFFSET:]) == bytes(CAP)
