"""One request as the daemon tracks it between Submit and its terminal message.

Ownership: fields are written on the event loop only, except `output` (the request's
OutputPipeline), written once by the admission worker before the engine knows the request and
then touched only by the request's detokenizer lane, and `prompt_tokens`, written once by the
admission worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class EventSink(Protocol):
    """What a LiveRequest delivers into (a Session)."""

    session_id: str

    def enqueue(self, request_id: str, payload: bytes, terminal: bool) -> None: ...


@dataclass(eq=False)
class LiveRequest:
    request_id: str  # the client's id: unique within its session only
    session: Any  # flared.server.session.Session (Any: avoids an import cycle)
    lane: int
    output: Any | None = None  # flared.frontend.pipeline.OutputPipeline; None: no text
    want_logprobs: bool = False
    prompt_tokens: int = 0
    delivered: bool = False  # a TokenDelta went out (the first carries prompt_tokens)
    submitted: bool = False  # the engine accepted it; engine.cancel() now works
    cancel_requested: bool = False  # the client asked; applied once submitted
    orphaned: bool = False  # its session is gone: cancel, deliver nothing
    terminated: bool = False  # an ErrorReply already ended it for the client
    daemon_cancel_reason: str | None = None  # the daemon cancelled it (drain timeout)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def engine_id(self) -> str:
        """The id the engine and the daemon's tables know it by: request ids are namespaced
        per session, so two clients may use the same id and neither learns of the other's."""
        return engine_id(self.session.session_id, self.request_id)

    @property
    def wants_cancel(self) -> bool:
        return (
            self.cancel_requested
            or self.orphaned
            or self.terminated
            or (self.daemon_cancel_reason is not None)
        )


def engine_id(session_id: str, request_id: str) -> str:
    return f"{session_id}/{request_id}"
