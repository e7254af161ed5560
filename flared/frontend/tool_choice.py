"""tool_choice as pure functions: what the template sees, and whether the output satisfies it.

"auto"      tools as given; no validation.
"none"      tools removed from the template (and so from parsing: pass the returned tools to
            OutputParser.for_request).
"required"  tools as given plus REQUIRED_INSTRUCTION for the prompt; the response FAILS with
            ToolChoiceUnsatisfied unless it holds a complete call to a declared tool.
{"type": "function", "function": {"name": N}}
            tools filtered to N, no instruction, no decoding constraint; the response must
            call N and must not call another tool; presentation omits answer text
            (`present`), keeping reasoning and tool arguments.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flared.engine.errors import InvalidRequest
from flared.frontend.deltas import ParsedOutput

REQUIRED_INSTRUCTION = (
    "You must respond by calling one or more of the provided tools; do not answer directly."
)
ToolChoice = str | dict[str, Any]


class ToolChoiceUnsatisfied(Exception):
    """The model's output does not meet the request's tool_choice; the response fails."""


def _name(tool: dict[str, Any]) -> str | None:
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else None


def named_choice(tool_choice: ToolChoice) -> str | None:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequest('tool_choice object must be {"type": "function", "function": '
                                 '{"name": ...}}')  # fmt: skip
        return name
    if tool_choice not in ("auto", "none", "required"):
        raise InvalidRequest(f"tool_choice must be auto, none, required or a function, got "
                             f"{tool_choice!r}")  # fmt: skip
    return None


def prepare_tools(
    tools: list[dict[str, Any]] | None, tool_choice: ToolChoice = "auto"
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(tools for the template, extra instruction or None). Raises InvalidRequest."""
    name = named_choice(tool_choice)
    tools = list(tools or [])
    if tool_choice == "none":
        return None, None
    if (tool_choice == "required" or name is not None) and not tools:
        raise InvalidRequest(f"tool_choice={tool_choice!r} needs at least one tool")
    if name is not None:
        chosen = [t for t in tools if _name(t) == name]
        if not chosen:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools")
        return chosen, None
    return (tools or None), (REQUIRED_INSTRUCTION if tool_choice == "required" else None)


def with_instruction(
    messages: list[dict[str, Any]], instruction: str | None
) -> list[dict[str, Any]]:
    """Messages with the instruction appended to the leading system message (or as a new one)."""
    if not instruction:
        return messages
    if (
        messages
        and messages[0].get("role") == "system"
        and isinstance(messages[0].get("content"), str)
    ):
        first = {**messages[0], "content": messages[0]["content"] + "\n\n" + instruction}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def validate_tool_choice(
    parsed: ParsedOutput, tool_choice: ToolChoice, tools: list[dict[str, Any]] | None
) -> ToolChoiceUnsatisfied | None:
    """None when the output satisfies tool_choice, else the error to fail the response with."""
    name = named_choice(tool_choice)
    if tool_choice in ("auto", "none"):
        return None
    declared = {n for n in (_name(t) for t in tools or []) if n is not None}
    called = [c["function"]["name"] for c in parsed.tool_calls]
    if name is not None:
        others = sorted({c for c in called if c != name})
        if others:
            return ToolChoiceUnsatisfied(
                f"tool_choice requires {name!r}; the model called {others}"
            )
        if name not in called:
            return ToolChoiceUnsatisfied(f"tool_choice requires a call to {name!r}; none was made"
                                         + _why(parsed))  # fmt: skip
        return None
    if not any(c in declared for c in called):
        return ToolChoiceUnsatisfied("tool_choice=required: no complete call to a declared tool"
                                     + _why(parsed))  # fmt: skip
    return None


def _why(parsed: ParsedOutput) -> str:
    return f" ({'; '.join(parsed.errors)})" if parsed.errors else ""


def present(parsed: ParsedOutput, tool_choice: ToolChoice) -> ParsedOutput:
    """What the client sees: a named tool_choice omits ordinary answer text."""
    if named_choice(tool_choice) is not None:
        return replace(parsed, content="")
    return parsed
