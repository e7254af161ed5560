"""Structured request fields (messages, tools, prompts, formats): each check sits beside the
JSON Schema the OpenAPI document declares for it, so the two are read and changed together."""

from __future__ import annotations

import re
from typing import Any

from libflare_client.http.errors import bad
from libflare_client.http.params import (
    INT64_MIN,
    UINT64_MAX,
    is_int,
    text_content,
    unicode,
)


def wire_value(v: Any, param: str) -> Any:
    """A JSON value the daemon's wire (msgpack) can carry: integers beyond 64 bits become
    floats (JSON Schema treats 1e30 and 10**30 alike); text that is not valid Unicode (lone
    surrogates from \\u escapes) is a 400."""
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return v
    if isinstance(v, int):
        return v if INT64_MIN <= v <= UINT64_MAX else float(v)
    if isinstance(v, str):
        try:
            v.encode()
        except UnicodeEncodeError as exc:
            raise bad(f"'{param}' contains text that is not valid Unicode", param) from exc
        return v
    if isinstance(v, list):
        return [wire_value(x, param) for x in v]
    if isinstance(v, dict):
        return {wire_value(k, param): wire_value(x, param) for k, x in v.items()}
    return v


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def text_part(types: tuple[str, ...] = ("text",)) -> dict[str, Any]:
    t: dict[str, Any] = {"const": types[0]} if len(types) == 1 else {"enum": list(types)}
    return {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": t, "text": {"type": "string"}},
    }


def content_schema(types: tuple[str, ...] = ("text",)) -> dict[str, Any]:
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part(types)}]}


# -- chat completions ----------------------------------------------------------------------
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {
                "name": {"type": "string"},
                "arguments": {"type": "string", "description": "JSON text"},
            },
        },
    },
}
_NAME = {"type": "string"}
CHAT_MESSAGE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "developer", "user"]},
                "content": content_schema(),
                "name": _NAME,
            },
        },
        {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"const": "assistant"},
                "content": nullable(content_schema()),
                "name": _NAME,
                "tool_calls": nullable({"type": "array", "items": TOOL_CALL_SCHEMA}),
                "reasoning_content": {"type": ["string", "null"]},
                "refusal": {"type": ["string", "null"]},
            },
        },
        {
            "type": "object",
            "required": ["role", "content", "tool_call_id"],
            "properties": {
                "role": {"const": "tool"},
                "content": content_schema(),
                "tool_call_id": {"type": "string"},
            },
        },
    ]
}
CHAT_MESSAGES_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": CHAT_MESSAGE_SCHEMA,
}


def _opt_str(msg: dict[str, Any], key: str, p: str) -> str | None:
    v = msg.get(key)
    if v is not None and not isinstance(v, str):
        raise bad(f"{p}.{key} must be a string", f"{p}.{key}")
    return v


def _tool_call(tc: Any, p: str) -> dict[str, Any]:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(fn, dict):
        raise bad(f"{p} must be {{id, type: 'function', function: {{name, arguments}}}}", p)
    for key, v in (("id", tc.get("id")), ("function.name", fn.get("name"))):
        if not isinstance(v, str):
            raise bad(f"{p}.{key} must be a string", f"{p}.{key}")
    if not isinstance(fn.get("arguments"), str):
        raise bad(f"{p}.function.arguments must be a string (JSON text)", f"{p}.function")
    return {
        "id": tc["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": fn["arguments"]},
    }


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad(f"{p} must be an object", p)
        role = msg.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(
                f"{p}.role must be one of system, developer, user, assistant, tool", f"{p}.role"
            )
        content = msg.get("content")
        if content is None and role != "assistant":
            raise bad(f"{p}.content is required for role {role!r}", f"{p}.content")
        item: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": "" if content is None else text_content(content, f"{p}.content"),
        }
        if role == "tool":
            tcid = _opt_str(msg, "tool_call_id", p)
            if tcid is None:
                raise bad(f"{p}.tool_call_id is required for role 'tool'", f"{p}.tool_call_id")
            item["tool_call_id"] = tcid
        else:
            name = _opt_str(msg, "name", p)
            if name is not None:
                item["name"] = name
        if role == "assistant":
            tcs = msg.get("tool_calls")
            if tcs is not None:
                if not isinstance(tcs, list):
                    raise bad(f"{p}.tool_calls must be an array", f"{p}.tool_calls")
                if tcs:
                    item["tool_calls"] = [
                        _tool_call(tc, f"{p}.tool_calls[{j}]") for j, tc in enumerate(tcs)
                    ]
            rc = _opt_str(msg, "reasoning_content", p)
            if rc:
                item["reasoning_content"] = rc
            _opt_str(msg, "refusal", p)
        out.append(item)
    return wire_value(out, "messages")  # type: ignore[no-any-return]


TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": TOOL_NAME.pattern},
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "a JSON Schema object"},
                "strict": {"type": ["boolean", "null"]},
            },
        },
    },
}
TOOLS_SCHEMA: dict[str, Any] = {"type": ["array", "null"], "items": TOOL_SCHEMA}
_NAMED = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}},
        },
    },
}
TOOL_CHOICE_SCHEMA: dict[str, Any] = {
    "anyOf": [{"enum": ["none", "auto", "required", None]}, _NAMED],
    "description": "'required' and a named function need tools (the name among them); the "
    "output is then constrained to a call",
}


def tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
    """(tools, tool_choice), checked together."""
    ts = body.get("tools")
    tc = tool_choice(body)
    if ts is None:
        ts = []
    if not isinstance(ts, list):
        raise bad("'tools' must be an array", "tools")
    names = []
    for i, t in enumerate(ts):
        p = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"{p} must be {{type: 'function', function: {{name, ...}}}}", p)
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad(f"{p}.function.name must match {TOOL_NAME.pattern}", f"{p}.function.name")
        names.append(name)
        for key, typ, what in (
            ("description", str, "a string"),
            ("parameters", dict, "an object"),
        ):
            if key in fn and not isinstance(fn[key], typ):
                raise bad(f"{p}.function.{key} must be {what}", f"{p}.function.{key}")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad(f"{p}.function.strict must be a boolean", f"{p}.function.strict")
    if tc == "required" and not ts:
        raise bad("tool_choice 'required' needs tools", "tool_choice")
    if isinstance(tc, dict) and tc["function"]["name"] not in names:
        raise bad("tool_choice names a function that is not among the tools", "tool_choice")
    return wire_value(ts, "tools") or None, tc


def tool_choice(body: dict[str, Any]) -> str | dict[str, Any]:
    tc = body.get("tool_choice")
    if tc is None:
        return "auto"
    if tc in ("none", "auto", "required"):
        return str(tc)
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not (
        isinstance(tc, dict)
        and tc.get("type") == "function"
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
    ):
        raise bad(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{type: 'function', function: {name}}",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": fn["name"]}}


RESPONSE_FORMAT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object"]},
                "schema": {
                    "type": "object",
                    "description": "extension (json_object): a JSON schema the object follows",
                },
            },
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": ["boolean", "null"]},
                    },
                },
            },
        },
        {
            "type": "object",
            "required": ["type", "regex"],
            "properties": {"type": {"const": "regex"}, "regex": {"type": "string", "minLength": 1}},
            "description": "extension: output matching a regular expression",
        },
        {
            "type": "object",
            "required": ["type", "grammar"],
            "properties": {
                "type": {"const": "grammar"},
                "grammar": {"type": "string", "minLength": 1},
            },
            "description": "extension: output of an EBNF grammar",
        },
        {"type": "null"},
    ],
    "description": "structured output; the daemon constrains sampling with a grammar (a schema "
    "or expression it cannot compile is a 400)",
}


def response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kinds = ("text", "json_object", "json_schema", "regex", "grammar")
    if not isinstance(rf, dict) or rf.get("type") not in kinds:
        raise bad(f"'response_format.type' must be one of {', '.join(kinds)}", "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        # llama.cpp's extension: a schema beside json_object constrains the object to it (it
        # is not silently dropped)
        schema = rf.get("schema")
        if schema is None:
            return {"type": "json_object"}
        if not isinstance(schema, dict):
            raise bad("response_format.schema must be an object", "response_format")
        out = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
        return wire_value(out, "response_format")  # type: ignore[no-any-return]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise bad("response_format.json_schema needs a 'name'", "response_format")
        if "schema" in js and not isinstance(js["schema"], dict):
            raise bad("response_format.json_schema.schema must be an object", "response_format")
        for key, typ in (("description", str), ("strict", (bool, type(None)))):
            if key in js and not isinstance(js[key], typ):
                raise bad(
                    f"response_format.json_schema.{key} has the wrong type", "response_format"
                )
        schema = js.get("schema", {"type": "object"})
        out = {"type": "json_schema", "json_schema": {"name": js["name"], "schema": schema}}
        return wire_value(out, "response_format")  # type: ignore[no-any-return]
    v = rf.get(kind)
    if not isinstance(v, str) or not v:
        raise bad(f"response_format.{kind} must be a non-empty string", "response_format")
    return {"type": kind, kind: unicode(v, "response_format")}


STREAM_OPTIONS_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "properties": {"include_usage": {"type": ["boolean", "null"]}},
    "description": "only with stream: true",
}
STOP_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "maxItems": 16},
        {"type": "null"},
    ]
}


# -- completions ---------------------------------------------------------------------------
_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        _TOKENS,
        {"type": "array", "minItems": 1, "items": _TOKENS},
    ],
    "description": "text (tokenized by the daemon), token ids (below the model's vocabulary "
    "size), or a list of either; each prompt gets n choices",
}


def prompts(body: dict[str, Any], vocab_size: int) -> list[dict[str, Any]]:
    """One submit keyword set per prompt: {"prompt": text} or {"prompt_token_ids": ids}."""
    prompt = body.get("prompt")
    if prompt == "" or (isinstance(prompt, list) and "" in prompt):
        raise bad("a text prompt must not be empty", "prompt")
    if isinstance(prompt, str):
        return [{"prompt": unicode(prompt, "prompt")}]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [{"prompt": unicode(p, "prompt")} for p in prompt]
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        out = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt)
    ):
        out = prompt
    else:
        raise bad(
            "'prompt' must be a string, a list of strings, a non-empty list of token ids, "
            "or a list of those",
            "prompt",
        )
    ids = [[int(t) for t in p] for p in out]
    hi = vocab_size if vocab_size > 0 else 1 << 31
    for p in ids:
        bad_ids = [t for t in p if not 0 <= t < hi]
        if bad_ids:
            raise bad(
                f"prompt token ids {bad_ids[:5]} are outside the vocabulary (0..{hi - 1})",
                "prompt",
                "invalid_token_id",
            )
    return [{"prompt_token_ids": p} for p in ids]
