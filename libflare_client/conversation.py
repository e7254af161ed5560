"""Conversation handles: a message history that grows by appending, and forks into branches.

An agent's loop is append-only: the user's turn, the model's reply (tool calls included), the
tool results, the next reply. Each request sends the whole history; the daemon renders it with
the bundle's chat template, takes a checkpoint at every message end, and restores the longest
one it holds, so only what was appended since is computed. `fork()` copies the history: each
branch continues from the shared prefix, which the daemon holds once.

    with Client() as c:
        conv = c.conversation(system="You are terse.", tools=TOOLS)
        conv.user("What is the weather in Paris?")
        reply = conv.chat(max_tokens=256)          # appended to the history
        for call in reply.tool_calls:
            conv.tool_result(call["id"], run(call))
        answer = conv.chat(max_tokens=256)         # history restored, not recomputed
        alt = conv.fork().user("And in Rome?")     # a branch sharing everything above
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from libflare_client.types import ChatResult, ParsedMessage, StreamEvent

if TYPE_CHECKING:
    from libflare_client.aio import AsyncClient
    from libflare_client.client import Client

H = TypeVar("H", bound="_History")


def assistant_message(
    content: str, reasoning: str | None, tool_calls: list[dict[str, Any]]
) -> dict[str, Any]:
    """The reply as the next request's history entry: OpenAI-shaped tool calls, and the
    reasoning under `reasoning_content` (templates that render reasoning read it; others
    ignore the key)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = copy.deepcopy(tool_calls)
    return msg


class _History:
    """The messages, tools and per-request defaults shared by both handle kinds."""

    def __init__(
        self,
        messages: list[dict[str, Any]] | None = None,
        system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **defaults: Any,
    ) -> None:
        self._messages: list[dict[str, Any]] = copy.deepcopy(list(messages or []))
        if system is not None:
            if self._messages and self._messages[0].get("role") == "system":
                raise ValueError("the history already starts with a system message")
            self._messages.insert(0, {"role": "system", "content": system})
        self.tools = copy.deepcopy(tools)
        self.defaults = dict(defaults)  # chat()/stream() keywords every request gets

    @property
    def messages(self) -> list[dict[str, Any]]:
        """A copy of the history (changing it changes nothing here)."""
        return copy.deepcopy(self._messages)

    def __len__(self) -> int:
        return len(self._messages)

    def append(self: H, *messages: dict[str, Any]) -> H:
        for msg in messages:
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise ValueError(f"a message is a dict with a 'role', got {msg!r}")
            self._messages.append(copy.deepcopy(msg))
        return self

    def user(self: H, content: str | list[dict[str, Any]]) -> H:
        return self.append({"role": "user", "content": content})

    def tool_result(self: H, tool_call_id: str, content: str, name: str | None = None) -> H:
        """A tool's output for the call with this id (from a reply's tool_calls)."""
        msg: dict[str, Any] = {"role": "tool", "tool_call_id": tool_call_id, "content": content}
        if name is not None:
            msg["name"] = name
        return self.append(msg)

    def _fork_into(self: H, other: H) -> H:
        other._messages = copy.deepcopy(self._messages)
        other.tools = copy.deepcopy(self.tools)
        other.defaults = dict(self.defaults)
        return other

    def _request(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if "messages" in kwargs:
            raise TypeError("a conversation sends its own history; append() to it instead")
        return {"messages": self.messages, "tools": self.tools, **self.defaults, **kwargs}

    def _record(self, reply: ChatResult) -> None:
        self._messages.append(assistant_message(reply.content, reply.reasoning, reply.tool_calls))

    def _record_stream(self, last: StreamEvent) -> None:
        msg = last.message if last.message is not None else ParsedMessage("", None)
        self._messages.append(assistant_message(msg.content, msg.reasoning, msg.tool_calls))


class Conversation(_History):
    """A history bound to a Client (`Client.conversation(...)`). Not for use from several
    threads at once; fork() one per thread instead."""

    def __init__(self, client: Client, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client = client

    def chat(self, **kwargs: Any) -> ChatResult:
        """Client.chat over the history; the reply is appended to it. A request that fails
        (any FlareError) leaves the history as it was."""
        reply = self._client.chat(**self._request(kwargs))
        self._record(reply)
        return reply

    def stream(self, **kwargs: Any) -> Iterator[StreamEvent]:
        """Client.stream over the history; once the stream finished, the parsed reply is
        appended (a stream left early, or one that failed, appends nothing)."""
        last: StreamEvent | None = None
        for ev in self._client.stream(**self._request(kwargs)):
            last = ev
            yield ev
        if last is not None and last.finish_reason is not None:
            self._record_stream(last)

    def fork(self) -> Conversation:
        """A branch: the same history, tools and defaults, growing on its own from here."""
        return self._fork_into(Conversation(self._client))


class AsyncConversation(_History):
    """A history bound to an AsyncClient (`AsyncClient.conversation(...)`)."""

    def __init__(self, client: AsyncClient, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client = client

    async def chat(self, **kwargs: Any) -> ChatResult:
        reply = await self._client.chat(**self._request(kwargs))
        self._record(reply)
        return reply

    async def stream(self, **kwargs: Any) -> AsyncIterator[StreamEvent]:
        last: StreamEvent | None = None
        async for ev in self._client.stream(**self._request(kwargs)):
            last = ev
            yield ev
        if last is not None and last.finish_reason is not None:
            self._record_stream(last)

    def fork(self) -> AsyncConversation:
        return self._fork_into(AsyncConversation(self._client))
