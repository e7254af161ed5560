"""AsyncClient: the asyncio client (INTERFACES.md). `Client` wraps it for blocking code."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from libflare_client._connection import Connection
from libflare_client.errors import ConnectionLost, InvalidRequest
from libflare_client.types import (
    ChatResult,
    GenerateResult,
    RenderedPrompt,
    SamplingParams,
    StreamEvent,
    collect,
)
from shm_protocol import messages as m
from shm_protocol.paths import client_socket_path


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:20]}"


def build_submit(
    *,
    request_id: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: list[dict[str, Any]] | None,
    tools: list[dict[str, Any]] | None,
    max_tokens: int,
    sampling: SamplingParams | None,
    logprobs: int,
    stop_token_ids: Sequence[int],
    min_tokens: int,
    ignore_eos: bool,
    detokenize: bool,
) -> m.Submit:
    if (prompt_token_ids is None) == (messages is None):
        raise InvalidRequest("pass exactly one of prompt_token_ids= and messages=")
    if tools and messages is None:
        raise InvalidRequest("tools= needs messages= (the daemon renders them into the prompt)")
    return m.Submit(
        request_id=request_id or new_request_id(),
        max_tokens=max_tokens,
        prompt_token_ids=list(prompt_token_ids or []),
        messages=list(messages or []),
        tools=list(tools or []),
        sampling=sampling.to_wire() if sampling is not None else None,
        logprobs=logprobs,
        stop_token_ids=list(stop_token_ids),
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        detokenize=detokenize,
    )


class AsyncClient:
    """One session with the daemon; reconnects on the next call after the daemon restarts.

    A call in flight when the connection dies raises ConnectionLost and is never resubmitted.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        transport: str = "ring",
        connect_timeout_s: float = 5.0,
        liveness_timeout_s: float = 5.0,
        client_name: str = "libflare_client",
    ) -> None:
        if transport not in m.TRANSPORTS:
            raise ValueError(f"transport must be one of {m.TRANSPORTS}, got {transport!r}")
        self.socket_path = Path(socket_path) if socket_path else client_socket_path()
        self.transport = transport
        self._connect_timeout_s = connect_timeout_s
        self._liveness_timeout_s = liveness_timeout_s
        self._client_name = client_name
        self._conn: Connection | None = None
        self._lock: asyncio.Lock | None = None

    async def connect(self) -> Connection:
        """The live connection, opening a new one if there is none (or the last one died)."""
        if self._conn is not None and not self._conn.closed:
            return self._conn
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = await Connection.open(
                    self.socket_path,
                    transport=self.transport,
                    connect_timeout_s=self._connect_timeout_s,
                    liveness_timeout_s=self._liveness_timeout_s,
                    client_name=self._client_name,
                )
            return self._conn

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    async def __aenter__(self) -> AsyncClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- generation ------------------------------------------------------------------------
    async def stream(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int = 16,
        sampling: SamplingParams | None = None,
        logprobs: int = 0,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        ignore_eos: bool = False,
        request_id: str | None = None,
        detokenize: bool = True,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Events as the engine produces them; the last one carries finish_reason and usage.
        Leaving the loop early cancels the request."""
        submit = build_submit(
            request_id=request_id, prompt_token_ids=prompt_token_ids, messages=messages,
            tools=tools, max_tokens=max_tokens, sampling=sampling, logprobs=logprobs,
            stop_token_ids=stop_token_ids, min_tokens=min_tokens, ignore_eos=ignore_eos,
            detokenize=detokenize,
        )  # fmt: skip
        conn = await self.connect()
        q = await conn.submit(submit)
        done = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finish_reason is not None:
                    done = True
                    yield item
                    return
                yield item
        finally:
            if not done:
                conn.forget(submit.request_id)
                if not conn.closed:
                    with contextlib.suppress(ConnectionLost):
                        await conn.cancel(submit.request_id)

    async def generate(
        self, prompt_token_ids: Sequence[int] | None = None, **kwargs: Any
    ) -> GenerateResult:
        """The whole completion. Same arguments as stream()."""
        events = [ev async for ev in self.stream(prompt_token_ids, **kwargs)]
        return collect(events[-1].request_id, events)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str = "auto",
        response_format: dict[str, Any] | None = None,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Render `messages` with the bundle's chat template and generate a reply.

        `content` is the generated text as-is: reasoning and tool-call parsing are not
        implemented yet (`reasoning` is None, `tool_calls` is empty). `tool_choice` accepts
        "auto" and "none"; `response_format` (structured output) is not supported yet."""
        if tool_choice not in ("auto", "none"):
            raise InvalidRequest(f"tool_choice {tool_choice!r} is not supported yet")
        if response_format is not None:
            raise InvalidRequest("response_format (structured output) is not supported yet")
        if tool_choice == "none":
            tools = None  # tool_choice "none" removes the tools from the template
        r = await self.generate(
            messages=messages, tools=tools, max_tokens=max_tokens, sampling=sampling, **kwargs
        )
        return ChatResult(r.request_id, r.text, None, [], r.finish_reason, r.usage, r.token_ids)

    # -- calls -----------------------------------------------------------------------------
    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> RenderedPrompt:
        conn = await self.connect()
        reply: m.RenderResult = await conn.call(
            lambda cid: m.Render(cid, list(messages), list(tools or []), add_generation_prompt)
        )
        return RenderedPrompt(
            list(reply.token_ids), list(reply.message_end_token_offsets), reply.text
        )

    async def cancel(self, request_id: str) -> None:
        """Cancel a request of this client; its stream ends with finish_reason "cancelled"."""
        conn = await self.connect()
        await conn.cancel(request_id)

    async def stats(self) -> dict[str, Any]:
        """Engine and daemon stats, plus "health" (starting/ready/draining/failed)."""
        conn = await self.connect()
        reply: m.StatsReply = await conn.call(m.GetStats)
        return {"health": reply.health, **reply.stats}

    async def health(self) -> str:
        conn = await self.connect()
        reply: m.Pong = await conn.call(m.Ping)
        return reply.health

    async def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.1) -> None:
        """Poll until the daemon reports "ready" (reconnecting as needed) or raise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: Exception | None = None
        while loop.time() < deadline:
            try:
                state = await self.health()
                if state == "ready":
                    return
                if state == "failed":
                    from libflare_client.errors import EngineError

                    raise EngineError("the daemon failed to start")
            except ConnectionLost as exc:
                last = exc
            await asyncio.sleep(poll_s)
        raise ConnectionLost(f"daemon at {self.socket_path} not ready within {timeout_s}s: {last}")
