"""Work that runs on the bounded frontend pool: render/tokenize a request, submit it to the
engine (Engine.submit blocks until the engine thread acknowledges), render-only calls.

Nothing here touches sockets or sessions; results go back to the loop, which owns them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flared.engine.errors import Busy, CapacityError, InvalidRequest
from flared.frontend.pipeline import RequestInput, check_template_kwargs, prepare
from flared.frontend.tool_choice import ToolChoiceUnsatisfied, prepare_tools, with_instruction
from flared.llm_engine import EngineError
from flared.requests import SamplingParams
from flared.server.live import LiveRequest
from shm_protocol import messages as m

MAX_REQUEST_ID_CHARS = 256


def error_code(exc: BaseException) -> str:
    if isinstance(exc, InvalidRequest):
        return m.INVALID_REQUEST
    if isinstance(exc, CapacityError):
        return m.CAPACITY
    if isinstance(exc, Busy):
        return m.BUSY
    if isinstance(exc, ToolChoiceUnsatisfied):
        return m.TOOL_CHOICE_UNSATISFIED
    return m.ENGINE_ERROR


def error_text(exc: BaseException) -> str:
    if isinstance(exc, (InvalidRequest, CapacityError, Busy, EngineError, ToolChoiceUnsatisfied)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def check_request_id(rid: str) -> None:
    if not rid or len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable characters")


def sampling_params(wire: m.WireSampling | None) -> SamplingParams:
    if wire is None:
        return SamplingParams()
    return SamplingParams(**msgspec.structs.asdict(wire))


def request_input(msg: m.Submit, prompt: list[int]) -> RequestInput:
    return RequestInput(
        prompt_token_ids=prompt, prompt_text=msg.prompt_text, messages=msg.messages,
        tools=msg.tools, tool_choice=msg.tool_choice, response_format=msg.response_format,
        stop=msg.stop, chat_template_kwargs=msg.chat_template_kwargs,
        add_generation_prompt=msg.add_generation_prompt,
        continue_final_message=msg.continue_final_message, detokenize=msg.detokenize,
        message_ends=msg.message_ends,
    )  # fmt: skip


def admit(engine: Any, frontend: Any, sink: Any, live: LiveRequest, msg: m.Submit,
          prompt: list[int]) -> bool:  # fmt: skip
    """Render / tokenize, build the output pipeline and grammar, and submit. False: skipped
    because the client is already gone. Raises the engine's typed rejections."""
    if live.orphaned:
        return False
    given = sum(map(bool, (prompt, msg.messages, msg.prompt_text)))
    if given > 1:
        raise InvalidRequest("send exactly one of prompt_token_ids, prompt_text and messages")
    prepared = prepare(frontend, request_input(msg, prompt))
    prompt = prepared.token_ids
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    live.prompt_tokens = len(prompt)
    live.output = prepared.output
    engine.submit(
        prompt,
        sink,
        request_id=live.request_id,
        max_tokens=msg.max_tokens,
        sampling=sampling_params(msg.sampling),
        logprobs=msg.logprobs,
        stop_token_ids=tuple(msg.stop_token_ids),
        min_tokens=msg.min_tokens,
        ignore_eos=msg.ignore_eos,
        # exact message-end offsets: the scheduler clips prefill chunks there (checkpoints)
        endpoints=prepared.endpoints,
        grammar=prepared.grammar,
    )
    return True


def render_call(frontend: Any, msg: m.Render) -> m.RenderResult:
    if frontend is None:
        raise InvalidRequest("this daemon has no text frontend")
    check_template_kwargs(msg.chat_template_kwargs)
    tools, instruction = prepare_tools(msg.tools, msg.tool_choice)
    r = frontend.render(
        with_instruction(msg.messages, instruction), tools, msg.add_generation_prompt,
        continue_final_message=msg.continue_final_message, **msg.chat_template_kwargs,
    )  # fmt: skip
    return m.RenderResult(msg.call_id, r.token_ids, r.message_end_token_offsets, r.text)
