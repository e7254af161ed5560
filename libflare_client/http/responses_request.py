"""OpenAI Responses request fields (stateless): input items, function tools, tool_choice and
text.format, each check beside the JSON Schema the OpenAPI document declares for it.

Input items become the OpenAI-shaped messages the daemon renders. An assistant turn is the
run of assistant items between other items: reasoning (-> reasoning_content), an assistant
message (-> content) and function_call items (-> tool_calls, id = call_id) make one assistant
message; a function_call_output is a tool message (tool_call_id = call_id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from libflare_client.http.errors import ApiError, bad
from libflare_client.http.params import TEXT_PART_TYPES, text_content
from libflare_client.http.structures import (
    RESPONSE_FORMAT_SCHEMA,
    TOOL_NAME,
    content_schema,
    nullable,
    response_format,
    text_part,
    wire_value,
)

_STR: dict[str, Any] = {"type": "string"}
_OPT_STR: dict[str, Any] = {"type": ["string", "null"]}
OUTPUT_PART_TYPES = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")

MESSAGE_ITEM: dict[str, Any] = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "type": {"const": "message"},
        "role": {"enum": list(ROLES)},
        "content": content_schema(TEXT_PART_TYPES),
    },
}
FUNCTION_CALL_ITEM: dict[str, Any] = {
    "type": "object",
    "required": ["type", "call_id", "name", "arguments"],
    "properties": {
        "type": {"const": "function_call"},
        "call_id": _STR,
        "name": _STR,
        "arguments": {"type": "string", "description": "JSON text"},
    },
}
FUNCTION_CALL_OUTPUT_ITEM: dict[str, Any] = {
    "type": "object",
    "required": ["type", "call_id", "output"],
    "properties": {
        "type": {"const": "function_call_output"},
        "call_id": _STR,
        "output": content_schema(OUTPUT_PART_TYPES),
    },
}
REASONING_ITEM: dict[str, Any] = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"const": "reasoning"},
        "summary": {"type": ["array", "null"], "items": text_part(("summary_text",))},
        "content": {"type": ["array", "null"], "items": text_part(("reasoning_text",))},
    },
    "description": "becomes the next assistant message's reasoning (its content, else its "
    "summary); encrypted_content is not read",
}
INPUT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        _STR,
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "anyOf": [
                    MESSAGE_ITEM,
                    FUNCTION_CALL_ITEM,
                    FUNCTION_CALL_OUTPUT_ITEM,
                    REASONING_ITEM,
                ]
            },
        },
    ]
}


class _Turns:
    """Builds the message list; `assistant` is the assistant message still open to items."""

    def __init__(self, instructions: str | None) -> None:
        self.msgs: list[dict[str, Any]] = []
        if instructions is not None:
            self.msgs.append({"role": "system", "content": instructions})
        self.assistant: dict[str, Any] | None = None

    def close(self) -> None:
        if self.assistant is not None:
            self.msgs.append(self.assistant)
            self.assistant = None

    def open(self, after_output: bool) -> dict[str, Any]:
        """The open assistant message; a new one if `after_output` and this one has output
        already (reasoning and text start a turn, function calls join it)."""
        a = self.assistant
        if a is not None and after_output and (a["content"] or a.get("tool_calls")):
            self.close()
        if self.assistant is None:
            self.assistant = {"role": "assistant", "content": ""}
        return self.assistant

    def add(self, msg: dict[str, Any]) -> None:
        self.close()
        self.msgs.append(msg)


def _str(item: dict[str, Any], key: str, p: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad(f"{p}.{key} must be a string", f"{p}.{key}")
    return v


def _parts_text(v: Any, p: str, kind: str) -> str:
    """An optional array of {type: kind, text} parts (null: none)."""
    if v is None:
        return ""
    if not isinstance(v, list):
        raise bad(f"'{p}' must be an array of {kind} parts", p)
    return text_content(v, p, (kind,))


def conversation(body: dict[str, Any], instructions: str | None) -> list[dict[str, Any]]:
    turns = _Turns(instructions)
    inp = body.get("input")
    if isinstance(inp, str):
        turns.add({"role": "user", "content": inp})
        return wire_value(turns.msgs, "input")  # type: ignore[no-any-return]
    if not isinstance(inp, list) or not inp:
        raise bad("'input' must be a string or a non-empty array of items", "input")
    for i, item in enumerate(inp):
        p = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(f"{p}.role must be user, assistant, system or developer", f"{p}.role")
            if "content" not in item:
                raise bad(f"{p}.content is required", f"{p}.content")
            text = text_content(item["content"], f"{p}.content", TEXT_PART_TYPES)
            if role == "assistant":
                turns.open(after_output=True)["content"] = text
            else:
                turns.add({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", p), "type": "function",
                    "function": {"name": _str(item, "name", p),
                                 "arguments": _str(item, "arguments", p)}}  # fmt: skip
            turns.open(after_output=False).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = text_content(item.get("output"), f"{p}.output", OUTPUT_PART_TYPES)
            turns.add({"role": "tool", "tool_call_id": _str(item, "call_id", p), "content": out})
        elif kind == "reasoning":
            # both are validated, whichever supplies the text
            text = _parts_text(item.get("content"), f"{p}.content", "reasoning_text")
            summary = _parts_text(item.get("summary"), f"{p}.summary", "summary_text")
            text = text or summary
            a = turns.open(after_output=True)
            a["reasoning_content"] = a.get("reasoning_content", "") + text
        else:
            raise bad(f"{p}: only message, function_call, function_call_output and reasoning "
                      "items are supported", p, "unsupported_value")  # fmt: skip
    turns.close()
    return wire_value(turns.msgs, "input")  # type: ignore[no-any-return]


# -- tools, tool_choice, text.format -------------------------------------------------------
TOOLS_SCHEMA: dict[str, Any] = {
    "type": ["array", "null"],
    "items": {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "pattern": TOOL_NAME.pattern},
            "description": _OPT_STR,
            "parameters": {"type": ["object", "null"], "description": "a JSON Schema object"},
            "strict": {"type": ["boolean", "null"]},
        },
        "description": "function tools only (built-in tools are a 400)",
    },
}
TOOL_CHOICE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"enum": ["none", "auto", "required", None]},
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {"type": {"const": "function"}, "name": _STR},
        },
    ],
    "description": "'required' and a named function need tools (the name among them) and fail "
    "the response when the model makes no such call",
}


def tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the tools as the daemon takes them, the tools as the response echoes them)."""
    ts = body.get("tools")
    if ts is None:
        return [], []
    if not isinstance(ts, list):
        raise bad("'tools' must be an array", "tools")
    daemon, echo = [], []
    for i, t in enumerate(ts):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"{p}: tool type {kind!r} is not supported (only 'function')", p,
                      "unsupported_value")  # fmt: skip
        name = t.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad(f"{p}.name must match {TOOL_NAME.pattern}", f"{p}.name")
        for key, typ, what in (("description", str, "a string"), ("parameters", dict,
                               "an object"), ("strict", bool, "a boolean")):  # fmt: skip
            if t.get(key) is not None and not isinstance(t[key], typ):
                raise bad(f"{p}.{key} must be {what}", f"{p}.{key}")
        fn: dict[str, Any] = {"name": name}
        for key in ("description", "parameters"):
            if t.get(key) is not None:
                fn[key] = t[key]
        daemon.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": name, "description": t.get("description"),
                     "parameters": t.get("parameters"), "strict": t.get("strict")})  # fmt: skip
    return wire_value(daemon, "tools"), wire_value(echo, "tools")


def tool_choice(body: dict[str, Any], names: list[str]) -> tuple[Any, Any]:
    """(the daemon's tool_choice, the echoed one)."""
    tc = body.get("tool_choice")
    if tc is None:
        return "auto", "auto"
    if tc in ("none", "auto", "required"):
        if tc == "required" and not names:
            raise bad("tool_choice 'required' needs tools", "tool_choice")
        return tc, tc
    if not (isinstance(tc, dict) and tc.get("type") == "function"
            and isinstance(tc.get("name"), str)):  # fmt: skip
        raise bad("tool_choice must be 'none', 'auto', 'required' or {type: 'function', name}",
                  "tool_choice")  # fmt: skip
    if tc["name"] not in names:
        raise bad("tool_choice names a function that is not among the tools", "tool_choice")
    return {"type": "function", "function": {"name": tc["name"]}}, {
        "type": "function",
        "name": tc["name"],
    }


_JSON_SCHEMA_FORMAT: dict[str, Any] = {
    "type": "object",
    "required": ["type", "name", "schema"],
    "properties": {
        "type": {"const": "json_schema"},
        "name": _STR,
        "schema": {"type": "object"},
        "description": _OPT_STR,
        "strict": {"type": ["boolean", "null"]},
    },
}
_CHAT_FORMATS = RESPONSE_FORMAT_SCHEMA["anyOf"]
TEXT_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "properties": {
        "format": nullable(
            {"anyOf": [_CHAT_FORMATS[0], _JSON_SCHEMA_FORMAT, _CHAT_FORMATS[2], _CHAT_FORMATS[3]]}
        )
    },
    "description": "format: structured output (text, json_object, json_schema, and the "
    "extensions regex and grammar); the daemon constrains sampling with a grammar (one it "
    "cannot compile is a 400)",
}


def text_format(body: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the daemon's response_format, the echoed text config)."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise bad("'text' must be an object", "text")
    f = text.get("format")
    if f is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(f, dict):
        raise bad("'text.format' must be an object", "text.format")
    shaped = f
    if f.get("type") == "json_schema":  # the flat Responses form -> the chat form
        for key in ("name", "schema"):
            if f.get(key) is None:
                raise bad(f"text.format.{key} is required for json_schema", "text.format")
        js = {k: f[k] for k in ("name", "schema", "description", "strict") if f.get(k) is not None}
        shaped = {"type": "json_schema", "json_schema": js}
    try:
        rf = response_format({"response_format": shaped})
    except ApiError as exc:
        raise bad(exc.message.replace("response_format", "text.format"), "text.format") from exc
    return rf, wire_value({"format": f}, "text.format")


@dataclass(frozen=True)
class ResponsesRequest:
    """The structured fields of one /v1/responses request, checked, and what it echoes."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any]
    response_format: dict[str, Any] | None
    echo: dict[str, Any]

    @classmethod
    def parse(cls, body: dict[str, Any], instructions: str | None) -> ResponsesRequest:
        msgs = conversation(body, instructions)
        daemon_tools, echo_tools = tools(body)
        tc, echo_tc = tool_choice(body, [t["name"] for t in echo_tools])
        rf, echo_text = text_format(body)
        echo = {"tools": echo_tools, "tool_choice": echo_tc, "text": echo_text}
        return cls(msgs, daemon_tools or None, tc, rf, echo)
