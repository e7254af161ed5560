"""Seeded generator of chat conversations for template parity (tools, results, reasoning...)."""

from __future__ import annotations

import random
from typing import Any

TEXTS = [
    "hello world", "What's the weather in Paris?", "你好世界，今天怎么样？", "emoji 🙂🚀 ok",
    "e\u0301te\u0301 cafe\u0301 (combining marks)", "こんにちは", "  padded  \n", "code:\n\tdef f(): return 42\n",
    'json {"a": [1, 2]}', "Bonjour le monde, héllo wörld", "line1\nline2\n\nline4", "ünïcödé ß ∑ ≠",
]  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name"},
         "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["c", "f"]}},
         "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web 🔎.",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string"}, "filters": {"type": "object"}, "exact": {"type": "boolean"}},
         "required": ["query"]}}},
]  # fmt: skip


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 3)))


def _call(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        args: dict[str, Any] = {"city": rng.choice(["Paris", "東京", "Zürich"]), "days": 3}
        return {"type": "function", "function": {"name": "get_weather", "arguments": args}}
    args = {"query": _text(rng), "filters": {"lang": "fr", "n": [1, 2]}, "exact": True}
    return {"type": "function", "function": {"name": "search", "arguments": args}}


def conversation(seed: int, template: str) -> dict[str, Any]:
    """One case: messages, tools, and rendering options for `template`."""
    rng = random.Random(seed)
    tools = TOOLS if rng.random() < 0.5 else None
    single_call = template == "llama3"  # that template refuses parallel calls
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": "You are helpful. " + _text(rng)})
    for _turn in range(rng.randint(1, 6 if seed % 7 else 14)):
        msgs.append({"role": "user", "content": _text(rng)})
        if tools and rng.random() < 0.6:
            n = 1 if single_call else rng.randint(1, 3)
            calls = [_call(rng) for _ in range(n)]
            msgs.append({"role": "assistant", "content": "" if single_call else _text(rng),
                         "tool_calls": calls})  # fmt: skip
            for _c in calls:
                msgs.append({"role": "tool", "content": '{"ok": true, "temp": 21.5, "note": "☀"}'})
        a: dict[str, Any] = {"role": "assistant", "content": _text(rng)}
        if template != "llama3" and rng.random() < 0.4:
            a["reasoning_content"] = "thinking about " + _text(rng)
        msgs.append(a)
    opts: dict[str, Any] = {}
    r = rng.random()
    if r < 0.2:
        opts["continue_final_message"] = True  # continue the final assistant message
    else:
        msgs.append({"role": "user", "content": _text(rng)})
        opts["add_generation_prompt"] = rng.random() < 0.9
    if template in ("qwen3", "qwen35") and rng.random() < 0.5:
        opts["enable_thinking"] = rng.random() < 0.5
    return {"messages": msgs, "tools": tools, "opts": opts}


def agent_conversation(seed: int, template: str) -> dict[str, Any]:
    """An agent trace: long turns of assistant tool calls and tool results, few user messages,
    reasoning on some assistant messages, sometimes a system message or a final assistant."""
    rng = random.Random(1000 + seed)
    single_call = template == "llama3"
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.7:
        msgs.append({"role": "system", "content": "You are an agent. " + _text(rng)})
    for _turn in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": _text(rng)})
        for _step in range(rng.randint(0, 12)):
            calls = [_call(rng) for _ in range(1 if single_call else rng.randint(1, 3))]
            a: dict[str, Any] = {"role": "assistant", "content": "" if single_call else _text(rng),
                                 "tool_calls": calls}  # fmt: skip
            if template != "llama3" and rng.random() < 0.5:
                a["reasoning_content"] = "step " + _text(rng)
            msgs.append(a)
            msgs.extend({"role": "tool", "content": _text(rng)} for _c in calls)
        if rng.random() < 0.8:
            msgs.append({"role": "assistant", "content": _text(rng)})
    opts: dict[str, Any] = {"add_generation_prompt": msgs[-1]["role"] != "assistant"}
    if msgs[-1]["role"] == "assistant" and rng.random() < 0.3:
        opts = {"add_generation_prompt": False, "continue_final_message": True}
    elif rng.random() < 0.5:
        msgs.append({"role": "user", "content": _text(rng)})
        opts = {"add_generation_prompt": True}
    if template in ("qwen3", "qwen35") and rng.random() < 0.5:
        opts["enable_thinking"] = rng.random() < 0.5
    return {"messages": msgs, "tools": TOOLS, "opts": opts}
