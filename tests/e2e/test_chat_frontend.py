"""The frontend through a real daemon and the real client: parsed chat output (reasoning, tool
calls, tool_choice), stop strings, text prompts and grammar-constrained sampling on the tiny
random Qwen3 bundle (its recipe declares THINK_TAGS reasoning and HERMES_JSON tool calls).

A random model rarely writes markup by itself, so the tests that need reasoning or a tool call
make it write one with a regex grammar: the output is then known text, and parsing must turn it
into the right message."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from e2e_support import NO_THINK, WEATHER, Daemon, call_text, is_baseline, wait_baseline
from e2e_support import regex as _regex

from libflare_client import (
    AsyncClient,
    Client,
    InvalidRequest,
    SamplingParams,
    ToolChoiceUnsatisfied,
)

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = call_text("Paris")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer"},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "days", "rain"],
    "additionalProperties": False,
}


def _valid(doc: Any) -> bool:
    """SCHEMA, checked by hand (every key required, no others, exact types)."""
    return (
        isinstance(doc, dict)
        and set(doc) == {"city", "days", "rain"}
        and doc["city"] in ("Paris", "Rome", "Oslo")
        and isinstance(doc["days"], int)
        and not isinstance(doc["days"], bool)
        and isinstance(doc["rain"], bool)
    )


def test_reasoning_is_split_from_content(daemon: Daemon) -> None:
    text = "<think>\nWhy.\n</think>\n\nSunny."
    with Client(daemon.socket) as c:
        r = c.chat(USER, response_format=_regex(text), chat_template_kwargs=NO_THINK,
                   max_tokens=96, sampling=SamplingParams(seed=4))  # fmt: skip
        events = list(c.stream(messages=USER, response_format=_regex(text), max_tokens=96,
                               chat_template_kwargs=NO_THINK, sampling=SamplingParams(seed=4)))  # fmt: skip
    assert r.text == text
    assert r.reasoning == "Why."
    assert r.content == "Sunny."
    assert r.finish_reason == "stop" and r.tool_calls == [] and r.tool_errors == []
    # streaming equals the final message
    assert "".join(e.reasoning for e in events) == r.reasoning
    assert "".join(e.content for e in events) == r.content
    assert "".join(e.text for e in events) == text
    last = events[-1]
    assert last.message is not None and last.message.content == r.content
    assert last.message.reasoning == r.reasoning


def test_forced_tool_call_is_parsed_with_ids(daemon: Daemon) -> None:
    """With tools declared the grammar also allows the <tool_call> token at the answer start
    (tool delimiters compose with the grammar): then the rest is unconstrained. Across seeds
    the output is either the exact call text (parsed into an OpenAI call) or free text after
    the escape token, which must never be dropped: malformed calls stay in content and are
    reported."""
    with Client(daemon.socket) as c:
        results = [
            c.chat(USER, tools=[WEATHER], response_format=_regex(CALL_TEXT), max_tokens=96,
                   chat_template_kwargs=NO_THINK, sampling=SamplingParams(seed=s))
            for s in range(2)
        ]  # fmt: skip
    exact = [r for r in results if r.text == CALL_TEXT]
    assert exact, [r.text for r in results]
    for r in exact:
        assert r.finish_reason == "tool_calls" and r.content == "" and r.tool_errors == []
        (call,) = r.tool_calls
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    for r in results:
        if r.text != CALL_TEXT and "<tool_call>" in r.text and not r.tool_calls:
            assert r.tool_errors and "<tool_call>" in r.content


def test_tool_call_stream_deltas(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        for seed in range(12):
            events = list(c.stream(messages=USER, tools=[WEATHER], max_tokens=96,
                                   response_format=_regex(CALL_TEXT), chat_template_kwargs=NO_THINK,
                                   sampling=SamplingParams(seed=seed)))  # fmt: skip
            if "".join(e.text for e in events) == CALL_TEXT:
                break
        else:
            pytest.fail("no seed produced the forced call")
    deltas = [d for e in events for d in e.tool_calls]
    assert deltas[0].index == 0 and deltas[0].name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris"}
    assert deltas[0].to_openai()["type"] == "function"
    last = events[-1]
    assert last.finish_reason == "tool_calls"
    assert last.message is not None and last.message.tool_calls[0]["id"] == deltas[0].id


def test_tool_choice_required_fails_without_a_call(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        with pytest.raises(ToolChoiceUnsatisfied, match="required"):
            c.chat(USER, tools=[WEATHER], tool_choice="required", max_tokens=8,
                   sampling=SamplingParams(seed=1))  # fmt: skip
        named = {"type": "function", "function": {"name": "get_weather"}}
        with pytest.raises(ToolChoiceUnsatisfied, match="get_weather"):
            c.chat(USER, tools=[WEATHER], tool_choice=named, max_tokens=8,
                   sampling=SamplingParams(seed=1))  # fmt: skip
        with pytest.raises(InvalidRequest, match="not among the tools"):
            other = {"type": "function", "function": {"name": "nope"}}
            c.chat(USER, tools=[WEATHER], tool_choice=other, max_tokens=8)
        # the daemon keeps serving and holds nothing afterwards
        assert c.chat(USER, max_tokens=4, sampling=SamplingParams(seed=1)).usage
    assert is_baseline(wait_baseline(daemon.socket))


def test_tool_choice_none_removes_tools_and_required_instructs(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        with_tools = c.render(USER, [WEATHER])
        none = c.render(USER, [WEATHER], tool_choice="none")
        plain = c.render(USER)
        required = c.render(USER, [WEATHER], tool_choice="required")
        thinking_off = c.render(USER, chat_template_kwargs=NO_THINK)
    assert "get_weather" in with_tools.text and none.text == plain.text
    assert "calling one or more of the provided tools" in required.text
    assert thinking_off.text.endswith("<think>\n\n</think>\n\n")


def test_required_is_satisfied_by_a_forced_call(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        for seed in range(12):
            try:
                r = c.chat(USER, tools=[WEATHER], tool_choice="required", max_tokens=96,
                           response_format=_regex(CALL_TEXT), chat_template_kwargs=NO_THINK,
                           sampling=SamplingParams(seed=seed))  # fmt: skip
            except ToolChoiceUnsatisfied:
                continue  # the escape token was sampled and no valid call followed
            assert r.finish_reason == "tool_calls"
            assert r.tool_calls[0]["function"]["name"] == "get_weather"
            return
    pytest.fail("no seed satisfied tool_choice=required")


def test_stop_string_ends_output_and_frees_the_request(daemon: Daemon) -> None:
    kw: dict[str, Any] = dict(max_tokens=24, sampling=SamplingParams(seed=3), ignore_eos=True)
    prompt = [5, 6, 7, 8]
    with Client(daemon.socket) as c:
        full = c.generate(prompt_token_ids=prompt, **kw)
        cut = len(full.text) // 2
        stop = full.text[cut : cut + 2]
        at = full.text.find(stop)  # the first occurrence ends the output
        assert stop and 0 <= at <= cut
        stopped = c.generate(prompt_token_ids=prompt, stop=[stop, "never-appears"], **kw)
        again = c.generate(prompt_token_ids=prompt, **kw)
    assert stopped.text == full.text[:at]
    assert stopped.finish_reason == "stop" and stopped.stop_string == stop
    # the engine generated the same tokens up to the stop; the history is not rewritten
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)
    assert stopped.usage.completion_tokens == len(stopped.token_ids)
    assert again.token_ids == full.token_ids and again.text == full.text
    assert is_baseline(wait_baseline(daemon.socket))


def test_stop_string_in_chat_stream(daemon: Daemon) -> None:
    text = "<think>\nPlan.\n</think>\n\nHi. STOP more"
    with Client(daemon.socket) as c:
        events = list(c.stream(messages=USER, response_format=_regex(text), stop=["STOP"],
                               max_tokens=96, chat_template_kwargs=NO_THINK,
                               sampling=SamplingParams(seed=2)))  # fmt: skip
    last = events[-1]
    assert "".join(e.text for e in events) == "<think>\nPlan.\n</think>\n\nHi. "
    assert last.finish_reason == "stop" and last.stop_string == "STOP"
    assert last.message is not None
    assert last.message.reasoning == "Plan." and last.message.content == "Hi. "
    assert is_baseline(wait_baseline(daemon.socket))


def test_text_prompt_is_tokenized_by_the_daemon(daemon: Daemon, tiny_bundle: Path) -> None:
    from flared.frontend.text import TextFrontend

    ids = TextFrontend.from_bundle(tiny_bundle).encode_prompt("hello world, 你好")
    kw: dict[str, Any] = dict(max_tokens=6, sampling=SamplingParams(seed=9), ignore_eos=True)
    with Client(daemon.socket) as c:
        by_text = c.generate(prompt="hello world, 你好", **kw)
        by_ids = c.generate(prompt_token_ids=ids, **kw)
        with pytest.raises(InvalidRequest, match="exactly one"):
            c.generate(prompt="x", prompt_token_ids=[1], **kw)
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.token_ids == by_ids.token_ids and by_text.text == by_ids.text
    assert by_text.message is None


def test_json_schema_outputs_validate_across_seeds(daemon: Daemon) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}

    async def run() -> list[Any]:
        async with AsyncClient(daemon.socket) as c:
            return await asyncio.gather(*[
                c.chat(USER, response_format=fmt, max_tokens=64, chat_template_kwargs=NO_THINK,
                       sampling=SamplingParams(seed=s, temperature=1.0))
                for s in range(8)
            ])  # fmt: skip

    results = asyncio.run(run())
    finished = [r for r in results if r.finish_reason == "stop"]
    assert len(finished) >= 5, [r.text for r in results]
    for r in finished:
        assert _valid(json.loads(r.content)), r.content
    for r in results:  # cut by max_tokens: still a prefix the grammar allowed
        assert r.content.lstrip().startswith("{")


def test_json_object_and_bad_grammars(daemon: Daemon) -> None:
    with Client(daemon.socket) as c:
        for s in range(2):
            r = c.chat(USER, response_format={"type": "json_object"}, max_tokens=32,
                       chat_template_kwargs=NO_THINK, sampling=SamplingParams(seed=s))  # fmt: skip
            if r.finish_reason == "stop":  # else cut by max_tokens inside a long string
                assert isinstance(json.loads(r.content), dict)
            else:
                assert r.content.startswith("{")
        ebnf = {"type": "grammar", "grammar": 'root ::= "yes" | "no" | "maybe"'}
        r = c.chat(USER, response_format=ebnf, max_tokens=16, chat_template_kwargs=NO_THINK,
                   sampling=SamplingParams(seed=1))  # fmt: skip
        assert r.content in ("yes", "no", "maybe") and r.finish_reason == "stop"
        with pytest.raises(InvalidRequest, match="compile"):
            c.chat(USER, response_format={"type": "regex", "regex": "(unclosed"}, max_tokens=4)
        with pytest.raises(InvalidRequest, match="response_format"):
            c.chat(USER, response_format={"type": "xml"}, max_tokens=4)
    assert is_baseline(wait_baseline(daemon.socket))


def test_mixed_constrained_and_unconstrained_batch(daemon: Daemon) -> None:
    """Constrained requests (one step in flight) batched with unconstrained ones (two): the
    unconstrained streams are exactly what they are alone (seeded), the constrained ones valid."""
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    free_kw: dict[str, Any] = dict(max_tokens=16, ignore_eos=True)

    async def run() -> tuple[list[Any], list[Any], list[Any]]:
        async with AsyncClient(daemon.socket) as c:
            alone = [
                await c.generate(prompt_token_ids=[3, 4, s], sampling=SamplingParams(seed=s),
                                 **free_kw)
                for s in range(2)
            ]  # fmt: skip
            jobs: list[Any] = []
            for s in range(2):
                jobs.append(c.chat(USER, response_format=fmt, max_tokens=48,
                                   chat_template_kwargs=NO_THINK,
                                   sampling=SamplingParams(seed=100 + s)))  # fmt: skip
                jobs.append(c.generate(prompt_token_ids=[3, 4, s],
                                       sampling=SamplingParams(seed=s), **free_kw))  # fmt: skip
            got = await asyncio.gather(*jobs)
            return alone, got[1::2], got[0::2]

    alone, mixed, constrained = asyncio.run(run())
    assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
    for r in constrained:
        if r.finish_reason == "stop":
            assert _valid(json.loads(r.content)), r.content
        else:
            assert r.content.lstrip().startswith("{")
    assert is_baseline(wait_baseline(daemon.socket))
