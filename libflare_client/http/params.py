"""Validation of request bodies into libflare_client arguments (400 with `param` on error).

The rules here and the OpenAPI document (openapi.py) describe the same thing, and the fuzz test
holds them together: every field the document declares is checked here exactly as declared
(scalars are declared once, in the tables below, and both the check and the schema come from
them). Field policy, the same on every endpoint:

- a declared field with a wrong type or value -> 400 `invalid_request_error`, `param` = field;
- a declared field Flare cannot honour is declared with only the values it honours (e.g.
  `logit_bias` empty, `echo` false), anything else -> 400 with code `unsupported_value`;
- `null` means "not given" for every optional field;
- a field the document does not declare is ignored (agent tools send many vendor extras).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from libflare_client import SamplingParams
from libflare_client.http.errors import bad

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 16
MAX_TOP_K = 1 << 30
INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1
# below this, temperatures are sampled at it: near-greedy already, and far above the fp32
# underflow that would divide logits by zero
MIN_TEMPERATURE = 1e-6
SEED_MOD = 1 << 64  # the daemon takes seeds in [0, 2^64); negative int64 seeds wrap


def is_int(v: Any) -> bool:
    """A JSON Schema integer: an int, or a float with no fractional part (not a bool)."""
    if isinstance(v, bool):
        return False
    return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v.is_integer())


def unicode(s: str, param: str) -> str:
    """`s`, unless it holds lone surrogates (JSON \\u escapes can), which no encoder takes."""
    try:
        s.encode()
    except UnicodeEncodeError as exc:
        raise bad(f"'{param}' contains text that is not valid Unicode", param) from exc
    return s


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# -- scalar fields: one declaration gives the check and the schema -------------------------
@dataclass(frozen=True)
class Number:
    lo: float
    hi: float
    lo_open: bool = False
    doc: str = ""

    def check(self, body: dict[str, Any], key: str) -> float | None:
        v = body.get(key)
        if v is None:
            return None
        if not is_num(v):
            raise bad(f"'{key}' must be a number", key)
        if v < self.lo or v > self.hi or (self.lo_open and v == self.lo):
            lb = "(" if self.lo_open else "["
            raise bad(f"'{key}' must be in {lb}{self.lo}, {self.hi}], got {v}", key)
        return float(v)

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": ["number", "null"], "maximum": self.hi}
        s["exclusiveMinimum" if self.lo_open else "minimum"] = self.lo
        return {**s, "description": self.doc} if self.doc else s


@dataclass(frozen=True)
class Integer:
    lo: int
    hi: int | None = None
    doc: str = ""

    def check(self, body: dict[str, Any], key: str) -> int | None:
        v = body.get(key)
        if v is None:
            return None
        if not is_int(v):
            raise bad(f"'{key}' must be an integer", key)
        if v < self.lo or (self.hi is not None and v > self.hi):
            hi = "" if self.hi is None else f", at most {self.hi}"
            raise bad(f"'{key}' must be at least {self.lo}{hi}, got {v}", key)
        return int(v)

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": ["integer", "null"], "minimum": self.lo}
        if self.hi is not None:
            s["maximum"] = self.hi
        return {**s, "description": self.doc} if self.doc else s


@dataclass(frozen=True)
class Boolean:
    only: bool | None = None  # the one value Flare honours, if it honours only one
    doc: str = ""

    def check(self, body: dict[str, Any], key: str) -> bool | None:
        v = body.get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise bad(f"'{key}' must be a boolean", key)
        if self.only is not None and v != self.only:
            raise bad(f"'{key}': {v} is not supported", key, "unsupported_value")
        return v

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = (
            {"type": ["boolean", "null"]} if self.only is None else {"enum": [self.only, None]}
        )
        return {**s, "description": self.doc} if self.doc else s


@dataclass(frozen=True)
class String:
    doc: str = ""

    def check(self, body: dict[str, Any], key: str) -> str | None:
        v = body.get(key)
        if v is None:
            return None
        if not isinstance(v, str):
            raise bad(f"'{key}' must be a string", key)
        return unicode(v, key)

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": ["string", "null"]}
        return {**s, "description": self.doc} if self.doc else s


@dataclass(frozen=True)
class Nothing:
    """A known field Flare does not implement: only absent, null or an empty value passes."""

    empty: Any
    doc: str = ""

    def check(self, body: dict[str, Any], key: str) -> None:
        v = body.get(key)
        if v is not None and v != self.empty:
            raise bad(f"'{key}' is not supported", key, "unsupported_value")

    def schema(self) -> dict[str, Any]:
        if isinstance(self.empty, dict):
            s: dict[str, Any] = {"type": ["object", "null"], "maxProperties": 0}
        elif isinstance(self.empty, list):
            s = {"type": ["array", "null"], "maxItems": 0}
        elif self.empty is None:
            s = {"type": "null"}
        else:
            s = {"enum": [self.empty, None]}
        return {**s, "description": self.doc} if self.doc else s


@dataclass(frozen=True)
class AnyObject:
    """Any object but one with a `reserved` key (its values are not checked here)."""

    doc: str = ""
    reserved: tuple[str, ...] = ()

    def check(self, body: dict[str, Any], key: str) -> dict[str, Any] | None:
        v = body.get(key)
        if v is not None and not isinstance(v, dict):
            raise bad(f"'{key}' must be an object", key)
        taken = sorted(k for k in v or () if k in self.reserved)
        if taken:
            raise bad(f"'{key}' must not set {', '.join(taken)}", key)
        return v

    def schema(self) -> dict[str, Any]:
        s: dict[str, Any] = {"type": ["object", "null"], "description": self.doc or IGNORED}
        if self.reserved:
            s["propertyNames"] = {"not": {"enum": list(self.reserved)}}
        return s


Scalar = Number | Integer | Boolean | String | Nothing | AnyObject

IGNORED = "accepted and ignored"
# what the daemon itself passes to chat templates: not settable through chat_template_kwargs
TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt",
                      "continue_final_message")  # fmt: skip
TEMPERATURE_DOC = "> 0 (Flare has no greedy mode); values below 1e-6 are sampled at 1e-6"
SAMPLING: dict[str, Scalar] = {
    "temperature": Number(0.0, 2.0, lo_open=True, doc=TEMPERATURE_DOC),
    "top_p": Number(0.0, 1.0, lo_open=True),
    "top_k": Integer(-1, MAX_TOP_K, doc="0 or -1 disable top-k (extension)"),
    "min_p": Number(0.0, 1.0, doc="extension"),
    "presence_penalty": Number(-2.0, 2.0),
    "frequency_penalty": Number(-2.0, 2.0),
    "repetition_penalty": Number(0.0, 10.0, lo_open=True, doc="extension"),
    "seed": Integer(INT64_MIN, UINT64_MAX, doc="negative seeds wrap modulo 2^64"),
}
EXTENSIONS: dict[str, Scalar] = {
    "min_tokens": Integer(0, doc="extension: no end of sequence before this many tokens"),
    "ignore_eos": Boolean(doc="extension: generate through end-of-sequence tokens"),
}
COMMON: dict[str, Scalar] = {
    "model": String(doc="any name; the daemon serves one model"),
    "stream": Boolean(),
    "user": String(doc=IGNORED),
    "metadata": AnyObject(),
    "store": Boolean(doc=IGNORED),
    "service_tier": String(doc=IGNORED),
    "prompt_cache_key": String(doc=IGNORED + " (the daemon caches prefixes by itself)"),
    "safety_identifier": String(doc=IGNORED),
}
CHAT: dict[str, Scalar] = {
    **COMMON,
    **SAMPLING,
    **EXTENSIONS,
    "n": Integer(1, MAX_N, doc="choices; admitted all together or not at all"),
    "max_tokens": Integer(1),
    "max_completion_tokens": Integer(1, doc="wins over max_tokens"),
    "logprobs": Boolean(),
    "top_logprobs": Integer(0, MAX_TOP_LOGPROBS, doc="needs logprobs: true"),
    "parallel_tool_calls": Boolean(doc="false: only the model's first call is returned"),
    "reasoning_effort": String(doc=IGNORED),
    "chat_template_kwargs": AnyObject(
        doc='extension: passed to the chat template, e.g. {"enable_thinking": false}',
        reserved=TEMPLATE_ARGUMENTS,
    ),
    "logit_bias": Nothing({}, doc="not supported: only empty"),
    "modalities": Nothing([], doc="not supported: only empty (text is the only modality)"),
    "audio": Nothing(None, doc="not supported"),
    "prediction": Nothing(None, doc="not supported"),
    "functions": Nothing([], doc="legacy, not supported: use tools"),
    "function_call": Nothing(None, doc="legacy, not supported: use tool_choice"),
}
COMPLETIONS: dict[str, Scalar] = {
    **COMMON,
    **SAMPLING,
    **EXTENSIONS,
    "n": Integer(1, MAX_N, doc="choices per prompt; admitted all together or not at all"),
    "max_tokens": Integer(1, doc="default 16"),
    "logprobs": Integer(0, MAX_TOP_LOGPROBS, doc="top alternatives per token"),
    "echo": Boolean(only=False, doc="not supported: only false"),
    "suffix": Nothing("", doc="not supported"),
    "best_of": Integer(1, 1, doc="only 1"),
    "logit_bias": Nothing({}, doc="not supported: only empty"),
}
MESSAGES: dict[str, Scalar] = {
    "model": String(doc="any name; the daemon serves one model"),
    "stream": Boolean(),
    "metadata": AnyObject(),
    "max_tokens": Integer(1),
    "temperature": Number(0.0, 1.0, lo_open=True, doc=TEMPERATURE_DOC),
    "top_p": Number(0.0, 1.0, lo_open=True),
    "top_k": Integer(-1, MAX_TOP_K, doc="0 or -1 disable top-k"),
    "seed": SAMPLING["seed"],
    **EXTENSIONS,
}
RESPONSES: dict[str, Scalar] = {
    **COMMON,
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "seed": SAMPLING["seed"],
    **EXTENSIONS,
    "max_output_tokens": Integer(1),
    "instructions": String(),
    "previous_response_id": Nothing(None, doc="not supported: this endpoint is stateless"),
    "background": Boolean(only=False, doc="not supported: only false"),
    "parallel_tool_calls": Boolean(doc="false: only the model's first call is returned"),
    "chat_template_kwargs": CHAT["chat_template_kwargs"],
}


def check_scalars(body: dict[str, Any], table: dict[str, Scalar]) -> dict[str, Any]:
    """Every key of `table`: the checked value, None when absent (checks run in table order,
    only for keys the body has; an absent or null field checks to None)."""
    out: dict[str, Any] = dict.fromkeys(table)
    for k, f in table.items():
        if k in body:
            out[k] = f.check(body, k)
    return out


# -- derived arguments ---------------------------------------------------------------------
def sampling(v: dict[str, Any]) -> SamplingParams:
    """`v`: the checked scalars. Temperature 0 gets its own message (a common request)."""
    seed = v.get("seed")
    t = v.get("temperature")
    return SamplingParams(
        temperature=None if t is None else max(t, MIN_TEMPERATURE),
        top_k=v.get("top_k"),
        top_p=v.get("top_p"),
        min_p=v.get("min_p"),
        repetition_penalty=v.get("repetition_penalty"),
        presence_penalty=v.get("presence_penalty"),
        frequency_penalty=v.get("frequency_penalty"),
        seed=None if seed is None else seed % SEED_MOD,
    )


def reject_greedy(body: dict[str, Any]) -> None:
    t = body.get("temperature")
    if is_num(t) and t == 0:
        raise bad(
            "temperature 0 (greedy decoding) is not supported by Flare; use temperature > 0",
            "temperature",
            "unsupported_value",
        )


def with_seed(sp: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n gets seed+i so the choices differ but stay reproducible."""
    if sp.seed is None or i == 0:
        return sp
    return replace(sp, seed=(sp.seed + i) % SEED_MOD)


def limits(v: dict[str, Any], max_tokens: int, ctx: int, key: str) -> tuple[int, dict[str, Any]]:
    """(max_tokens, extension kwargs): min_tokens <= max_tokens; both clipped to the context
    (generation stops there anyway, with finish_reason "length")."""
    mt = v.get("min_tokens") or 0
    if mt > max_tokens:
        raise bad(f"'min_tokens' ({mt}) must not exceed '{key}' ({max_tokens})", "min_tokens")
    if ctx > 0:
        max_tokens, mt = min(max_tokens, ctx), min(mt, ctx)
    return max_tokens, {"min_tokens": mt, "ignore_eos": bool(v.get("ignore_eos"))}


def stops(body: dict[str, Any], key: str = "stop", allow_str: bool = True) -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str) and allow_str:
        v = [v]
    what = "a string or an array of strings" if allow_str else "an array of strings"
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'{key}' must be {what}", key)
    if len(v) > MAX_STOPS:
        raise bad(f"'{key}' accepts at most {MAX_STOPS} strings", key)
    return [unicode(s, key) for s in v if s]


TEXT_PART_TYPES = ("text", "input_text", "output_text")


def text_content(content: Any, param: str, types: tuple[str, ...] = ("text",)) -> str:
    """Message content: a string, or an array of text parts {type, text}."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            p = f"{param}[{i}]"
            if not isinstance(part, dict):
                raise bad(f"{p} must be a content part object", p)
            if part.get("type") not in types:
                kind = part.get("type")
                raise bad(
                    f"{p}: content part type {kind!r} is not supported (only {', '.join(types)})",
                    p,
                    "unsupported_value",
                )
            if not isinstance(part.get("text"), str):
                raise bad(f"{p}.text must be a string", f"{p}.text")
            out.append(part["text"])
        return "".join(out)
    raise bad(f"'{param}' must be a string or an array of text parts", param)


def stream_flags(body: dict[str, Any], stream: bool) -> bool:
    """include_usage from stream_options (which needs stream: true)."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed with stream: true", "stream_options")
    iu = so.get("include_usage")
    if iu is not None and not isinstance(iu, bool):
        raise bad("'stream_options.include_usage' must be a boolean", "stream_options")
    return bool(iu)


def chat_logprobs(v: dict[str, Any]) -> tuple[bool, int]:
    lp, top = bool(v.get("logprobs")), v.get("top_logprobs")
    if top is not None and not lp:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return lp, top or 0
