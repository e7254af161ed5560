"""Typed errors (INTERFACES.md). Every failure a caller can see is a FlareError subclass."""

from __future__ import annotations

from shm_protocol import messages as m


class FlareError(Exception):
    """Base class of every libflare_client error."""


class InvalidRequest(FlareError):
    """The request is malformed (validation failed); fix it before retrying."""


class CapacityError(FlareError):
    """The request exceeds a prepared capacity of the loaded bundle; never retried."""


class Busy(FlareError):
    """The daemon's queue is full, or it is starting or draining; retry later."""


class Cancelled(FlareError):
    """The daemon cancelled the request (slow consumer, drain timeout, or shutdown)."""


class EngineError(FlareError):
    """Execution failed inside the daemon."""


class ToolChoiceUnsatisfied(FlareError):
    """The output did not satisfy tool_choice ("required": no complete call to a declared
    tool; a named function: not called, or another tool called). The response failed."""


class ConnectionLost(FlareError):
    """The daemon is gone or unreachable. An in-flight request is never resubmitted."""


class ProtocolError(FlareError):
    """The daemon and this client do not speak the same protocol, or a frame was invalid."""


class PermissionDenied(FlareError):
    """The daemon refused this process's credentials (socket permissions or SO_PEERCRED)."""


_BY_CODE: dict[str, type[FlareError]] = {
    m.INVALID_REQUEST: InvalidRequest,
    m.CAPACITY: CapacityError,
    m.BUSY: Busy,
    m.CANCELLED: Cancelled,
    m.ENGINE_ERROR: EngineError,
    m.PROTOCOL: ProtocolError,
    m.UNSUPPORTED_VERSION: ProtocolError,
    m.PERMISSION_DENIED: PermissionDenied,
    m.TOOL_CHOICE_UNSATISFIED: ToolChoiceUnsatisfied,
}


def from_reply(reply: m.ErrorReply) -> FlareError:
    cls = _BY_CODE.get(reply.code, FlareError)
    return cls(reply.message)
