"""Anthropic Messages tool use and thinking through flare-http and the official `anthropic`
client: tool_use blocks (one and parallel, stream and not), the client's stream accumulator,
a tool round trip over two turns, tool_choice, thinking blocks, and the request checks.

The tiny random model is steered with a regex output format (`output_config.format`, a Flare
extension beside json_schema) so it writes known markup; the assertions are on what the shim
made of it. Token counts tie the HTTP requests to the daemon's rendering of the conversation
the shim built (Client.render of the same messages gives the same prompt)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from e2e_support import WEATHER, call_text, regex  # noqa: E402
from test_http_fixtures import Shim  # noqa: E402

from libflare_client import Client  # noqa: E402
from libflare_client.http.anthropic_request import MessagesRequest  # noqa: E402

USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],  # type: ignore[index]
    "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
}
TWO_CALLS = call_text("Paris") + "\n" + call_text("Rome")
THINK = "<think>\nWhy.\n</think>\n\nSunny."


@pytest.fixture(scope="module")
def shim(daemon: Any) -> Iterator[Shim]:
    s = Shim(daemon.socket)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ant(shim: Shim) -> Iterator[Any]:
    with anthropic.Anthropic(base_url=shim.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


def steer(text: str, seed: int) -> dict[str, Any]:
    return {"output_config": {"format": regex(text)}, "seed": seed}


def steered(ant: Any, text: str, done: Any, messages: Any = USER, **kw: Any) -> tuple[int, Any]:
    """The first seed whose reply satisfies `done` (with tools declared the grammar admits an
    escape into free text at the answer start, so not every seed follows it)."""
    for seed in range(12):
        try:
            r = ant.messages.create(model="flare", max_tokens=160, messages=messages,
                                    extra_body=steer(text, seed), **kw)  # fmt: skip
        except anthropic.InternalServerError as exc:  # a seed that escaped a required call
            assert "tool_choice" in exc.message
            continue
        if done(r):
            return seed, r
    pytest.fail("no seed produced the steered output")


def uses(r: Any) -> list[Any]:
    return [b for b in r.content if b.type == "tool_use"]


def test_parallel_tool_use_stream_and_not(ant: Any, shim: Shim) -> None:
    seed, r = steered(ant, TWO_CALLS, lambda r: r.stop_reason == "tool_use", tools=[TOOL])
    assert [b.type for b in r.content] == ["tool_use", "tool_use"]
    calls = uses(r)
    assert [c.name for c in calls] == ["get_weather"] * 2
    assert [c.input for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(c.id.startswith("toolu_") for c in calls) and calls[0].id != calls[1].id
    kw: dict[str, Any] = dict(model="flare", max_tokens=160, messages=USER, tools=[TOOL],
                              extra_body=steer(TWO_CALLS, seed))  # fmt: skip
    # the SDK's stream helper rebuilds the calls from content_block_start + input_json_delta
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        (b.type, b.name, b.input) for b in r.content
    ]
    # raw events: each block starts (input {}), gets its JSON, stops, at indexes 0 and 1
    body = {"model": "flare", "max_tokens": 160, "messages": USER, "tools": [TOOL],
            **steer(TWO_CALLS, seed), "stream": True}  # fmt: skip
    with httpx.stream("POST", shim.url + "/v1/messages", json=body, timeout=120) as h:
        raw = h.read().decode()
    evs = [json.loads(f.split("data: ", 1)[1]) for f in raw.split("\n\n") if "data: " in f]
    blocks = [e for e in evs if e["type"].startswith("content_block")]
    starts = [e for e in blocks if e["type"] == "content_block_start"]
    assert [e["content_block"]["input"] for e in starts] == [{}, {}]
    assert [e["index"] for e in starts] == [0, 1]
    for i, call in enumerate(calls):
        mine = [e["type"] for e in blocks if e["index"] == i]
        assert mine[0] == "content_block_start" and mine[-1] == "content_block_stop"
        js = "".join(e["delta"]["partial_json"] for e in blocks
                     if e["index"] == i and e["type"] == "content_block_delta")  # fmt: skip
        assert json.loads(js) == call.input
    assert [e["type"] for e in evs][-2:] == ["message_delta", "message_stop"]
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"


def test_tool_round_trip_over_two_turns(ant: Any, daemon: Any) -> None:
    _, first = steered(ant, call_text("Paris"), lambda r: r.stop_reason == "tool_use",
                       tools=[TOOL])  # fmt: skip
    (call,) = uses(first)
    turn2 = [
        *USER,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
            {"type": "text", "text": "Thanks. And tomorrow?"},
        ]},
    ]  # fmt: skip
    # the next step of the agent loop: a call for the other city (a steered plain answer is
    # unreliable here: after a tool result the random model takes the grammar's escape)
    _, second = steered(ant, call_text("Rome"), lambda r: r.stop_reason == "tool_use",
                        tools=[TOOL], messages=turn2)  # fmt: skip
    assert [c.input for c in uses(second)] == [{"city": "Rome"}]
    # the shim's conversation: assistant tool call, tool message, then the user's text
    req = MessagesRequest.parse({"messages": turn2, "tools": [TOOL]})
    roles = [m["role"] for m in req.messages]
    assert roles == ["user", "assistant", "tool", "user"]
    assert req.messages[1]["tool_calls"][0]["id"] == call.id
    assert json.loads(req.messages[1]["tool_calls"][0]["function"]["arguments"]) == call.input
    assert req.messages[2] == {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}
    with Client(daemon.socket) as c:
        rendered = c.render(
            req.messages, req.tools, chat_template_kwargs={"enable_thinking": False}
        )
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in rendered.text
    assert second.usage.input_tokens == len(rendered.token_ids)


def test_tool_choice_and_parallel_limit(ant: Any) -> None:
    named = {"type": "tool", "name": "get_weather"}
    _, r = steered(ant, call_text("Oslo"), lambda r: r.stop_reason == "tool_use",
                   tools=[TOOL], tool_choice=named)  # fmt: skip
    assert [c.input for c in uses(r)] == [{"city": "Oslo"}]
    # a required call the output does not make fails the request (not a silent answer)
    with pytest.raises(anthropic.InternalServerError, match="tool_choice"):
        ant.messages.create(model="flare", max_tokens=4, messages=USER, tools=[TOOL],
                            tool_choice={"type": "any"}, extra_body=steer("Sunny.", 1))  # fmt: skip
    # disable_parallel_tool_use: the first of two calls
    one = {"type": "auto", "disable_parallel_tool_use": True}
    _, r = steered(ant, TWO_CALLS, lambda r: r.stop_reason == "tool_use", tools=[TOOL],
                   tool_choice=one)  # fmt: skip
    assert [c.input for c in uses(r)] == [{"city": "Paris"}]
    # none: the template sees no tools (the same prompt as without them)
    plain = ant.messages.create(model="flare", max_tokens=1, messages=USER)
    none = ant.messages.create(model="flare", max_tokens=1, messages=USER, tools=[TOOL],
                               tool_choice={"type": "none"})  # fmt: skip
    with_tools = ant.messages.create(model="flare", max_tokens=1, messages=USER, tools=[TOOL])
    assert none.usage.input_tokens == plain.usage.input_tokens
    assert with_tools.usage.input_tokens > plain.usage.input_tokens


def test_thinking_blocks(ant: Any) -> None:
    on = {"type": "enabled", "budget_tokens": 1024}
    seed, r = steered(ant, THINK, lambda r: r.stop_reason == "end_turn", thinking=on)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Why." and r.content[0].signature == ""
    assert r.content[1].text == "Sunny."
    kw: dict[str, Any] = dict(model="flare", max_tokens=160, messages=USER, thinking=on,
                              extra_body=steer(THINK, seed))  # fmt: skip
    with ant.messages.stream(**kw) as s:
        thinking = "".join(e.thinking for e in s if e.type == "thinking")
        final = s.get_final_message()
    assert thinking == "Why."
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in r.content]
    # without thinking the template's thinking is off: a longer prompt (an empty think block)
    # and no thinking block in the reply
    off = ant.messages.create(model="flare", max_tokens=1, messages=USER)
    assert off.usage.input_tokens > r.usage.input_tokens
    assert all(b.type != "thinking" for b in off.content)
    # a thinking block sent back becomes the assistant turn's reasoning
    back = MessagesRequest.parse({"messages": [*USER, {"role": "assistant",
                                  "content": [b.model_dump() for b in r.content]}]})  # fmt: skip
    assert back.messages[-1] == {"role": "assistant", "content": "Sunny.",
                                 "reasoning_content": "Why."}  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0]"),
        ({"messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
         "messages[0].content[0].input"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]},
         "messages[0].content[0].is_error"),
    ],
)  # fmt: skip
def test_invalid_tool_fields_400(shim: Shim, extra: dict[str, Any], param: str) -> None:
    body = {"model": "flare", "max_tokens": 4, "messages": USER, **extra}
    r = httpx.post(shim.url + "/v1/messages", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    with pytest.raises(Exception) as ei:  # the same check, with the field path
        MessagesRequest.parse(body)
    assert getattr(ei.value, "param", None) == param, ei.value


def test_tool_result_forms() -> None:
    """String or text-block content; is_error marks the content for the model."""
    turn = [*USER, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "x"},
                                                                {"type": "text", "text": "y"}]},
        {"type": "tool_result", "tool_use_id": "b", "content": "boom", "is_error": True},
        {"type": "tool_result", "tool_use_id": "c"},
    ]}]  # fmt: skip
    msgs = MessagesRequest.parse({"messages": turn}).messages
    assert msgs[1:] == [
        {"role": "tool", "tool_call_id": "a", "content": "xy"},
        {"role": "tool", "tool_call_id": "b", "content": "Error: boom"},
        {"role": "tool", "tool_call_id": "c", "content": ""},
    ]
