"""Validation of request bodies into libflare_client arguments (400 with `param` on error)."""

from __future__ import annotations

import math
from typing import Any

from libflare_client import SamplingParams
from libflare_client.http.errors import bad

MAX_N = 16
MAX_TOP_LOGPROBS = 20


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def opt_num(body: dict[str, Any], key: str, lo: float, hi: float, lo_open: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return None
    if not is_num(v):
        raise bad(f"'{key}' must be a number", key)
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def opt_int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not is_int(v):
        raise bad(f"'{key}' must be an integer", key)
    if v < lo or v > hi:
        raise bad(f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return int(v)


def opt_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return v


def sampling(body: dict[str, Any], temperature_max: float = 2.0) -> SamplingParams:
    t = body.get("temperature")
    if t is not None and is_num(t) and t == 0:
        raise bad(
            "temperature 0 (greedy decoding) is not supported by Flare; use temperature > 0",
            "temperature",
            "unsupported_value",
        )
    return SamplingParams(
        temperature=opt_num(body, "temperature", 0.0, temperature_max, lo_open=True),
        top_k=opt_int(body, "top_k", -1, 1 << 30),
        top_p=opt_num(body, "top_p", 0.0, 1.0, lo_open=True),
        min_p=opt_num(body, "min_p", 0.0, 1.0),
        repetition_penalty=opt_num(body, "repetition_penalty", 0.0, 10.0, lo_open=True),
        presence_penalty=opt_num(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=opt_num(body, "frequency_penalty", -2.0, 2.0),
        seed=opt_int(body, "seed", -(1 << 63), (1 << 64) - 1),
    )


def with_seed(sp: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n gets seed+i so the choices differ but stay reproducible."""
    if sp.seed is None or i == 0:
        return sp
    from dataclasses import replace

    return replace(sp, seed=(sp.seed + i) % (1 << 63))


def stops(body: dict[str, Any], key: str = "stop") -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'{key}' must be a string or a list of strings", key)
    if len(v) > 16:
        raise bad(f"'{key}' accepts at most 16 strings", key)
    return [s for s in v if s]


def max_tokens(body: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    for k in keys:
        v = body.get(k)
        if v is not None:
            if not is_int(v) or v < 1:
                raise bad(f"'{k}' must be a positive integer", k)
            return int(v)
    return default


def text_content(content: Any, param: str) -> str:
    """OpenAI/Anthropic message content: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in (
                "text",
                "input_text",
                "output_text",
            ):
                text = part.get("text")
                if not isinstance(text, str):
                    raise bad("a text content part needs a string 'text'", param)
                out.append(text)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"content part type {kind!r} is not supported (text only)", param)
        return "".join(out)
    raise bad("'content' must be a string or a list of content parts", param)


ROLES = ("system", "developer", "user", "assistant", "tool")


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
        if role not in ROLES:
            raise bad(f"{p}.role must be one of {', '.join(ROLES)}", f"{p}.role")
        item: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": text_content(msg.get("content"), f"{p}.content"),
        }
        if role == "assistant" and msg.get("tool_calls"):
            if not isinstance(msg["tool_calls"], list):
                raise bad(f"{p}.tool_calls must be an array", f"{p}.tool_calls")
            item["tool_calls"] = msg["tool_calls"]
        if role == "tool" and msg.get("tool_call_id") is not None:
            item["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            item["name"] = msg["name"]
        out.append(item)
    return out


def tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    ts = body.get("tools")
    if ts is None or ts == []:
        tc = body.get("tool_choice")
        if tc not in (None, "none", "auto"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(ts, list):
        raise bad("'tools' must be an array", "tools")
    for i, t in enumerate(ts):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}] must be {{type: 'function', function: {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}].function.name must be a string", f"tools[{i}].function.name")
    tc = body.get("tool_choice")
    if tc not in (None, "auto", "none"):
        raise bad(
            "only tool_choice 'auto' and 'none' are supported (forced tool calls need the "
            "daemon's structured output, not available yet)",
            "tool_choice",
        )
    return ts


def response_format(body: dict[str, Any]) -> None:
    rf = body.get("response_format")
    if rf is None:
        return
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad(
            "'response_format.type' must be text, json_object or json_schema", "response_format"
        )
    if rf["type"] != "text":
        raise bad(
            f"response_format {rf['type']!r} (structured output) is not supported yet",
            "response_format",
            "unsupported_value",
        )


def n_choices(body: dict[str, Any]) -> int:
    n = opt_int(body, "n", 1, MAX_N)
    return 1 if n is None else n


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = opt_bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with stream: true", "stream_options")
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
        include_usage = bool(iu)
    return stream, include_usage


def chat_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    lp = opt_bool(body, "logprobs")
    top = opt_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not lp:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return lp, top or 0


def extensions(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM-style extensions: min_tokens, ignore_eos (benchmarks use them for fixed lengths)."""
    mt = opt_int(body, "min_tokens", 0, 1 << 30)
    return {"min_tokens": mt or 0, "ignore_eos": opt_bool(body, "ignore_eos")}
