"""Anthropic Messages wire shapes: the message body and its SSE stream.

Stream order (the anthropic client's accumulator indexes its snapshot's content by the
events' `index`): message_start, ping, then per block content_block_start (a tool_use block
starts with input {}), its deltas (text_delta / thinking_delta / input_json_delta with
partial_json), for thinking a signature_delta, content_block_stop; then message_delta
(stop_reason, usage) and message_stop. Blocks come from one Blocks sequence, so the unary
body has the same blocks as the stream.
"""

from __future__ import annotations

import json
from typing import Any

from libflare_client.http.blocks import Block, Blocks, Event
from libflare_client.http.errors import ApiError
from libflare_client.http.formats import Format, sse, sse_json
from libflare_client.http.generation import Delta, Generation


def stop_reason(reason: str | None, stop_seq: str | None) -> str:
    if stop_seq is not None:
        return "stop_sequence"
    if reason == "tool_calls":
        return "tool_use"
    return "max_tokens" if reason == "length" else "end_turn"


def tool_use_id(call_id: str) -> str:
    """Anthropic's id form for the daemon's call id (`call_X` -> `toolu_X`)."""
    return "toolu_" + call_id.removeprefix("call_")


def block_json(b: Block, final: bool) -> dict[str, Any]:
    """The content block; not `final`: as content_block_start announces it (empty)."""
    if b.kind == "text":
        return {"type": "text", "text": b.text if final else ""}
    if b.kind == "thinking":
        return {"type": "thinking", "thinking": b.text if final else "", "signature": ""}
    # the daemon returns only calls whose arguments parsed as a JSON object
    args = json.loads(b.text) if final and b.text else {}
    return {"type": "tool_use", "id": tool_use_id(b.call_id), "name": b.name, "input": args}


# a content_block_delta frame as msgspec writes it, with the index and the JSON text to fill in
_DELTA_FRAME = {
    kind: b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"' + dtype + b'","' + key + b'":%b}}\n\n'
    for kind, dtype, key in (("text", b"text_delta", b"text"),
                             ("thinking", b"thinking_delta", b"thinking"),
                             ("tool", b"input_json_delta", b"partial_json"))
}  # fmt: skip


def frames(events: list[Event]) -> list[bytes]:
    out = []
    for op, b, text in events:
        if op == "delta":  # the common event: one token's text
            out.append(_DELTA_FRAME[b.kind] % (b.index, sse_json(text)))
        elif op == "open":
            start = {"type": "content_block_start", "index": b.index,
                     "content_block": block_json(b, False)}  # fmt: skip
            out.append(sse(start, "content_block_start"))
        else:
            if b.kind == "thinking":
                sig = {"type": "content_block_delta", "index": b.index,
                       "delta": {"type": "signature_delta", "signature": ""}}  # fmt: skip
                out.append(sse(sig, "content_block_delta"))
            out.append(sse({"type": "content_block_stop", "index": b.index}, "content_block_stop"))
    return out


class AnthropicFormat(Format):
    """One choice (Messages has no n). `thinking`: reasoning is returned as thinking blocks."""

    def __init__(self, gen: Generation, model: str, thinking: bool = False) -> None:
        super().__init__(gen, model)
        self.id = f"msg_{gen.request_id.removeprefix('req-')}"
        self.blocks = Blocks(reasoning=thinking)

    def error_status(self, err: ApiError) -> int:
        return err.anthropic_status

    def error_status_body(self, err: ApiError) -> dict[str, Any]:
        return err.anthropic()

    def stream_error(self, err: ApiError) -> bytes:
        return sse(err.anthropic(), "error")

    def keepalive(self) -> bytes:
        return sse({"type": "ping"}, "ping")

    def _note(self, d: Delta) -> None:
        if d.finish_reason is not None:
            self.reasons[0], self.stop_seqs[0] = d.finish_reason, d.stop_sequence

    def collect(self, d: Delta) -> None:
        self._note(d)
        self.blocks.feed(d)

    def _usage(self) -> dict[str, int]:
        u = self.gen.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": u["cached_tokens"],
        }

    def stream_start(self) -> list[bytes]:
        msg: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # known when the first tokens came with the stream's start (the usual case: the
            # shim holds the headers up to first_event_wait_s); message_delta repeats it
            "usage": {"input_tokens": self.gen.usage()["prompt_tokens"], "output_tokens": 0},
        }
        return [sse({"type": "message_start", "message": msg}, "message_start"), self.keepalive()]

    def stream_delta(self, d: Delta) -> list[bytes]:
        self._note(d)
        return frames(self.blocks.feed(d))

    def stream_end(self) -> list[bytes]:
        delta = {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(self.reasons[0], self.stop_seqs[0]),
                "stop_sequence": self.stop_seqs[0],
            },
            "usage": self._usage(),
        }
        return [
            *frames(self.blocks.finish()),
            sse(delta, "message_delta"),
            sse({"type": "message_stop"}, "message_stop"),
        ]

    def body(self) -> dict[str, Any]:
        self.blocks.finish()
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [block_json(b, True) for b in self.blocks.blocks],
            "stop_reason": stop_reason(self.reasons[0], self.stop_seqs[0]),
            "stop_sequence": self.stop_seqs[0],
            "usage": self._usage(),
        }
