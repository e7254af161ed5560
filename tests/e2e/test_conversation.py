"""Conversation handles against a real daemon: replies are appended (tool calls included),
tool results go in, the next request restores the history instead of recomputing it, forks
branch from a shared prefix, a failed request changes nothing, and the async handle agrees."""

from __future__ import annotations

import asyncio

import pytest
from e2e_support import NO_THINK, WEATHER, Daemon, call_text, regex

from libflare_client import AsyncClient, Client, InvalidRequest, SamplingParams

SEEDED = {"max_tokens": 8, "sampling": SamplingParams(seed=3), "chat_template_kwargs": NO_THINK}


def test_a_tool_loop_appends_and_reuses_the_history(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        asked = c.conversation(system="Be brief.", tools=[WEATHER], **SEEDED)
        asked.user("weather in Paris?")
        for seed in range(8):  # the grammar forces the call's text; a seed must also end it
            conv = asked.fork()
            first = conv.chat(response_format=regex(call_text("Paris")), max_tokens=96,
                              sampling=SamplingParams(seed=seed))  # fmt: skip
            if first.finish_reason == "tool_calls":
                break
        else:
            pytest.fail("no seed completed the forced tool call")
        assert len(conv) == 3 and len(asked) == 2
        (call,) = first.tool_calls
        assert call["function"]["name"] == "get_weather"
        recorded = conv.messages[-1]
        assert recorded["role"] == "assistant" and recorded["tool_calls"] == first.tool_calls
        conv.tool_result(call["id"], "sunny, 21 C")
        second = conv.chat()
        assert len(conv) == 5 and conv.messages[-1]["content"] == second.content
        assert second.usage.cached_tokens > 0  # the shared history was restored, not recomputed
        # the same request as a plain chat over the same history: the same reply
        plain = c.chat(conv.messages[:-1], tools=[WEATHER], **SEEDED)
        assert plain.content == second.content and plain.token_ids == second.token_ids


def test_forks_branch_from_a_shared_prefix(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        base = c.conversation(max_tokens=4, sampling=SamplingParams(seed=1))
        base.user("tell me a story about a fox")
        base.chat()
        a = base.fork().user("make it shorter")
        b = base.fork().user("make it longer")
        ra, rb = a.chat(), b.chat()
        assert ra.usage.cached_tokens > 0 and rb.usage.cached_tokens > 0
        assert len(base) == 2 and len(a) == len(b) == 4
        assert a.messages[:2] == b.messages[:2] == base.messages
        assert a.messages[2]["content"] != b.messages[2]["content"]


def test_stream_appends_once_finished_and_failures_change_nothing(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        conv = c.conversation(**SEEDED).user("hello")
        events = list(conv.stream())
        assert events[-1].finish_reason is not None and len(conv) == 2
        assert conv.messages[-1]["content"] == events[-1].message.content  # type: ignore[union-attr]
        conv.user("again")
        for _ in conv.stream(max_tokens=50, ignore_eos=True):
            break  # left early: no reply to record
        assert len(conv) == 3
        with pytest.raises(InvalidRequest):
            conv.chat(max_tokens=0)
        assert len(conv) == 3
        with pytest.raises(TypeError, match="its own history"):
            conv.chat(messages=[{"role": "user", "content": "x"}])
        with pytest.raises(ValueError, match="role"):
            conv.append({"content": "no role"})
        snapshot = conv.messages
        snapshot.append({"role": "user", "content": "not in the history"})
        assert len(conv) == 3  # `messages` is a copy


def test_async_conversation_agrees_with_the_blocking_one(daemon: Daemon) -> None:
    async def run() -> tuple[str, list[str]]:
        async with AsyncClient(daemon.socket) as c:
            conv = c.conversation(**SEEDED).user("hello")
            reply = await conv.chat()
            conv.user("and then?")
            texts = [ev.text async for ev in conv.stream()]
            assert len(conv) == 4
            return reply.content, texts

    content, _ = asyncio.run(run())
    with Client(daemon.socket) as c:
        assert c.conversation(**SEEDED).user("hello").chat().content == content
