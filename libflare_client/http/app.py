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

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from libflare_client import AsyncClient, FlareError
from libflare_client.http import params as P
from libflare_client.http import structures as S
from libflare_client.http.anthropic_format import AnthropicFormat
from libflare_client.http.anthropic_request import MessagesRequest
from libflare_client.http.errors import ApiError, bad, from_flare
from libflare_client.http.formats import ChatFormat, CompletionFormat
from libflare_client.http.generation import Generation
from libflare_client.http.openapi import document_json
from libflare_client.http.response import GenerationResponse
from libflare_client.http.responses_format import ResponsesFormat
from libflare_client.http.responses_request import ResponsesRequest
from shm_protocol.redact import redact

log = logging.getLogger("flare.http")
OPENAPI = document_json().encode()
START_POLL_S = 0.1  # how often a request waiting for a starting daemon asks for its health


@dataclass
class Settings:
    socket_path: str | None = None
    api_key: str | None = None
    model_name: str = "flare"
    default_max_tokens: int = 1024
    keepalive_s: float = 15.0
    first_event_wait_s: float = 1.0  # hold the HTTP status this long for admission errors
    max_body_bytes: int = 32 << 20  # a larger request body is refused (413) before it is read
    max_choices: int = 128  # /v1/completions: prompts x n in one call
    # how long a request waits for a starting daemon: the handshake of a socket-activated
    # flared whose interpreter is still starting, then its model's load (minutes); with no
    # daemon listening at all the connect fails at once, whatever this says
    connect_timeout_s: float = 300.0


class StartWatch:
    """One health poll of a starting daemon, shared by every request that waits for it: a
    hundred requests queued at boot ask ten times a second in all, not each."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._task: asyncio.Task[str] | None = None
        self._waiters = 0

    async def wait(self, timeout_s: float) -> str:
        """The daemon's health once it is no longer "starting", or "starting" when timeout_s
        passed first; FlareError when the daemon is lost meanwhile."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
            self._task.add_done_callback(_retrieved)
        task = self._task
        self._waiters += 1
        try:
            done, _ = await asyncio.wait({task}, timeout=max(timeout_s, 0.0))
        finally:
            self._waiters -= 1
        return task.result() if done else "starting"

    async def _poll(self) -> str:
        while True:
            state = await self._client.health()
            if state != "starting" or self._waiters == 0:  # no one waits any more: stop
                return state
            await asyncio.sleep(START_POLL_S)


def _retrieved(task: asyncio.Task[str]) -> None:
    """A poll whose waiters all left may end in an error no one reads: read it here."""
    if not task.cancelled():
        task.exception()


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:24]}"


def build_app(settings: Settings) -> Starlette:
    client = AsyncClient(
        settings.socket_path,
        client_name="flare-http",
        connect_timeout_s=settings.connect_timeout_s,
    )
    counters: dict[str, int] = {"requests": 0, "disconnects": 0}
    start_watch = StartWatch(client)

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

    async def read_body(request: Request) -> bytes:
        """The body, or 413 as soon as it is known to exceed max_body_bytes (by its declared
        length, or while it streams in): never buffered beyond the limit."""
        limit = settings.max_body_bytes
        too_large = ApiError(
            413, f"the request body is larger than {limit} bytes", "invalid_request_error",
            None, "request_too_large", {"x-should-retry": "false"},
        )  # fmt: skip
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(request: Request) -> dict[str, Any]:
        try:
            body = json.loads(await read_body(request))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise bad(f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        return body

    async def welcome() -> tuple[int, int]:
        """(max_context_tokens, vocab_size) of the daemon's model; (0, 0) while unreachable.

        Every generating endpoint asks first, so a request that arrives while the daemon starts
        (socket activation queues its connection until flared runs) waits here, up to
        connect_timeout_s in all, for the model to be loaded instead of being refused as Busy.
        One that gives up, or finds the daemon draining, failed or gone, goes on to the
        daemon's own refusal (a 503 with Retry-After, or the failure)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settings.connect_timeout_s
        try:
            w = (await client.connect()).welcome
            if w.health != "ready" and await start_watch.wait(deadline - loop.time()) == "ready":
                w = await client.welcome()  # a fresh session: the model's facts
            return w.max_context_tokens, w.vocab_size
        except FlareError:
            return 0, 0

    def default_max(ctx: int) -> int:
        if ctx > 0:
            return max(1, min(settings.default_max_tokens, ctx // 2))
        return settings.default_max_tokens

    def start(
        rid: str, submits: list[dict[str, Any]], max_tool_calls: int | None = None
    ) -> Generation:
        """Stop strings travel in the submits: the daemon ends the output at them."""
        counters["requests"] += 1
        gen = Generation(client, rid, submits, max_tool_calls)
        gen.start()
        return gen

    # -- endpoints -------------------------------------------------------------------------
    async def health(request: Request) -> Response:
        try:
            state = await asyncio.wait_for(client.health(), 2.0)
        except (FlareError, TimeoutError) as exc:
            return JSONResponse(
                {"status": "unavailable", "detail": redact(str(exc))},
                503,
                headers={"Retry-After": "1"},
            )
        code = 200 if state == "ready" else 503
        # not ready (starting, draining, failed): 503, retryable while starting or draining
        headers = {"Retry-After": "1"} if state in ("starting", "draining") else {}
        body = {"status": "ok" if code == 200 else state, "daemon": state}
        return JSONResponse(body, code, headers=headers)

    async def openapi(request: Request) -> Response:
        return Response(OPENAPI, media_type="application/json")

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
        P.reject_greedy(body)
        v = P.check_scalars(body, P.CHAT)
        messages = S.chat_messages(body)
        tools, tool_choice = S.tools(body)
        rf = S.response_format(body)
        ctk = S.wire_value(v["chat_template_kwargs"] or {}, "chat_template_kwargs")
        stream = bool(v["stream"])
        include_usage = P.stream_flags(body, stream)
        lp, top = P.chat_logprobs(v)
        n = v["n"] or 1
        sp = P.sampling(v)
        stops = P.stops(body)
        ctx, _ = await welcome()
        key = "max_completion_tokens" if v["max_completion_tokens"] is not None else "max_tokens"
        mt, ext = P.limits(v, v[key] or default_max(ctx), ctx, key)
        rid = new_request_id()
        submits = [
            dict(
                messages=messages,
                tools=tools,
                tool_choice=tool_choice,
                response_format=rf,
                chat_template_kwargs=ctk,
                stop=stops,
                max_tokens=mt,
                sampling=P.with_seed(sp, i),
                logprobs=max(top, 1) if lp else 0,
                **ext,
            )
            for i in range(n)
        ]
        gen = start(rid, submits, 1 if v["parallel_tool_calls"] is False else None)
        fmt = ChatFormat(gen, v["model"] or settings.model_name, include_usage, top, lp)
        return GenerationResponse(gen, fmt, stream, settings, counters)  # type: ignore[return-value]

    async def completions(request: Request) -> Response:
        auth(request)
        body = await read_json(request)
        P.reject_greedy(body)
        v = P.check_scalars(body, P.COMPLETIONS)
        ctx, vocab = await welcome()
        prompts = S.prompts(body, vocab)
        stream = bool(v["stream"])
        include_usage = P.stream_flags(body, stream)
        lp = v["logprobs"]
        n = v["n"] or 1
        if len(prompts) * n > settings.max_choices:
            raise bad(
                f"{len(prompts)} prompts x n={n} is {len(prompts) * n} choices; at most "
                f"{settings.max_choices} per request",
                "prompt",
            )
        sp = P.sampling(v)
        stops = P.stops(body)
        mt, ext = P.limits(v, v["max_tokens"] or 16, ctx, "max_tokens")
        rid = new_request_id()
        submits = [
            dict(
                **p,
                stop=stops,
                max_tokens=mt,
                sampling=P.with_seed(sp, i),
                logprobs=max(lp, 1) if lp is not None else 0,
                **ext,
            )
            for p in prompts
            for i in range(n)
        ]
        gen = start(rid, submits)
        fmt = CompletionFormat(
            gen, v["model"] or settings.model_name, include_usage, lp, len(prompts)
        )
        return GenerationResponse(gen, fmt, stream, settings, counters)  # type: ignore[return-value]

    async def messages(request: Request) -> Response:
        try:
            auth(request)
            body = await read_json(request)
            P.reject_greedy(body)
            v = P.check_scalars(body, P.MESSAGES)
            req = MessagesRequest.parse(body)
            if v["max_tokens"] is None:
                raise bad("'max_tokens' is required and must be a positive integer", "max_tokens")
            stream = bool(v["stream"])
            sp = P.sampling(v)
            stops = P.stops(body, "stop_sequences", allow_str=False)
            ctx, _ = await welcome()
            mt, ext = P.limits(v, v["max_tokens"], ctx, "max_tokens")
        except ApiError as err:
            return error_response(err, anthropic=True)
        rid = new_request_id()
        submit = dict(
            messages=req.messages,
            tools=req.tools,
            tool_choice=req.tool_choice,
            response_format=req.response_format,
            chat_template_kwargs={"enable_thinking": req.thinking},
            stop=stops,
            max_tokens=mt,
            sampling=sp,
            **ext,
        )
        gen = start(rid, [submit], req.max_tool_calls)
        fmt = AnthropicFormat(gen, v["model"] or settings.model_name, req.thinking)
        return GenerationResponse(gen, fmt, stream, settings, counters)  # type: ignore[return-value]

    async def responses(request: Request) -> Response:
        auth(request)
        body = await read_json(request)
        P.reject_greedy(body)
        v = P.check_scalars(body, P.RESPONSES)
        req = ResponsesRequest.parse(body, v["instructions"])
        ctk = S.wire_value(v["chat_template_kwargs"] or {}, "chat_template_kwargs")
        stream = bool(v["stream"])
        sp = P.sampling(v)
        ctx, _ = await welcome()
        mo = v["max_output_tokens"]
        mt, ext = P.limits(v, mo or default_max(ctx), ctx, "max_output_tokens")
        rid = new_request_id()
        submit = dict(
            messages=req.messages,
            tools=req.tools,
            tool_choice=req.tool_choice,
            response_format=req.response_format,
            chat_template_kwargs=ctk,
            max_tokens=mt,
            sampling=sp,
            **ext,
        )
        parallel = v["parallel_tool_calls"] is not False
        gen = start(rid, [submit], None if parallel else 1)
        echo = {
            "instructions": v["instructions"],
            "max_output_tokens": mo,
            "temperature": v["temperature"],
            "top_p": v["top_p"],
            "parallel_tool_calls": parallel,
            **req.echo,
        }
        fmt = ResponsesFormat(gen, v["model"] or settings.model_name, echo)
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
        status = err.anthropic_status if anthropic else err.status
        return JSONResponse(body, status, headers={**err.headers, "x-request-id": rid})

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
        Route("/openapi.json", openapi, methods=["GET"]),
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
