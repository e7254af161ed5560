"""AsyncClient: the asyncio client (INTERFACES.md). `Client` wraps it for blocking code."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import uuid
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libflare_client._connection import Connection
from libflare_client.errors import ConnectionLost, InvalidRequest
from libflare_client.types import (
    ChatResult,
    GenerateResult,
    MessageAccumulator,
    RenderedPrompt,
    SamplingParams,
    StreamEvent,
    collect,
)
from shm_protocol import messages as m
from shm_protocol.paths import client_socket_path

if TYPE_CHECKING:
    from libflare_client.conversation import AsyncConversation


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:20]}"


ToolChoice = str | dict[str, Any]


def _offsets(values: Sequence[int]) -> list[int]:
    """Token offsets as plain ints, or InvalidRequest (the daemon checks their range)."""
    out = list(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise InvalidRequest(f"message_ends must be integers, got {out[:5]!r}")
    return out


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
    prompt: str | None = None,
    stop: Sequence[str] | str | None = None,
    tool_choice: ToolChoice = "auto",
    response_format: dict[str, Any] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    message_ends: Sequence[int] = (),
) -> m.Submit:
    given = sum(x is not None for x in (prompt_token_ids, messages, prompt))
    if given != 1:
        raise InvalidRequest("pass exactly one of prompt_token_ids=, prompt= and messages=")
    if tools and messages is None:
        raise InvalidRequest("tools= needs messages= (the daemon renders them into the prompt)")
    if messages is None and (tool_choice != "auto" or chat_template_kwargs):
        raise InvalidRequest("tool_choice= and chat_template_kwargs= need messages=")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequest("prompt= must be a string (token ids go in prompt_token_ids=)")
    if message_ends and messages is not None:
        raise InvalidRequest("message_ends= is for prompt_token_ids= and prompt= (messages= "
                             "requests get theirs from the chat template)")  # fmt: skip
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if stops and not detokenize:
        raise InvalidRequest("stop strings need detokenize=True")
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
        tool_choice=tool_choice,
        response_format=response_format,
        stop=stops,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        prompt_text=prompt or "",
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        message_ends=_offsets(message_ends),
    )


class AsyncClient:
    """One session with the daemon; reconnects on the next call after the daemon restarts.

    A call in flight when the connection dies raises ConnectionLost and is never resubmitted.
    `anticipate_events` (ring transport): while a stream's events come at a steady cadence,
    wake just before the next expected batch and poll the ring for a bounded window instead of
    waiting for the doorbell (shm_protocol/cadence.py). None (the default): on where this
    process may run on at least four CPUs (`anticipation_default`), off on smaller hosts, where
    the polling would take CPU from the daemon. Measured on the H200 host: a paced event's
    delivery latency halves (raw transport); through the daemon inter-token p50 and p99 are
    unchanged and the client spends ~60 us more CPU per token (README).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        transport: str = "ring",
        connect_timeout_s: float = 5.0,
        liveness_timeout_s: float = 5.0,
        client_name: str = "libflare_client",
        anticipate_events: bool | None = None,
    ) -> None:
        if transport not in m.TRANSPORTS:
            raise ValueError(f"transport must be one of {m.TRANSPORTS}, got {transport!r}")
        self.socket_path = Path(socket_path) if socket_path else client_socket_path()
        self.transport = transport
        self._connect_timeout_s = connect_timeout_s
        self._liveness_timeout_s = liveness_timeout_s
        self._client_name = client_name
        self._anticipate_events = anticipate_events
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
                    anticipate_events=self._anticipate_events,
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
        prompt: str | None = None,
        stop: Sequence[str] | str | None = None,
        tool_choice: ToolChoice = "auto",
        response_format: dict[str, Any] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        message_ends: Sequence[int] = (),
    ) -> AsyncGenerator[StreamEvent, None]:
        """Events as the engine produces them; the last one carries finish_reason and usage.
        Leaving the loop early cancels the request.

        The prompt is exactly one of `prompt_token_ids`, `prompt` (text, tokenized by the
        daemon) and `messages` (rendered by the bundle's chat template, with `tools`,
        `tool_choice`, `chat_template_kwargs`). For messages the events carry parsed
        `content` / `reasoning` / `tool_calls` deltas and the last one the whole `message`.
        `stop`: strings that end the output (excluded from it); `response_format`: structured
        output (json_schema, json_object, regex, grammar). `message_ends`: with token ids or
        text, the token offsets where the prompt's messages end; each becomes an exact
        checkpoint that a later request sharing the prompt up to it resumes from."""
        submit = build_submit(
            request_id=request_id, prompt_token_ids=prompt_token_ids, messages=messages,
            tools=tools, max_tokens=max_tokens, sampling=sampling, logprobs=logprobs,
            stop_token_ids=stop_token_ids, min_tokens=min_tokens, ignore_eos=ignore_eos,
            detokenize=detokenize, prompt=prompt, stop=stop, tool_choice=tool_choice,
            response_format=response_format, chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, message_ends=message_ends,
        )  # fmt: skip
        acc = MessageAccumulator() if messages is not None else None
        conn = await self.connect()
        q = conn.start(submit)  # raises before anything is sent, or the request exists
        done = False
        try:
            await conn.flush()
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if acc is not None:
                    acc.add(item)
                if item.finish_reason is not None:
                    done = True
                    if acc is not None:
                        item = dataclasses.replace(item, message=acc.message(item))
                    else:
                        item = dataclasses.replace(item, message=None)
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
        """The whole completion. Same arguments as stream() (e.g. `prompt="text"`)."""
        events = [ev async for ev in self.stream(prompt_token_ids, **kwargs)]
        return collect(events[-1].request_id, events)

    def conversation(
        self,
        messages: list[dict[str, Any]] | None = None,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **defaults: Any,
    ) -> AsyncConversation:
        """Client.conversation for this AsyncClient (its chat and stream are awaitable)."""
        from libflare_client.conversation import AsyncConversation

        return AsyncConversation(self, messages, system, tools, **defaults)

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: ToolChoice = "auto",
        response_format: dict[str, Any] | None = None,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """Render `messages` with the bundle's chat template, generate, and parse the reply.

        `tool_choice`: "auto", "none" (tools removed from the template), "required" (raises
        ToolChoiceUnsatisfied unless a complete call to a declared tool is produced) or
        {"type": "function", "function": {"name": N}}. `response_format`: json_schema /
        json_object / regex / grammar structured output. Other keywords are stream()'s
        (stop, chat_template_kwargs such as {"enable_thinking": False}, logprobs, ...)."""
        r = await self.generate(
            messages=messages, tools=tools, tool_choice=tool_choice,
            response_format=response_format, max_tokens=max_tokens, sampling=sampling, **kwargs,
        )  # fmt: skip
        msg = r.message
        assert msg is not None
        return ChatResult(
            r.request_id, msg.content, msg.reasoning, msg.tool_calls, r.finish_reason, r.usage,
            r.token_ids, msg.tool_errors, r.text, r.stop_string, r.logprobs,
        )  # fmt: skip

    # -- calls -----------------------------------------------------------------------------
    async def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tool_choice: ToolChoice = "auto",
    ) -> RenderedPrompt:
        """The prompt a messages request with the same arguments would run on."""
        conn = await self.connect()
        kw = dict(chat_template_kwargs or {})
        reply: m.RenderResult = await conn.call(
            lambda cid: m.Render(
                cid,
                list(messages),
                list(tools or []),
                add_generation_prompt,
                kw,
                continue_final_message,
                tool_choice,
            )
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

    def transport_stats(self) -> dict[str, int]:
        """This client's side of the event transport, for the current connection (zeros when
        there is none): doorbell_wakes (the loop woke for a doorbell), poll_windows (it woke
        early to poll for an expected batch), polls_caught (that batch landed in the window),
        late_publishes (ring sessions: a step's events were published more than 1.5 steps
        after the previous ones, i.e. the daemon or its engine was delayed), anticipating (1
        when this session polls around expected batches, see `anticipate_events`)."""
        conn = self._conn
        if conn is None:
            return {
                "doorbell_wakes": 0, "poll_windows": 0, "polls_caught": 0, "late_publishes": 0,
                "anticipating": 0,
            }  # fmt: skip
        return conn.transport_stats()

    async def health(self) -> str:
        conn = await self.connect()
        reply: m.Pong = await conn.call(m.Ping)
        return reply.health

    async def welcome(self) -> m.Welcome:
        """The live session's Welcome (connecting if there is none). A session opened while
        the daemon started holds one without the model's facts (vocab_size,
        max_context_tokens and eos_token_ids come with the loaded bundle): once the daemon is
        ready, such a session is replaced by a fresh one, provided nothing is in flight on it.
        """
        conn = await self.connect()
        if conn.welcome.health == "ready" or not conn.idle:
            return conn.welcome
        if await self.health() != "ready":
            return conn.welcome
        assert self._lock is not None  # connect() made it
        async with self._lock:
            if self._conn is conn and conn.idle:
                self._conn = None
                await conn.close()
        return (await self.connect()).welcome

    async def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.1) -> None:
        """Poll until the daemon reports "ready" (reconnecting as needed) or raise; the session
        then carries the model's facts in its Welcome (see welcome())."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: Exception | None = None
        while loop.time() < deadline:
            try:
                state = await self.health()
                if state == "ready":
                    await self.welcome()
                    return
                if state == "failed":
                    from libflare_client.errors import EngineError

                    raise EngineError("the daemon failed to start")
            except ConnectionLost as exc:
                last = exc
            await asyncio.sleep(poll_s)
        raise ConnectionLost(f"daemon at {self.socket_path} not ready within {timeout_s}s: {last}")
