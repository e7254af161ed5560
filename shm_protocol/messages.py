"""Every message that crosses the control socket or an event ring, one frozen Struct each.

Encoding: msgpack arrays (`array_like=True`), an integer tag in the first array element. msgspec
writes every field of an array_like Struct (`omit_defaults` does not shorten arrays), so a
message that gains fields encodes longer. Tags never change once released; new fields go last
with defaults: older peers ignore trailing elements they do not know, newer peers give missing
ones their defaults. Client -> daemon messages are imperative (`Submit`),
daemon -> client messages are nouns (`TokenDelta`). Golden bytes for every message are pinned in
tests/unit/protocol/test_golden.py.

Tag ranges: 1..63 client -> daemon, 64..127 daemon -> client. An event-ring record is a msgpack
array of `RingEvent`s: everything one flush published (shm_protocol/outbox.py).
"""

from __future__ import annotations

from typing import Any, Final, TypeAlias

import msgspec

PROTOCOL_VERSION: Final = 2  # 2: event-ring records are arrays of events; odd/even sleep word
SUPPORTED_VERSIONS: Final = frozenset({2})

_OPTS: dict[str, Any] = {"frozen": True, "array_like": True, "omit_defaults": True, "gc": False}


# -- client -> daemon -------------------------------------------------------------------------
class OpenSession(msgspec.Struct, tag=1, **_OPTS):
    """The first frame of every connection. `transport` chooses how token events come back:
    "ring" (shared-memory ring + doorbell) or "socket" (plain frames). `doorbell` (ring only):
    "" = EventsReady frames on this socket; DOORBELL_PIPE = a pipe of its own (see Welcome)."""

    protocol_version: int
    client_name: str = ""
    transport: str = "ring"
    doorbell: str = ""


class WireSampling(msgspec.Struct, **_OPTS):
    """Mirror of flared.requests.SamplingParams; None = the bundle's default."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


class Submit(msgspec.Struct, tag=2, **_OPTS):
    """Start a request. The prompt is exactly one of: `prompt_token_ids` inline, the next record
    of the session's request ring (`prompt_ring_bytes` > 0, little-endian u32 ids), `messages`
    (rendered by the daemon's chat template) or `prompt_text` (tokenized by the daemon, with the
    tokenizer's special tokens, e.g. a BOS).

    Chat controls (with `messages` only): `tool_choice` ("auto" | "none" | "required" |
    {"type": "function", "function": {"name": N}}), `chat_template_kwargs` (e.g.
    {"enable_thinking": false}), `add_generation_prompt`, `continue_final_message`. Messages
    requests are parsed by the bundle's reasoning and tool-call parsers (TokenDelta.content /
    reasoning / tool_calls). `response_format` (OpenAI json_schema / json_object, or
    {"type": "regex", "regex": R} / {"type": "grammar", "grammar": EBNF}) constrains sampling.
    `stop` strings end the output at text level (the matched string is not returned).
    `message_ends` (with `prompt_token_ids` or `prompt_text` only): token offsets strictly inside
    the prompt, increasing, where the caller's messages end; each is an exact checkpoint that a
    later request sharing the prompt up to it resumes from (messages requests get theirs from
    the chat template)."""

    request_id: str
    max_tokens: int = 16
    prompt_token_ids: list[int] = []
    prompt_ring_bytes: int = 0
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    sampling: WireSampling | None = None
    logprobs: int = 0
    stop_token_ids: list[int] = []
    min_tokens: int = 0
    ignore_eos: bool = False
    detokenize: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    response_format: dict[str, Any] | None = None
    stop: list[str] = []
    chat_template_kwargs: dict[str, Any] = {}
    prompt_text: str = ""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    message_ends: list[int] = []


class Cancel(msgspec.Struct, tag=3, **_OPTS):
    request_id: str


class GetStats(msgspec.Struct, tag=4, **_OPTS):
    call_id: int


class Render(msgspec.Struct, tag=5, **_OPTS):
    call_id: int
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = {}
    continue_final_message: bool = False
    tool_choice: str | dict[str, Any] = "auto"


class Ping(msgspec.Struct, tag=6, **_OPTS):
    call_id: int


class Advance(msgspec.Struct, tag=7, **_OPTS):
    """The client consumed event-ring records after a `writer_blocked` doorbell; the daemon
    re-reads the ring tail (this frame's syscall is the barrier that publishes it)."""


# -- daemon -> client -------------------------------------------------------------------------
class Welcome(msgspec.Struct, tag=64, **_OPTS):
    """Handshake reply. With transport "ring" the frame carries two memfds (SCM_RIGHTS):
    the event ring (daemon writes) and the request ring (client writes), in that order, and
    when `doorbell` is DOORBELL_PIPE a third fd: the read end of the session's doorbell pipe.
    A byte on it means "the event ring has records for a reader that declared its sleep";
    EventsReady then only announces a full ring (`writer_blocked`)."""

    protocol_version: int
    session_id: str
    health: str
    max_frame_bytes: int
    event_ring_bytes: int = 0
    request_ring_bytes: int = 0
    vocab_size: int = 0
    max_context_tokens: int = 0
    eos_token_ids: list[int] = []
    doorbell: str = ""


class ToolCallPart(msgspec.Struct, **_OPTS):
    """One OpenAI `delta.tool_calls[]` element: `id` and `name` (non-empty) only on a call's
    first part; `arguments` fragments concatenate to the call's arguments JSON."""

    index: int
    arguments: str = ""
    id: str = ""
    name: str = ""


class TokenDelta(msgspec.Struct, tag=65, **_OPTS):
    """Tokens one request generated in one engine step. `logprobs[i]` and `top_logprobs[i]`
    belong to `token_ids[i]` when the request asked for logprobs.

    `text` is the detokenized output (after stop strings), raw: think tags and tool-call markup
    included. For messages requests `content`, `reasoning` and `tool_calls` are the same output
    parsed (answer text, reasoning text, tool-call parts); text held back by a parser (a
    possible tag prefix, an incomplete call) arrives in a later delta or in Finished.
    `prompt_tokens` (a request's first delta only; 0 in the others) is its prompt's length, so
    a client can report input usage before the request finishes."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] = []
    top_logprobs: list[list[tuple[int, float]]] = []
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallPart] = []
    prompt_tokens: int = 0


class Finished(msgspec.Struct, tag=66, **_OPTS):
    """The request is over; nothing follows it for this request id. `text` (and `content`,
    `reasoning`, `tool_calls`) are the flushed tails of the detokenizer and parsers.

    `finish_reason` is "tool_calls" when a messages request produced tool calls and stopped;
    `stop_string` is the stop string that ended the output (excluded from it); `tool_errors`
    reports malformed tool-call output (kept as content, never dropped); `has_reasoning` tells
    an empty reasoning section from none."""

    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    text: str = ""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallPart] = []
    stop_string: str = ""
    tool_errors: list[str] = []
    has_reasoning: bool = False


class ErrorReply(msgspec.Struct, tag=67, **_OPTS):
    """A typed failure. `code` is one of ERROR_CODES. With a `request_id` it ends that
    request; with a `call_id` it answers that call; with neither it ends the session."""

    code: str
    message: str
    request_id: str = ""
    call_id: int = 0


class StatsReply(msgspec.Struct, tag=68, **_OPTS):
    call_id: int
    health: str
    stats: dict[str, Any] = {}


class RenderResult(msgspec.Struct, tag=69, **_OPTS):
    call_id: int
    token_ids: list[int]
    message_end_token_offsets: list[int] = []
    text: str = ""


class Pong(msgspec.Struct, tag=70, **_OPTS):
    call_id: int
    health: str = ""


class EventsReady(msgspec.Struct, tag=71, **_OPTS):
    """Doorbell: event-ring records up to byte position `head` are published. Sent only when
    the reader declared that it is about to sleep (the ring's `sleeps` word changed since the
    last doorbell) or, once per head, while the ring is full; a reader that is awake drains
    without one. The socket syscalls on both sides order the ring memory before the read.
    `writer_blocked`: the ring is full; the client sends `Advance` after draining."""

    head: int
    writer_blocked: bool = False


# What the event ring carries: each ring record is a msgpack array of these (outbox.py).
RingEvent: TypeAlias = TokenDelta | Finished | ErrorReply

ClientMessage: TypeAlias = OpenSession | Submit | Cancel | GetStats | Render | Ping | Advance
DaemonMessage: TypeAlias = (
    Welcome | TokenDelta | Finished | ErrorReply | StatsReply | RenderResult | Pong | EventsReady
)

# Error codes carried by ErrorReply.code; libflare_client maps each to an exception class.
INVALID_REQUEST: Final = "invalid_request"
CAPACITY: Final = "capacity"
BUSY: Final = "busy"
CANCELLED: Final = "cancelled"
ENGINE_ERROR: Final = "engine_error"
PROTOCOL: Final = "protocol"
UNSUPPORTED_VERSION: Final = "unsupported_version"
PERMISSION_DENIED: Final = "permission_denied"
# tool_choice "required" or a named function was not satisfied by the output
TOOL_CHOICE_UNSATISFIED: Final = "tool_choice_unsatisfied"
ERROR_CODES: Final = frozenset(
    {
        TOOL_CHOICE_UNSATISFIED,
        INVALID_REQUEST,
        CAPACITY,
        BUSY,
        CANCELLED,
        ENGINE_ERROR,
        PROTOCOL,
        UNSUPPORTED_VERSION,
        PERMISSION_DENIED,
    }
)

# Health states reported by Welcome / StatsReply / Pong.
HEALTH_STATES: Final = ("starting", "ready", "draining", "failed")
FINISH_REASONS: Final = ("stop", "length", "cancelled", "tool_calls")
TRANSPORTS: Final = ("ring", "socket")
# Event-ring doorbells: "" = EventsReady frames on the control socket (the first protocol
# release); "pipe" = one byte on a pipe whose write end only the daemon holds (non-blocking, so
# no client can stall the daemon through it) and whose read end the client's event loop polls.
DOORBELL_PIPE: Final = "pipe"
DOORBELLS: Final = ("", DOORBELL_PIPE)
