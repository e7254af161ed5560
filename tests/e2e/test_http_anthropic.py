"""/v1/messages through the official `anthropic` client against a real daemon and shim."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_http_fixtures import Shim  # noqa: E402

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
    full = httpx.post(shim.url + "/v1/messages", json=body, headers=h).json()
    with httpx.stream("POST", shim.url + "/v1/messages", json={**body, "stream": True},
                      headers=h) as r:  # fmt: skip
        raw = r.read().decode()
    events = [e.split("\n")[0].removeprefix("event: ") for e in raw.split("\n\n") if e]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta", "ping"}
    import json

    text = "".join(
        json.loads(e.split("data: ", 1)[1])["delta"]["text"]
        for e in raw.split("\n\n")
        if e.startswith("event: content_block_delta")
    )
    assert text == full["content"][0]["text"]


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
