"""One HTTP generation = n daemon streams, with all-or-nothing admission and stop strings.

Talks to the daemon only through libflare_client.AsyncClient. Every choice runs in its own
pump task that copies the client's stream events into one queue; aborting a generation
cancels the pumps, which cancels the requests in the daemon (the client's stream generator
sends a Cancel when it is left early).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from libflare_client import AsyncClient, FlareError, StreamEvent, TokenLogprob, ToolCallDelta


@dataclass
class Delta:
    """What one choice produced since the last Delta (the daemon ends outputs at stop strings:
    `stop_sequence` is the one that ended this choice)."""

    index: int
    text: str
    logprobs: list[tuple[str, TokenLogprob]] = field(default_factory=list)  # (token text, lp)
    finish_reason: str | None = None  # "stop" | "length" | daemon reason, on the last Delta
    stop_sequence: str | None = None
    reasoning: str = ""  # messages requests: the parsed reasoning delta
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ChoiceState:
    index: int
    request_id: str
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # tokens of the events that carried reasoning text
    finished: bool = False
    finish_reason: str | None = None
    parsed: bool = False  # a messages request: the daemon parses content/reasoning/tool calls


KEEPALIVE = object()
_END = object()
Item = tuple[int, Any]  # (choice index, a StreamEvent, an exception, KEEPALIVE or _END)


class Mailbox:
    """The pumps' items for the one consumer: put never waits; the consumer waits for items.
    Lighter than asyncio.Queue on the per-token path (one deque append, at most one wake)."""

    def __init__(self) -> None:
        self.items: deque[Item] = deque()
        self.last_put_s = time.monotonic()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        self.items.append(item)
        self.last_put_s = time.monotonic()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def next_put(self) -> asyncio.Future[None]:
        """A future done at the next put. Take it before yielding to the loop (a put in
        between would not wake it)."""
        w = self._waiter
        if w is None or w.done():
            w = self._waiter = asyncio.get_running_loop().create_future()
        return w


class Generation:
    """n requests submitted together; iterate batches() (or deltas()) for their merged
    output (the daemon applies stop strings)."""

    def __init__(
        self,
        client: AsyncClient,
        request_id: str,
        submits: list[dict[str, Any]],
        max_tool_calls: int | None = None,
    ) -> None:
        """`max_tool_calls`: calls past this many are left out of the output (a client that
        disabled parallel calls gets the first one)."""
        self.client = client
        self.max_tool_calls = max_tool_calls
        self.request_id = request_id
        n = len(submits)
        self.choices = [
            ChoiceState(
                i,
                request_id if n == 1 else f"{request_id}-{i}",
                parsed=submits[i].get("messages") is not None,
            )
            for i in range(n)
        ]
        self._submits = submits
        self._box = Mailbox()
        self._unfinished = n
        self._pumps: list[asyncio.Task[None]] = []
        self._ticker: asyncio.TimerHandle | None = None
        self.aborted = False

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        for ch, kw in zip(self.choices, self._submits):
            self._pumps.append(asyncio.create_task(self._pump(ch, kw)))

    async def _pump(self, ch: ChoiceState, kw: dict[str, Any]) -> None:
        try:
            async for ev in self.client.stream(request_id=ch.request_id, **kw):
                self._box.put((ch.index, ev))
        except Exception as exc:  # FlareError, or anything else: the consumer raises it
            self._box.put((ch.index, exc))

    def abort(self) -> None:
        """Cancel every unfinished request (client gone, or an error in another choice)."""
        if self.aborted:
            return
        self.aborted = True
        if self._ticker is not None:
            self._ticker.cancel()
        for t in self._pumps:
            if not t.done():
                t.cancel()
        self._box.put((-1, _END))

    async def wait_closed(self, timeout_s: float = 2.0) -> None:
        if self._pumps:
            with contextlib.suppress(Exception):
                await asyncio.wait(self._pumps, timeout=timeout_s)

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    def _finish(self, ch: ChoiceState) -> None:
        if not ch.finished:
            ch.finished = True
            self._unfinished -= 1

    # -- admission -------------------------------------------------------------------------
    async def admit(self, timeout_s: float | None) -> bool:
        """Wait until every choice has its first item (left in the mailbox for batches()). An
        error in any choice aborts all and is raised (all-or-nothing admission). False: timed
        out, still pending."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            seen: set[int] = set()
            for idx, item in self._box.items:
                if idx in seen:  # admission looks at each choice's first item only
                    continue
                if item is _END:
                    raise FlareError("the request was aborted")
                if isinstance(item, BaseException):
                    self.abort()
                    raise item
                if isinstance(item, StreamEvent) and item.prompt_tokens:
                    self.choices[idx].prompt_tokens = item.prompt_tokens  # usage before output
                seen.add(idx)
            if len(seen) == len(self.choices):
                return True
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._box.next_put(), remaining)
            except TimeoutError:
                return False

    # -- output ----------------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[Delta]:
        """Every Delta until each choice finished (see batches())."""
        async for batch in self.batches():
            for d in batch or ():  # (no keepalive_s: never None)
                yield d

    async def batches(self, keepalive_s: float | None = None) -> AsyncIterator[list[Delta] | None]:
        """Lists of the Deltas that are ready (never empty), or None when nothing came for
        about keepalive_s (time for a keepalive), until every choice finished. An error is raised after the Deltas
        that came before it (the other choices are aborted first)."""
        if keepalive_s is not None:
            self._tick(keepalive_s)
        items = self._box.items
        try:
            while self._unfinished:
                if not items:
                    await self._box.next_put()
                batch: list[Delta] = []
                keep = False
                while items and self._unfinished:
                    idx, item = items.popleft()
                    if item is KEEPALIVE:
                        keep = True
                        continue
                    if batch and (item is _END or isinstance(item, BaseException)):
                        items.appendleft((idx, item))  # after the output that came first
                        break
                    d = self._delta(idx, item)
                    if d is not None:
                        batch.append(d)
                if batch:
                    yield batch
                elif keep:
                    yield None
        finally:
            if self._ticker is not None:
                self._ticker.cancel()

    def _tick(self, keepalive_s: float) -> None:
        """A keepalive into the mailbox when nothing was put for keepalive_s (checked four
        times per period: one timer per period, not one per token)."""
        if not self._box.items and time.monotonic() - self._box.last_put_s >= keepalive_s:
            self._box.put((-2, KEEPALIVE))
        loop = asyncio.get_running_loop()
        self._ticker = loop.call_later(keepalive_s / 4, self._tick, keepalive_s)

    def _delta(self, idx: int, item: Any) -> Delta | None:
        if item is _END:
            raise FlareError("the request was aborted")
        if isinstance(item, BaseException):
            self.abort()
            raise item
        return self._process(self.choices[idx], item)

    def _process(self, ch: ChoiceState, ev: StreamEvent) -> Delta | None:
        if ch.finished:
            return None
        if ev.prompt_tokens:  # the first event: input usage is known before the finish
            ch.prompt_tokens = ev.prompt_tokens
        if ev.finish_reason is not None:
            self._finish(ch)
            if ev.usage is not None:
                ch.prompt_tokens = ev.usage.prompt_tokens
                ch.cached_tokens = ev.usage.cached_tokens
                ch.completion_tokens = ev.usage.completion_tokens
            ch.finish_reason = ev.finish_reason
            return Delta(
                ch.index, self._text(ch, ev), self._lps(ev), ev.finish_reason, ev.stop_string,
                ev.reasoning, self._calls(ev),
            )  # fmt: skip
        ch.completion_tokens += len(ev.token_ids)
        if ev.reasoning:
            ch.reasoning_tokens += len(ev.token_ids)
        text = self._text(ch, ev)
        return Delta(ch.index, text, self._lps(ev), None, None, ev.reasoning, self._calls(ev))

    def _calls(self, ev: StreamEvent) -> list[ToolCallDelta]:
        if not ev.tool_calls:
            return []
        if self.max_tool_calls is None:
            return list(ev.tool_calls)
        return [tc for tc in ev.tool_calls if tc.index < self.max_tool_calls]

    @staticmethod
    def _text(ch: ChoiceState, ev: StreamEvent) -> str:
        """The answer text: parsed content for messages requests (no reasoning or tool-call
        markup), the raw text for prompts."""
        return ev.content if ch.parsed else ev.text

    @staticmethod
    def _lps(ev: StreamEvent) -> list[tuple[str, TokenLogprob]]:
        # the daemon reports text per engine step, not per token: the step's text goes with
        # its first token (one token per step is the common case)
        return [(ev.text if i == 0 else "", lp) for i, lp in enumerate(ev.logprobs)]

    # -- totals ----------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        prompt = max((c.prompt_tokens for c in self.choices), default=0)
        cached = max((c.cached_tokens for c in self.choices), default=0)
        completion = sum(c.completion_tokens for c in self.choices)
        reasoning = sum(c.reasoning_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached,
                "reasoning_tokens": reasoning}  # fmt: skip
