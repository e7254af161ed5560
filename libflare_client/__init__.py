"""libflare_client: the thin Flare SDK (no torch, no tokenizer, no flared import).

from libflare_client import Client, AsyncClient, SamplingParams, FlareError
"""

from libflare_client.aio import AsyncClient
from libflare_client.client import Client
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
)
from libflare_client.types import (
    ChatResult,
    GenerateResult,
    RenderedPrompt,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Busy",
    "Cancelled",
    "CapacityError",
    "ChatResult",
    "Client",
    "ConnectionLost",
    "EngineError",
    "FlareError",
    "GenerateResult",
    "InvalidRequest",
    "PermissionDenied",
    "ProtocolError",
    "RenderedPrompt",
    "SamplingParams",
    "StreamEvent",
    "TokenLogprob",
    "Usage",
]
