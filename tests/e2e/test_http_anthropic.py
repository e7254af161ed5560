"""/v1/messages through the official `anthropic` client against a real daemon and shim."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_http_faults import ev, fake  # noqa: E402, F401  (the fake-stream fixture)
from test_http_fixtures import Shim  # noqa: E402

from libflare_client import Busy, EngineError  # noqa: E402

MSGS = [{"role": "user", "content": "Write a haiku about rain."}]


@pytest.fixture(scope="module")
def shim(daemon: Any) -> Iterator[Shim]:
    s = Shim(daemon.socket, api_key="k")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ant(shim: Shim) -> Iterator[Any]:
    with anthropic.Anthropic(base_url=shim.url, api_key="k", max_retries=0) as c:
        yield c


def test_messages_non_stream_and_stream_agree(ant: Any) -> None:
    # this anthropic SDK has no temperature/top_p arguments: sampling goes through extra_body
    kw: dict[str, Any] = dict(model="flare", max_tokens=12, messages=MSGS, system="Be brief.",
                              extra_body={"temperature": 0.7, "seed": 8})  # fmt: skip
    r = ant.messages.create(**kw)
    assert r.type == "message" and r.role == "assistant"
    assert r.content[0].type == "text"
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    with ant.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0


def test_messages_seeded_stream_equals_non_stream(shim: Shim) -> None:
    body = {"model": "flare", "max_tokens": 10, "messages": MSGS, "seed": 21}
    h = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    full = httpx.post(shim.url + "/v1/messages", json=body, headers=h, timeout=60).json()
    with httpx.stream("POST", shim.url + "/v1/messages", json={**body, "stream": True},
                      headers=h, timeout=60) as r:  # fmt: skip
        raw = r.read().decode()
    events = [e.split("\n")[0].removeprefix("event: ") for e in raw.split("\n\n") if e]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta", "ping"}

    text = "".join(
        json.loads(e.split("data: ", 1)[1])["delta"]["text"]
        for e in raw.split("\n\n")
        if e.startswith("event: content_block_delta")
    )
    assert text == full["content"][0]["text"]
    # input usage is in message_start already (clients that track context read it there)
    start = json.loads(raw.split("event: message_start\ndata: ", 1)[1].split("\n", 1)[0])
    assert start["message"]["usage"]["input_tokens"] == full["usage"]["input_tokens"] > 0


def test_messages_errors(shim: Shim, ant: Any) -> None:
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(
            model="flare", max_tokens=5, messages=MSGS, extra_body={"temperature": 0}
        )
    r = httpx.post(shim.url + "/v1/messages", json={"model": "x", "messages": MSGS},
                   headers={"x-api-key": "k"})  # fmt: skip
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    bad = anthropic.Anthropic(base_url=shim.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="flare", max_tokens=5, messages=MSGS)


def test_sdk_stream_event_order_and_stop_sequence(ant: Any) -> None:
    kw: dict[str, Any] = dict(model="flare", max_tokens=16, messages=MSGS,
                              extra_body={"seed": 5})  # fmt: skip
    full = ant.messages.create(**kw).content[0].text
    assert len(full) > 4
    with ant.messages.create(**kw, stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == full
    assert events[-2].delta.stop_reason in ("end_turn", "max_tokens")
    assert events[-2].usage.output_tokens > 0
    # a stop sequence cuts the text before it, in both forms
    stop = full[2:4]
    cut = full[: full.find(stop)]
    r = ant.messages.create(**kw, stop_sequences=[stop])
    assert r.content[0].text == cut
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with ant.messages.stream(**kw, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == cut
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_error_event_mid_stream(shim: Shim, ant: Any, fake: dict[str, Any]) -> None:  # noqa: F811
    """A failure after the SSE headers: an `error` event, no message_stop; the SDK raises."""
    fake["plan"] = lambda rid: [ev(rid, "a"), ev(rid, "b"), EngineError("boom")]
    h = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
    body = {"model": "flare", "max_tokens": 8, "messages": MSGS, "stream": True}
    with httpx.stream("POST", shim.url + "/v1/messages", json=body, headers=h,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        raw = r.read().decode()
    names = [e.split("\n")[0].removeprefix("event: ") for e in raw.split("\n\n") if e]
    assert names[-1] == "error" and "message_stop" not in names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    err = json.loads(raw.split("event: error\ndata: ", 1)[1])
    assert err == {"type": "error", "error": {"type": "api_error", "message": "boom"}}
    with (
        pytest.raises(anthropic.APIStatusError, match="boom"),
        ant.messages.stream(model="flare", max_tokens=8, messages=MSGS) as s,
    ):
        "".join(s.text_stream)
    # queue full before the headers: Anthropic's overloaded status, 529, with Retry-After and
    # an overloaded_error body; the SDK raises its OverloadedError for it
    fake["plan"] = lambda rid: [Busy("queue full")]
    r2 = httpx.post(shim.url + "/v1/messages", json=body, headers=h, timeout=60)
    assert r2.status_code == 529 and r2.headers["retry-after"] == "1", r2.text
    assert r2.json()["error"]["type"] == "overloaded_error"
    with pytest.raises(anthropic.OverloadedError, match="queue full"):
        ant.messages.create(model="flare", max_tokens=8, messages=MSGS)
