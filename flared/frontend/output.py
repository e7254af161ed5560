"""OutputParser: detokenized text -> content, reasoning and OpenAI-shaped tool-call deltas.

Composition: reasoning splitter first (by the bundle's ReasoningParser), then the tool-call
extractor (by its ToolParser) on the answer only; tool calls inside reasoning stay reasoning.
Invariant: for any chunking of the same text, the concatenated deltas of push() and flush()
are identical, and finish() is exactly their accumulation (streaming == non-streaming).
"""

from __future__ import annotations

import secrets
from typing import Any

from flared.frontend.deltas import ContentDelta, Delta, ParsedOutput, ReasoningDelta
from flared.frontend.reasoning import REASONING_SPLITTERS, reasoning_started_in_prompt
from flared.frontend.tool_parsers import TOOL_BODY_PARSERS, ToolCallExtractor
from prep.bundle import ReasoningParser, ToolParser


class OutputParser:
    def __init__(
        self,
        reasoning: ReasoningParser = ReasoningParser.NONE,
        tool: ToolParser = ToolParser.NONE,
        tools: list[dict[str, Any]] | None = None,
        *,
        reasoning_started: bool = False,
        id_prefix: str | None = None,
    ) -> None:
        self._splitter = REASONING_SPLITTERS[reasoning](reasoning_started)
        make_body = TOOL_BODY_PARSERS[tool]
        prefix = id_prefix if id_prefix is not None else secrets.token_hex(6)
        self._tools = (
            ToolCallExtractor(make_body(tools), prefix) if make_body is not None and tools else None
        )
        self._result = ParsedOutput()
        self._finished = False

    @staticmethod
    def for_request(
        reasoning: ReasoningParser,
        tool: ToolParser,
        prompt_text: str,
        tools: list[dict[str, Any]] | None,
        *,
        id_prefix: str | None = None,
    ) -> OutputParser:
        """The parser for one request: tools are the ones the template saw (prepare_tools), so
        tool_choice="none" parses no calls; an open `<think>` at the prompt's end starts in
        reasoning."""
        started = reasoning is not ReasoningParser.NONE and reasoning_started_in_prompt(prompt_text)
        return OutputParser(reasoning, tool, tools, reasoning_started=started, id_prefix=id_prefix)

    def _route(self, split: tuple[str, str], final: bool) -> list[Delta]:
        reasoning, answer = split
        out: list[Delta] = []
        if reasoning:
            out.append(ReasoningDelta(reasoning))
        if self._tools is None:
            if answer:
                out.append(ContentDelta(answer))
        else:
            out += self._tools.push(answer) if answer else []
            if final:
                out += self._tools.flush()
        for d in out:
            self._result.add(d)
        return out

    def push(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("OutputParser.push after finish")
        return self._route(self._splitter.push(text), final=False) if text else []

    def flush(self) -> list[Delta]:
        """End of output: release everything held back (the last streamed deltas)."""
        if self._finished:
            return []
        self._finished = True
        return self._route(self._splitter.flush(), final=True)

    def finish(self) -> ParsedOutput:
        self.flush()
        if self._tools is not None:
            self._result.errors = list(self._tools.errors)
        return self._result
