"""Parsed chat output through flare-http and the official `openai` client: tool calls (one
and parallel, stream and not), reasoning_content, json_schema output, text prompts.

A random tiny model rarely writes markup by itself, so the outputs are steered with the
daemon's grammar-constrained sampling (`response_format` regex, a Flare extension): the model
must then write known text, and the assertions are on what the shim parsed from it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from e2e_support import NO_THINK, WEATHER, call_text, regex  # noqa: E402
from test_http_fixtures import Shim  # noqa: E402

USER = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]


@pytest.fixture(scope="module")
def oai(daemon: Any) -> Iterator[Any]:
    s = Shim(daemon.socket)
    with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c
    s.stop()


def steered(oai: Any, text: str, seeds: range, done: Any, **kw: Any) -> tuple[int, Any]:
    """The first seed whose output is exactly `text` (the grammar admits an escape into free
    text when tools are declared, so not every seed follows it)."""
    for seed in seeds:
        try:
            r = oai.chat.completions.create(
                model="flare", messages=USER, max_tokens=160, seed=seed,
                extra_body={"response_format": regex(text), "chat_template_kwargs": NO_THINK},
                **kw,
            )  # fmt: skip
        except openai.InternalServerError as exc:  # a seed that escaped the steered call
            assert exc.body["code"] == "tool_choice_unsatisfied"  # type: ignore[index]
            continue
        if done(r.choices[0]):
            return seed, r
    pytest.fail(f"no seed in {seeds} produced the steered output")


def test_parallel_tool_calls_stream_and_not(oai: Any) -> None:
    text = call_text("Paris") + "\n" + call_text("Rome")
    seed, r = steered(oai, text, range(12), lambda ch: ch.finish_reason == "tool_calls",
                      tools=[WEATHER])  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    calls = ch.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    # the steered run's budget: the grammar admits other tokenizations of the same text, so
    # its length in tokens depends on the seed
    kw: dict[str, Any] = dict(
        model="flare", messages=USER, max_tokens=160, seed=seed, tools=[WEATHER],
        extra_body={"response_format": regex(text), "chat_template_kwargs": NO_THINK},
    )  # fmt: skip
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert all(d.index is not None for d in deltas)
    for i, call in enumerate(calls):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].id and mine[0].type == "function"  # ids are per request
        assert mine[0].function.name == "get_weather"
        assert all(d.id is None and d.function.name is None for d in mine[1:])
        assert "".join(d.function.arguments or "" for d in mine) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the SDK's stream helper accumulates the same calls (it needs index on every delta)
    with oai.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_named_tool_choice_is_forwarded(oai: Any) -> None:
    """A named tool_choice reaches the daemon: steered into that call it is parsed; a call
    the output does not make is a 500 tool_choice_unsatisfied error, not a silent answer."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, r = steered(oai, call_text("Oslo"), range(12),
                   lambda ch: ch.finish_reason == "tool_calls", tools=[WEATHER],
                   tool_choice=named)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    with pytest.raises(openai.InternalServerError) as ei:
        oai.chat.completions.create(
            model="flare", messages=USER, max_tokens=4, seed=1, tools=[WEATHER],
            tool_choice=named, extra_body={"response_format": regex("Sunny.")},
        )  # fmt: skip
    assert ei.value.body["code"] == "tool_choice_unsatisfied"  # type: ignore[index]
    assert ei.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.BadRequestError) as bi:
        oai.chat.completions.create(
            model="flare", messages=USER, max_tokens=4, tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )  # fmt: skip
    assert bi.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_reasoning_content(oai: Any) -> None:
    text = "<think>\nWhy.\n</think>\n\nSunny."
    _, r = steered(oai, text, range(3), lambda ch: ch.finish_reason == "stop")
    msg = r.choices[0].message
    assert msg.content == "Sunny." and msg.model_extra["reasoning_content"] == "Why."


def test_json_schema_output_validates_and_stream_equals_non_stream(oai: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    kw: dict[str, Any] = dict(
        model="flare", messages=USER, max_tokens=60, response_format=fmt,
        extra_body={"chat_template_kwargs": NO_THINK},
    )  # fmt: skip
    for seed in range(3):
        r = oai.chat.completions.create(**kw, seed=seed)
        if r.choices[0].finish_reason != "stop":
            continue  # ran out of tokens inside the JSON
        doc = json.loads(r.choices[0].message.content)
        assert set(doc) == {"city", "days"} and doc["city"] in ("Paris", "Rome")
        assert isinstance(doc["days"], int)
        chunks = list(oai.chat.completions.create(**kw, seed=seed, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == r.choices[0].message.content
        return
    pytest.fail("no seed finished its JSON within max_tokens")


def test_json_object_with_a_schema_follows_it(oai: Any) -> None:
    """llama.cpp's extension {"type": "json_object", "schema": S}: the object follows S (the
    schema is not silently dropped); a schema that is not an object is a 400."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo"]}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    kw: dict[str, Any] = dict(model="flare", messages=USER, max_tokens=40,
                              extra_body={"chat_template_kwargs": NO_THINK})  # fmt: skip
    fmt = {"type": "json_object", "schema": schema}
    for seed in range(4):
        r = oai.chat.completions.create(**kw, seed=seed, response_format=fmt)
        if r.choices[0].finish_reason == "stop":
            assert json.loads(r.choices[0].message.content) == {"city": "Oslo"}
            break
    else:
        pytest.fail("no seed finished its JSON within max_tokens")
    with pytest.raises(openai.BadRequestError, match="schema must be an object"):
        oai.chat.completions.create(**kw, response_format={"type": "json_object", "schema": 1})


def test_text_prompts_on_completions(oai: Any) -> None:
    r = oai.completions.create(model="flare", prompt=["Hello", "Bye"], max_tokens=4, seed=3, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    s = list(oai.completions.create(model="flare", prompt="Hello", max_tokens=4, seed=3,
                                    stream=True))  # fmt: skip
    one = oai.completions.create(model="flare", prompt="Hello", max_tokens=4, seed=3)
    assert "".join(c.choices[0].text for c in s if c.choices) == one.choices[0].text


def test_chat_template_kwargs_reach_the_template(oai: Any, daemon: Any) -> None:
    """The prompt is the daemon's rendering with the request's chat_template_kwargs (thinking
    off adds an empty think block to the generation prompt)."""
    from libflare_client import Client

    on = oai.chat.completions.create(model="flare", messages=USER, max_tokens=1, seed=1)
    off = oai.chat.completions.create(model="flare", messages=USER, max_tokens=1, seed=1,
                                      extra_body={"chat_template_kwargs": NO_THINK})  # fmt: skip
    with Client(daemon.socket) as c:
        rendered = c.render(USER, chat_template_kwargs=NO_THINK)
    assert off.usage.prompt_tokens == len(rendered.token_ids)
    assert on.usage.prompt_tokens < off.usage.prompt_tokens
