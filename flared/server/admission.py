"""Work that runs on the bounded frontend pool: render/tokenize a request, submit it to the
engine (Engine.submit blocks until the engine thread acknowledges), render-only calls.

Nothing here touches sockets or sessions; results go back to the loop, which owns them.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import msgspec

from flared.engine.errors import Busy, CapacityError, InvalidRequest
from flared.frontend.pipeline import Prepared, RequestInput, check_template_kwargs, prepare
from flared.frontend.tool_choice import ToolChoiceUnsatisfied, prepare_tools, with_instruction
from flared.llm_engine import EngineError
from flared.requests import SamplingParams
from flared.server.live import LiveRequest
from shm_protocol import messages as m
from shm_protocol.redact import redact

log = logging.getLogger("flared.server")

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


_refs = itertools.count(1)


def error_text(exc: BaseException) -> str:
    """A typed rejection's own message; anything else is a bug or an environment failure, and
    the client gets its kind and a reference into the daemon's log, not its details."""
    if isinstance(exc, (InvalidRequest, CapacityError, Busy, ToolChoiceUnsatisfied)):
        return str(exc)  # about the request itself (it may quote the client's own input)
    if isinstance(exc, EngineError):
        return redact(str(exc))
    ref = f"E{os.getpid()}-{next(_refs)}"
    log.error("internal error [%s]", ref, exc_info=exc)
    return f"internal error ({type(exc).__name__}); the daemon's log has it under [{ref}]"


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


def _prepared(frontend: Any, live: LiveRequest, msg: m.Submit, prompt: list[int]) -> Prepared:
    given = sum(map(bool, (prompt, msg.messages, msg.prompt_text)))
    if given > 1:
        raise InvalidRequest("send exactly one of prompt_token_ids, prompt_text and messages")
    prepared = prepare(frontend, request_input(msg, prompt))
    if not prepared.token_ids:
        raise InvalidRequest("the prompt is empty")
    live.prompt_tokens = len(prepared.token_ids)
    live.output = prepared.output
    return prepared


def _engine_kwargs(live: LiveRequest, msg: m.Submit, prepared: Prepared) -> dict[str, Any]:
    return {
        "request_id": live.engine_id,
        "max_tokens": msg.max_tokens,
        "sampling": sampling_params(msg.sampling),
        "logprobs": msg.logprobs,
        "stop_token_ids": tuple(msg.stop_token_ids),
        "min_tokens": msg.min_tokens,
        "ignore_eos": msg.ignore_eos,
        # exact message-end offsets: the scheduler clips prefill chunks there (checkpoints)
        "endpoints": prepared.endpoints,
        "grammar": prepared.grammar,
    }


def admit(engine: Any, frontend: Any, sink: Any, live: LiveRequest, msg: m.Submit,
          prompt: list[int]) -> bool:  # fmt: skip
    """Render / tokenize, build the output pipeline and grammar, and submit. False: skipped
    because the client is already gone. Raises the engine's typed rejections."""
    if live.orphaned or live.terminated:
        return False
    prepared = _prepared(frontend, live, msg, prompt)
    engine.submit(prepared.token_ids, sink, **_engine_kwargs(live, msg, prepared))
    return True


# Token ids in, token ids out: no text to render or detokenize and no grammar to compile, so
# the loop submits it itself instead of handing it to the frontend pool (a thread hand-off
# before the engine sees the request). Bounded so that the loop's O(prompt) work (a copy, one
# packing of the ids) stays well under a millisecond.
DIRECT_MAX_PROMPT_TOKENS = 32768


def is_direct(msg: m.Submit, prompt: list[int]) -> bool:
    """Whether `admit_direct` may take `msg` on the event loop."""
    return (
        not msg.messages
        and not msg.prompt_text
        and not msg.detokenize
        and msg.response_format is None
        and len(prompt) <= DIRECT_MAX_PROMPT_TOKENS
    )


def admit_direct(engine: Any, frontend: Any, sink: Any, live: LiveRequest, msg: m.Submit,
                 prompt: list[int], accepted: Any) -> None:  # fmt: skip
    """`admit` for an `is_direct` request without blocking: what is wrong with it raises here,
    the engine's verdict goes to `accepted` (engine thread; see Engine.submit_nowait)."""
    prepared = _prepared(frontend, live, msg, prompt)
    engine.submit_nowait(prepared.token_ids, sink, accepted, **_engine_kwargs(live, msg, prepared))


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
