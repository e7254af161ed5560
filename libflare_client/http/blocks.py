"""One choice's output as an ordered list of typed blocks, for the APIs that return content as
blocks or items (Anthropic Messages `content`, Responses `output`).

Reasoning, answer text and each tool call are one block each, in the order the model wrote
them. A block opens when output of another kind (or a new call) arrives and closes when the
next one opens or the output ends, so a stream's events and a unary body come from the same
sequence and agree. Within one delta the order is reasoning, text, tool calls (the order the
daemon's parsers produce them in).

Invariant: at most the last block is open, and every event names a block by its index in
`blocks`, which never changes once opened (the clients index their snapshots by it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from libflare_client.http.generation import Delta

BlockKind = Literal["thinking", "text", "tool"]
Op = Literal["open", "delta", "close"]


@dataclass
class Block:
    index: int
    kind: BlockKind
    parts: list[str] = field(default_factory=list)
    call_id: str = ""  # tool blocks: the daemon's call id ("call_...") and the function name
    name: str = ""

    @property
    def text(self) -> str:
        return "".join(self.parts)


Event = tuple[Op, Block, str]  # (op, block, the new text of a "delta"; "" otherwise)


class Blocks:
    """`feed` each Delta of one choice, then `finish`; both return the events to stream."""

    def __init__(self, reasoning: bool = True) -> None:
        self.blocks: list[Block] = []
        self.reasoning = reasoning  # False: reasoning is left out (the client did not ask)
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # the daemon's call index -> its block

    def feed(self, d: Delta) -> list[Event]:
        out: list[Event] = []
        if d.reasoning and self.reasoning:
            self._append(out, "thinking", d.reasoning)
        if d.text:
            self._append(out, "text", d.text)
        for tc in d.tool_calls:
            blk = self._calls.get(tc.index)
            if blk is None:  # a call's first delta carries its id and name
                blk = self._start(out, "tool")
                blk.call_id, blk.name = tc.id or "", tc.name or ""
                self._calls[tc.index] = blk
            if tc.arguments:
                blk.parts.append(tc.arguments)
                if blk is self._open:
                    out.append(("delta", blk, tc.arguments))
                # else: the daemon sends a call's fragments before the next call starts
                # (tool_parsers), so an earlier call never grows; kept in the body regardless
        return out

    def finish(self) -> list[Event]:
        """Close the last block; an output with no block at all gets one empty text block."""
        out: list[Event] = []
        if not self.blocks:
            self._start(out, "text")
        if self._open is not None:
            out.append(("close", self._open, ""))
            self._open = None
        return out

    def _append(self, out: list[Event], kind: BlockKind, text: str) -> None:
        blk = self._open
        if blk is None or blk.kind != kind:
            blk = self._start(out, kind)
        blk.parts.append(text)
        out.append(("delta", blk, text))

    def _start(self, out: list[Event], kind: BlockKind) -> Block:
        if self._open is not None:
            out.append(("close", self._open, ""))
        blk = Block(len(self.blocks), kind)
        self.blocks.append(blk)
        self._open = blk
        out.append(("open", blk, ""))
        return blk
