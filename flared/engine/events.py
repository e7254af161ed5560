"""What the scheduler tells the rest of the daemon about requests, in order, per request id.

A request's stream is zero or more `TokenEvent`s followed by exactly one `FinishEvent`; nothing
follows the `FinishEvent` for that request (a later request may reuse the id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from flared.engine.plan import FinishReason, SampledToken


@dataclass(frozen=True)
class TokenEvent:
    """Tokens a request generated in one step, in generation order."""

    request_id: str
    tokens: tuple[SampledToken, ...]


@dataclass(frozen=True)
class FinishEvent:
    """The request is over. `prompt_tokens` is the client's prompt length (not recomputed tokens);
    `completion_tokens` counts every token emitted in its `TokenEvent`s."""

    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


EngineEvent: TypeAlias = TokenEvent | FinishEvent
