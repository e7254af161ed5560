"""Schemathesis fuzz of flare-http's own OpenAPI document against a real shim on loopback in
front of a real daemon (tiny model).

Positive data (fits the document) must be served: never a 5xx, a 200 whose body conforms to
the document, and a stream with no error event. The one 400 allowed there is the context
length, which a static document cannot express. Negative data (violates the document) must be
a 4xx carrying the endpoint's error object. A few constraints between fields are not in the
document either; `fit()` repairs those in positive cases, and keeps generation short (the
shim's validation, not the model, is under test).

Bounded by default; FLARE_FUZZ_EXAMPLES=500 for a long run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from test_http_fixtures import Shim  # noqa: E402

from libflare_client.http.openapi import build_document, document_json  # noqa: E402

EXAMPLES = int(os.environ.get("FLARE_FUZZ_EXAMPLES", "6"))
SCHEMA = schemathesis.openapi.from_dict(build_document())
GENERATION = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # shrinking over HTTP takes minutes
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def shim(daemon: Any) -> Iterator[Shim]:
    s = Shim(daemon.socket)
    yield s
    s.stop()


def test_committed_document_is_current(shim: Shim) -> None:
    import httpx

    path = os.path.join(os.path.dirname(__file__), "../../libflare_client/http/openapi.json")
    with open(path) as f:
        assert f.read() == document_json(), "regenerate openapi.json (see openapi.py)"
    served = httpx.get(shim.url + "/openapi.json").json()
    assert served == build_document() and served["openapi"].startswith("3.1")


def fit(path: str, body: Any) -> None:
    """Repair, in a positive case, the constraints between fields the document cannot say."""
    if not isinstance(body, dict):
        return
    num = (int, float)  # JSON Schema integers may arrive as 3.0
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), num):
            body[key] = min(body[key], 2)
    main = {"/v1/responses": "max_output_tokens", "/v1/chat/completions": "max_completion_tokens"}
    body[main.get(path, "max_tokens")] = min(body.get(main.get(path, "max_tokens")) or 2, 2)
    if isinstance(body.get("n"), num):
        body["n"] = min(body["n"], 2)
    if isinstance(body.get("min_tokens"), num):
        body["min_tokens"] = min(body["min_tokens"], 1)
    if body.get("top_logprobs") is not None and path == "/v1/chat/completions":
        body["logprobs"] = True
    if body.get("stream_options") is not None and not body.get("stream"):
        body["stream"] = True
    rf = body.get("response_format")
    if isinstance(rf, dict) and rf.get("type") in ("regex", "grammar"):
        del body["response_format"]  # a random expression need not compile
    elif isinstance(rf, dict) and isinstance(rf.get("json_schema"), dict):
        rf["json_schema"]["schema"] = {"type": "object"}  # nor a random schema
    for outer in ("output_config", "text"):  # the same, for /v1/messages and /v1/responses
        f = body.get(outer).get("format") if isinstance(body.get(outer), dict) else None
        if isinstance(f, dict) and f.get("type") in ("regex", "grammar"):
            del body[outer]["format"]
        elif isinstance(f, dict) and f.get("type") == "json_schema":
            f["schema"] = {"type": "object"}
    fit_tool_choice(path, body)
    prompt = body.get("prompt")
    if isinstance(prompt, list):  # <= 2 short prompts of ids below the tiny model's vocabulary
        prompt = [p[:16] if isinstance(p, list | str) else p for p in prompt[:16]]
        if prompt and isinstance(prompt[0], list | str):
            prompt = prompt[:2]
        body["prompt"] = [
            p if isinstance(p, str) else
            [int(t) % 200 for t in p] if isinstance(p, list) else int(p) % 200
            for p in prompt
        ]  # fmt: skip
    elif isinstance(prompt, str):
        body["prompt"] = prompt[:64]


def fit_tool_choice(path: str, body: dict[str, Any]) -> None:
    """Only 'auto' and 'none': a random model cannot make the call that 'required' / 'any' /
    a named tool demand (the request would fail with tool_choice_unsatisfied, by design)."""
    tc = body.get("tool_choice")
    if path == "/v1/messages":
        if isinstance(tc, dict) and tc.get("type") in ("any", "tool"):
            body["tool_choice"] = {"type": "auto"}
    elif tc == "required" or isinstance(tc, dict):
        body["tool_choice"] = "auto"


def header(r: Any, name: str) -> str:
    v = r.headers.get(name, "")
    return str(v[0] if isinstance(v, list) else v)


def stream_errors(text: str) -> list[str]:
    bad = []
    for frame in text.split("\n\n"):
        if "event: error" in frame or "event: response.failed" in frame:
            bad.append(frame)
        for line in frame.split("\n"):  # SSE lines end at LF here (never str.splitlines)
            if line.startswith("data: {") and '"error"' in line:
                d = json.loads(line[6:])
                if isinstance(d, dict) and d.get("error"):
                    bad.append(frame)
    return bad


def error_object(path: str, r: Any) -> dict[str, Any]:
    body = r.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        return dict(body["error"])
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


@pytest.mark.parametrize("path", GENERATION)
def test_positive(shim: Shim, path: str) -> None:
    op = SCHEMA[path]["POST"]

    @SETTINGS
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    def run(case: Any) -> None:
        fit(path, case.body)
        r = case.call(base_url=shim.url, timeout=60)
        case.validate_response(r, checks=CHECKS)
        if r.status_code != 200:
            err = error_object(path, r)
            # only the context length, which the document cannot state, may refuse valid data
            assert r.status_code == 400 and (
                err.get("code") == "context_length_exceeded"
                or "context limit" in err.get("message", "")
            ), (case.body, r.status_code, r.text)
        elif header(r, "content-type").startswith("text/event-stream"):
            assert not stream_errors(r.text), r.text

    run()


@pytest.mark.parametrize("path", GENERATION)
def test_negative(shim: Shim, path: str) -> None:
    op = SCHEMA[path]["POST"]

    @SETTINGS
    @given(case=op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    def run(case: Any) -> None:
        r = case.call(base_url=shim.url, timeout=60)
        assert 400 <= r.status_code < 500, (case.body, r.status_code, r.text)
        err = error_object(path, r)
        assert header(r, "x-request-id").startswith("req-")
        if path != "/v1/messages":
            assert err["type"] == "invalid_request_error"

    run()


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/openapi.json"])
def test_get_endpoints(shim: Shim, path: str) -> None:
    op = SCHEMA[path]["GET"]

    @settings(SETTINGS, max_examples=3)
    @given(case=op.as_strategy())
    def run(case: Any) -> None:
        r = case.call(base_url=shim.url, timeout=30)
        case.validate_response(r, checks=CHECKS)
        assert r.status_code == 200

    run()
