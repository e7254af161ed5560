"""Anthropic Messages request fields: content blocks, tools, tool_choice, thinking and
output_config, each check beside the JSON Schema the OpenAPI document declares for it.

The conversation becomes the OpenAI-shaped messages the daemon renders: an assistant turn's
text, thinking and tool_use blocks become one assistant message (content, reasoning_content,
tool_calls with the input as JSON text); a user turn's tool_result blocks become one tool
message each (tool_call_id = tool_use_id) and its text blocks a user message, in block order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from libflare_client.http.errors import bad
from libflare_client.http.params import is_int, text_content, unicode
from libflare_client.http.structures import TOOL_NAME, content_schema, nullable, wire_value

_STR: dict[str, Any] = {"type": "string"}
_OPT_STR: dict[str, Any] = {"type": ["string", "null"]}
_OPT_BOOL: dict[str, Any] = {"type": ["boolean", "null"]}


def _block(kind: str, required: list[str], props: dict[str, Any], doc: str = "") -> dict[str, Any]:
    s = {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"const": kind}, **props},
    }
    return {**s, "description": doc} if doc else s


TEXT_BLOCK = _block("text", ["text"], {"text": _STR})
TOOL_RESULT_BLOCK = _block(
    "tool_result",
    ["tool_use_id"],
    {
        "tool_use_id": _STR,
        "content": nullable(content_schema()),
        "is_error": _OPT_BOOL,
    },
    "becomes a tool message; with is_error the content is prefixed with 'Error: '",
)
TOOL_USE_BLOCK = _block(
    "tool_use", ["id", "name", "input"], {"id": _STR, "name": _STR, "input": {"type": "object"}}
)
THINKING_BLOCK = _block(
    "thinking", ["thinking"], {"thinking": _STR}, "becomes reasoning; the signature is not read"
)
REDACTED_BLOCK = _block("redacted_thinking", [], {}, "left out (Flare cannot read it)")


def _message(role: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    items = {"anyOf": blocks}
    return {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": role},
            "content": {"anyOf": [_STR, {"type": "array", "items": items}]},
        },
    }


MESSAGES_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            _message("user", [TEXT_BLOCK, TOOL_RESULT_BLOCK]),
            _message("assistant", [TEXT_BLOCK, TOOL_USE_BLOCK, THINKING_BLOCK, REDACTED_BLOCK]),
        ]
    },
}
SYSTEM_SCHEMA: dict[str, Any] = nullable(content_schema())
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def conversation(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": text_content(system, "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    for i, msg in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise bad(f"{p}.role must be 'user' or 'assistant'", f"{p}.role")
        if "content" not in msg:
            raise bad(f"{p}.content is required", f"{p}.content")
        role, content = msg["role"], msg["content"]
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise bad(f"{p}.content must be a string or an array of content blocks", f"{p}.content")
        elif role == "user":
            msgs += _user_turn(content, p)
        else:
            msgs.append(_assistant_turn(content, p))
    return wire_value(msgs, "messages")  # type: ignore[no-any-return]


def _kind(blk: Any, q: str, allowed: tuple[str, ...]) -> str:
    kind = blk.get("type") if isinstance(blk, dict) else None
    if not isinstance(blk, dict) or not isinstance(kind, str):
        raise bad(f"{q} must be a content block object with a 'type'", q)
    if kind not in allowed:
        raise bad(f"{q}: content block type {kind!r} is not supported here (only "
                  f"{', '.join(allowed)})", q, "unsupported_value")  # fmt: skip
    return kind


def _str(blk: dict[str, Any], key: str, q: str) -> str:
    v = blk.get(key)
    if not isinstance(v, str):
        raise bad(f"{q}.{key} must be a string", f"{q}.{key}")
    return v


def _user_turn(content: list[Any], p: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, blk in enumerate(content):
        q = f"{p}.content[{j}]"
        if _kind(blk, q, USER_BLOCKS) == "text":
            texts.append(_str(blk, "text", q))
            continue
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts = []
        out.append(_tool_result(blk, q))
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _tool_result(blk: dict[str, Any], q: str) -> dict[str, Any]:
    tid = _str(blk, "tool_use_id", q)
    c = blk.get("content")
    text = "" if c is None else text_content(c, f"{q}.content")
    err = blk.get("is_error")
    if err is not None and not isinstance(err, bool):
        raise bad(f"{q}.is_error must be a boolean", f"{q}.is_error")
    return {"role": "tool", "tool_call_id": tid, "content": f"Error: {text}" if err else text}


def _assistant_turn(content: list[Any], p: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, blk in enumerate(content):
        q = f"{p}.content[{j}]"
        kind = _kind(blk, q, ASSISTANT_BLOCKS)
        if kind == "text":
            texts.append(_str(blk, "text", q))
        elif kind == "thinking":
            thinking.append(_str(blk, "thinking", q))
        elif kind == "tool_use":
            cid, name = _str(blk, "id", q), _str(blk, "name", q)
            if not isinstance(blk.get("input"), dict):
                raise bad(f"{q}.input must be an object", f"{q}.input")
            args = json.dumps(blk["input"], ensure_ascii=False)
            calls.append({"id": cid, "type": "function",
                          "function": {"name": name, "arguments": args}})  # fmt: skip
    item: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        item["tool_calls"] = calls
    if thinking:
        item["reasoning_content"] = "".join(thinking)
    return item


# -- tools ---------------------------------------------------------------------------------
TOOLS_SCHEMA: dict[str, Any] = {
    "type": ["array", "null"],
    "items": {
        "type": "object",
        "required": ["name", "input_schema"],
        "properties": {
            "name": {"type": "string", "pattern": TOOL_NAME.pattern},
            "description": _OPT_STR,
            "input_schema": {"type": "object", "description": "a JSON Schema object"},
            "type": {"enum": ["custom", None]},
        },
        "description": "client tools only (server and Anthropic-defined tools are a 400)",
    },
}
_DPTU = {"disable_parallel_tool_use": _OPT_BOOL}
TOOL_CHOICE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["auto", "any"]}, **_DPTU},
        },
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {"type": {"const": "tool"}, "name": _STR, **_DPTU},
        },
        {"type": "object", "required": ["type"], "properties": {"type": {"const": "none"}}},
        {"type": "null"},
    ],
    "description": "'any' and 'tool' need tools (the name among them) and fail the response "
    "when the model makes no such call; disable_parallel_tool_use keeps the first call only",
}


def tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The tools as OpenAI function tools (what the daemon's templates take)."""
    ts = body.get("tools")
    if ts is None:
        return []
    if not isinstance(ts, list):
        raise bad("'tools' must be an array", "tools")
    out = []
    for i, t in enumerate(ts):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f"{p} must be a tool object {{name, description, input_schema}}", p)
        if t.get("type") not in ("custom", None):
            raise bad(f"{p}.type {t.get('type')!r}: only client tools (name, description, "
                      "input_schema) are supported", f"{p}.type", "unsupported_value")  # fmt: skip
        name = t.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad(f"{p}.name must match {TOOL_NAME.pattern}", f"{p}.name")
        desc = t.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{p}.description must be a string", f"{p}.description")
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"{p}.input_schema must be an object (a JSON Schema)", f"{p}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": t["input_schema"]}
        if desc is not None:
            fn["description"] = desc
        out.append({"type": "function", "function": fn})
    return wire_value(out, "tools")  # type: ignore[no-any-return]


def tool_choice(
    body: dict[str, Any], tools: list[dict[str, Any]]
) -> tuple[str | dict[str, Any], int | None]:
    """(the daemon's tool_choice, the most calls to return: 1 with disable_parallel_tool_use)."""
    tc = body.get("tool_choice")
    if tc is None:
        return "auto", None
    kind = tc.get("type") if isinstance(tc, dict) else None
    if not isinstance(tc, dict) or kind not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice must be {type: 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
    if kind == "none":
        return "none", None
    dptu = tc.get("disable_parallel_tool_use")
    if dptu is not None and not isinstance(dptu, bool):
        raise bad("tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice")
    limit = 1 if dptu else None
    if kind == "auto":
        return "auto", limit
    if not tools:
        raise bad(f"tool_choice {kind!r} needs tools", "tool_choice")
    if kind == "any":
        return "required", limit
    name = tc.get("name")
    if not isinstance(name, str):
        raise bad("tool_choice.name must be a string", "tool_choice")
    if name not in [t["function"]["name"] for t in tools]:
        raise bad("tool_choice names a tool that is not among the tools", "tool_choice")
    return {"type": "function", "function": {"name": name}}, limit


# -- thinking and output format ------------------------------------------------------------
THINKING_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type", "budget_tokens"],
            "properties": {
                "type": {"const": "enabled"},
                "budget_tokens": {"type": "integer", "minimum": 1},
            },
        },
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["disabled", "adaptive"]}},
        },
        {"type": "null"},
    ],
    "description": "enabled/adaptive: the chat template's thinking is on and the parsed "
    "reasoning is returned as thinking blocks (signature ''); absent or disabled: thinking is "
    "off. budget_tokens is not enforced: max_tokens bounds reasoning and answer together",
}


def thinking(body: dict[str, Any]) -> bool:
    th = body.get("thinking")
    if th is None:
        return False
    kind = th.get("type") if isinstance(th, dict) else None
    if not isinstance(th, dict) or kind not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking must be {type: 'enabled', budget_tokens}, {type: 'disabled'} or "
                  "{type: 'adaptive'}", "thinking")  # fmt: skip
    if kind == "enabled":
        b: Any = th.get("budget_tokens")
        if not is_int(b) or b < 1:
            raise bad("thinking.budget_tokens must be a positive integer", "thinking")
    return bool(kind != "disabled")


_FORMATS: list[dict[str, Any]] = [
    {"type": "object", "required": ["type", "schema"],
     "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}},
    {"type": "object", "required": ["type", "regex"],
     "properties": {"type": {"const": "regex"}, "regex": {"type": "string", "minLength": 1}},
     "description": "extension: output matching a regular expression"},
    {"type": "object", "required": ["type", "grammar"],
     "properties": {"type": {"const": "grammar"}, "grammar": {"type": "string", "minLength": 1}},
     "description": "extension: output of an EBNF grammar"},
]  # fmt: skip
OUTPUT_CONFIG_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "properties": {"format": {"anyOf": [*_FORMATS, {"type": "null"}]}},
    "description": "format: structured output (the daemon constrains sampling with a grammar; "
    "one it cannot compile is a 400); other keys are ignored",
}


def output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """output_config.format as the daemon's response_format."""
    oc = body.get("output_config")
    if oc is None:
        return None
    if not isinstance(oc, dict):
        raise bad("'output_config' must be an object", "output_config")
    f = oc.get("format")
    if f is None:
        return None
    kind = f.get("type") if isinstance(f, dict) else None
    if not isinstance(f, dict) or kind not in ("json_schema", "regex", "grammar"):
        raise bad("output_config.format.type must be json_schema, regex or grammar",
                  "output_config.format")  # fmt: skip
    if kind == "json_schema":
        if not isinstance(f.get("schema"), dict):
            raise bad("output_config.format.schema must be an object", "output_config.format")
        rf = {"type": "json_schema", "json_schema": {"name": "output", "schema": f["schema"]}}
        return wire_value(rf, "output_config.format")  # type: ignore[no-any-return]
    v = f.get(kind)
    if not isinstance(v, str) or not v:
        raise bad(f"output_config.format.{kind} must be a non-empty string",
                  "output_config.format")  # fmt: skip
    return {"type": kind, kind: unicode(v, "output_config.format")}


@dataclass(frozen=True)
class MessagesRequest:
    """The structured fields of one /v1/messages request, checked."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any]
    max_tool_calls: int | None
    thinking: bool
    response_format: dict[str, Any] | None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> MessagesRequest:
        msgs = conversation(body)
        ts = tools(body)
        tc, limit = tool_choice(body, ts)
        return cls(msgs, ts or None, tc, limit, thinking(body), output_format(body))
