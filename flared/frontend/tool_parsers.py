"""Tool-call extraction from answer text, incrementally. Registered by the bundle's ToolParser
enum, never by model name.

Both formats wrap a call in `<tool_call>` ... `</tool_call>`; they differ in the body:
  HERMES_JSON  {"name": "f", "arguments": {...}}
  QWEN_XML     <function=f><parameter=k>\nv\n</parameter>...</function>, values typed with the
               tool's JSON schema (integer, number, boolean, null, object, array; else string).
A call is released when its closing tag arrives and its body parses: the first delta carries
index, id, type and name, the second the whole arguments JSON. A call that never validates is
not streamed and retracted later; it is reported in `errors` and its raw text goes to content.
Whitespace between content and a call, and between calls, is dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from flared.frontend.deltas import ContentDelta, Delta, ToolCallDelta, holdback
from prep.bundle import ToolParser

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
BodyParser = Callable[[str], tuple[str, str]]  # body -> (name, arguments JSON); raises ValueError


def _schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function", t)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def parse_hermes(body: str) -> tuple[str, str]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"tool call is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('tool call JSON needs a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call arguments are not valid JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return obj["name"], json.dumps(args, ensure_ascii=False)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _types(schema: dict[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [x for s in schema[key] if isinstance(s, dict) for x in _types(s)]
    return []


def typed_value(raw: str, schema: dict[str, Any]) -> Any:
    """An XML parameter value converted to the first schema type it satisfies; else the string."""
    for t in _types(schema):
        if t == "string":
            return raw
        if t == "boolean" and raw.strip().lower() in ("true", "false"):
            return raw.strip().lower() == "true"
        if t == "null" and raw.strip().lower() in ("null", "none"):
            return None
        if t in ("integer", "number", "object", "array"):
            try:
                v = json.loads(raw)
            except json.JSONDecodeError:
                continue
            ok = {
                "integer": isinstance(v, int) and not isinstance(v, bool),
                "number": isinstance(v, (int, float)) and not isinstance(v, bool),
                "object": isinstance(v, dict),
                "array": isinstance(v, list),
            }[t]
            if ok:
                return v
    return raw


def make_xml_parser(tools: list[dict[str, Any]] | None) -> BodyParser:
    schemas = _schemas(tools)

    def parse(body: str) -> tuple[str, str]:
        m = _FUNCTION.fullmatch(body)
        if m is None:
            raise ValueError("tool call needs one <function=NAME>...</function> block")
        name, inner = m.group(1).strip(), m.group(2)
        props = schemas.get(name, {}).get("properties", {})
        args: dict[str, Any] = {}
        end = 0
        for p in _PARAM.finditer(inner):
            if inner[end : p.start()].strip():
                raise ValueError(
                    f"unexpected text in tool call {name!r}: {inner[end : p.start()]!r}"
                )
            end = p.end()
            raw = p.group(2)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            key = p.group(1).strip()
            args[key] = typed_value(raw, props.get(key, {}) if isinstance(props, dict) else {})
        if inner[end:].strip():
            raise ValueError(f"unterminated or malformed parameter in tool call {name!r}")
        return name, json.dumps(args, ensure_ascii=False)

    return parse


class ToolCallExtractor:
    """Splits answer text into content deltas and complete, validated tool-call deltas."""

    def __init__(self, parse_body: BodyParser, id_prefix: str) -> None:
        self._parse = parse_body
        self._id_prefix = id_prefix
        self._buf = ""
        self._in_call = False
        self._after_call = False  # drop whitespace that follows a call
        self.num_calls = 0
        self.errors: list[str] = []

    def push(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._buf:
            if self._in_call:
                i = self._buf.find(CALL_CLOSE)
                if i < 0:
                    break
                body, self._buf = self._buf[:i], self._buf[i + len(CALL_CLOSE) :]
                self._in_call = False
                out += self._finish_call(body)
                continue
            if self._after_call:
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    break
                self._buf, self._after_call = stripped, False
            i = self._buf.find(CALL_OPEN)
            if i >= 0:
                before = self._buf[:i].rstrip()  # whitespace before a call is layout, not content
                if before:
                    out.append(ContentDelta(before))
                self._buf, self._in_call = self._buf[i + len(CALL_OPEN) :], True
                continue
            keep = holdback(self._buf, (CALL_OPEN,))
            body = self._buf[: len(self._buf) - keep]
            released = body.rstrip()  # trailing whitespace waits: a call may follow it
            if released:
                out.append(ContentDelta(released))
            self._buf = self._buf[len(released) :]
            break
        return out

    def _finish_call(self, body: str) -> list[Delta]:
        self._after_call = True
        try:
            name, arguments = self._parse(body)
        except ValueError as exc:
            self.errors.append(f"malformed tool call (kept as content): {exc}")
            return [ContentDelta(CALL_OPEN + body + CALL_CLOSE)]
        index = self.num_calls
        self.num_calls += 1
        call_id = f"call_{self._id_prefix}{index}"
        return [ToolCallDelta(index, "", call_id, name), ToolCallDelta(index, arguments)]

    def flush(self) -> list[Delta]:
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            self.errors.append("unterminated tool call (kept as content)")
            return [ContentDelta(CALL_OPEN + buf)]
        if self._after_call or not buf:
            return []
        return [ContentDelta(buf)]


TOOL_BODY_PARSERS: dict[ToolParser, Callable[[list[dict[str, Any]] | None], BodyParser] | None] = {
    ToolParser.NONE: None,
    ToolParser.HERMES_JSON: lambda tools: parse_hermes,
    ToolParser.QWEN_XML: make_xml_parser,
}
