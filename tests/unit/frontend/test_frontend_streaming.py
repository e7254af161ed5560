"""Detokenizer round trips, stop strings, output parsers (streaming == non-streaming)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from flared.frontend.detok import IncrementalDetokenizer, StopMatcher
from flared.frontend.output import OutputParser
from flared.frontend.tool_choice import prepare_tools, present, validate_tool_choice
from prep.bundle import ReasoningParser as R
from prep.bundle import ToolParser as T
from prep.tiny import build_tokenizer

TOK = build_tokenizer()
V = TOK.get_vocab_size()
TEXTS = st.text(alphabet=st.sampled_from(list("ab 你好🙂é\u0301\n{}<>/")), max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, V - 1), max_size=40), st.lists(st.integers(1, 4), min_size=1))
def test_detok_exact_on_random_ids(ids: list[int], steps: list[int]) -> None:
    d = IncrementalDetokenizer(TOK)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = steps[k % len(steps)]
        piece = d.push(ids[i : i + n])
        assert not piece.endswith("\ufffd") or "\ufffd" in TOK.decode(ids, skip_special_tokens=True)
        out.append(piece)
        i, k = i + n, k + 1
    out.append(d.flush())
    assert "".join(out) == TOK.decode(ids, skip_special_tokens=True)


@settings(max_examples=100, deadline=None)
@given(TEXTS)
def test_detok_never_emits_partial_utf8_of_real_text(text: str) -> None:
    ids = TOK.encode(text).ids
    d = IncrementalDetokenizer(TOK)
    pieces = [d.push([t]) for t in ids] + [d.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


@settings(max_examples=200, deadline=None)
@given(TEXTS, st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), max_size=3),
       st.lists(st.integers(1, 5), min_size=1))  # fmt: skip
def test_stop_matcher_equals_offline_truncation(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    m = StopMatcher(stops)
    out, i, k = "", 0, 0
    while i < len(text) and not m.stopped:
        n = cuts[k % len(cuts)]
        out += m.push(text[i : i + n]).text
        i, k = i + n, k + 1
    out += m.flush()
    ends = [(text.find(s) + len(s), -len(s), s) for s in stops if s and s in text]
    if ends:
        end, neg, s = min(ends)
        assert m.matched == s and out == text[: end + neg]
    else:
        assert not m.stopped and out == text


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "ratio": {"type": "number"}}}}}]  # fmt: skip
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York 🗽\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            '<parameter=opts>\n{"a": [1]}\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n'
            "</function>\n</tool_call>")  # fmt: skip
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SAMPLES = {
    T.QWEN_XML: "<think>\nplan 你好\n</think>\n\nChecking.\n" + XML_CALL + "\n" + XML_CALL,
    T.HERMES_JSON: "<think>x</think>\n\nSure "
    + JSON_CALL
    + JSON_CALL
    + "<tool_call>{bad}</tool_call>",
}


def _stream(parser: OutputParser, text: str, cuts: list[int]) -> list[Any]:
    deltas, i, k = [], 0, 0
    while i < len(text):
        n = cuts[k % len(cuts)]
        deltas += parser.push(text[i : i + n])
        i, k = i + n, k + 1
    return deltas + parser.flush()


def test_xml_tool_call_values_are_typed() -> None:
    p = OutputParser(R.THINK_TAGS, T.QWEN_XML, TOOLS, id_prefix="t")
    p.push(SAMPLES[T.QWEN_XML])
    out = p.finish()
    assert out.reasoning == "plan 你好" and out.content == "Checking." and not out.errors
    import json

    args = json.loads(out.tool_calls[0]["function"]["arguments"])
    assert args == {
        "city": "New York 🗽",
        "days": 3,
        "metric": True,
        "opts": {"a": [1]},
        "ratio": 0.5,
    }
    assert [c["id"] for c in out.tool_calls] == ["call_t0", "call_t1"]


def test_malformed_calls_are_reported_and_kept() -> None:
    p = OutputParser(R.NONE, T.HERMES_JSON, TOOLS, id_prefix="t")
    p.push(SAMPLES[T.HERMES_JSON] + "<tool_call>{unterminated")
    out = p.finish()
    assert len(out.tool_calls) == 2 and len(out.errors) == 2
    assert "<tool_call>{bad}</tool_call>" in out.content and "{unterminated" in out.content


def test_reasoning_opened_by_the_template() -> None:
    p = OutputParser.for_request(R.THINK_TAGS, T.NONE, "<|im_start|>assistant\n<think>\n", None)
    p.push("deep thought\n</think>\n\n42")
    out = p.finish()
    assert (out.reasoning, out.content) == ("deep thought", "42")


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(list(SAMPLES)), st.lists(st.integers(1, 7), min_size=1, max_size=6))
def test_streaming_equals_non_streaming(kind: T, cuts: list[int]) -> None:
    whole = OutputParser(R.THINK_TAGS, kind, TOOLS, id_prefix="t")
    whole.push(SAMPLES[kind])
    expect = whole.finish()
    p = OutputParser(R.THINK_TAGS, kind, TOOLS, id_prefix="t")
    deltas = _stream(p, SAMPLES[kind], cuts)
    got = p.finish()
    assert got == expect
    wire = [d.to_openai() for d in deltas if hasattr(d, "to_openai")]
    firsts = [w for w in wire if "id" in w]
    assert all("index" in w for w in wire) and len(firsts) == len(expect.tool_calls)
    assert all("name" not in w["function"] for w in wire if "id" not in w)


def test_tool_choice_modes() -> None:
    tools = [*TOOLS, {"type": "function", "function": {"name": "other", "parameters": {}}}]
    assert prepare_tools(tools, "none") == (None, None)
    assert prepare_tools(tools, "auto") == (tools, None)
    t, instr = prepare_tools(tools, "required")
    assert t == tools and instr
    named = {"type": "function", "function": {"name": "other"}}
    assert prepare_tools(tools, named) == ([tools[1]], None)
    p = OutputParser(R.NONE, T.HERMES_JSON, tools, id_prefix="t")
    p.push("hi " + JSON_CALL)
    out = p.finish()
    assert validate_tool_choice(out, "required", tools) is None
    assert validate_tool_choice(out, named, tools) is not None  # called the wrong tool
    assert validate_tool_choice(out, {"type": "function", "function": {"name": "get_weather"}},
                                tools) is None  # fmt: skip
    assert present(out, named).content == "" and out.content == "hi"
    empty = OutputParser(R.NONE, T.HERMES_JSON, tools).finish()
    assert validate_tool_choice(empty, "required", tools) is not None
