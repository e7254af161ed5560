"""Tokenizer, chat-template prompts with message endpoints (chat_render.py), detokenizers.

Rendering reproduces Transformers' `apply_chat_template` byte for byte (jinja_env.py) and
tokenizes the prompt with `add_special_tokens=False`, as Transformers does: by segments between
added tokens with cached segment encodings (segments.py, exact by construction), or whole when
the tokenizer does not allow it. A char endpoint becomes a token endpoint only when it is an
exact cut: every token before it ends at or before it and every token after starts at or after
it, so no endpoint cuts through a BPE token or a multi-token Unicode character. Endpoints are
sorted, unique and strictly inside the prompt; the final open assistant header (and a continued
final message) never yields one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flared.engine.errors import InvalidRequest
from flared.frontend.chat_render import ChatRenderer
from flared.frontend.detok import IncrementalDetokenizer
from flared.frontend.jinja_env import json_memo
from flared.frontend.segments import SegmentEncoder

__all__ = ["IncrementalDetokenizer", "Rendered", "TextFrontend", "common_prefix_length"]

_SPECIAL_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip


@dataclass(frozen=True)
class Rendered:
    text: str
    token_ids: list[int]
    message_end_token_offsets: list[int]
    # True when the template renders an earlier assistant turn differently from how the model
    # produced it (its prompt + output are no longer a prefix of this prompt).
    rewrites_history: bool = False
    # Tokens of this prompt before the first rewritten character (None without a rewrite).
    first_rewritten_token: int | None = None
    # Index of the earliest assistant message whose history was rewritten.
    rewritten_message_index: int | None = None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common token prefix (what a cache keyed on tokens can reuse)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
    """The special-token strings Transformers passes to templates (its special_tokens_map)."""
    out: dict[str, str] = {}
    for key in _SPECIAL_KEYS:
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


class _Cuts:
    """Exact token cuts of one encoding: char offset -> token count, or None if inexact."""

    def __init__(self, offsets: Sequence[tuple[int, int]]) -> None:
        n = len(offsets)
        self.num_tokens = n
        # max_end[k]: max end over tokens [0, k); min_start[k]: min start over tokens [k, n)
        self.max_end = [0] * (n + 1)
        for k, (_s, e) in enumerate(offsets):
            self.max_end[k + 1] = max(self.max_end[k], e)
        self.min_start = [1 << 62] * (n + 1)
        for k in range(n - 1, -1, -1):
            self.min_start[k] = min(self.min_start[k + 1], offsets[k][0])

    def exact(self, mark: int) -> int | None:
        lo, hi = 0, self.num_tokens  # largest k with max_end[k] <= mark (max_end is monotone)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.max_end[mid] <= mark:
                lo = mid
            else:
                hi = mid - 1
        return lo if self.min_start[lo] >= mark else None

    def tokens_before(self, char_pos: int) -> int:
        """Tokens that end at or before char_pos (those untouched by a change at char_pos)."""
        k = 0
        while k < self.num_tokens and self.max_end[k + 1] <= char_pos:
            k += 1
        return k


class TextFrontend:
    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        eos_token_ids: list[int],
        tokenizer_config: dict[str, Any] | None = None,
        *,
        reasoning_parser: Any = None,
        tool_parser: Any = None,
        model_vocab_size: int | None = None,
    ) -> None:
        from prep.bundle import ReasoningParser, ToolParser

        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template = chat_template
        special = _special_tokens(tokenizer_config or {})
        self._renderer = ChatRenderer(chat_template, special) if chat_template else None
        # output parsers: the bundle's typed enums (the recipe's declaration), never a name
        self.reasoning_parser: ReasoningParser = reasoning_parser or ReasoningParser.NONE
        self.tool_parser: ToolParser = tool_parser or ToolParser.NONE
        self.model_vocab_size = model_vocab_size or self.vocab_size
        self._special_ids = {
            i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self._grammar_lock = threading.Lock()
        self._grammar_compiler: Any = None
        self._segments = SegmentEncoder.build(tokenizer)

    @staticmethod
    def from_bundle(bundle_dir: Path | str) -> TextFrontend:
        from prep.bundle import read_manifest

        b = Path(bundle_dir)
        m = read_manifest(b)
        return TextFrontend.from_files(
            b / m.frontend.tokenizer_file,
            b / m.frontend.tokenizer_config_file,
            m.frontend.chat_template,
            m.frontend.eos_token_ids,
            reasoning_parser=m.frontend.reasoning_parser,
            tool_parser=m.frontend.tool_parser,
            model_vocab_size=m.geometry.vocab_size,
        )

    @staticmethod
    def from_files(
        tokenizer_file: Path,
        tokenizer_config_file: Path,
        chat_template: str | None,
        eos_token_ids: list[int],
        **options: Any,
    ) -> TextFrontend:
        """`options`: reasoning_parser, tool_parser, model_vocab_size (see __init__)."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_file))
        cfg = json.loads(Path(tokenizer_config_file).read_text())
        return TextFrontend(tok, chat_template, eos_token_ids, cfg, **options)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt as Transformers' `tokenizer(text)` encodes it (special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, skip_special_tokens)

    def output_detokenizer(self, keep: Sequence[str] = ()) -> IncrementalDetokenizer:
        """Skips special tokens except those whose text is in `keep` (the parsers' tags, which
        some tokenizers mark special): the parsers must see them, the client never sees EOS."""
        if not any(c in keep for c in self._special_ids.values()):
            return IncrementalDetokenizer(self.tokenizer, True)
        skip = [i for i, c in self._special_ids.items() if c not in keep]
        return IncrementalDetokenizer(self.tokenizer, False, skip)

    def grammar_compiler(self) -> Any:
        """The bundle's xgrammar compiler (flared.frontend.grammar), built on first use."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from flared.frontend.grammar import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_vocab_size, self.eos_token_ids
                )
            return self._grammar_compiler

    def _chat(self) -> ChatRenderer:
        if self._renderer is None:
            raise InvalidRequest("this bundle has no chat template; send prompt_token_ids")
        return self._renderer

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        chat = self._chat()
        return chat.render(
            messages, tools, add_generation_prompt, continue_final_message, template_kwargs
        ).text

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> Rendered:
        chat = self._chat()
        flags = (add_generation_prompt, continue_final_message)
        keys = chat.chain(messages, tools, template_kwargs)
        with json_memo():  # the prompt and its window renders dump the same tools
            full = chat.prompt(messages, tools, *flags, template_kwargs, keys[-1])
            text = full.text
            if self._segments is not None:
                # a long new prompt is tokenized on a helper thread while the report renders
                pending = self._segments.begin(text)
                report = chat.report(messages, tools, template_kwargs, keys, full, flags)
                seg = pending()
                ids, exact, tokens_before = seg.ids, seg.exact_cut, seg.tokens_before
            else:
                enc = self.tokenizer.encode(text, add_special_tokens=False)
                cuts = _Cuts(enc.offsets)
                ids, exact, tokens_before = list(enc.ids), cuts.exact, cuts.tokens_before
                report = chat.report(messages, tools, template_kwargs, keys, full, flags)
        offsets: list[int] = []
        for end in report.ends:
            n = exact(end)
            if n is not None and 0 < n < len(ids) and (not offsets or offsets[-1] < n):
                offsets.append(n)
        at = report.rewrite_char
        return Rendered(
            text=text,
            token_ids=ids,
            message_end_token_offsets=offsets,
            rewrites_history=report.rewrite_message is not None,
            first_rewritten_token=None if at is None else tokens_before(at),
            rewritten_message_index=report.rewrite_message,
        )
