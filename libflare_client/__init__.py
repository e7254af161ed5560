"""libflare_client: the thin Flare SDK (no torch, no tokenizer, no flared import).

from libflare_client import Client, AsyncClient, SamplingParams, FlareError
"""

from libflare_client.aio import AsyncClient
from libflare_client.client import Client
from libflare_client.conversation import AsyncConversation, Conversation
from libflare_client.errors import (
    Busy,
    Cancelled,
    CapacityError,
    ConnectionLost,
    EngineError,
    FlareError,
    InvalidRequest,
    PermissionDenied,
    ProtocolError,
    ToolChoiceUnsatisfied,
)
from libflare_client.types import (
    ChatResult,
    GenerateResult,
    ParsedMessage,
    RenderedPrompt,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncConversation",
    "Busy",
    "Cancelled",
    "CapacityError",
    "ChatResult",
    "Client",
    "ConnectionLost",
    "Conversation",
    "EngineError",
    "FlareError",
    "GenerateResult",
    "InvalidRequest",
    "ParsedMessage",
    "PermissionDenied",
    "ProtocolError",
    "RenderedPrompt",
    "SamplingParams",
    "StreamEvent",
    "TokenLogprob",
    "ToolCallDelta",
    "ToolChoiceUnsatisfied",
    "Usage",
]
