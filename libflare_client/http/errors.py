"""HTTP errors: OpenAI error objects, Anthropic error objects, and the FlareError mapping."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

from libflare_client import (
    Busy,
    Cancelled,
    CapacityError,
    ConnectionLost,
    EngineError,
    FlareError,
    InvalidRequest,
    ToolChoiceUnsatisfied,
)
from shm_protocol.redact import redact

RETRY_AFTER_S = "1"
log = logging.getLogger("flare.http")
_refs = itertools.count(1)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def openai(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    @property
    def anthropic_status(self) -> int:
        """Anthropic's API says "overloaded" with 529 (its SDKs raise OverloadedError for it,
        and retry it), where OpenAI's says 503."""
        return 529 if self.status == 503 else self.status

    def anthropic(self) -> dict[str, Any]:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "request_too_large",
            529: "overloaded_error",
        }.get(self.anthropic_status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def from_flare(exc: BaseException) -> ApiError:
    retry = {"Retry-After": RETRY_AFTER_S}
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), "invalid_request_error", None, "invalid_request")
    if isinstance(exc, CapacityError):
        # a prepared limit (context length, page pool): no retry can succeed, so a client error
        # like OpenAI's context_length_exceeded, not a 503 that SDKs would retry
        return ApiError(400, str(exc), "invalid_request_error", None, "context_length_exceeded")
    if isinstance(exc, Busy):
        return ApiError(503, str(exc), "server_error", None, "busy", retry)
    if isinstance(exc, ConnectionLost):
        msg = f"the daemon is unavailable (reconnecting): {redact(str(exc))}"
        return ApiError(503, msg, "server_error", None, "daemon_unavailable", retry)
    if isinstance(exc, Cancelled):
        return ApiError(503, str(exc), "server_error", None, "cancelled", retry)
    # a failed execution is not resubmitted by SDKs that honour x-should-retry
    no_retry = {"x-should-retry": "false"}
    if isinstance(exc, ToolChoiceUnsatisfied):
        return ApiError(500, str(exc), "server_error", None, "tool_choice_unsatisfied", no_retry)
    if isinstance(exc, EngineError):
        return ApiError(500, str(exc), "server_error", None, "engine_error", no_retry)
    if isinstance(exc, FlareError):
        return ApiError(500, str(exc), "server_error", None, "flare_error", no_retry)
    ref = f"H{os.getpid()}-{next(_refs)}"
    log.error("internal error [%s]", ref, exc_info=exc)
    msg = f"internal error ({type(exc).__name__}); the server's log has it under [{ref}]"
    return ApiError(500, msg, "server_error", None, None, no_retry)
