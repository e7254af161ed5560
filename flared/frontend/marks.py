"""Chat-template renders that also report where each message's loop iteration starts.

The template is compiled a second time with one extra statement at the start of every
top-level `{% for x in name %}` loop body (plain name iterated, plain name bound, not recursive):
the expression statement `x | __flare_mark` (what `{% do %}` compiles to). It outputs nothing,
so the text is byte-identical to the plain render, and it runs while the render generator is
being consumed, so it reads the exact number of characters emitted before that iteration. It is
a filter because compiled code calls filters directly; a call would pass the sandbox's checks
once per message and tool of every window render. Items are matched to messages by identity;
marks for other objects (a loop over tools) are ignored.

`MarkedRender.starts[j]` is the char offset where message j's iteration begins. It is None when
the marks cannot be trusted: a message marked twice (two loops over the messages, or the same
object twice in the list), marks that go backwards, or marked messages that are not one
contiguous run ending at the last message. Callers then fall back to plain prefix renders.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate, pairwise
from typing import Any

MARK = "__flare_mark"


@dataclass(frozen=True)
class MarkedRender:
    text: str
    starts: dict[int, int] | None  # message index -> char offset of its iteration's start
    first_marked: int  # index of the first marked message (earlier ones: the template's head)


def _instrument(body: list[Any], nodes: Any) -> int:
    """Prepend a mark to each top-level loop over a plain name; returns how many were marked."""
    count = 0
    for node in body:
        if isinstance(node, nodes.For):
            if (
                isinstance(node.iter, nodes.Name)
                and isinstance(node.target, nodes.Name)
                and not node.recursive
            ):
                item = nodes.Name(node.target.name, "load")
                mark = nodes.Filter(item, MARK, [], [], None, None)
                node.body.insert(0, nodes.ExprStmt(mark).set_lineno(node.lineno))
                count += 1
        elif isinstance(node, nodes.If):
            count += _instrument(node.body, nodes) + _instrument(node.else_, nodes)
            for branch in node.elif_:
                count += _instrument(branch.body, nodes) + _instrument(branch.else_, nodes)
        elif isinstance(node, (nodes.With, nodes.Scope)):
            count += _instrument(node.body, nodes)
    return count


@lru_cache(maxsize=16)
def compile_marked(source: str) -> Any | None:
    """The marked template for `source`, or None when it has no loop to mark."""
    from jinja2 import nodes, pass_context

    from flared.frontend.jinja_env import compile_template

    env = compile_template(source).environment
    # the environment is this source's own (compile_template); the filter calls the render's
    # consumer, passed in the context (render_marked)
    env.filters[MARK] = pass_context(lambda context, item: context.parent[MARK](item))
    ast = env.parse(source)
    if not _instrument(ast.body, nodes):
        return None
    ast.set_environment(env)
    # globals as a plain dict, not jinja's ChainMap over env.globals (final by now): every
    # render copies them into its context, and a window render is small enough to notice
    glob = dict(env.make_globals(None))
    return env.template_class.from_code(env, env.compile(ast), glob, None)


class _Consumer:
    """The pieces a render yields, and how many came before each marked item."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.marks: list[tuple[int, int]] = []  # (id of the item, pieces yielded before it)

    def mark(self, item: Any) -> None:
        self.marks.append((id(item), len(self.parts)))


def render_marked(template: Any, messages: list[Any], **context: Any) -> MarkedRender:
    """Render like `template.render` (exceptions included), with the message starts."""
    consumer = _Consumer()
    ctx = template.new_context({**context, "messages": messages, MARK: consumer.mark})
    parts = consumer.parts
    append = parts.append
    try:
        for piece in template.root_render_func(ctx):
            append(piece)
    except Exception:
        template.environment.handle_exception()
    text = "".join(parts)
    index = {id(m): j for j, m in enumerate(messages)}
    if len(index) != len(messages):  # one object twice: identity cannot tell them apart
        return MarkedRender(text, None, len(messages))
    chars = list(accumulate(map(len, parts), initial=0))  # chars[n]: of the first n pieces
    starts: dict[int, int] = {}
    last = -1
    for ident, n in consumer.marks:
        j = index.get(ident)
        if j is None:
            continue
        pos = chars[n]
        if j in starts or pos < last:
            return MarkedRender(text, None, len(messages))
        starts[j] = last = pos
    first = min(starts, default=len(messages))
    ordered = [starts.get(j, -1) for j in range(first, len(messages))]
    if -1 in ordered or any(a > b for a, b in pairwise(ordered)):
        return MarkedRender(text, None, len(messages))
    return MarkedRender(text, starts, first)
