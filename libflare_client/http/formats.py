"""Wire shapes: the Format base, OpenAI chat.completion(.chunk) and text_completion (Anthropic
Messages and Responses: anthropic_format.py, responses_format.py)."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

import msgspec

from libflare_client import TokenLogprob
from libflare_client.http.errors import ApiError
from libflare_client.http.generation import Delta, Generation

_encode = msgspec.json.Encoder().encode


# JSON leaves U+0085, U+2028 and U+2029 unescaped, and line splitters that follow Unicode
# (str.splitlines, httpx's iter_lines) would cut an event's data line at them: escaped here
_UNICODE_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
                   (b"\xe2\x80\xa9", b"\\u2029"))  # fmt: skip


def sse_json(data: Any) -> bytes:
    """`data` as JSON for one SSE data line."""
    body = _encode(data)
    if b"\xe2\x80" in body or b"\xc2\x85" in body:
        for raw, escaped in _UNICODE_BREAKS:
            body = body.replace(raw, escaped)
    return body


def sse(data: Any, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + sse_json(data) + b"\n\n"


DONE = b"data: [DONE]\n\n"
KEEPALIVE_LINE = b": keepalive\n\n"


def tok_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def chat_lp_entry(text: str, lp: TokenLogprob, top_n: int) -> dict[str, Any]:
    tok = text if text else tok_name(lp.token_id)
    return {
        "token": tok,
        "logprob": lp.logprob,
        "bytes": list(tok.encode()),
        "top_logprobs": [
            {"token": tok_name(t), "logprob": v, "bytes": list(tok_name(t).encode())}
            for t, v in lp.top[:top_n]
        ],
    }


def usage_obj(u: dict[str, int]) -> dict[str, Any]:
    return {
        "prompt_tokens": u["prompt_tokens"],
        "completion_tokens": u["completion_tokens"],
        "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]},
    }


def finish(reason: str | None) -> str:
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


class Format(ABC):
    """Base: subclasses turn Deltas into SSE frames and collected output into a body."""

    def __init__(self, gen: Generation, model: str, include_usage: bool = False) -> None:
        self.gen = gen
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        n = len(gen.choices)
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.lps: list[list[tuple[str, TokenLogprob]]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.stop_seqs: list[str | None] = [None] * n
        self.reasoning: list[list[str]] = [[] for _ in range(n)]
        self.calls: list[dict[int, dict[str, Any]]] = [{} for _ in range(n)]

    def collect(self, d: Delta) -> None:
        self.texts[d.index].append(d.text)
        self.lps[d.index].extend(d.logprobs)
        if d.reasoning:
            self.reasoning[d.index].append(d.reasoning)
        for tc in d.tool_calls:  # first delta of a call: id and name; then argument fragments
            call = self.calls[d.index].setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if tc.id is not None:
                call["id"] = tc.id
            if tc.name is not None:
                call["function"]["name"] = tc.name
            call["function"]["arguments"] += tc.arguments
        if d.finish_reason is not None:
            self.reasons[d.index] = d.finish_reason
            self.stop_seqs[d.index] = d.stop_sequence

    def error_status(self, err: ApiError) -> int:
        return err.status

    def error_status_body(self, err: ApiError) -> dict[str, Any]:
        return err.openai()

    def stream_error(self, err: ApiError) -> bytes:
        return sse(err.openai())

    def stream_start(self) -> list[bytes]:
        return []

    @abstractmethod
    def stream_delta(self, d: Delta) -> list[bytes]:
        """SSE frames for one generated delta."""

    def stream_end(self) -> list[bytes]:
        return [DONE]

    @abstractmethod
    def body(self) -> dict[str, Any]:
        """The non-streamed response body."""


class _OpenAIChunks(Format):
    """Chunk envelope and stream end shared by chat and text completions.

    Per token only the choice is encoded: the envelope (id, object, created, model, ...) is
    encoded once and the choice's JSON goes between its two halves (`_frame`), the bytes
    msgspec would write for the whole chunk."""

    id: str
    chunk_object: str

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        c: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            c["usage"] = None
        return c

    def _envelope(self) -> None:
        head, tail = sse_json(self._chunk([])).split(b'"choices":[]')
        self._head = b"data: " + head + b'"choices":['
        self._tail = b"]" + tail + b"\n\n"

    def _frame(self, choice: bytes) -> bytes:
        """The SSE frame of a chunk with this one choice (JSON)."""
        return self._head + choice + self._tail

    def stream_end(self) -> list[bytes]:
        out = []
        if self.include_usage:
            c = self._chunk([])
            c["usage"] = usage_obj(self.gen.usage())
            out.append(sse(c))
        out.append(DONE)
        return out


class ChatFormat(_OpenAIChunks):
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, gen: Generation, model: str, include_usage: bool, top_logprobs: int, logprobs: bool
    ) -> None:
        super().__init__(gen, model, include_usage)
        self.id = f"chatcmpl-{gen.request_id.removeprefix('req-')}"
        self.logprobs = logprobs
        self.top = top_logprobs
        self._envelope()

    def stream_start(self) -> list[bytes]:
        return [
            self._frame(
                sse_json(
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
            )
            for i in range(len(self.gen.choices))
        ]

    def stream_delta(self, d: Delta) -> list[bytes]:
        if d.finish_reason is None and not (d.logprobs and self.logprobs):
            if d.text and not (d.reasoning or d.tool_calls):  # the common token: text only
                return [self._frame(b'{"index":%d,"delta":{"content":%b},"logprobs":null,'
                                    b'"finish_reason":null}' % (d.index, sse_json(d.text)))]  # fmt: skip
            if not (d.text or d.reasoning or d.tool_calls):
                return []
        lp = None
        if self.logprobs and d.logprobs:
            lp = {
                "content": [chat_lp_entry(t, x, self.top) for t, x in d.logprobs],
                "refusal": None,
            }
        delta: dict[str, Any] = {"content": d.text} if d.text else {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.tool_calls:  # index on every delta; id, type and name only on a call's first
            delta["tool_calls"] = [tc.to_openai() for tc in d.tool_calls]
        ch = {
            "index": d.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish(d.finish_reason) if d.finish_reason else None,
        }
        return [self._frame(sse_json(ch))]

    def body(self) -> dict[str, Any]:
        choices = []
        for i in range(len(self.gen.choices)):
            lp = None
            if self.logprobs:
                lp = {
                    "content": [chat_lp_entry(t, x, self.top) for t, x in self.lps[i]],
                    "refusal": None,
                }
            calls = [self.calls[i][k] for k in sorted(self.calls[i])]
            content = "".join(self.texts[i])
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None if calls and not content else content,
                "refusal": None,
                "tool_calls": calls or None,
            }
            if self.reasoning[i]:
                message["reasoning_content"] = "".join(self.reasoning[i])
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish(self.reasons[i]),
                }
            )
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage_obj(self.gen.usage()),
        }


class CompletionFormat(_OpenAIChunks):
    chunk_object = "text_completion"

    def __init__(
        self, gen: Generation, model: str, include_usage: bool, logprobs: int | None, prompts: int
    ) -> None:
        super().__init__(gen, model, include_usage)
        self.id = f"cmpl-{gen.request_id.removeprefix('req-')}"
        self.logprobs = logprobs
        self.prompts = prompts
        self.offsets = [0] * len(gen.choices)  # text streamed so far per choice, in characters
        self._envelope()

    def _lp(self, items: list[tuple[str, TokenLogprob]], offset: int) -> dict[str, Any]:
        toks, lps, tops, offs = [], [], [], []
        for text, x in items:
            tok = text if text else tok_name(x.token_id)
            toks.append(tok)
            lps.append(x.logprob)
            tops.append({tok_name(t): v for t, v in x.top[: self.logprobs or 0]})
            offs.append(offset)
            offset += len(text)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def stream_delta(self, d: Delta) -> list[bytes]:
        i = d.index
        if d.finish_reason is None and not (d.logprobs and self.logprobs is not None):
            if not d.text:
                return []
            self.offsets[i] += len(d.text)  # the common token: text only
            return [self._frame(b'{"index":%d,"text":%b,"logprobs":null,"finish_reason":null}'
                                % (i, sse_json(d.text)))]  # fmt: skip
        if not d.text and not d.logprobs and d.finish_reason is None:
            return []
        offset = self.offsets[i]
        self.offsets[i] += len(d.text)
        lp = self._lp(d.logprobs, offset) if self.logprobs is not None and d.logprobs else None
        ch = {
            "index": i,
            "text": d.text,
            "logprobs": lp,
            "finish_reason": finish(d.finish_reason) if d.finish_reason else None,
        }
        return [self._frame(sse_json(ch))]

    def body(self) -> dict[str, Any]:
        choices = []
        for i in range(len(self.gen.choices)):
            lp = self._lp(self.lps[i], 0) if self.logprobs is not None else None
            choices.append(
                {
                    "index": i,
                    "text": "".join(self.texts[i]),
                    "logprobs": lp,
                    "finish_reason": finish(self.reasons[i]),
                }
            )
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage_obj(self.gen.usage()),
        }
