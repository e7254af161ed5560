"""Length-prefixed msgpack frames: a 4-byte big-endian body length, then the body.

The length is checked against `max_frame_bytes` BEFORE any body byte is buffered or decoded, so
a hostile peer cannot make the reader allocate more than one bounded frame. Decoding goes
through typed msgspec decoders (never pickle); anything that is not exactly one known message
raises `ProtocolViolation`, and the caller closes that connection only.
"""

from __future__ import annotations

import struct
from typing import Final, Generic, TypeVar

import msgspec

from shm_protocol.messages import ClientMessage, DaemonMessage, RingEvent

HEADER: Final = struct.Struct(">I")
HEADER_BYTES: Final = HEADER.size
DEFAULT_MAX_FRAME_BYTES: Final = 1 << 20

T = TypeVar("T")


class ProtocolViolation(Exception):
    """The peer sent bytes that are not a valid frame; the connection must be closed."""


_ENCODER = msgspec.msgpack.Encoder()


def encode_body(msg: msgspec.Struct) -> bytes:
    return _ENCODER.encode(msg)


def encode_frame(msg: msgspec.Struct) -> bytes:
    body = _ENCODER.encode(msg)
    return HEADER.pack(len(body)) + body


def array_header(n: int) -> bytes:
    """The msgpack array header for `n` elements: an array body is its elements' encodings
    concatenated, so a batch of already-encoded messages is this header plus their bytes."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


ARRAY_HEADER_MAX_BYTES: Final = 5


def check_length(length: int, max_frame_bytes: int) -> int:
    if length > max_frame_bytes:
        raise ProtocolViolation(f"frame of {length} bytes exceeds the {max_frame_bytes}-byte limit")
    return length


class TypedDecoder(Generic[T]):
    """Decodes one message body into the union `T`, mapping every failure to ProtocolViolation."""

    def __init__(self, union: type[T]) -> None:
        self._dec: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(union)

    def decode(self, body: bytes | memoryview) -> T:
        try:
            return self._dec.decode(body)
        except msgspec.ValidationError as exc:
            raise ProtocolViolation(f"invalid message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ProtocolViolation(f"undecodable frame: {exc}") from None


def client_decoder() -> TypedDecoder[ClientMessage]:
    return TypedDecoder(ClientMessage)  # type: ignore[arg-type]


def daemon_decoder() -> TypedDecoder[DaemonMessage]:
    return TypedDecoder(DaemonMessage)  # type: ignore[arg-type]


def ring_event_decoder() -> TypedDecoder[list[RingEvent]]:
    """Decodes one event-ring record: a msgpack array of events, in one call."""
    return TypedDecoder(list[RingEvent])


class FrameBuffer(Generic[T]):
    """Incremental frame splitter for a byte stream (sans-IO).

    Invariant: `_buf` never holds more than one header plus one bounded body plus whatever
    the last `feed` brought; callers feed reads of bounded size."""

    def __init__(self, decoder: TypedDecoder[T], max_frame_bytes: int) -> None:
        self._decoder = decoder
        self._max = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[T]:
        self._buf += data
        out: list[T] = []
        while len(self._buf) >= HEADER_BYTES:
            (length,) = HEADER.unpack_from(self._buf, 0)
            check_length(length, self._max)
            end = HEADER_BYTES + length
            if len(self._buf) < end:
                break
            body = bytes(self._buf[HEADER_BYTES:end])
            del self._buf[:end]
            out.append(self._decoder.decode(body))
        return out

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)
