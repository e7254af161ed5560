"""One request's way through the frontend: prompt preparation (admission) and output
processing (detokenize -> stop strings -> reasoning -> tool calls), off the engine thread.

`prepare()` runs on the daemon's frontend pool: it renders messages (tool_choice applied: "none"
removes the tools, "required" adds the instruction, a named function filters them), tokenizes
a text prompt, compiles the response_format grammar, and builds the request's OutputPipeline.

OutputPipeline invariants (it runs on the request's single detokenizer lane, in event order):
  - `text` pieces concatenate to the detokenized output cut before the first stop string that
    completes; once a stop string matched, nothing more is released (push returns None) and
    the caller finishes the request in the engine. The model's token history is untouched.
  - parsed pieces (content, reasoning, tool-call parts) are the OutputParser's deltas of that
    same text, so streaming equals the final parsed message. A named tool_choice presents no
    answer text (tool_choice.present).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flared.engine.errors import InvalidRequest
from flared.frontend.deltas import ContentDelta, Delta, ReasoningDelta, ToolCallDelta
from flared.frontend.detok import IncrementalDetokenizer, StopMatcher
from flared.frontend.output import OutputParser
from flared.frontend.reasoning import CLOSE as THINK_CLOSE
from flared.frontend.reasoning import OPEN as THINK_OPEN
from flared.frontend.reasoning import reasoning_started_in_prompt
from flared.frontend.tool_choice import (
    ToolChoice,
    ToolChoiceUnsatisfied,
    named_choice,
    prepare_tools,
    validate_tool_choice,
    with_instruction,
)
from flared.frontend.tool_parsers import CALL_CLOSE, CALL_OPEN
from prep.bundle import ReasoningParser, ToolParser

MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
# Special tokens the output parsers read; they stay in the detokenized text of parsed requests.
PARSER_TAGS = (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE)


@dataclass(frozen=True)
class RequestInput:
    """What a client asked for, in plain types (the daemon maps its wire message to this)."""

    prompt_token_ids: Sequence[int] = ()
    prompt_text: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    response_format: dict[str, Any] | None = None
    stop: Sequence[str] = ()
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    detokenize: bool = True
    message_ends: Sequence[int] = ()  # token-id and text prompts (messages: the template's)


@dataclass
class Prepared:
    token_ids: list[int]
    endpoints: tuple[int, ...] = ()
    output: OutputPipeline | None = None
    grammar: Any = None  # flared.frontend.grammar.RequestGrammar, None = unconstrained


@dataclass(frozen=True)
class Piece:
    """What one engine step's tokens release."""

    text: str = ""
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    newly_stopped: bool = False  # a stop string completed in this piece: finish the request


@dataclass(frozen=True)
class Tail:
    """The flushed end of the output, and what the whole output amounted to."""

    text: str = ""
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    stop_string: str | None = None
    tool_errors: tuple[str, ...] = ()
    has_reasoning: bool = False
    num_tool_calls: int = 0
    num_tokens: int = 0  # tokens up to and including the one that completed a stop string
    error: ToolChoiceUnsatisfied | None = None  # the response fails with this


def check_stops(stop: Sequence[str]) -> list[str]:
    stops = [s for s in stop if s]
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop strings must be strings of at most {MAX_STOP_CHARS} chars")
    return stops


class OutputPipeline:
    def __init__(
        self,
        detok: IncrementalDetokenizer,
        stops: Sequence[str] = (),
        parser: OutputParser | None = None,
        tool_choice: ToolChoice = "auto",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self._detok = detok
        self._stop = StopMatcher(stops) if stops else None
        self._parser = parser
        self._tool_choice = tool_choice
        self._tools = tools
        self._hide_content = named_choice(tool_choice) is not None
        self.stopped = False
        self.num_tokens = 0

    @property
    def parsed(self) -> bool:
        return self._parser is not None

    def _piece(self, text: str, final: bool, stopped: bool = False) -> Piece:
        if self._parser is None:
            return Piece(text, newly_stopped=stopped)
        deltas: list[Delta] = self._parser.push(text) if text else []
        if final:
            deltas += self._parser.flush()
        content, reasoning, calls = [], [], []
        for d in deltas:
            if isinstance(d, ContentDelta):
                if not self._hide_content:
                    content.append(d.text)
            elif isinstance(d, ReasoningDelta):
                reasoning.append(d.text)
            else:
                calls.append(d)
        return Piece(text, "".join(content), "".join(reasoning), tuple(calls), stopped)

    def push(self, token_ids: Sequence[int]) -> Piece | None:
        """None: the output already ended at a stop string; drop these tokens."""
        if self.stopped:
            return None
        self.num_tokens += len(token_ids)
        text = self._detok.push(token_ids)
        if self._stop is None:
            return self._piece(text, final=False)
        r = self._stop.push(text)
        if r.stopped:
            self.stopped = True
            # the stop ends the output: flush the parsers now (nothing else will arrive)
            return self._piece(r.text, final=True, stopped=True)
        return self._piece(r.text, final=False)

    def finish(self, reason: str) -> Tail:
        """End of output. `reason`: the engine's finish reason ("stop", "length", ...)."""
        text = ""
        if not self.stopped:
            text = self._detok.flush()
            if self._stop is not None:
                r = self._stop.push(text)
                text = r.text if r.stopped else r.text + self._stop.flush()
                self.stopped = r.stopped
            piece = self._piece(text, final=True)
        else:
            piece = Piece()
        matched = self._stop.matched if self._stop is not None else None
        if self._parser is None:
            return Tail(piece.text, stop_string=matched, num_tokens=self.num_tokens)
        parsed = self._parser.finish()
        error = None
        if reason != "cancelled":
            error = validate_tool_choice(parsed, self._tool_choice, self._tools)
        return Tail(
            piece.text, piece.content, piece.reasoning, piece.tool_calls, matched,
            tuple(parsed.errors), parsed.reasoning is not None, len(parsed.tool_calls),
            self.num_tokens, error,
        )  # fmt: skip


# what the renderer itself passes to chat templates: never settable through chat_template_kwargs
# (flare-http rejects them too, from its own copy of this list)
TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt",
                      "continue_final_message")  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any]) -> None:
    """InvalidRequest when a request's chat_template_kwargs would set a renderer argument."""
    taken = sorted(k for k in kwargs if k in TEMPLATE_ARGUMENTS)
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs may not set {', '.join(taken)}: the request's own fields do"
        )


def prepare(frontend: Any, req: RequestInput) -> Prepared:
    """Prompt ids, message endpoints, output pipeline and grammar of one request.
    `frontend` is a flared.frontend.text.TextFrontend (or None: token ids only)."""
    stops = check_stops(req.stop)
    ends = tuple(req.message_ends)
    if req.messages:
        if ends:
            raise InvalidRequest(
                "message_ends is for prompt_token_ids and prompt_text: a messages request's "
                "endpoints come from the chat template"
            )
        return _prepare_chat(frontend, req, stops)
    if req.tools or req.tool_choice != "auto" or req.chat_template_kwargs:
        raise InvalidRequest("tools, tool_choice and chat_template_kwargs need messages")
    if req.prompt_text:
        if frontend is None:
            raise InvalidRequest("this daemon has no text frontend; send prompt_token_ids")
        ids = frontend.encode_prompt(req.prompt_text)
    else:
        # as given: the engine checks every id (integer, in the vocabulary) in one packing at
        # submit, where a Python pass here cost ~0.3 ms per 5,000 tokens before the first token
        ids = list(req.prompt_token_ids)
    if frontend is None:
        if stops or req.response_format:
            raise InvalidRequest("stop strings and response_format need the text frontend")
        return Prepared(ids, ends)
    output = None
    if req.detokenize:
        output = OutputPipeline(frontend.detokenizer(), stops)
    elif stops:
        raise InvalidRequest("stop strings need detokenize")
    return Prepared(ids, ends, output, _grammar(frontend, req.response_format))


def _prepare_chat(frontend: Any, req: RequestInput, stops: list[str]) -> Prepared:
    if frontend is None:
        raise InvalidRequest("this daemon has no text frontend; send prompt_token_ids")
    check_template_kwargs(req.chat_template_kwargs)
    tools, instruction = prepare_tools(req.tools, req.tool_choice)
    messages = with_instruction(req.messages, instruction)
    rendered = frontend.render(
        messages, tools, req.add_generation_prompt,
        continue_final_message=req.continue_final_message, **req.chat_template_kwargs,
    )  # fmt: skip
    rp: ReasoningParser = frontend.reasoning_parser
    tp: ToolParser = frontend.tool_parser
    prompt_text: str = rendered.text
    parser = OutputParser.for_request(rp, tp, prompt_text, tools)
    keep = PARSER_TAGS if (rp is not ReasoningParser.NONE or tp is not ToolParser.NONE) else ()
    detok = frontend.output_detokenizer(keep)
    output = OutputPipeline(detok, stops, parser, req.tool_choice, tools)
    grammar = None
    if req.response_format:
        thinking = rp is ReasoningParser.THINK_TAGS
        tail = prompt_text.rstrip()
        grammar = _grammar(
            frontend, req.response_format,
            reasoning_open=thinking and reasoning_started_in_prompt(prompt_text),
            allow_reasoning=thinking and not tail.endswith(THINK_CLOSE),
            allow_tool_calls=bool(tools) and tp is not ToolParser.NONE,
        )  # fmt: skip
    endpoints = tuple(rendered.message_end_token_offsets)
    return Prepared(list(rendered.token_ids), endpoints, output, grammar)


def _grammar(frontend: Any, response_format: dict[str, Any] | None, **composition: bool) -> Any:
    from flared.frontend.grammar import spec_from_response_format

    if response_format is not None and not isinstance(response_format, dict):
        raise InvalidRequest("response_format must be an object")
    spec = spec_from_response_format(response_format)
    if spec is None:
        return None
    return frontend.grammar_compiler().matcher(spec, **composition)
