"""The Jinja environment Transformers' `apply_chat_template` renders with, reproduced exactly.

Sandboxed (immutable), trim_blocks + lstrip_blocks, loop controls, a `{% generation %}` block
that renders its body unchanged, `tojson` as `json.dumps` (ensure_ascii=False, Python's default
separators, optional indent / separators / sort_keys), `raise_exception` -> InvalidRequest and
`strftime_now`. Anything a template raises surfaces as InvalidRequest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from types import BuiltinMethodType
from typing import Any

from flared.engine.errors import InvalidRequest

# Transformers appends this to the final message for continue_final_message and cuts there.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateRaised(Exception):
    """raise_exception() inside a template; converted to InvalidRequest at the render boundary."""


# While set (one request's renders: its prompt and its window renders), `tojson` results by
# (id, options), each kept with its object so that an id is never reused for another one. The
# objects cannot change meanwhile: templates run in the immutable sandbox and the renders of a
# request only read the request's messages and tools.
_JSON_MEMO: ContextVar[dict[tuple[int, Any], tuple[Any, str]] | None] = ContextVar(
    "flare_json_memo", default=None
)


@contextmanager
def json_memo() -> Iterator[None]:
    """Remember `tojson` results for the renders inside (the tools of every window render)."""
    token = _JSON_MEMO.set({})
    try:
        yield
    finally:
        _JSON_MEMO.reset(token)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    memo = _JSON_MEMO.get()
    key = (id(x), (ensure_ascii, indent, None if separators is None else tuple(separators),
                   sort_keys))  # fmt: skip
    if memo is not None:
        hit = memo.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
    out = json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    if memo is not None and isinstance(x, (dict, list)):
        memo[key] = (x, out)
    return out


def _raise(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _generation_extension() -> Any:
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (assistant-mask marker)."""

        tags = {"generation"}  # noqa: RUF012 (jinja reads a class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationBlock


_DICT_ATTRS = frozenset(dir(dict))
# the sandbox wraps these (a format string could reach attributes of its arguments)
_STR_FORMAT = frozenset({"format", "format_map"})
# `loop` properties that are ints or bools (previtem/nextitem are items: left to the sandbox)
_LOOP_NUMBERS = frozenset(
    {"index0", "index", "revindex0", "revindex", "first", "last", "length", "depth0", "depth"}
)
# namespace values returned directly: no str.format to wrap, nothing internal to refuse
_PLAIN_VALUES = frozenset({bool, int, float, str, type(None)})


@lru_cache(maxsize=1)
def _environment_class() -> Any:
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class Environment(ImmutableSandboxedEnvironment):
        """The immutable sandbox with the attribute lookups chat templates make most (a
        message or tool dict's key, a string method, `loop.index0` and the like, a
        `namespace()` field) answered directly. Each returns exactly what the sandbox's own
        `getattr` returns for it: a plain dict has no attribute outside dir(dict), so the
        sandbox falls through to the item (or undefined); a public str method is never
        internal and str is immutable, so the sandbox deems it safe; a LoopContext or a
        Namespace is neither internal nor a known mutable, so the sandbox returns a public
        attribute's value unless it is a str.format method to wrap, which a number, bool,
        str or None never is (a missing namespace field: the sandbox tries the item, which a
        Namespace refuses, then returns undefined). str.format and str.format_map go to the sandbox,
        which wraps them (a format string could otherwise read attributes of its arguments);
        tests pin the equivalence."""

        def getattr(self, obj: Any, attribute: str) -> Any:
            kind = type(obj)
            if kind is dict and attribute not in _DICT_ATTRS:
                try:
                    return obj[attribute]
                except KeyError:
                    return self.undefined(obj=obj, name=attribute)
            if kind is str and not attribute.startswith("_") and attribute not in _STR_FORMAT:
                try:
                    return getattr(obj, attribute)
                except AttributeError:
                    return self.undefined(obj=obj, name=attribute)
            if kind is LoopContext and attribute in _LOOP_NUMBERS:
                return getattr(obj, attribute)
            if kind is Namespace and not attribute.startswith("_"):
                try:
                    value = getattr(obj, attribute)
                except AttributeError:
                    return self.undefined(obj=obj, name=attribute)
                if type(value) in _PLAIN_VALUES:
                    return value
            return super().getattr(obj, attribute)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            """A builtin method (`content.strip('\\n')`) or `namespace(...)` is called as the
            sandbox would call it: neither carries `unsafe_callable`, `alters_data` or a jinja
            pass-arg marker, so the sandbox's check passes and Context.call only drops its
            own keywords before calling (a StopIteration becomes undefined there too)."""
            if type(__obj) is BuiltinMethodType or __obj is Namespace:
                kwargs.pop("_block_vars", None)
                kwargs.pop("_loop_vars", None)
                try:
                    return __obj(*args, **kwargs)
                except StopIteration:
                    return __context.environment.undefined(
                        "value was undefined because a callable raised a StopIteration exception"
                    )
            return super().call(__context, __obj, *args, **kwargs)

    return Environment


@lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """Compile once per distinct template source (templates are immutable bundle data)."""
    from jinja2.ext import loopcontrols

    env = _environment_class()(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except Exception as exc:
        raise InvalidRequest(f"chat template does not compile: {exc}") from exc


def render_template(template: Any, **context: Any) -> str:
    return str(call_template(template.render, **context))


def call_template(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) with template failures surfaced as InvalidRequest."""
    try:
        return fn(*args, **kwargs)
    except TemplateRaised as exc:
        raise InvalidRequest(f"chat template error: {exc}") from exc
    except InvalidRequest:
        raise
    except Exception as exc:
        raise InvalidRequest(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def tag_final_message(messages: list[Any]) -> tuple[list[Any], str]:
    """Append CONTINUE_TAG to the final message's text as Transformers does; returns the new
    message list (earlier messages shared, the final one copied) and the untagged final text."""
    if not messages or not isinstance(messages[-1], Mapping):
        raise InvalidRequest("continue_final_message needs a final message to continue")
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + CONTINUE_TAG
        return [*messages[:-1], last], content
    if isinstance(content, (list, tuple)):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                final = part["text"]
                part["text"] = final + CONTINUE_TAG
                last["content"] = parts
                return [*messages[:-1], last], final
    raise InvalidRequest("continue_final_message: the final message has no text to continue")


def cut_at_tag(rendered: str, final_text: str) -> str:
    """Cut the rendered chat at the continuation tag (drops the template's closing tokens)."""
    tag = CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise InvalidRequest(
            "continue_final_message: the template does not reproduce the final message"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()
