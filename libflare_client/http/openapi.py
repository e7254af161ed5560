"""The OpenAPI 3.1 document of flare-http's own endpoints, served at GET /openapi.json.

Built from the same declarations the request checks use (params.py tables, structures.py
schemas). The committed copy, openapi.json beside this file, is regenerated with
`python -m libflare_client.http.openapi > libflare_client/http/openapi.json`; a test keeps the
two equal.
"""

from __future__ import annotations

import json
from typing import Any

from libflare_client.http import anthropic_request as A
from libflare_client.http import params as P
from libflare_client.http import responses_request as R
from libflare_client.http import structures as S

VERSION = "0.1.0"


def _body(
    table: dict[str, P.Scalar], extra: dict[str, Any], required: list[str], doc: str
) -> dict[str, Any]:
    props = {k: f.schema() for k, f in table.items()}
    props.update(extra)
    return {"type": "object", "required": required, "properties": props, "description": doc}


UNKNOWN = (
    " Fields this document does not declare are ignored; declared fields are validated and "
    "a wrong value is a 400."
)

CHAT_REQUEST = _body(
    P.CHAT,
    {
        "messages": S.CHAT_MESSAGES_SCHEMA,
        "tools": S.TOOLS_SCHEMA,
        "tool_choice": S.TOOL_CHOICE_SCHEMA,
        "response_format": S.RESPONSE_FORMAT_SCHEMA,
        "stop": S.STOP_SCHEMA,
        "stream_options": S.STREAM_OPTIONS_SCHEMA,
    },
    ["messages"],
    "OpenAI chat completion request." + UNKNOWN,
)
COMPLETION_REQUEST = _body(
    P.COMPLETIONS,
    {"prompt": S.PROMPT_SCHEMA, "stop": S.STOP_SCHEMA, "stream_options": S.STREAM_OPTIONS_SCHEMA},
    ["prompt"],
    "OpenAI (legacy) text completion request." + UNKNOWN,
)
MESSAGES_REQUEST = _body(
    P.MESSAGES,
    {
        "messages": A.MESSAGES_SCHEMA,
        "system": A.SYSTEM_SCHEMA,
        "stop_sequences": {
            "type": ["array", "null"],
            "items": {"type": "string"},
            "maxItems": P.MAX_STOPS,
        },
        "tools": A.TOOLS_SCHEMA,
        "tool_choice": A.TOOL_CHOICE_SCHEMA,
        "thinking": A.THINKING_SCHEMA,
        "output_config": A.OUTPUT_CONFIG_SCHEMA,
    },
    ["max_tokens", "messages"],
    "Anthropic Messages request." + UNKNOWN,
)
MESSAGES_REQUEST["properties"]["max_tokens"] = {"type": "integer", "minimum": 1}
RESPONSES_REQUEST = _body(
    P.RESPONSES,
    {
        "input": R.INPUT_SCHEMA,
        "text": R.TEXT_SCHEMA,
        "tools": R.TOOLS_SCHEMA,
        "tool_choice": R.TOOL_CHOICE_SCHEMA,
    },
    ["input"],
    "OpenAI Responses request (stateless)." + UNKNOWN,
)

OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
    },
}
FINISH = {"enum": ["stop", "length", "tool_calls"]}
CHAT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "chat.completion"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": {"type": "integer"},
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "content": {"type": ["string", "null"]},
                            "reasoning_content": {"type": ["string", "null"]},
                            "tool_calls": {
                                "type": ["array", "null"],
                                "items": S.TOOL_CALL_SCHEMA,
                            },
                        },
                    },
                    "finish_reason": FINISH,
                },
            },
        },
        "usage": USAGE,
    },
}
TEXT_COMPLETION = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "text_completion"},
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "text", "finish_reason"],
                "properties": {
                    "index": {"type": "integer"},
                    "text": {"type": "string"},
                    "finish_reason": FINISH,
                },
            },
        },
        "usage": USAGE,
    },
}
_S = {"type": "string"}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    """An object with every listed property required."""
    return {"type": "object", "required": list(props), "properties": props}


MESSAGE = {
    "type": "object",
    "required": ["id", "type", "role", "content", "stop_reason", "usage"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "content": {
            "type": "array",
            "items": {
                "anyOf": [
                    _obj({"type": {"const": "text"}, "text": _S}),
                    _obj({"type": {"const": "thinking"}, "thinking": _S, "signature": _S}),
                    _obj(
                        {
                            "type": {"const": "tool_use"},
                            "id": {"type": "string", "pattern": "^toolu_"},
                            "name": _S,
                            "input": {"type": "object"},
                        }
                    ),
                ]
            },
        },
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "usage": {
            "type": "object",
            "required": ["input_tokens", "output_tokens"],
            "properties": {
                "input_tokens": {"type": "integer"},
                "output_tokens": {"type": "integer"},
            },
        },
    },
}
RESPONSE = {
    "type": "object",
    "required": ["id", "object", "status", "output"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "response"},
        "status": {"enum": ["completed", "incomplete"]},
        "output": {
            "type": "array",
            "items": {
                "anyOf": [
                    _obj(
                        {
                            "type": {"const": "message"},
                            "id": _S,
                            "role": {"const": "assistant"},
                            "content": {
                                "type": "array",
                                "items": _obj({"type": {"const": "output_text"}, "text": _S}),
                            },
                        }
                    ),
                    _obj(
                        {
                            "type": {"const": "reasoning"},
                            "id": _S,
                            "summary": {"type": "array"},
                            "content": {
                                "type": "array",
                                "items": _obj({"type": {"const": "reasoning_text"}, "text": _S}),
                            },
                        }
                    ),
                    _obj(
                        {
                            "type": {"const": "function_call"},
                            "id": _S,
                            "call_id": _S,
                            "name": _S,
                            "arguments": _S,
                        }
                    ),
                ]
            },
        },
    },
}

RID = {
    "x-request-id": {
        "description": "the request id; failures log it",
        "schema": {"type": "string"},
    }
}
RETRY = {
    **RID,
    "Retry-After": {"description": "seconds", "schema": {"type": "string"}},
}
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "description": "JSON, or [DONE] ending an OpenAI stream"},
    },
    "description": "one server-sent event (OpenAPI 3.1: the schema describes each event)",
}
SSE = {"text/event-stream": {"schema": SSE_EVENT}}


def _errors(error: dict[str, Any], anthropic: bool = False) -> dict[str, Any]:
    def r(desc: str, headers: dict[str, Any]) -> dict[str, Any]:
        return {
            "description": desc,
            "headers": headers,
            "content": {"application/json": {"schema": error}},
        }

    busy = "queue full, or the daemon unavailable (reconnecting)"
    return {
        "400": r("invalid request (type/message/param/code)", RID),
        "401": r("missing or wrong API key (only when the shim has one)", RID),
        "413": r("the request body is larger than the shim's limit (--max-body-bytes)", RID),
        "500": r("execution failure in the daemon", RID),
        # Anthropic's API says "overloaded" with 529, OpenAI's with 503
        ("529" if anthropic else "503"): r(busy, RETRY),
    }


def _generation(
    summary: str,
    request: dict[str, Any],
    ok: dict[str, Any],
    error: dict[str, Any],
    anthropic: bool = False,
) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": request}},
            },
            "responses": {
                "200": {
                    "description": (
                        "the completion (JSON), or with stream: true its SSE stream; a failure "
                        "after the headers ends the stream with an error event and no success "
                        "marker"
                    ),
                    "headers": RID,
                    "content": {"application/json": {"schema": ok}, **SSE},
                },
                **_errors(error, anthropic),
            },
        }
    }


def _get(summary: str, ok: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": ok, **(extra or {})}}}


def build_document() -> dict[str, Any]:
    json_ok = {"application/json": {"schema": {"type": "object"}}}
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array"}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "flare-http",
            "version": VERSION,
            "description": (
                "OpenAI- and Anthropic-compatible HTTP endpoints of Flare, served by a client "
                "of the flared daemon. Request fields this document does not declare are "
                "ignored; declared fields are validated, and fields Flare cannot honour are "
                "declared with the only values it accepts (others are a 400 with code "
                "unsupported_value). With an API key configured every endpoint but /health "
                "and /openapi.json needs `Authorization: Bearer KEY` or `x-api-key: KEY`."
            ),
        },
        "servers": [{"url": "http://127.0.0.1:8000"}],
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            }
        },
        "security": [{}, {"bearer": []}, {"apiKey": []}],
        "paths": {
            "/v1/chat/completions": _generation(
                "Chat completion", CHAT_REQUEST, CHAT_COMPLETION, OPENAI_ERROR
            ),
            "/v1/completions": _generation(
                "Text completion (token-id prompts)",
                COMPLETION_REQUEST,
                TEXT_COMPLETION,
                OPENAI_ERROR,
            ),
            "/v1/messages": _generation(
                "Anthropic Messages", MESSAGES_REQUEST, MESSAGE, ANTHROPIC_ERROR, anthropic=True
            ),
            "/v1/responses": _generation(
                "Responses (stateless)", RESPONSES_REQUEST, RESPONSE, OPENAI_ERROR
            ),
            "/v1/models": _get(
                "The one model the daemon serves",
                {"description": "model list", "content": {"application/json": {"schema": models}}},
                {"401": _errors(OPENAI_ERROR)["401"]},
            ),
            "/health": {
                "get": {
                    "summary": "Daemon health (public)",
                    "security": [{}],
                    "responses": {
                        "200": {"description": "ready", "content": json_ok},
                        "503": {"description": "not ready or unreachable", "content": json_ok},
                    },
                }
            },
            "/metrics": _get(
                "Prometheus text",
                {
                    "description": "metrics",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                {"401": _errors(OPENAI_ERROR)["401"]},
            ),
            "/openapi.json": {
                "get": {
                    "summary": "This document (public)",
                    "security": [{}],
                    "responses": {"200": {"description": "OpenAPI 3.1", "content": json_ok}},
                }
            },
        },
    }


def document_json() -> str:
    return json.dumps(build_document(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(document_json(), end="")
