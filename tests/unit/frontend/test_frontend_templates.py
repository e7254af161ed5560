"""Byte-identical prompts and identical ids vs Transformers; endpoints; prefix stability."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import contextlib

from corpus import conversation
from frontend_support import frontend_for

from flared.engine.errors import InvalidRequest
from flared.frontend.text import common_prefix_length

TEMPLATE_NAMES = ["qwen3", "qwen3_coder", "qwen35", "llama3"]
NUM_CASES = 60


def _hf(d: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def _hf_ids(hf: Any, case: dict[str, Any]) -> tuple[str, list[int]]:
    opts = {"add_generation_prompt": False, **case["opts"]}
    text = hf.apply_chat_template(case["messages"], tools=case["tools"], tokenize=False, **opts)
    out = hf.apply_chat_template(case["messages"], tools=case["tools"], tokenize=True, **opts)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return text, list(ids)


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_parity_with_transformers(name: str, tdirs: dict[str, Path]) -> None:
    fe, hf = frontend_for(tdirs[name]), _hf(tdirs[name])
    kinds = {"tools": 0, "continue": 0, "thinking_off": 0, "long": 0}
    for seed in range(NUM_CASES):
        case = conversation(seed, name)
        text, ids = _hf_ids(hf, case)
        opts = {"add_generation_prompt": False, **case["opts"]}
        gen = opts.pop("add_generation_prompt")
        r = fe.render(case["messages"], case["tools"], gen, **opts)
        assert r.text == text, (seed, r.text, text)
        assert r.token_ids == ids, seed
        offs = r.message_end_token_offsets
        assert offs == sorted(set(offs)) and all(0 < o < len(ids) for o in offs)
        kinds["tools"] += bool(case["tools"])
        kinds["continue"] += bool(opts.get("continue_final_message"))
        kinds["thinking_off"] += opts.get("enable_thinking") is False
        kinds["long"] += len(case["messages"]) > 12
    assert kinds["tools"] > 10 and kinds["continue"] > 5 and kinds["long"] > 3, kinds


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_endpoints_are_exact_cuts(name: str, tdirs: dict[str, Path]) -> None:
    fe = frontend_for(tdirs[name])
    for seed in range(0, NUM_CASES, 3):
        case = conversation(seed, name)
        opts = {"add_generation_prompt": False, **case["opts"]}
        gen = opts.pop("add_generation_prompt")
        r = fe.render(case["messages"], case["tools"], gen, **opts)
        prefixes = set()
        for i in range(len(case["messages"])):
            with contextlib.suppress(InvalidRequest):
                prefixes.add(fe.render_text(case["messages"][: i + 1], case["tools"], False))
        for n in r.message_end_token_offsets:
            head = fe.decode(r.token_ids[:n], skip_special_tokens=False)
            assert head in prefixes and fe.encode(head) == r.token_ids[:n], (seed, n)
        if gen:  # the open assistant header is never an endpoint
            assert r.message_end_token_offsets[-1:] != [len(r.token_ids)]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
@pytest.mark.parametrize("reasoning", [False, True])
def test_prefix_stability_across_turns(name: str, reasoning: bool, tdirs: dict[str, Path]) -> None:
    """Turn k+1's prompt extends turn k's prompt, or the rewrite is reported."""
    fe = frontend_for(tdirs[name])
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    prev: list[int] | None = None
    reported = False
    for k in range(5):
        msgs.append({"role": "user", "content": f"question {k} 你好 🙂"})
        r = fe.render(msgs)
        if prev is not None:
            common = common_prefix_length(prev, r.token_ids)
            if r.rewrites_history:
                reported = True
                assert r.first_rewritten_token is not None and r.first_rewritten_token <= common
            else:
                assert common == len(prev), (k, common, len(prev))
        prev = r.token_ids
        reply: dict[str, Any] = {"role": "assistant", "content": f"answer {k}"}
        if reasoning:
            reply["reasoning_content"] = f"let me think {k}"
        msgs.append(reply)
    # Qwen3 renders the latest turn with a (possibly empty) think block and strips it once a
    # newer user turn exists; Qwen3.5 opens <think> in every prompt: both rewrite history.
    assert reported == (name in ("qwen3", "qwen35"))


def test_qwen35_without_reasoning_reports_the_reopened_think(tdirs: dict[str, Path]) -> None:
    """Qwen3.5's prompt opens <think>; a past turn is re-rendered without it: a rewrite."""
    fe = frontend_for(tdirs["qwen35"])
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]  # fmt: skip
    r = fe.render(msgs)
    assert r.rewrites_history and r.rewritten_message_index == 1


def test_template_exception_is_invalid_request(tdirs: dict[str, Path]) -> None:
    fe = frontend_for(tdirs["llama3"])
    two_calls = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}] * 2}  # fmt: skip
    with pytest.raises(InvalidRequest, match="single tool-calls"):
        fe.render([{"role": "user", "content": "x"}, two_calls])
