"""The template environment's fast attribute lookups and calls return exactly what the immutable
sandbox returns, and the sandbox still refuses what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from jinja2 import pass_context
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.runtime import LoopContext, Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment, unsafe
from jinja2.utils import Namespace

from flared.engine.errors import InvalidRequest
from flared.frontend.jinja_env import compile_template, render_template

CASES = [
    ({"content": "hi", "role": "user"}, "content"),
    ({"content": "hi"}, "missing"),
    ({"items": "shadowed"}, "items"),  # a dict attribute wins over a key, as in the sandbox
    ({"get": 1}, "get"),
    ({"a": 1}, "update"),  # mutating: unsafe in the immutable sandbox
    ({"a": 1}, "__class__"),
    ("text", "startswith"),
    ("text", "split"),
    ("text", "format"),
    ("text", "nope"),
    ("text", "__class__"),
    ("text", "_private"),
    ([1, 2], "append"),
]


def _loop(advance: int) -> LoopContext:
    """A `loop` variable `advance` items into ["a", "b", "c"] (0: before the first item)."""
    loop = LoopContext(["a", "b", "c"], Undefined)
    for _ in range(advance):
        next(loop)
    return loop


LOOP_ATTRS = ["index0", "index", "revindex0", "revindex", "first", "last", "length", "depth0",
              "depth", "previtem", "nextitem", "cycle", "changed", "_iterator", "__class__",
              "nope"]  # fmt: skip
NS_ATTRS = ["flag", "count", "ratio", "name", "empty", "items", "fmt", "missing", "_private",
            "_Namespace__attrs", "__class__"]  # fmt: skip


def _describe(env, value):
    if isinstance(value, env.undefined):
        return ("undefined", type(value).__name__)
    if callable(value):
        # a wrapped str.format is a function without __self__; a method's owner by its repr
        self_repr = repr(getattr(value, "__self__", None))
        return ("callable", getattr(value, "__name__", None), type(value).__name__, self_repr)
    return ("value", value)


@pytest.mark.parametrize(("obj", "attr"), CASES)
def test_fast_lookups_equal_the_sandbox(obj, attr):
    fast = compile_template("{{ 1 }}").environment
    base = ImmutableSandboxedEnvironment()
    assert type(fast) is not ImmutableSandboxedEnvironment  # the fast path is what runs
    assert _describe(fast, fast.getattr(obj, attr)) == _describe(base, base.getattr(obj, attr))


def _namespace() -> Namespace:
    return Namespace(
        flag=True, count=3, ratio=0.5, name="x", empty=None, items=[1], fmt="{}".format
    )


@pytest.mark.parametrize("attr", LOOP_ATTRS)
@pytest.mark.parametrize("advance", [1, 2, 3])
def test_loop_lookups_equal_the_sandbox(advance: int, attr: str) -> None:
    fast = compile_template("{{ 1 }}").environment
    base = ImmutableSandboxedEnvironment()
    got, want = fast.getattr(_loop(advance), attr), base.getattr(_loop(advance), attr)
    assert _describe(fast, got) == _describe(base, want)


@pytest.mark.parametrize("attr", NS_ATTRS)
def test_namespace_lookups_equal_the_sandbox(attr: str) -> None:
    fast = compile_template("{{ 1 }}").environment
    base = ImmutableSandboxedEnvironment()
    got, want = fast.getattr(_namespace(), attr), base.getattr(_namespace(), attr)
    assert _describe(fast, got) == _describe(base, want)
    if not callable(want):
        assert got == want or (isinstance(got, Undefined) and isinstance(want, Undefined))


def _outcome(env: Any, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ctx = env.from_string("").new_context({})
    try:
        out = env.call(ctx, fn, *args, **kwargs)
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))
    if isinstance(out, Namespace):
        return ("namespace", {k: getattr(out, k) for k in kwargs if not k.startswith("_")})
    if isinstance(out, Undefined):
        return ("undefined", type(out).__name__, out._undefined_hint)
    return ("value", out)


@unsafe
def _refused() -> str:
    return "ran"


@pass_context
def _with_context(context: Any) -> str:
    return type(context).__name__


CALLS = [
    (" x\n".strip, ("\n",), {"_loop_vars": {"a": 1}}),
    ("a,b".split, (",",), {"_block_vars": {}}),
    ("abc".startswith, ("<tool",), {}),
    ({"a": 1}.get, ("a",), {}),
    ("x".join, (5,), {}),  # raises TypeError either way
    (next, (iter(()),), {}),  # StopIteration: undefined either way
    (Namespace, (), {"multi_step_tool": True, "last_query_index": 3, "_loop_vars": {}}),
    (len, ([1, 2],), {}),
    (_refused, (), {}),  # not a builtin: the sandbox's check (SecurityError)
    (_with_context, (), {}),  # not a builtin: Context.call passes the context
]


@pytest.mark.parametrize(("fn", "args", "kwargs"), CALLS)
def test_fast_calls_equal_the_sandbox(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
    fast = compile_template("{{ 1 }}").environment
    base = ImmutableSandboxedEnvironment()
    assert _outcome(fast, fn, args, dict(kwargs)) == _outcome(base, fn, args, dict(kwargs))


LOOPS = """{%- set ns = namespace(seen=0, last='', flag=false) %}
{%- for m in items %}{{ loop.index0 }}/{{ loop.index }}/{{ loop.revindex }}/{{ loop.length }}
{{- '^' if loop.first }}{{- '$' if loop.last }}{{ loop.previtem }}<{{ loop.nextitem }}>
{%- set ns.seen = ns.seen + 1 %}{%- set ns.last = m.strip() %}{{ ns.missing }}{{ ns.flag }}
{{- m.upper().split('B') }}{{ loop.cycle('x', 'y') }}{{ loop.changed(m) }}
{%- for k in m %}{{ loop.depth }}{{ k }}{% endfor %}{% endfor %}{{ ns.seen }}{{ ns.last }}"""


def test_loop_and_namespace_templates_render_as_in_the_sandbox() -> None:
    base = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    items = [" ab ", "b", "cb"]
    want = base.from_string(LOOPS).render(items=items)
    assert render_template(compile_template(LOOPS), items=items) == want


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].content.__class__.__mro__ }}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'x': 1}) }}",
        "{{ '{0.__class__}'.format(messages) }}",
    ],
)
def test_the_sandbox_still_refuses(source):
    """Each escape attempt fails the render or renders as undefined, never as the object."""
    tpl = compile_template(source)
    try:
        out = render_template(tpl, messages=[{"role": "user", "content": "x"}])
    except (InvalidRequest, SecurityError, UndefinedError):
        return
    assert "class" not in out and "None" not in out
