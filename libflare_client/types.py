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
class StreamEvent:
    """Tokens of one engine step; the last event of a stream carries finish_reason and usage
    (and the detokenizer's flushed text, usually with no tokens)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ChatResult:
    """`content` is the generated text. Reasoning and tool-call parsing are not implemented
    yet: `reasoning` is always None and `tool_calls` always empty."""

    request_id: str
    content: str
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    usage: Usage
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    message_end_token_offsets: list[int]
    text: str = ""


def delta_event(d: m.TokenDelta) -> StreamEvent:
    lps: list[TokenLogprob] = []
    if d.logprobs:
        tops = d.top_logprobs or [[] for _ in d.token_ids]
        lps = [
            TokenLogprob(t, lp, [(int(a), float(b)) for a, b in top])
            for t, lp, top in zip(d.token_ids, d.logprobs, tops)
        ]
    return StreamEvent(d.request_id, list(d.token_ids), d.text, lps)


def finished_event(f: m.Finished) -> StreamEvent:
    usage = Usage(f.prompt_tokens, f.completion_tokens, f.cached_tokens)
    return StreamEvent(f.request_id, [], f.text, [], f.finish_reason, usage)


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
        request_id, token_ids, "".join(texts), last.finish_reason, last.usage, lps
    )
