"""Engine events -> encoded wire messages, on the detokenizer lanes.

Per-request order is kept by construction: a request always maps to the same single-threaded
lane, batches enter a lane in the order the engine produced them, and a lane completes them in
order. Encoding happens here too, so the event loop only copies bytes into rings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flared.engine.events import FinishEvent, TokenEvent
from flared.engine.plan import FinishReason
from flared.server.live import LiveRequest
from shm_protocol import messages as m
from shm_protocol.codec import encode_body

FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.EOS: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CAPACITY: "length",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.NONE: "stop",
}


@dataclass(frozen=True)
class Outgoing:
    live: LiveRequest
    payload: bytes
    terminal: bool


@dataclass(frozen=True)
class Work:
    """One engine event bound to its request; `error` replaces a FinishEvent's Finished with
    an ErrorReply (engine failure, daemon cancellation), decided on the loop."""

    event: Any
    live: LiveRequest
    error: m.ErrorReply | None = None


def _delta(ev: TokenEvent, live: LiveRequest) -> bytes:
    ids = [t.token_id for t in ev.tokens]
    text = live.detokenizer.push(ids) if live.detokenizer is not None else ""
    if not live.want_logprobs:
        return encode_body(m.TokenDelta(ev.request_id, ids, text))
    lps = [float(t.logprob) for t in ev.tokens]
    tops = [[(int(a), float(b)) for a, b in t.top_logprobs] for t in ev.tokens]
    return encode_body(m.TokenDelta(ev.request_id, ids, text, lps, tops))


def _finished(ev: FinishEvent, live: LiveRequest) -> bytes:
    tail = live.detokenizer.flush() if live.detokenizer is not None else ""
    return encode_body(
        m.Finished(
            ev.request_id,
            FINISH_REASONS.get(ev.reason, "stop"),
            live.prompt_tokens or ev.prompt_tokens,
            ev.completion_tokens,
            ev.cached_tokens,
            tail,
        )
    )


def render_batch(batch: Sequence[Work]) -> list[Outgoing]:
    """Lane job: detokenize and encode, in order. Never raises for one bad event."""
    out: list[Outgoing] = []
    for w in batch:
        if isinstance(w.event, TokenEvent):
            if w.live.orphaned or w.live.terminated:
                continue
            out.append(Outgoing(w.live, _delta(w.event, w.live), False))
        elif w.error is not None:
            out.append(Outgoing(w.live, encode_body(w.error), True))
        else:
            out.append(Outgoing(w.live, _finished(w.event, w.live), True))
    return out
