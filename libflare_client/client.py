"""Client: the blocking client. It runs an AsyncClient on a private event-loop thread, so
one implementation serves both; methods are safe to call from several threads."""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Iterator, Sequence
from typing import Any, TypeVar

from libflare_client.aio import AsyncClient
from libflare_client.conversation import Conversation
from libflare_client.errors import ConnectionLost
from libflare_client.types import (
    ChatResult,
    GenerateResult,
    RenderedPrompt,
    SamplingParams,
    StreamEvent,
)
from shm_protocol import messages as m

T = TypeVar("T")


class Client:
    def __init__(self, socket_path: str | os.PathLike[str] | None = None, **options: Any) -> None:
        """`options` are AsyncClient's: transport, connect_timeout_s, liveness_timeout_s,
        client_name, anticipate_events. Nothing connects until the first call (or `with`)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="flare-client", daemon=True
        )
        self._thread.start()
        self._aclient = AsyncClient(socket_path, **options)
        self.socket_path = self._aclient.socket_path

    def _run(self, coro: Awaitable[T]) -> T:
        if self._loop.is_closed():
            raise RuntimeError("this Client is closed")
        return asyncio.run_coroutine_threadsafe(_await(coro), self._loop).result()

    def connect(self) -> None:
        self._run(self._aclient.connect())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._aclient.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        self._loop.close()

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(
        self, prompt_token_ids: Sequence[int] | None = None, **kwargs: Any
    ) -> Iterator[StreamEvent]:
        """See AsyncClient.stream. Breaking out of the loop cancels the request (sent before
        this generator closes).

        The client's loop thread runs the whole stream and hands each event over through a
        queue, so an event costs this thread one wake-up; awaiting each event from here cost a
        round trip through the loop per event (a hop there, a wake-up back)."""
        if self._loop.is_closed():
            raise RuntimeError("this Client is closed")
        out: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        agen: AsyncGenerator[StreamEvent, None] = self._aclient.stream(prompt_token_ids, **kwargs)
        pump = asyncio.run_coroutine_threadsafe(_pump(agen, out), self._loop)
        ended = False
        try:
            while True:
                kind, value = self._take(out)
                if kind == "event":
                    yield value
                    continue
                ended = True
                if kind == "error":
                    raise value
                if kind == "closed":  # the stream was cancelled by something else
                    raise ConnectionLost("the stream stopped before its final event")
                return  # "end"
        finally:
            if not ended and not self._loop.is_closed():  # left early: cancel the request
                pump.cancel()
                # and wait (bounded) until the cancel was sent; never on the loop's own thread
                # (a generator finalised there), which has to run the pump to send it
                if threading.current_thread() is not self._thread:
                    deadline = time.monotonic() + _CLOSE_TIMEOUT_S
                    while not self._loop.is_closed() and time.monotonic() < deadline:
                        try:
                            if out.get(timeout=0.05)[0] == "closed":
                                break
                        except queue.Empty:
                            continue

    def _take(self, out: queue.SimpleQueue[tuple[str, Any]]) -> tuple[str, Any]:
        """The pump's next item; waits in bounded slices so a client closed meanwhile is seen
        (the AsyncClient's liveness timeout bounds a silent daemon)."""
        while True:
            try:
                return out.get(timeout=_POLL_S)
            except queue.Empty:
                if self._loop.is_closed():
                    raise RuntimeError("this Client was closed during the stream") from None

    def generate(
        self, prompt_token_ids: Sequence[int] | None = None, **kwargs: Any
    ) -> GenerateResult:
        """See AsyncClient.stream for the arguments (e.g. `prompt="text"`, `stop=[...]`)."""
        return self._run(self._aclient.generate(prompt_token_ids, **kwargs))

    def conversation(
        self,
        messages: list[dict[str, Any]] | None = None,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **defaults: Any,
    ) -> Conversation:
        """A conversation handle over this client: append messages, chat (the reply is
        appended), fork branches. `defaults` are chat()/stream() keywords for every request
        (max_tokens, sampling, chat_template_kwargs, ...). See libflare_client.conversation."""
        return Conversation(self, messages, system, tools, **defaults)

    def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] = "auto",
        response_format: dict[str, Any] | None = None,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """See AsyncClient.chat: the parsed reply (content, reasoning, tool_calls)."""
        return self._run(
            self._aclient.chat(
                messages, tools, tool_choice, response_format, max_tokens, sampling, **kwargs
            )
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> RenderedPrompt:
        """See AsyncClient.render (chat_template_kwargs, continue_final_message, tool_choice)."""
        return self._run(self._aclient.render(messages, tools, add_generation_prompt, **kwargs))

    def cancel(self, request_id: str) -> None:
        self._run(self._aclient.cancel(request_id))

    def stats(self) -> dict[str, Any]:
        return self._run(self._aclient.stats())

    def transport_stats(self) -> dict[str, int]:
        """AsyncClient.transport_stats: doorbell_wakes, poll_windows, polls_caught,
        late_publishes."""
        return self._aclient.transport_stats()

    def health(self) -> str:
        return self._run(self._aclient.health())

    def welcome(self) -> m.Welcome:
        """See AsyncClient.welcome: the session's Welcome, renewed once a daemon that was
        starting when it opened is ready."""
        return self._run(self._aclient.welcome())

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        self._run(self._aclient.wait_ready(timeout_s))


async def _await(aw: Awaitable[T]) -> T:
    return await aw


_POLL_S = 1.0  # how often a blocked stream consumer checks that its client is still open
_CLOSE_TIMEOUT_S = 5.0  # how long leaving a stream early waits for its cancel to be sent


async def _pump(agen: AsyncGenerator[StreamEvent, None], out: queue.SimpleQueue[Any]) -> None:
    """Runs one stream on the client's loop: ("event", ev) per event, then ("end", None) or
    ("error", exc), and ("closed", None) once the stream is closed (its cancel sent, when it
    was cancelled; AsyncClient.stream is safe to cancel at any await, its connection's
    handshake and its Submit included)."""
    try:
        async for ev in agen:
            out.put(("event", ev))
        out.put(("end", None))
    except Exception as exc:  # typed client errors (ConnectionLost, InvalidRequest, ...)
        out.put(("error", exc))
    finally:
        try:
            await agen.aclose()  # a no-op after the stream ended; after a cancel, sends it
        finally:
            out.put(("closed", None))
