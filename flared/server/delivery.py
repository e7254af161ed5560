"""Engine events -> encoded wire messages, on the detokenizer lanes.

Per-request order is kept by construction: a request always maps to the same single-threaded
lane, batches enter a lane in the order the engine produced them, and a lane completes them in
order. The request's OutputPipeline (detokenize -> stop strings -> reasoning -> tool calls)
runs here, off the engine thread and off the event loop; encoding happens here too, so the
loop only copies bytes into rings. A request without a pipeline (token ids out) has nothing
but encoding to do: the loop runs `render_batch` for it itself (service.Service._drain_inbox).

A stop string ends the output in the lane: later tokens of that request are dropped, the
Outgoing asks the loop to finish the request in the engine (cancel at the step boundary, so
its row and pages are freed), and the engine's FinishEvent then ends the stream with
finish_reason "stop" and `stop_string` set.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flared.engine.events import FinishEvent, TokenEvent
from flared.engine.plan import FinishReason
from flared.frontend.deltas import ToolCallDelta
from flared.server.admission import error_text
from flared.server.live import LiveRequest
from shm_protocol import messages as m
from shm_protocol.codec import encode_body

log = logging.getLogger("flared.server")

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
    finish_engine: bool = False  # the output ended (stop string): cancel it in the engine


@dataclass(frozen=True)
class Work:
    """One engine event bound to its request; `error` replaces a FinishEvent's Finished with
    an ErrorReply (engine failure, daemon cancellation), decided on the loop."""

    event: Any
    live: LiveRequest
    error: m.ErrorReply | None = None


def _parts(calls: Sequence[ToolCallDelta]) -> list[m.ToolCallPart]:
    return [m.ToolCallPart(c.index, c.arguments, c.id or "", c.name or "") for c in calls]


def _delta(ev: TokenEvent, live: LiveRequest) -> Outgoing | None:
    ids = [t.token_id for t in ev.tokens]
    out = live.output
    piece = out.push(ids) if out is not None else None
    if out is not None and piece is None:
        return None  # after a stop string: these tokens are not part of the output
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    if live.want_logprobs:
        lps = [float(t.logprob) for t in ev.tokens]
        tops = [[(int(a), float(b)) for a, b in t.top_logprobs] for t in ev.tokens]
    first = 0 if live.delivered else live.prompt_tokens
    live.delivered = True
    if piece is None:
        msg = m.TokenDelta(live.request_id, ids, "", lps, tops, prompt_tokens=first)
        return Outgoing(live, encode_body(msg), False)
    msg = m.TokenDelta(
        live.request_id, ids, piece.text, lps, tops, piece.content, piece.reasoning,
        _parts(piece.tool_calls), first,
    )  # fmt: skip
    return Outgoing(live, encode_body(msg), False, piece.newly_stopped)


def _finished(ev: FinishEvent, live: LiveRequest) -> bytes:
    reason = FINISH_REASONS.get(ev.reason, "stop")
    prompt_tokens = live.prompt_tokens or ev.prompt_tokens
    out = live.output
    if out is None:
        msg = m.Finished(live.request_id, reason, prompt_tokens, ev.completion_tokens,
                         ev.cached_tokens)  # fmt: skip
        return encode_body(msg)
    completion_tokens = ev.completion_tokens
    if out.stopped:  # a stop string ended the output before the engine's own finish
        reason, completion_tokens = "stop", out.num_tokens
    tail = out.finish(reason)
    if tail.error is not None:
        return encode_body(
            m.ErrorReply(m.TOOL_CHOICE_UNSATISFIED, str(tail.error), request_id=live.request_id)
        )
    if tail.stop_string is not None:  # also when it completed in the flushed tail
        reason = "stop"
    if tail.num_tool_calls and reason == "stop":
        reason = "tool_calls"
    return encode_body(
        m.Finished(
            live.request_id,
            reason,
            prompt_tokens,
            completion_tokens,
            ev.cached_tokens,
            tail.text,
            tail.content,
            tail.reasoning,
            _parts(tail.tool_calls),
            tail.stop_string or "",
            list(tail.tool_errors),
            tail.has_reasoning,
        )
    )


def render_batch(batch: Sequence[Work]) -> list[Outgoing]:
    """Lane job: run the output pipeline and encode, in order. A failure in one request's
    pipeline ends that request with an engine_error; the others are unaffected."""
    out: list[Outgoing] = []
    for w in batch:
        if w.live.terminated or w.live.extra.get("failed"):
            continue
        if w.live.orphaned and isinstance(w.event, TokenEvent):
            continue
        try:
            if isinstance(w.event, TokenEvent):
                o = _delta(w.event, w.live)
                if o is not None:
                    out.append(o)
            elif w.error is not None:
                out.append(Outgoing(w.live, encode_body(w.error), True))
            else:
                out.append(Outgoing(w.live, _finished(w.event, w.live), True))
        except Exception as exc:
            log.error("output processing failed for %s", w.live.request_id)  # (+ traceback below)
            w.live.extra["failed"] = True  # lane-local: nothing more is processed for it
            text = f"output processing failed: {error_text(exc)}"
            err = m.ErrorReply(m.ENGINE_ERROR, text, request_id=w.live.request_id)
            out.append(Outgoing(w.live, encode_body(err), True, True))
    return out
