"""What output parsing yields: typed deltas while streaming, one ParsedOutput at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI `delta.tool_calls[]` element: index always; id/type/name only on a call's
    first delta; arguments are JSON-text fragments whose concatenation is the arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        out["function"] = fn
        return out


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


@dataclass
class ParsedOutput:
    content: str = ""
    reasoning: str | None = None
    # OpenAI message.tool_calls: {"id", "type": "function", "function": {"name", "arguments"}}
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, delta: Delta) -> None:
        if isinstance(delta, ContentDelta):
            self.content += delta.text
        elif isinstance(delta, ReasoningDelta):
            self.reasoning = (self.reasoning or "") + delta.text
        elif delta.id is not None:
            fn = {"name": delta.name or "", "arguments": delta.arguments}
            self.tool_calls.append({"id": delta.id, "type": "function", "function": fn})
        else:
            self.tool_calls[delta.index]["function"]["arguments"] += delta.arguments


def holdback(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of tags."""
    n = len(buf)
    best = n
    for t in tags:  # the leftmost start i (n - i < len(t)) with t.startswith(buf[i:])
        c = t[0] if t else ""
        i = buf.find(c, max(0, n - len(t) + 1)) if c else -1
        while -1 < i < best:
            if t.startswith(buf[i:]):
                best = i
                break
            i = buf.find(c, i + 1)
    return n - best
