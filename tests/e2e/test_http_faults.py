"""Failure paths of flare-http: the shim runs for real, but its client's stream() is replaced by
fakes that fail in chosen places (errors after the SSE headers, slow first token, Busy in one of
n choices). The daemon is real (the shim connects to it for its context size)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from libflare_client import Busy, ConnectionLost, EngineError, StreamEvent, Usage

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from test_http_fixtures import Shim  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]
BODY = {"model": "flare", "messages": MSGS, "max_tokens": 4}


@pytest.fixture(scope="module")
def shim(daemon: Any) -> Iterator[Shim]:
    s = Shim(daemon.socket, keepalive_s=0.05, first_event_wait_s=0.05)
    yield s
    s.stop()


@pytest.fixture
def fake(shim: Shim) -> Iterator[dict[str, Any]]:
    """Install a fake stream(); `state["plan"](request_id)` returns the events (or exceptions,
    or ("sleep", s)) for one request; state["cancelled"] lists requests left early."""
    state: dict[str, Any] = {"cancelled": []}
    client = shim.app.state.client

    async def stream(*, request_id: str, **kw: Any) -> AsyncIterator[StreamEvent]:
        finished = False
        try:
            for item in state["plan"](request_id):
                if isinstance(item, tuple):
                    await asyncio.sleep(item[1])
                elif isinstance(item, BaseException):
                    finished = True
                    raise item
                else:
                    finished = item.finish_reason is not None
                    yield item
        finally:
            if not finished:
                state["cancelled"].append(request_id)

    client.stream = stream
    yield state
    del client.stream


def ev(rid: str, text: str, final: bool = False) -> StreamEvent:
    if final:  # messages requests carry the parsed answer text in `content`
        return StreamEvent(rid, [], text, [], "stop", Usage(3, 2, 0), content=text)
    return StreamEvent(rid, [7], text, [], content=text)


def test_error_after_headers_ends_stream_without_done(shim: Shim, fake: dict[str, Any]) -> None:
    fake["plan"] = lambda rid: [ev(rid, "a"), ("sleep", 0.1), ev(rid, "b"), EngineError("boom")]
    with httpx.stream("POST", shim.url + "/v1/chat/completions",
                      json={**BODY, "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e and not e.startswith(":")]
    assert "[DONE]" not in raw
    err = json.loads(events[-1].removeprefix("data: "))["error"]
    assert err["type"] == "server_error" and "boom" in err["message"] and rid
    oai = openai.OpenAI(base_url=shim.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="boom"):
        list(oai.chat.completions.create(**BODY, stream=True))


def test_keepalive_while_waiting_for_first_token(shim: Shim, fake: dict[str, Any]) -> None:
    fake["plan"] = lambda rid: [("sleep", 0.4), ev(rid, "hel"), ev(rid, "lo"), ev(rid, "", True)]
    with httpx.stream("POST", shim.url + "/v1/chat/completions",
                      json={**BODY, "stream": True}) as r:  # fmt: skip
        raw = r.read().decode()
    assert ": keepalive\n\n" in raw and raw.endswith("data: [DONE]\n\n")
    assert raw.index(": keepalive") < raw.index('"hel"')
    oai = openai.OpenAI(base_url=shim.url + "/v1", api_key="x", max_retries=0)
    chunks = list(oai.chat.completions.create(**BODY, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "hello"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_keepalives_on_the_anthropic_and_responses_streams(
    shim: Shim, fake: dict[str, Any]
) -> None:
    """A slow first token: /v1/messages sends `ping` events (its own keepalive, which the
    anthropic SDK skips), /v1/responses SSE comments; both streams still parse to the text."""
    anthropic = pytest.importorskip("anthropic")
    fake["plan"] = lambda rid: [("sleep", 0.4), ev(rid, "hel"), ev(rid, "lo"), ev(rid, "", True)]
    body = {"model": "flare", "max_tokens": 4, "messages": MSGS, "stream": True}
    with httpx.stream("POST", shim.url + "/v1/messages", json=body) as r:
        raw = r.read().decode()
    events = [e.split("\n")[0].removeprefix("event: ") for e in raw.split("\n\n") if e]
    first_delta = events.index("content_block_delta")
    assert events.count("ping") >= 3 and "ping" in events[2:first_delta], (
        events
    )  # beyond the opening one
    ant = anthropic.Anthropic(base_url=shim.url, api_key="x", max_retries=0)
    with ant.messages.stream(model="flare", max_tokens=4, messages=MSGS) as st:
        assert "".join(st.text_stream) == "hello"
    body = {"model": "flare", "input": "hi", "max_output_tokens": 4, "stream": True}
    with httpx.stream("POST", shim.url + "/v1/responses", json=body) as r:
        raw = r.read().decode()
    assert raw.index(": keepalive") < raw.index('"hel"'), raw[:300]
    done = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
    assert done[-1]["type"] == "response.completed"
    assert done[-1]["response"]["output"][0]["content"][0]["text"] == "hello"


def test_a_failed_responses_stream_keeps_what_was_streamed(
    shim: Shim, fake: dict[str, Any]
) -> None:
    fake["plan"] = lambda rid: [ev(rid, "hel"), ev(rid, "lo"), EngineError("device fault")]
    body = {"model": "flare", "input": "hi", "max_output_tokens": 8, "stream": True}
    with httpx.stream("POST", shim.url + "/v1/responses", json=body) as r:
        raw = r.read().decode()
    events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
    failed = events[-1]
    assert failed["type"] == "response.failed", failed
    response = failed["response"]
    assert response["status"] == "failed" and "device fault" in response["error"]["message"]
    (item,) = response["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "hello"
    oai = openai.OpenAI(base_url=shim.url + "/v1", api_key="x", max_retries=0)
    seen = [e.type for e in oai.responses.create(model="flare", input="hi", stream=True)]
    assert seen[-1] == "response.failed"  # the SDK parses the failed response


@pytest.mark.parametrize("stream", [False, True])
def test_busy_is_503_with_retry_after(shim: Shim, fake: dict[str, Any], stream: bool) -> None:
    fake["plan"] = lambda rid: [Busy("queue full")]
    r = httpx.post(shim.url + "/v1/chat/completions", json={**BODY, "stream": stream})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.headers["x-request-id"].startswith("req-")
    assert r.json()["error"]["code"] == "busy"


def test_n_all_or_nothing(shim: Shim, fake: dict[str, Any]) -> None:
    def plan(rid: str) -> list[Any]:
        if rid.endswith("-1"):
            return [("sleep", 0.05), Busy("queue full")]
        return [ev(rid, "x"), ("sleep", 30), ev(rid, "", True)]

    fake["plan"] = plan
    r = httpx.post(shim.url + "/v1/chat/completions", json={**BODY, "n": 3}, timeout=10)
    assert r.status_code == 503
    rid = r.headers["x-request-id"]
    for _ in range(100):
        if len(fake["cancelled"]) == 2:
            break
        time.sleep(0.02)
    assert sorted(fake["cancelled"]) == [f"{rid}-0", f"{rid}-2"]


def test_engine_error_500_and_connection_lost_503(shim: Shim, fake: dict[str, Any]) -> None:
    fake["plan"] = lambda rid: [ev(rid, "x"), EngineError("device fault")]
    r = httpx.post(shim.url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    fake["plan"] = lambda rid: [ConnectionLost("no Flare daemon reachable at /run/flare/x.sock")]
    r = httpx.post(shim.url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["code"] == "daemon_unavailable"
    assert r.headers["retry-after"] == "1" and "x-should-retry" not in r.headers  # retryable
    assert "/run/flare" not in r.text and "<path>" in r.text  # no filesystem paths to clients


def test_a_generation_lost_midway_is_not_retried(shim: Shim, fake: dict[str, Any]) -> None:
    """The daemon went away after it had taken the request: a retry would run the whole
    generation again, so the 503 says x-should-retry: false (the openai SDK then raises at
    once instead of resubmitting)."""
    fake["plan"] = lambda rid: [ev(rid, "x"), ConnectionLost("daemon gone")]
    r = httpx.post(shim.url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 503 and r.headers["x-should-retry"] == "false", r.headers
    assert "retry-after" not in r.headers
    calls: list[str] = []
    fake["plan"] = lambda rid: calls.append(rid) or [ev(rid, "x"), ConnectionLost("gone")]
    client = openai.OpenAI(base_url=shim.url + "/v1", api_key="k", max_retries=2)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="flare", messages=MSGS, max_tokens=4)  # type: ignore[arg-type]
    assert len(calls) == 1  # not resubmitted


def test_an_internal_error_shows_its_kind_not_its_details(shim: Shim, fake: dict[str, Any]) -> None:
    fake["plan"] = lambda rid: [RuntimeError("cannot open /var/lib/flare/secret.bin")]
    r = httpx.post(shim.url + "/v1/chat/completions", json=BODY)
    assert r.status_code == 500 and r.headers["x-should-retry"] == "false"
    message = r.json()["error"]["message"]
    assert "RuntimeError" in message and "secret" not in message and "[H" in message, message


def test_unicode_line_separators_stay_inside_a_data_line(shim: Shim, fake: dict[str, Any]) -> None:
    """U+2028/U+2029/U+0085 in generated text are escaped in the JSON, so clients that split
    lines the Unicode way (httpx's iter_lines) still see one data line per event."""
    text = "a\u2028b\u2029c\x85d"
    fake["plan"] = lambda rid: [ev(rid, text), ev(rid, "", True)]
    with httpx.stream("POST", shim.url + "/v1/chat/completions",
                      json={**BODY, "stream": True}) as r:  # fmt: skip
        lines = list(r.iter_lines())
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
    assert all(x.startswith(("data: ", ":")) or not x for x in lines)
