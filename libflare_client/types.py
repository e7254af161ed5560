"""Result and parameter types of the client API (plain frozen dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shm_protocol import messages as m


@dataclass(frozen=True)
class SamplingParams:
    """Mirror of flared.requests.SamplingParams: None takes the bundle's default.
    temperature must be > 0 (greedy is not a sampling mode); a seed makes the stream
    reproducible and independent of what else is running."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None

    def to_wire(self) -> m.WireSampling:
        return m.WireSampling(
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.presence_penalty,
            self.frequency_penalty,
            self.seed,
        )


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """log-softmax of the raw logits (fp32) for the generated token, and the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI `delta.tool_calls[]` element. `id` and `name` are set only on a call's first
    delta; the `arguments` fragments of one index concatenate to its arguments JSON."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        out["function"] = fn
        return out


@dataclass(frozen=True)
class ParsedMessage:
    """The assistant message parsed from a messages request's whole output. `tool_calls` are
    OpenAI-shaped ({"id", "type": "function", "function": {"name", "arguments"}});
    `tool_errors` reports malformed tool-call output (its raw text stays in `content`)."""

    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StreamEvent:
    """Tokens of one engine step; the last event of a stream carries finish_reason and usage
    (and the detokenizer's flushed text, usually with no tokens).

    `text` is the raw detokenized output (after stop strings). For messages requests the same
    output arrives parsed: `content`, `reasoning` and `tool_calls` deltas, and the last event
    carries the whole parsed `message`. `stop_string` (last event) is the stop string that
    ended the output; finish_reason is "tool_calls" when tool calls were produced."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    stop_string: str | None = None
    message: ParsedMessage | None = None
    prompt_tokens: int | None = None  # on the first event: the prompt's length in tokens


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled" | "tool_calls"
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_string: str | None = None  # the stop string that ended the output (not in text)
    message: ParsedMessage | None = None  # messages requests: the parsed reply


@dataclass(frozen=True)
class ChatResult:
    """The parsed reply. `content` is the answer text (reasoning and tool-call markup removed;
    empty for a named tool_choice), `reasoning` the reasoning text (None when the output had no
    reasoning section), `tool_calls` OpenAI-shaped calls with ids. finish_reason is
    "tool_calls" when calls were produced. `tool_errors` reports malformed tool-call output
    (kept in content, never dropped); `text` is the raw output."""

    request_id: str
    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    usage: Usage
    token_ids: list[int] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    text: str = ""
    stop_string: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    message_end_token_offsets: list[int]
    text: str = ""


def _tool_deltas(parts: list[m.ToolCallPart]) -> list[ToolCallDelta]:
    return [ToolCallDelta(p.index, p.arguments, p.id or None, p.name or None) for p in parts]


def delta_event(d: m.TokenDelta) -> StreamEvent:
    lps: list[TokenLogprob] = []
    if d.logprobs:
        tops = d.top_logprobs or [[] for _ in d.token_ids]
        lps = [
            TokenLogprob(t, lp, [(int(a), float(b)) for a, b in top])
            for t, lp, top in zip(d.token_ids, d.logprobs, tops)
        ]
    calls = _tool_deltas(d.tool_calls) if d.tool_calls else []
    return StreamEvent(
        d.request_id, list(d.token_ids), d.text, lps, content=d.content, reasoning=d.reasoning,
        tool_calls=calls, prompt_tokens=d.prompt_tokens or None,
    )  # fmt: skip


def finished_event(f: m.Finished) -> StreamEvent:
    """`message` here holds only what the parsed tail says about the whole output (whether it
    had a reasoning section, tool errors); the stream replaces it with the accumulated one."""
    usage = Usage(f.prompt_tokens, f.completion_tokens, f.cached_tokens)
    tail = ParsedMessage("", "" if f.has_reasoning else None, [], list(f.tool_errors))
    return StreamEvent(
        f.request_id, [], f.text, [], f.finish_reason, usage, content=f.content,
        reasoning=f.reasoning, tool_calls=_tool_deltas(f.tool_calls),
        stop_string=f.stop_string or None, message=tail,
    )  # fmt: skip


class MessageAccumulator:
    """Folds a messages stream's parsed deltas into the final ParsedMessage."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] | None = None
        self.tool_calls: list[dict[str, Any]] = []

    def add(self, ev: StreamEvent) -> None:
        if ev.content:
            self.content.append(ev.content)
        if ev.reasoning:
            self.reasoning = [*(self.reasoning or []), ev.reasoning]
        for d in ev.tool_calls:
            if d.id is not None:
                fn = {"name": d.name or "", "arguments": d.arguments}
                self.tool_calls.append({"id": d.id, "type": "function", "function": fn})
            elif 0 <= d.index < len(self.tool_calls):
                self.tool_calls[d.index]["function"]["arguments"] += d.arguments

    def message(self, last: StreamEvent) -> ParsedMessage:
        """The whole message, given the stream's last event (see finished_event)."""
        tail = last.message
        reasoning = "".join(self.reasoning) if self.reasoning is not None else None
        if reasoning is None and tail is not None and tail.reasoning is not None:
            reasoning = ""
        errors = list(tail.tool_errors) if tail is not None else []
        return ParsedMessage("".join(self.content), reasoning, self.tool_calls, errors)


def collect(request_id: str, events: list[StreamEvent]) -> GenerateResult:
    token_ids: list[int] = []
    texts: list[str] = []
    lps: list[TokenLogprob] = []
    last = events[-1]
    for ev in events:
        token_ids.extend(ev.token_ids)
        texts.append(ev.text)
        lps.extend(ev.logprobs)
    assert last.finish_reason is not None and last.usage is not None
    return GenerateResult(
        request_id, token_ids, "".join(texts), last.finish_reason, last.usage, lps,
        last.stop_string, last.message,
    )  # fmt: skip
