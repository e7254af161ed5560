"""Reasoning splitters: answer text vs reasoning text, incrementally. Registered by the bundle's
ReasoningParser enum, never by model name.

THINK_TAGS: reasoning is the text between `<think>` and `</think>`. `<think>` is recognised at
the start of the output (after whitespace), or is already open when the template put it at the
end of the prompt (`started=True`; see `reasoning_started_in_prompt`). Newlines right after
`<think>` and right before `</think>` are trimmed, and newlines right after `</think>` are
dropped from the answer, as the Qwen templates do when re-rendering a turn. Without a closing
tag everything after `<think>` is reasoning (e.g. output cut by max_tokens).
"""

from __future__ import annotations

from collections.abc import Callable

from flared.frontend.deltas import holdback
from prep.bundle import ReasoningParser

OPEN, CLOSE = "<think>", "</think>"
Split = tuple[str, str]  # (reasoning, answer) released by one push


def reasoning_started_in_prompt(prompt_text: str) -> bool:
    """True when the generation prompt leaves a `<think>` open (e.g. Qwen3.5 thinking mode)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class NoReasoning:
    def push(self, text: str) -> Split:
        return "", text

    def flush(self) -> Split:
        return "", ""


class ThinkTags:
    def __init__(self, started: bool = False) -> None:
        self._state = "reasoning" if started else "start"
        self._buf = ""
        self._trim_lead = True  # drop newlines at the start of the current section

    def push(self, text: str) -> Split:
        self._buf += text
        reasoning = answer = ""
        while True:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._buf = head[len(OPEN) :]
                    self._state, self._trim_lead = "reasoning", True
                    continue
                if OPEN.startswith(head):
                    return reasoning, answer  # could still become <think>
                self._state, self._trim_lead = "answer", False
                continue
            if self._trim_lead:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return reasoning, answer
                self._trim_lead = False
            if self._state == "answer":
                answer += self._buf
                self._buf = ""
                return reasoning, answer
            i = self._buf.find(CLOSE)
            if i >= 0:
                reasoning += self._buf[:i].rstrip("\n")
                self._buf = self._buf[i + len(CLOSE) :]
                self._state, self._trim_lead = "answer", True
                continue
            hold = holdback(self._buf, (CLOSE,))
            body = self._buf[: len(self._buf) - hold]
            kept = body.rstrip("\n")  # trailing newlines may precede </think>: hold them too
            reasoning += kept
            self._buf = self._buf[len(kept) :]
            return reasoning, answer

    def flush(self) -> Split:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return buf.rstrip("\n"), ""
        return "", buf  # "start": a partial "<thi" that never completed is answer text


REASONING_SPLITTERS: dict[ReasoningParser, Callable[[bool], NoReasoning | ThinkTags]] = {
    ReasoningParser.NONE: lambda started: NoReasoning(),
    ReasoningParser.THINK_TAGS: lambda started: ThinkTags(started),
}
