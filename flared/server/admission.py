"""Work that runs on the bounded frontend pool: render/tokenize a request, submit it to the
engine (Engine.submit blocks until the engine thread acknowledges), render-only calls.

Nothing here touches sockets or sessions; results go back to the loop, which owns them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from flared.engine.errors import Busy, CapacityError, InvalidRequest
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
    return m.ENGINE_ERROR


def error_text(exc: BaseException) -> str:
    if isinstance(exc, (InvalidRequest, CapacityError, Busy, EngineError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def check_request_id(rid: str) -> None:
    if not rid or len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
        raise InvalidRequest(f"request_id must be 1..{MAX_REQUEST_ID_CHARS} printable characters")


def sampling_params(wire: m.WireSampling | None) -> SamplingParams:
    if wire is None:
        return SamplingParams()
    return SamplingParams(**msgspec.structs.asdict(wire))


def admit(engine: Any, frontend: Any, sink: Any, live: LiveRequest, msg: m.Submit,
          prompt: list[int]) -> bool:  # fmt: skip
    """Render (for messages) and submit. False: skipped because the client is already gone.
    Raises the engine's typed rejections."""
    if live.orphaned:
        return False
    endpoints: tuple[int, ...] = ()
    if msg.messages:
        if frontend is None:
            raise InvalidRequest("this daemon has no text frontend; send prompt_token_ids")
        rendered = frontend.render(msg.messages, msg.tools or None)
        prompt = rendered.token_ids
        # exact message-end offsets: the scheduler clips prefill chunks there (checkpoints)
        endpoints = tuple(rendered.message_end_token_offsets)
    elif msg.tools:
        raise InvalidRequest("tools need messages (they are rendered into the chat template)")
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    live.prompt_tokens = len(prompt)
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
        endpoints=endpoints,
    )
    return True


def render_call(frontend: Any, msg: m.Render) -> m.RenderResult:
    if frontend is None:
        raise InvalidRequest("this daemon has no text frontend")
    r = frontend.render(msg.messages, msg.tools or None, msg.add_generation_prompt)
    return m.RenderResult(msg.call_id, r.token_ids, r.message_end_token_offsets, r.text)
