"""Conversation handles' history rules, against a recording client (the daemon-backed
behaviour is in tests/e2e/test_conversation.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from libflare_client import ChatResult, Usage
from libflare_client.conversation import Conversation
from libflare_client.types import ParsedMessage, StreamEvent

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


class Recorder:
    """Answers every request with a fixed reply and keeps what it was sent."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def chat(self, **kw: Any) -> ChatResult:
        self.sent.append(kw)
        return ChatResult("r", "", "thought", [CALL], "tool_calls", Usage(3, 2, 0))

    def stream(self, **kw: Any) -> Iterator[StreamEvent]:
        self.sent.append(kw)
        yield StreamEvent("r", [5], "he")
        yield StreamEvent("r", [6], "llo", finish_reason="stop",
                          message=ParsedMessage("hello", None))  # fmt: skip


def test_replies_tool_results_and_defaults() -> None:
    rec = Recorder()
    conv = Conversation(rec, None, "Be brief.", [{"type": "function"}], max_tokens=9)  # type: ignore[arg-type]
    conv.user("hi").chat(max_tokens=3)
    sent = rec.sent[0]
    assert sent["max_tokens"] == 3 and sent["tools"] == [{"type": "function"}]
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    assert conv.messages[-1] == {"role": "assistant", "content": "", "reasoning_content": "thought",
                                 "tool_calls": [CALL]}  # fmt: skip
    conv.tool_result("call_1", "42", name="f")
    assert conv.messages[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "42",
                                 "name": "f"}  # fmt: skip
    conv.chat()
    assert rec.sent[1]["max_tokens"] == 9 and len(rec.sent[1]["messages"]) == 4


def test_fork_is_independent_and_histories_are_copies() -> None:
    rec = Recorder()
    base = Conversation(rec).user("a")  # type: ignore[arg-type]
    branch = base.fork().user("b")
    assert len(base) == 1 and len(branch) == 2
    branch.messages[0]["content"] = "changed"  # a copy
    assert branch.messages[0]["content"] == "a"
    msg = {"role": "user", "content": "c"}
    base.append(msg)
    msg["content"] = "mutated after append"
    assert base.messages[-1]["content"] == "c"
    with pytest.raises(ValueError, match="already starts with a system"):
        Conversation(rec, [{"role": "system", "content": "x"}], "y")  # type: ignore[arg-type]


def test_stream_records_the_parsed_reply_only_once_finished() -> None:
    rec = Recorder()
    conv = Conversation(rec).user("hi")  # type: ignore[arg-type]
    it = conv.stream()
    next(it)
    assert len(conv) == 1  # not yet finished
    list(it)
    assert conv.messages[-1] == {"role": "assistant", "content": "hello"}
