"""Endpoints and the rewrite report from window renders equal rendering every prefix in full."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from corpus import agent_conversation, conversation
from frontend_support import frontend_for, reference_render

TEMPLATE_NAMES = ["qwen3", "qwen3_coder", "qwen35", "llama3"]


def _render(fe: Any, case: dict[str, Any]) -> tuple[list[int], int | None, int | None]:
    opts = {"add_generation_prompt": False, **case["opts"]}
    gen = opts.pop("add_generation_prompt")
    r = fe.render(case["messages"], case["tools"], gen, **opts)
    return r.message_end_token_offsets, r.rewritten_message_index, r.first_rewritten_token


def _cases(name: str) -> list[dict[str, Any]]:
    return [conversation(s, name) for s in range(60)] + [
        agent_conversation(s, name) for s in range(40)
    ]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_windows_equal_full_prefix_renders(name: str, tdirs: dict[str, Path]) -> None:
    fe = frontend_for(tdirs[name])
    cases = _cases(name)
    for seed, case in enumerate(cases):
        assert _render(fe, case) == reference_render(fe, case), seed
    assert fe._renderer.use_windows  # the shipped templates never needed the fallback
    assert sum(len(c["messages"]) > 30 for c in cases) > 5  # long agent turns were covered


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_next_turns_from_the_cache_equal_full_renders(name: str, tdirs: dict[str, Path]) -> None:
    """Worlds cached by one request (their base is that request's prompt) serve the next."""
    fe = frontend_for(tdirs[name])
    for seed in range(12):
        case = agent_conversation(seed, name)
        msgs = case["messages"]
        first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
        for n in range(first_user + 1, len(msgs) + 1):
            if msgs[n - 1]["role"] == "assistant":
                continue
            step = {"messages": msgs[:n], "tools": case["tools"], "opts": {}}
            assert _render(fe, {**step, "opts": {"add_generation_prompt": True}}) == (
                reference_render(fe, {**step, "opts": {"add_generation_prompt": True}})
            ), (seed, n)


INDEXED = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + ' #' + loop.index0|string + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

COUNTED = """{{- '<|im_start|>system\\n' + (messages|length)|string + ' messages<|im_end|>\\n' }}
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


SHORT_HEAD = """{%- if messages|length < 4 %}{%- set loop_messages = messages[2:] %}
{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


@pytest.mark.parametrize(
    "source", [INDEXED, COUNTED, SHORT_HEAD], ids=["loop-index", "message-count", "short-head"]
)
def test_templates_outside_the_window_assumptions_fall_back(
    source: str, tiny_ckpt: Path, tmp_path: Path
) -> None:
    """A template numbering messages, counting them in the header, or skipping messages of
    short conversations (a window then leaves its first message unmarked): the checks catch it
    and every prefix is rendered in full from then on, with the same results as the reference."""
    import json

    cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = source
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer.json").write_bytes((tiny_ckpt / "tokenizer.json").read_bytes())
    fe = frontend_for(tmp_path)
    for seed in range(8):
        case = conversation(seed * 7, "qwen3")
        case = {"messages": [{k: m[k] for k in ("role", "content")} for m in case["messages"]],
                "tools": None, "opts": {"add_generation_prompt": True}}  # fmt: skip
        assert _render(fe, case) == reference_render(fe, case), seed
    assert not fe._renderer.use_windows


def test_windows_on_the_tiny_chatml_template(tiny_ckpt: Path) -> None:
    """The daemon tests' own template (a system message handled by loop.first)."""
    fe = frontend_for(tiny_ckpt)
    for seed, case in enumerate(_cases("chatml")[::2]):
        assert _render(fe, case) == reference_render(fe, case), seed
    assert fe._renderer.use_windows
