"""The daemon's output pipeline on real token ids of the tiny tokenizer: detokenize -> stop
strings -> reasoning -> tool calls, streaming equal to the final message; tool_choice checks;
segment tokenization equal to whole-text tokenization; holdback against its definition."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from corpus import conversation
from frontend_support import frontend_for
from hypothesis import given, settings
from hypothesis import strategies as st

from flared.engine.errors import InvalidRequest
from flared.frontend import segments
from flared.frontend.deltas import holdback
from flared.frontend.pipeline import OutputPipeline, RequestInput, prepare
from flared.frontend.segments import SegmentEncoder
from flared.frontend.text import _Cuts
from prep.bundle import ReasoningParser, ToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
OUTPUT = ("<think>\nweather 你好 🙂\n</think>\n\nLet me check. "
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          "<|im_end|>")  # fmt: skip


def _fe(tdirs: dict[str, Path]) -> Any:
    fe = frontend_for(tdirs["qwen3"])
    fe.reasoning_parser, fe.tool_parser = ReasoningParser.THINK_TAGS, ToolParser.HERMES_JSON
    return fe


def _run(pipe: OutputPipeline, ids: list[int], chunk: int) -> tuple[list[Any], Any]:
    pieces = []
    for i in range(0, len(ids), chunk):
        p = pipe.push(ids[i : i + chunk])
        if p is not None:
            pieces.append(p)
    return pieces, pipe.finish("stop")


def _chat(fe: Any, **kw: Any) -> OutputPipeline:
    req = RequestInput(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, **kw)
    out = prepare(fe, req).output
    assert out is not None
    return out


@pytest.mark.parametrize("chunk", [1, 2, 5, 100])
def test_chat_output_is_parsed_and_streaming_equals_final(tdirs: dict[str, Path],
                                                          chunk: int) -> None:  # fmt: skip
    fe = _fe(tdirs)
    ids = fe.encode(OUTPUT)
    pieces, tail = _run(_chat(fe), ids, chunk)
    text = "".join(p.text for p in pieces) + tail.text
    assert text == OUTPUT.removesuffix("<|im_end|>")  # EOS never reaches the client
    assert "".join(p.reasoning for p in pieces) + tail.reasoning == "weather 你好 🙂"
    assert "".join(p.content for p in pieces) + tail.content == "Let me check."
    calls = [c for p in pieces for c in p.tool_calls] + list(tail.tool_calls)
    assert calls[0].name == "get_weather" and calls[0].id and calls[0].index == 0
    assert json.loads("".join(c.arguments for c in calls)) == {"city": "Paris"}
    assert tail.num_tool_calls == 1 and tail.error is None and tail.tool_errors == ()


def test_stop_string_cuts_the_text_and_ends_parsing(tdirs: dict[str, Path]) -> None:
    fe = _fe(tdirs)
    ids = fe.encode(OUTPUT)
    pipe = _chat(fe, stop=["check"])
    pieces, tail = _run(pipe, ids, 1)
    assert "".join(p.text for p in pieces) + tail.text == OUTPUT[: OUTPUT.index("check")]
    assert sum(p.newly_stopped for p in pieces) == 1
    assert tail.stop_string == "check" and tail.num_tool_calls == 0
    assert "".join(p.content for p in pieces) == "Let me "
    assert pipe.num_tokens < len(ids)  # later tokens were dropped
    assert pipe.push([1]) is None


def test_tool_choice_named_hides_content_and_required_fails(tdirs: dict[str, Path]) -> None:
    fe = _fe(tdirs)
    named = {"type": "function", "function": {"name": "get_weather"}}
    pieces, tail = _run(_chat(fe, tool_choice=named), fe.encode(OUTPUT), 3)
    assert all(p.content == "" for p in pieces) and tail.error is None
    no_call = fe.encode("<think>\nx\n</think>\n\njust text<|im_end|>")
    _p, tail = _run(_chat(fe, tool_choice="required"), no_call, 3)
    assert tail.error is not None and "required" in str(tail.error)
    bad = fe.encode("<tool_call>\n{not json}\n</tool_call>")
    pieces, tail = _run(_chat(fe), bad, 2)
    assert tail.tool_errors and "<tool_call>" in "".join(p.content for p in pieces) + tail.content


def test_tool_choice_none_removes_the_tools_from_the_prompt(tdirs: dict[str, Path]) -> None:
    fe = _fe(tdirs)
    msgs = [{"role": "user", "content": "hi"}]
    with_tools = prepare(fe, RequestInput(messages=msgs, tools=TOOLS)).token_ids
    none = prepare(fe, RequestInput(messages=msgs, tools=TOOLS, tool_choice="none")).token_ids
    assert none == fe.render(msgs).token_ids != with_tools


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt",
                                 "continue_final_message", "documents"])  # fmt: skip
def test_chat_template_kwargs_cannot_set_renderer_arguments(
    tdirs: dict[str, Path], key: str
) -> None:
    """The daemon refuses them itself (a typed error, not a TypeError from the render call);
    other keys reach the template."""
    fe = _fe(tdirs)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequest, match=f"may not set {key}"):
        prepare(fe, RequestInput(messages=msgs, chat_template_kwargs={key: True}))
    ok = prepare(fe, RequestInput(messages=msgs, chat_template_kwargs={"enable_thinking": False}))
    assert ok.token_ids


NAMES = ("qwen3", "qwen3_coder", "qwen35", "llama3")


def test_segment_encoding_equals_whole_encoding(tdirs: dict[str, Path]) -> None:
    for name in NAMES:
        fe = frontend_for(tdirs[name])
        seg = SegmentEncoder.build(fe.tokenizer)
        assert seg is not None
        rng = random.Random(0)
        for seed in range(20):
            case = conversation(seed, name)
            text = fe.render_text(case["messages"], case["tools"])
            whole = fe.tokenizer.encode(text, add_special_tokens=False)
            enc = seg.encode(text)
            assert enc.ids == list(whole.ids)
            cuts = _Cuts(whole.offsets)
            for mark in [rng.randrange(len(text) + 1) for _ in range(30)] + [0, len(text)]:
                assert enc.exact_cut(mark) == cuts.exact(mark), (name, mark)


def test_background_segment_encoding_equals_whole_encoding(
    tdirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long new text is encoded on a helper thread (the caller renders meanwhile): same ids
    and cuts as encoding the whole text; a tokenizer failure there reaches the caller."""
    started: list[int] = []

    class Counted(segments._Background):
        def __init__(self, *args: Any) -> None:
            started.append(1)
            super().__init__(*args)

    monkeypatch.setattr(segments, "_Background", Counted)
    fe = frontend_for(tdirs["qwen3"])
    seg = SegmentEncoder.build(fe.tokenizer)
    assert seg is not None
    texts = [fe.render_text(conversation(s, "qwen3")["messages"]) for s in range(200)]
    text = "".join(texts)
    assert len(text) > 2 * segments.MIN_BACKGROUND_CHARS
    pending = seg.begin(text)
    assert started  # the helper thread ran
    enc = pending()
    whole = fe.tokenizer.encode(text, add_special_tokens=False)
    assert enc.ids == list(whole.ids)
    cuts = _Cuts(whole.offsets)
    rng = random.Random(1)
    for mark in [rng.randrange(len(text) + 1) for _ in range(200)]:
        assert enc.exact_cut(mark) == cuts.exact(mark), mark
    assert seg.begin(text)().ids == enc.ids and len(started) == 1  # cached now: no thread

    class Broken:
        def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> Any:
            raise RuntimeError("tokenizer failed")

    broken = SegmentEncoder(Broken(), {"<|im_end|>": 2})
    pending = broken.begin("x" * segments.MIN_BACKGROUND_CHARS + "<|im_end|>")
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        pending()


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_cached_render_equals_uncached(
    name: str, background: bool, tdirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caches (prefix renders, segment encodings) change no result: the same conversations and
    their next turns rendered by one long-lived frontend equal fresh whole-text renders."""
    shared = frontend_for(tdirs[name])
    if background:  # every new segment on the helper thread, as for a long new conversation
        monkeypatch.setattr(segments, "MIN_BACKGROUND_CHARS", 0)
    for seed in range(0, 30, 2):
        case = conversation(seed, name)
        opts = {"add_generation_prompt": False, **case["opts"]}
        gen = opts.pop("add_generation_prompt")
        for msgs in (case["messages"][:-1], case["messages"]):
            if not msgs:
                continue
            fresh = frontend_for(tdirs[name])
            fresh._segments = None  # whole-text tokenization, nothing cached
            try:
                want = fresh.render(msgs, case["tools"], gen, **opts)
            except InvalidRequest:
                continue
            assert shared.render(msgs, case["tools"], gen, **opts) == want, seed
            assert shared.render(msgs, case["tools"], gen, **opts) == want, seed


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="<abt/>", max_size=12), st.lists(st.text(alphabet="<abt/>",
       min_size=1, max_size=5), min_size=1, max_size=3))  # fmt: skip
def test_holdback_is_the_longest_proper_prefix_suffix(buf: str, tags: list[str]) -> None:
    want = 0
    for k in range(len(buf), 0, -1):
        if any(t.startswith(buf[-k:]) and k < len(t) for t in tags):
            want = k
            break
    assert holdback(buf, tuple(tags)) == want
