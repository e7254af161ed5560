"""OpenAI Responses wire shapes (stateless): the response object and its SSE events.

Output items come from one Blocks sequence: reasoning -> a `reasoning` item (its text as one
reasoning_text content part), text -> a `message` item (one output_text part), each tool call
-> a `function_call` item (call_id = the daemon's call id). Streamed, every item is announced
with response.output_item.added and ended with response.output_item.done; between them a
message or reasoning item has content_part.added, its text deltas, the text's .done and
content_part.done, and a function call has function_call_arguments.delta and .done (the
openai client's stream state needs the item before any of its deltas, and identical ids in
added, done and the completed response). Every event carries a sequence_number from 0.
"""

from __future__ import annotations

from typing import Any

from libflare_client.http.blocks import Block, Blocks, Event
from libflare_client.http.errors import ApiError
from libflare_client.http.formats import Format, sse, sse_json
from libflare_client.http.generation import Delta, Generation

_PREFIX = {"text": "msg", "thinking": "rs", "tool": "fc"}
_PART = {"text": "output_text", "thinking": "reasoning_text"}
_TEXT_EVENT = {"text": "response.output_text", "thinking": "response.reasoning_text"}


def _delta_frame(event: str, fields: bytes) -> bytes:
    """A delta event's frame as _ev writes it: sequence_number, item_id, output_index and the
    delta's JSON to fill in (`fields` names them, in _ev's key order)."""
    head = b'event: %b\ndata: {"type":"%b","sequence_number":%%d,' % (
        event.encode(),
        event.encode(),
    )
    return head + fields + b"}\n\n"


_DELTA_FRAME = {
    "text": _delta_frame("response.output_text.delta", b'"item_id":"%b","output_index":%d,'
                         b'"content_index":0,"delta":%b,"logprobs":[]'),
    "thinking": _delta_frame("response.reasoning_text.delta", b'"item_id":"%b",'
                             b'"output_index":%d,"content_index":0,"delta":%b'),
    "tool": _delta_frame("response.function_call_arguments.delta", b'"item_id":"%b",'
                         b'"output_index":%d,"delta":%b'),
}  # fmt: skip


class ResponsesFormat(Format):
    def __init__(self, gen: Generation, model: str, echo: dict[str, Any]) -> None:
        super().__init__(gen, model)
        self.rid = gen.request_id.removeprefix("req-")
        self.id = f"resp_{self.rid}"
        self.echo = echo
        self.seq = 0
        self.blocks = Blocks()

    # -- items -----------------------------------------------------------------------------
    def item_id(self, b: Block) -> str:
        return f"{_PREFIX[b.kind]}_{self.rid}_{b.index}"

    def _part(self, b: Block, text: str) -> dict[str, Any]:
        if b.kind == "thinking":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, b: Block, done: bool) -> dict[str, Any]:
        """The output item; not `done`: as output_item.added announces it (no content yet)."""
        status = "completed" if done else "in_progress"
        if b.kind == "tool":
            return {"type": "function_call", "id": self.item_id(b), "call_id": b.call_id,
                    "name": b.name, "arguments": b.text if done else "", "status": status}  # fmt: skip
        content = [self._part(b, b.text)] if done else []
        if b.kind == "thinking":
            return {"type": "reasoning", "id": self.item_id(b), "summary": [],
                    "content": content, "status": status}  # fmt: skip
        return {"type": "message", "id": self.item_id(b), "status": status, "role": "assistant",
                "content": content}  # fmt: skip

    def _response(
        self, status: str, output: list[dict[str, Any]], error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        r: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": error,
            "incomplete_details": None,
            "store": False,
            "previous_response_id": None,
            "metadata": {},
            "usage": None,
            **self.echo,
        }
        if status in ("completed", "incomplete"):
            u = self.gen.usage()
            r["usage"] = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": u["reasoning_tokens"]},
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            }
            if self.reasons[0] == "length":
                r["status"] = "incomplete"
                r["incomplete_details"] = {"reason": "max_output_tokens"}
        return r

    # -- events ----------------------------------------------------------------------------
    def _ev(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, type_)

    def _events(self, events: list[Event]) -> list[bytes]:
        out = []
        for op, b, text in events:
            if op == "delta":  # the common event: one token's text, as _ev would encode it
                item_id = self.item_id(b).encode()
                out.append(_DELTA_FRAME[b.kind] % (self.seq, item_id, b.index, sse_json(text)))
                self.seq += 1
                continue
            at = {"item_id": self.item_id(b), "output_index": b.index}
            if op == "open":
                out.append(self._ev("response.output_item.added", output_index=b.index,
                                    item=self.item(b, False)))  # fmt: skip
                if b.kind != "tool":
                    out.append(self._ev("response.content_part.added", **at, content_index=0,
                                        part=self._part(b, "")))  # fmt: skip
            else:
                out += self._close(b, at)
        return out

    def _close(self, b: Block, at: dict[str, Any]) -> list[bytes]:
        text = b.text
        if b.kind == "tool":
            args = self._ev("response.function_call_arguments.done", **at, arguments=text)
            return [args, self._ev("response.output_item.done", output_index=b.index,
                                   item=self.item(b, True))]  # fmt: skip
        extra: dict[str, Any] = {"logprobs": []} if b.kind == "text" else {}
        return [
            self._ev(_TEXT_EVENT[b.kind] + ".done", **at, content_index=0, text=text, **extra),
            self._ev("response.content_part.done", **at, content_index=0,
                     part=self._part(b, text)),
            self._ev("response.output_item.done", output_index=b.index, item=self.item(b, True)),
        ]  # fmt: skip

    # -- Format ----------------------------------------------------------------------------
    def collect(self, d: Delta) -> None:
        if d.finish_reason is not None:
            self.reasons[0] = d.finish_reason
        self.blocks.feed(d)

    def error_status_body(self, err: ApiError) -> dict[str, Any]:
        return err.openai()

    def stream_error(self, err: ApiError) -> bytes:
        """response.failed, its output what was streamed before the failure (each item
        "incomplete"), so a client that rebuilds the response from it loses nothing."""
        error = {"code": err.code or err.type, "message": err.message}
        output = [{**self.item(b, True), "status": "incomplete"} for b in self.blocks.blocks]
        return self._ev("response.failed", response=self._response("failed", output, error))

    def stream_start(self) -> list[bytes]:
        r = self._response("in_progress", [])
        return [self._ev("response.created", response=r),
                self._ev("response.in_progress", response=r)]  # fmt: skip

    def stream_delta(self, d: Delta) -> list[bytes]:
        if d.finish_reason is not None:
            self.reasons[0] = d.finish_reason
        return self._events(self.blocks.feed(d))

    def stream_end(self) -> list[bytes]:
        out = self._events(self.blocks.finish())
        r = self._response("completed", [self.item(b, True) for b in self.blocks.blocks])
        done = "response.incomplete" if r["status"] == "incomplete" else "response.completed"
        return [*out, self._ev(done, response=r)]

    def body(self) -> dict[str, Any]:
        self.blocks.finish()
        return self._response("completed", [self.item(b, True) for b in self.blocks.blocks])
