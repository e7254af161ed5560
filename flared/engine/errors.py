"""Why the engine refused a request at submission. Each message names the limit exceeded."""

from __future__ import annotations


class EngineRejection(Exception):
    """A request the engine will not take. Nothing was queued or allocated for it."""


class InvalidRequest(EngineRejection):
    """The request is malformed: empty prompt, duplicate live id, max_tokens < 1, bad endpoints."""


class CapacityError(EngineRejection):
    """The request could never run here: it exceeds the context limit or the whole page pool."""


class Busy(EngineRejection):
    """The request is fine but the waiting queue is full; retrying later may succeed."""
