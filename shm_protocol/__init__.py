"""Flare's wire contract: frames and messages on the control socket, shared-memory rings.

Dependencies: the standard library and msgspec only (posix_ipc is not needed: segments are
sealed memfds and wake-ups are pipe or socket doorbells).
"""

from shm_protocol.codec import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameBuffer,
    ProtocolViolation,
    client_decoder,
    daemon_decoder,
    encode_body,
    encode_frame,
)
from shm_protocol.messages import PROTOCOL_VERSION, SUPPORTED_VERSIONS
from shm_protocol.ring import RingCorrupt, RingReader, RingWriter

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "FrameBuffer",
    "ProtocolViolation",
    "RingCorrupt",
    "RingReader",
    "RingWriter",
    "client_decoder",
    "daemon_decoder",
    "encode_body",
    "encode_frame",
]
