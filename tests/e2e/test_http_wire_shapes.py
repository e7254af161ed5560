"""flare-http's per-token frames are written from pre-encoded templates (the envelope encoded
once, only the text encoded per token): they must be byte for byte what encoding the whole
event would give, for any text. Pure tests: no daemon, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette")

from libflare_client.http.anthropic_format import frames
from libflare_client.http.blocks import Block
from libflare_client.http.formats import ChatFormat, CompletionFormat, sse
from libflare_client.http.generation import Delta, Generation
from libflare_client.http.responses_format import ResponsesFormat

TEXTS = ["tok", 'a "quoted" \\ back\nslash', "é 好 🌧", "\x00\x1f\x7f", "line\u2028sep\x85\u2029"]


def gen(n: int = 1) -> Generation:
    return Generation(None, "req-0123abcd", [{"messages": []}] * n)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("usage", [False, True])
def test_chat_and_completion_chunks(text: str, usage: bool) -> None:
    chat = ChatFormat(gen(2), "m", usage, 0, False)
    choice: dict[str, Any] = {"index": 1, "delta": {"content": text}, "logprobs": None,
                              "finish_reason": None}  # fmt: skip
    assert chat.stream_delta(Delta(1, text)) == [sse(chat._chunk([choice]))]
    comp = CompletionFormat(gen(2), "m", usage, None, 1)
    choice = {"index": 1, "text": text, "logprobs": None, "finish_reason": None}
    assert comp.stream_delta(Delta(1, text)) == [sse(comp._chunk([choice]))]
    # the general path (a finishing delta) uses the same envelope
    done = chat.stream_delta(Delta(0, text, finish_reason="stop"))
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": "stop"}
    assert done == [sse(chat._chunk([choice]))]


@pytest.mark.parametrize("text", TEXTS)
def test_anthropic_deltas(text: str) -> None:
    for kind, dtype, key in (("text", "text_delta", "text"),
                             ("thinking", "thinking_delta", "thinking"),
                             ("tool", "input_json_delta", "partial_json")):  # fmt: skip
        got = frames([("delta", Block(3, kind), text)])  # type: ignore[arg-type]
        want = {"type": "content_block_delta", "index": 3, "delta": {"type": dtype, key: text}}
        assert got == [sse(want, "content_block_delta")]


@pytest.mark.parametrize("text", TEXTS)
def test_responses_deltas(text: str) -> None:
    fast = ResponsesFormat(gen(), "m", {})
    slow = ResponsesFormat(gen(), "m", {})
    for kind, event in (("text", "response.output_text.delta"),
                        ("thinking", "response.reasoning_text.delta"),
                        ("tool", "response.function_call_arguments.delta")):  # fmt: skip
        b = Block(2, kind)  # type: ignore[arg-type]
        at: dict[str, Any] = {"item_id": slow.item_id(b), "output_index": 2}
        if kind != "tool":
            at["content_index"] = 0
        extra = {"logprobs": []} if kind == "text" else {}
        assert fast._events([("delta", b, text)]) == [slow._ev(event, **at, delta=text, **extra)]
    assert fast.seq == slow.seq == 3
