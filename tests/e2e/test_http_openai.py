"""flare-http through the official `openai` client against a real daemon and a real shim."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from e2e_support import is_baseline, wait_baseline  # noqa: E402
from test_http_fixtures import Shim  # noqa: E402

MSGS = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture(scope="module")
def shim(daemon: Any) -> Iterator[Shim]:
    s = Shim(daemon.socket, keepalive_s=0.05)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(shim: Shim) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=shim.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_chat_non_stream(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.with_raw_response.create(
        model="flare", messages=MSGS, max_tokens=12, seed=3, temperature=0.8
    )
    assert r.headers["x-request-id"].startswith("req-")
    c = r.parse()
    assert c.object == "chat.completion" and len(c.choices) == 1
    ch = c.choices[0]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str)
    assert ch.finish_reason in ("stop", "length")
    assert c.usage is not None and c.usage.prompt_tokens > 0
    assert 0 < c.usage.completion_tokens <= 12
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens


def test_stream_equals_non_stream_and_usage_chunk(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="flare", messages=MSGS, max_tokens=16, seed=11, temperature=1.0)
    full = oai.chat.completions.create(**kw)
    chunks = list(
        oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert len({c.id for c in chunks}) == 1
    choice_chunks = [c for c in chunks if c.choices]
    assert all(c.usage is None for c in choice_chunks)
    assert choice_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert last.usage.prompt_tokens == full.usage.prompt_tokens  # type: ignore[union-attr]
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == full.choices[0].message.content


def test_raw_sse_shape(shim: Shim) -> None:
    body = {"model": "x", "messages": MSGS, "max_tokens": 5, "seed": 1, "stream": True}
    with httpx.stream("POST", shim.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        if e.startswith(":"):
            continue
        assert e.startswith("data: ")
        json.loads(e[6:])  # every data line is JSON (the openai decoder needs that)


def test_n2_and_logprobs(oai: openai.OpenAI) -> None:
    c = oai.chat.completions.create(
        model="flare", messages=MSGS, max_tokens=6, seed=5, n=2, logprobs=True, top_logprobs=3
    )
    assert [ch.index for ch in c.choices] == [0, 1]
    for ch in c.choices:
        assert ch.logprobs is not None and ch.logprobs.content
        for e in ch.logprobs.content:
            assert e.logprob <= 0 and len(e.top_logprobs) == 3
    assert c.usage.completion_tokens == sum(  # type: ignore[union-attr]
        len(ch.logprobs.content)
        for ch in c.choices  # type: ignore[union-attr]
    )
    # streamed n=2: every choice gets its role chunk and a finish_reason
    chunks = list(
        oai.chat.completions.create(
            model="flare", messages=MSGS, max_tokens=6, seed=5, n=2, stream=True
        )
    )
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason is not None
        assert "".join(x.delta.content or "" for x in mine) == c.choices[i].message.content


def test_stop_string_truncates(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="flare", messages=MSGS, max_tokens=24, seed=9)
    full = oai.chat.completions.create(**kw).choices[0].message.content or ""
    assert len(full) > 4
    stop = full[2:4]
    first = full.find(stop)
    r = oai.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].message.content == full[:first]
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:first]


def test_stop_strings_on_completions_with_n_streamed(oai: openai.OpenAI) -> None:
    """The daemon ends each choice at its first stop string: /v1/completions with n=2,
    unary and streamed, each choice cut before the stop and finished with "stop"."""
    kw: dict[str, Any] = dict(model="flare", prompt="Once upon a time", max_tokens=24, seed=5, n=2)
    full = [c.text for c in sorted(oai.completions.create(**kw).choices, key=lambda c: c.index)]
    assert all(len(t) > 4 for t in full), full
    stop = full[0][2:4]
    want = [t[: t.find(stop)] if stop in t else t for t in full]
    r = oai.completions.create(**kw, stop=[stop])
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in got] == want
    assert got[0].finish_reason == "stop"
    texts = ["", ""]
    for chunk in oai.completions.create(**kw, stop=[stop], stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == want


def test_completions_token_ids(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model="flare", prompt=[1, 2, 3, 4], max_tokens=5, seed=2, logprobs=2)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens == 4
    assert r.choices[0].logprobs is not None
    assert len(r.choices[0].logprobs.token_logprobs or []) == r.usage.completion_tokens
    s = list(
        oai.completions.create(
            model="flare", prompt=[1, 2, 3, 4], max_tokens=5, seed=2, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in s if c.choices) == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model="flare", prompt=[[1, 2], "mixed"], max_tokens=5)  # type: ignore[list-item]
    assert ei.value.body["param"] == "prompt"  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
        ({"stop": 5}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"user": 5}, "user"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 1 << 64}, "seed"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 17}, "n"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"min_tokens": 9}, "min_tokens"),  # > max_tokens
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
    ],
)
def test_invalid_values_400(shim: Shim, extra: dict[str, Any], param: str) -> None:
    body = {"model": "flare", "messages": MSGS, "max_tokens": 4, **extra}
    r = httpx.post(shim.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert r.headers["x-request-id"].startswith("req-")


def test_unknown_fields_ignored_and_models(oai: openai.OpenAI, shim: Shim) -> None:
    """Undeclared fields are ignored; declared no-op fields accepted (the OpenAPI document
    says which); a negative int64 seed wraps and stays reproducible."""
    extra = {"frobnicate": 1, "user": "u1", "store": False, "metadata": {"a": "b"},
             "parallel_tool_calls": True, "logit_bias": {}, "service_tier": "auto"}  # fmt: skip
    r = httpx.post(
        shim.url + "/v1/chat/completions",
        json={"model": "flare", "messages": MSGS, "max_tokens": 2, **extra},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    kw: dict[str, Any] = dict(model="flare", messages=MSGS, max_completion_tokens=4, seed=-7)
    a, b = oai.chat.completions.create(**kw), oai.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage is not None and a.usage.completion_tokens <= 4
    assert [m.id for m in oai.models.list()] == ["flare"]
    r = httpx.post(shim.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_context_length_is_a_400_not_retried(oai: openai.OpenAI, shim: Shim) -> None:
    """A prompt beyond the prepared context can never succeed: 400 context_length_exceeded
    (as OpenAI), not a 503 that SDKs would retry."""
    body = {"model": "flare", "prompt": [5] * 600, "max_tokens": 4}  # context is 512
    r = httpx.post(shim.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.headers["x-request-id"] and "retry-after" not in r.headers
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(**body, stream=True)


def test_api_key_401(daemon: Any) -> None:
    s = Shim(daemon.socket, api_key="sekrit")
    try:
        assert httpx.get(s.url + "/health").status_code == 200  # public
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = httpx.get(s.url + "/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="flare", messages=MSGS, max_tokens=2)
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.chat.completions.create(model="flare", messages=MSGS, max_tokens=2).choices
    finally:
        s.stop()


def test_metrics(shim: Shim) -> None:
    r = httpx.get(shim.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {line.split(" ")[0] for line in r.text.splitlines() if not line.startswith("#")}
    assert {"flare_up", "flare_pages_total", "flare_requests_running"} <= names
    for line in r.text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_disconnect_mid_stream_cancels(daemon: Any, shim: Shim) -> None:
    """Drop the TCP connection after the first content chunk: the daemon frees the request."""
    wait_baseline(daemon.socket)
    body = json.dumps(
        {
            "model": "flare",
            "messages": MSGS,
            "max_tokens": 400,
            "stream": True,
            "seed": 4,
            "min_tokens": 400,
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", shim.port))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    got = b""
    while got.count(b"data: ") < 3:
        got += s.recv(65536)
    assert b" 200 " in got.split(b"\r\n")[0]
    from libflare_client import Client

    with Client(daemon.socket) as c:
        assert c.stats()["requests_live"] >= 1
    s.close()
    t0 = time.monotonic()
    st = wait_baseline(daemon.socket, timeout_s=10)
    assert is_baseline(st), st
    assert time.monotonic() - t0 < 5
    assert shim.app.state.counters["disconnects"] >= 1


def test_responses_stateless(oai: Any) -> None:
    kw: dict[str, Any] = dict(
        model="flare",
        input="Say something.",
        instructions="Be terse.",
        max_output_tokens=10,
        extra_body={"seed": 13},
    )
    r = oai.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 10
    events = list(oai.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    # the SDK's responses.stream() helper accumulates the same text (its get_final_response
    # wants response.completed; a max_output_tokens stop ends with response.incomplete, as
    # OpenAI's does)
    with oai.responses.stream(**kw) as s:
        done = [e for e in s if e.type == "response.output_text.done"]
    assert done[0].text == r.output_text
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="flare", input="x", previous_response_id="resp_1")


def test_a_storm_of_disconnects_frees_everything_and_keepalive_reuse_is_not_cancelled(
    daemon: Any, shim: Shim
) -> None:
    """Twelve streams, half of them dropped after their first chunk and a non-stream request
    dropped while it waits: every dropped request is freed, the survivors finish in full, and
    a keep-alive connection that carries two requests in turn completes both (the first's
    end is not taken for a disconnect of the second)."""
    import threading

    wait_baseline(daemon.socket)

    def request(body: dict[str, Any]) -> bytes:
        data = json.dumps(body).encode()
        return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))  # fmt: skip

    stream = {"model": "flare", "messages": MSGS, "max_tokens": 60, "stream": True,
              "min_tokens": 60}  # fmt: skip
    socks = []
    for i in range(12):
        s = socket.create_connection(("127.0.0.1", shim.port))
        s.sendall(request({**stream, "seed": i}))
        socks.append(s)
    unary = socket.create_connection(("127.0.0.1", shim.port))
    unary.sendall(request({**stream, "stream": False, "max_tokens": 400, "min_tokens": 400}))
    results: dict[int, bytes] = {}

    def finish(i: int, s: socket.socket, got: bytes) -> None:
        while not got.endswith(b"data: [DONE]\n\n") and not got.endswith(b"0\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        results[i] = got

    threads = []
    for i, s in enumerate(socks):
        got = b""
        while b"data: " not in got:
            got += s.recv(65536)
        if i % 2:
            s.close()  # dropped after its first chunk
        else:
            t = threading.Thread(target=finish, args=(i, s, got))
            t.start()
            threads.append(t)
    unary.close()  # dropped while its generation runs
    for t in threads:
        t.join(60)
    for i, got in results.items():
        text = got.decode()
        content = "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in text.splitlines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"]
        )
        assert "data: [DONE]" in text and '"finish_reason":"length"' in text, (i, text[-300:])
        assert content, i
    for s in socks[::2]:
        s.close()
    st = wait_baseline(daemon.socket, timeout_s=10)
    assert is_baseline(st), st
    with httpx.Client(base_url=shim.url, timeout=60) as h:  # one keep-alive connection
        bodies = [{"model": "flare", "messages": MSGS, "max_tokens": 5, "min_tokens": 5}] * 2
        for body in bodies:
            r = h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        with h.stream("POST", "/v1/chat/completions", json={**bodies[0], "stream": True}) as r:
            assert r.read().decode().endswith("data: [DONE]\n\n")
        r = h.post("/v1/chat/completions", json=bodies[0])
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
