"""The commands the engine thread takes from its queue (flared.llm_engine): submit, cancel,
stop, and how a submitter learns the verdict on its request (a threading.Event it waits on, or
a callback for callers that must not block)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from flared.engine.events import EngineEvent
from flared.engine.plan import RequestParams

log = logging.getLogger("flared.engine")

Sink = Callable[[EngineEvent], None]
# submit_nowait's verdict: None once the request is admitted into a step (or queued), or its
# typed rejection; called on the engine thread, must not block
Accepted = Callable[[BaseException | None], None]


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: RequestParams
    sink: Sink
    done: Signal
    endpoints: tuple[int, ...] = ()
    grammar: Any = None
    packed: bytes | None = None  # prompt_token_ids as little-endian int64s


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Stop:
    """Drain in-flight steps, cancel what is left, and leave the loop."""


@dataclass
class Ack:
    error: BaseException | None = None


class Signal(Protocol):
    """What `Submit.done` needs: a threading.Event, or Notify."""

    def set(self) -> None:
        """Called once on the engine thread, after the verdict is in the request's Ack."""


class Notify:
    """`submit_nowait`'s `done`: calls back with the engine's verdict instead of waking a
    waiting thread."""

    def __init__(self, acks: dict[str, Ack], request_id: str, ack: Ack, callback: Accepted) -> None:
        self._acks, self._rid, self._ack, self._callback = acks, request_id, ack, callback

    def set(self) -> None:
        if self._acks.get(self._rid) is self._ack:
            del self._acks[self._rid]
        try:
            self._callback(self._ack.error)
        except Exception:  # the engine thread must survive its caller's callback
            log.exception("submit callback failed for %s", self._rid)
