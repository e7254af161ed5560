"""The template environment's fast attribute lookups return exactly what the immutable sandbox
returns, and the sandbox still refuses what it refuses."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.sandbox import ImmutableSandboxedEnvironment

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


def _describe(env, value):
    if isinstance(value, env.undefined):
        return ("undefined", type(value).__name__)
    if callable(value):
        return ("callable", getattr(value, "__name__", None), getattr(value, "__self__", None))
    return ("value", value)


@pytest.mark.parametrize(("obj", "attr"), CASES)
def test_fast_lookups_equal_the_sandbox(obj, attr):
    fast = compile_template("{{ 1 }}").environment
    base = ImmutableSandboxedEnvironment()
    assert type(fast) is not ImmutableSandboxedEnvironment  # the fast path is what runs
    assert _describe(fast, fast.getattr(obj, attr)) == _describe(base, base.getattr(obj, attr))


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
