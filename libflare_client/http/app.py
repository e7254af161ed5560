"""The flare-http ASGI app (Starlette): OpenAI- and Anthropic-compatible endpoints that talk to
the daemon only through libflare_client.AsyncClient."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from libflare_client import AsyncClient, FlareError
from libflare_client.http import params as P
from libflare_client.http.errors import ApiError, bad, from_flare
from libflare_client.http.formats import (
    KEEPALIVE_LINE,
    AnthropicFormat,
    ChatFormat,
    CompletionFormat,
    Format,
    ResponsesFormat,
)
from libflare_client.http.generation import KEEPALIVE, Generation

log = logging.getLogger("flare.http")


@dataclass
class Settings:
    socket_path: str | None = None
    api_key: str | None = None
    model_name: str = "flare"
    default_max_tokens: int = 1024
    keepalive_s: float = 15.0
    first_event_wait_s: float = 1.0  # hold the HTTP status this long for admission errors


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


class GenerationResponse:
    """ASGI response for one Generation: unary JSON or SSE; watches for the client going away
    and aborts the generation (cancelling its requests in the daemon) when it does."""

    def __init__(
        self,
        gen: Generation,
        fmt: Format,
        stream: bool,
        settings: Settings,
        counters: dict[str, int],
    ) -> None:
        self.gen, self.fmt, self.stream, self.settings = gen, fmt, stream, settings
        self.counters = counters
        self.disconnected = False
        self.headers = [(b"x-request-id", gen.request_id.encode())]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        watcher = asyncio.create_task(self._watch(receive))
        try:
            if self.stream:
                await self._run_stream(send)
            else:
                await self._run_unary(send)
        except OSError:
            self.gen.abort()
        finally:
            watcher.cancel()
            if not self.gen.done:
                self.gen.abort()

    async def _watch(self, receive: Any) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.disconnected = True
                if not self.gen.done:
                    self.counters["disconnects"] += 1
                    log.info("%s: client disconnected, cancelling", self.gen.request_id)
                    self.gen.abort()
                return

    async def _send_json(
        self, send: Any, status: int, body: Any, extra: dict[str, str] | None = None
    ) -> None:
        data = msgspec.json.encode(body)
        headers = [
            *self.headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
        ]
        headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _error(self, send: Any, exc: BaseException) -> None:
        err = from_flare(exc)
        self._log_error(err)
        await self._send_json(send, err.status, self.fmt.error_status_body(err), err.headers)

    def _log_error(self, err: ApiError) -> None:
        self.counters[f"errors_{err.status}"] = self.counters.get(f"errors_{err.status}", 0) + 1
        lvl = logging.ERROR if err.status >= 500 else logging.INFO
        log.log(lvl, "%s: %d %s", self.gen.request_id, err.status, err.message)

    async def _run_unary(self, send: Any) -> None:
        try:
            await self.gen.admit(None)
            async for d in self.gen.deltas():
                self.fmt.collect(d)
        except Exception as exc:
            if not self.disconnected:
                await self._error(send, exc)
            return
        await self._send_json(send, 200, self.fmt.body())

    async def _run_stream(self, send: Any) -> None:
        try:
            await self.gen.admit(self.settings.first_event_wait_s)
        except Exception as exc:
            await self._error(send, exc)
            return
        headers = [
            *self.headers,
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def body(chunks: list[bytes]) -> None:
            if chunks:
                await send(
                    {"type": "http.response.body", "body": b"".join(chunks), "more_body": True}
                )

        await body(self.fmt.stream_start())
        keep = getattr(self.fmt, "keepalive", None)
        try:
            async for d in self.gen.deltas(self.settings.keepalive_s):
                if d is KEEPALIVE:
                    await body([keep() if keep else KEEPALIVE_LINE])
                else:
                    await body(self.fmt.stream_delta(d))
        except Exception as exc:
            if self.disconnected:
                return
            err = from_flare(exc)
            self._log_error(err)
            await send({"type": "http.response.body", "body": self.fmt.stream_error(err)})
            return
        await send({"type": "http.response.body", "body": b"".join(self.fmt.stream_end())})


def build_app(settings: Settings) -> Starlette:
    client = AsyncClient(settings.socket_path, client_name="flare-http")
    counters: dict[str, int] = {"requests": 0, "disconnects": 0}

    def auth(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        got = request.headers.get("x-api-key")
        h = request.headers.get("authorization", "")
        if got is None and h.lower().startswith("bearer "):
            got = h[7:].strip()
        if got is None or not hmac.compare_digest(got.encode(), key.encode()):
            raise ApiError(
                401, "missing or invalid API key", "authentication_error", None, "invalid_api_key"
            )

    async def read_json(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    async def default_max(body_max: int | None = None) -> int:
        try:
            conn = await client.connect()
            ctx = conn.welcome.max_context_tokens
        except FlareError:
            ctx = 0
        if ctx > 0:
            return max(1, min(settings.default_max_tokens, ctx // 2))
        return settings.default_max_tokens

    def model_of(body: dict[str, Any]) -> str:
        m = body.get("model")
        if m is not None and not isinstance(m, str):
            raise bad("'model' must be a string", "model")
        return m or settings.model_name

    def start(rid: str, submits: list[dict[str, Any]], stops: list[str]) -> Generation:
        counters["requests"] += 1
        gen = Generation(client, rid, submits, stops)
        gen.start()
        return gen

    # -- endpoints -------------------------------------------------------------------------
    async def health(request: Request) -> Response:
        try:
            state = await asyncio.wait_for(client.health(), 2.0)
        except (FlareError, TimeoutError) as exc:
            return JSONResponse(
                {"status": "unavailable", "detail": str(exc)}, 503, headers={"Retry-After": "1"}
            )
        code = 200 if state == "ready" else 503
        return JSONResponse({"status": "ok" if code == 200 else state, "daemon": state}, code)

    async def models(request: Request) -> Response:
        auth(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": settings.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "flare",
                    }
                ],
            }
        )

    async def chat_completions(request: Request) -> Response:
        auth(request)
        body = await read_json(request)
        messages = P.chat_messages(body)
        tools = P.tools(body)
        P.response_format(body)
        stream, include_usage = P.stream_flags(body)
        lp, top = P.chat_logprobs(body)
        n = P.n_choices(body)
        sp = P.sampling(body)
        stops = P.stops(body)
        ext = P.extensions(body)
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise bad("'user' must be a string", "user")
        mt = P.max_tokens(body, ("max_completion_tokens", "max_tokens"), await default_max())
        rid = new_request_id()
        submits = [
            dict(
                messages=messages,
                tools=tools,
                max_tokens=mt,
                sampling=P.with_seed(sp, i),
                logprobs=max(top, 1) if lp else 0,
                **ext,
            )
            for i in range(n)
        ]
        gen = start(rid, submits, stops)
        fmt = ChatFormat(gen, model_of(body), include_usage, top, lp)
        return GenerationResponse(gen, fmt, stream, settings, counters)  # type: ignore[return-value]

    async def completions(request: Request) -> Response:
        auth(request)
        body = await read_json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(P.is_int(t) for t in prompt):
            prompts = [prompt]
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(p, list) and p and all(P.is_int(t) for t in p) for p in prompt)
        ):
            prompts = prompt
        elif isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
        ):
            raise bad(
                "text prompts are not supported yet: the daemon offers no raw-text encode "
                "call to its clients; pass token ids (a list of integers) or use "
                "/v1/chat/completions",
                "prompt",
                "unsupported_value",
            )
        else:
            raise bad(
                "'prompt' must be a non-empty list of token ids (or a list of them)", "prompt"
            )
        if body.get("echo"):
            raise bad("'echo' is not supported", "echo", "unsupported_value")
        if body.get("suffix"):
            raise bad("'suffix' is not supported", "suffix", "unsupported_value")
        bo = body.get("best_of")
        if bo is not None and bo != 1 and bo != body.get("n", 1):
            raise bad("'best_of' is not supported", "best_of", "unsupported_value")
        stream, include_usage = P.stream_flags(body)
        lp = P.opt_int(body, "logprobs", 0, P.MAX_TOP_LOGPROBS)
        n = P.n_choices(body)
        sp = P.sampling(body)
        stops = P.stops(body)
        ext = P.extensions(body)
        mt = P.max_tokens(body, ("max_tokens",), 16)
        rid = new_request_id()
        submits = [
            dict(
                prompt_token_ids=p,
                max_tokens=mt,
                sampling=P.with_seed(sp, i),
                logprobs=max(lp, 1) if lp is not None else 0,
                **ext,
            )
            for p in prompts
            for i in range(n)
        ]
        gen = start(rid, submits, stops)
        fmt = CompletionFormat(gen, model_of(body), include_usage, lp, len(prompts))
        return GenerationResponse(gen, fmt, stream, settings, counters)  # type: ignore[return-value]

    async def messages(request: Request) -> Response:
        try:
            auth(request)
            body = await read_json(request)
            msgs: list[dict[str, Any]] = []
            system = body.get("system")
            if system is not None:
                msgs.append({"role": "system", "content": P.text_content(system, "system")})
            raw = body.get("messages")
            if not isinstance(raw, list) or not raw:
                raise bad("'messages' must be a non-empty array", "messages")
            for i, msg in enumerate(raw):
                p = f"messages[{i}]"
                if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
                    raise bad(f"messages[{i}].role must be 'user' or 'assistant'", "messages")
                msgs.append(
                    {
                        "role": msg["role"],
                        "content": P.text_content(msg.get("content"), f"{p}.content"),
                    }
                )
            mt = body.get("max_tokens")
            if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
                raise bad("'max_tokens' is required and must be a positive integer", "max_tokens")
            if body.get("tools"):
                raise bad("tools are not supported on /v1/messages yet", "tools")
            stream = P.opt_bool(body, "stream")
            sp = P.sampling(body, temperature_max=1.0)
            stops = P.stops(body, "stop_sequences")
        except ApiError as err:
            return error_response(err, anthropic=True)
        rid = new_request_id()
        gen = start(rid, [dict(messages=msgs, max_tokens=mt, sampling=sp)], stops)
        fmt = AnthropicFormat(gen, body.get("model") or settings.model_name)
        return GenerationResponse(gen, fmt, stream, settings, counters)  # type: ignore[return-value]

    async def responses(request: Request) -> Response:
        auth(request)
        body = await read_json(request)
        if body.get("previous_response_id") is not None:
            raise bad(
                "previous_response_id is not supported: this endpoint is stateless",
                "previous_response_id",
                "unsupported_value",
            )
        if body.get("tools"):
            raise bad("tools are not supported on /v1/responses yet", "tools")
        if body.get("background"):
            raise bad("background responses are not supported", "background")
        fmt_ = (
            (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        )
        if fmt_ is not None and (not isinstance(fmt_, dict) or fmt_.get("type") != "text"):
            raise bad(
                "text.format other than 'text' (structured output) is not supported yet",
                "text.format",
                "unsupported_value",
            )
        msgs: list[dict[str, Any]] = []
        instructions = body.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise bad("'instructions' must be a string", "instructions")
            msgs.append({"role": "system", "content": instructions})
        inp = body.get("input")
        if isinstance(inp, str):
            msgs.append({"role": "user", "content": inp})
        elif isinstance(inp, list) and inp:
            for i, item in enumerate(inp):
                p = f"input[{i}]"
                if not isinstance(item, dict) or item.get("type", "message") != "message":
                    raise bad(f"{p}: only message items are supported", p)
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise bad(f"{p}.role must be user, assistant, system or developer", p)
                msgs.append(
                    {
                        "role": "system" if role == "developer" else role,
                        "content": P.text_content(item.get("content"), f"{p}.content"),
                    }
                )
        else:
            raise bad("'input' must be a string or a non-empty array of messages", "input")
        stream = P.opt_bool(body, "stream")
        sp = P.sampling(body)
        mt = P.max_tokens(body, ("max_output_tokens",), await default_max())
        rid = new_request_id()
        gen = start(
            rid, [dict(messages=msgs, max_tokens=mt, sampling=sp, **P.extensions(body))], []
        )
        echo = {
            "instructions": instructions,
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
        }
        fmt = ResponsesFormat(gen, model_of(body), echo)
        return GenerationResponse(gen, fmt, stream, settings, counters)  # type: ignore[return-value]

    async def metrics(request: Request) -> Response:
        auth(request)
        try:
            stats = await client.stats()
            up = 1
        except FlareError:
            stats, up = {}, 0
        lines = ["# TYPE flare_up gauge", f"flare_up {up}"]
        for k, v in flatten("flare", stats):
            lines.append(f"{k} {v}")
        for k, v in counters.items():
            if not k.startswith("_"):
                lines.append(f"flare_http_{k}_total {v}")
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def error_response(err: ApiError, anthropic: bool = False) -> Response:
        rid = new_request_id()  # early (validation/auth) errors carry a request id too
        lvl = logging.ERROR if err.status >= 500 else logging.INFO
        log.log(lvl, "%s: %d %s", rid, err.status, err.message)
        body = err.anthropic() if anthropic else err.openai()
        return JSONResponse(body, err.status, headers={**err.headers, "x-request-id": rid})

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def on_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(from_flare(exc))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ApiError: on_api_error, Exception: on_error},
    )
    app.state.client = client
    app.state.counters = counters
    app.state.started = time.time()
    return app


_NAME = re.compile(r"[^a-zA-Z0-9_]")


def flatten(prefix: str, obj: Any) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += flatten(f"{prefix}_{_NAME.sub('_', str(k))}", v)
    elif isinstance(obj, bool):
        out.append((prefix, float(obj)))
    elif isinstance(obj, (int, float)):
        out.append((prefix, obj))
    elif isinstance(obj, str) and prefix == "flare_health":
        for s in ("starting", "ready", "draining", "failed"):
            out.append((f'flare_health{{state="{s}"}}', 1.0 if obj == s else 0.0))
    return out
