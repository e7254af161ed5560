"""The ASGI response of one generation: unary JSON or an SSE stream, written from the
Generation's output through its Format; a client going away aborts the generation (which
cancels its requests in the daemon)."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from libflare_client.http.errors import ApiError, from_flare
from libflare_client.http.formats import KEEPALIVE_LINE, Format
from libflare_client.http.generation import Generation

if TYPE_CHECKING:
    from libflare_client.http.app import Settings

log = logging.getLogger("flare.http")


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

    async def _error(self, send: Any, exc: BaseException, started: bool = False) -> None:
        err = from_flare(exc)
        if started and err.status == 503:
            # the daemon had taken the request: a retry would run the generation again from
            # the start, so it fails visibly instead (SDKs honour x-should-retry: false)
            err.headers.pop("Retry-After", None)
            err.headers["x-should-retry"] = "false"
        self._log_error(err)
        status = self.fmt.error_status(err)
        await self._send_json(send, status, self.fmt.error_status_body(err), err.headers)

    def _log_error(self, err: ApiError) -> None:
        self.counters[f"errors_{err.status}"] = self.counters.get(f"errors_{err.status}", 0) + 1
        lvl = logging.ERROR if err.status >= 500 else logging.INFO
        log.log(lvl, "%s: %d %s", self.gen.request_id, err.status, err.message)

    async def _run_unary(self, send: Any) -> None:
        started = False
        try:
            await self.gen.admit(None)
            started = True
            async for d in self.gen.deltas():
                self.fmt.collect(d)
        except Exception as exc:
            if not self.disconnected:
                await self._error(send, exc, started)
            return
        await self._send_json(send, 200, self.fmt.body())

    async def _run_stream(self, send: Any) -> None:
        try:
            admitted = await self.gen.admit(self.settings.first_event_wait_s)
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
        # one write per batch of ready output; the stream's opening frames go with the first
        # batch when the first tokens are already here (admitted), else at once
        pending = self.fmt.stream_start()
        if not admitted:
            await self._body(send, pending)
            pending = []
        fmt = self.fmt
        keep = getattr(fmt, "keepalive", None)
        try:
            async for batch in self.gen.batches(self.settings.keepalive_s):
                if batch is None:
                    pending.append(keep() if keep else KEEPALIVE_LINE)
                else:
                    for d in batch:
                        pending += fmt.stream_delta(d)
                if pending:
                    await self._body(send, pending)
                    pending = []
        except Exception as exc:
            if self.disconnected:
                return
            err = from_flare(exc)
            self._log_error(err)
            await self._body(send, [*pending, self.fmt.stream_error(err)], more=False)
            return
        await self._body(send, [*pending, *self.fmt.stream_end()], more=False)

    @staticmethod
    async def _body(send: Any, frames: list[bytes], more: bool = True) -> None:
        if frames or not more:
            await send({"type": "http.response.body", "body": b"".join(frames), "more_body": more})
