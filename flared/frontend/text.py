"""Tokenizer, chat-template rendering and incremental detokenization from a bundle's assets.

Rendering uses jinja2 with the same environment Transformers' `apply_chat_template` uses
(sandboxed, trim_blocks, lstrip_blocks, loop controls, `tojson` with ensure_ascii=False,
`raise_exception`, `strftime_now`), so prompts are byte-identical.

Message endpoints: the end of completed message i is found by rendering messages[:i+1] without
a generation prompt; when that text is a prefix of the full prompt and the prefix ends exactly
on a token boundary of the full encoding, its token count is an exact endpoint. A mark inside a
token (BPE merge across the boundary) yields no endpoint rather than a wrong one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from flared.engine.errors import InvalidRequest


@dataclass(frozen=True)
class Rendered:
    text: str
    token_ids: list[int]
    message_end_token_offsets: list[int]


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _raise(message: str) -> None:
    raise InvalidRequest(f"chat template error: {message}")


def _make_env() -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
    """The special-token strings templates may reference, as Transformers passes them."""
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[key] = v
    return out


class IncrementalDetokenizer:
    """Emits text only once it is complete UTF-8; the concatenation of all output equals
    decode(all tokens)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0  # characters of decode(ids) already returned
        self._skip = skip_special_tokens

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        end = len(text)
        while end > self._emitted and text[end - 1] == "\ufffd":
            end -= 1  # an incomplete UTF-8 sequence decodes to U+FFFD; hold it back
        out = text[self._emitted : end]
        self._emitted = end
        return out

    def flush(self) -> str:
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        out = text[self._emitted :]
        self._emitted = len(text)
        return out


class TextFrontend:
    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        eos_token_ids: list[int],
        tokenizer_config: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._template = _make_env().from_string(chat_template) if chat_template else None
        self._special = _special_tokens(tokenizer_config or {})

    @staticmethod
    def from_bundle(bundle_dir: Path | str) -> TextFrontend:
        from tokenizers import Tokenizer

        from prep.bundle import read_manifest

        b = Path(bundle_dir)
        m = read_manifest(b)
        tok = Tokenizer.from_file(str(b / m.frontend.tokenizer_file))
        cfg = json.loads((b / m.frontend.tokenizer_config_file).read_text())
        return TextFrontend(tok, m.frontend.chat_template, m.frontend.eos_token_ids, cfg)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer)

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        if self._template is None:
            raise InvalidRequest("this bundle has no chat template; send prompt_token_ids")
        try:
            return str(
                self._template.render(
                    messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                    **self._special, **template_kwargs,
                )
            )  # fmt: skip
        except InvalidRequest:
            raise
        except Exception as exc:
            raise InvalidRequest(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> Rendered:
        text = self.render_text(messages, tools, add_generation_prompt, **template_kwargs)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        ends = [e for _s, e in enc.offsets]
        starts = [s for s, _e in enc.offsets]
        marks: list[int] = []
        for i in range(len(messages)):
            prefix = self.render_text(messages[: i + 1], tools, False, **template_kwargs)
            if text.startswith(prefix):
                marks.append(len(prefix))
        offsets: list[int] = []
        for mark in marks:
            # exact cut: every token before ends at or before the mark, every token after starts
            # at or after it
            n = sum(1 for e in ends if e <= mark)
            exact = 0 < n < len(ids) and all(s >= mark for s in starts[n:])
            if exact and (not offsets or offsets[-1] < n):
                offsets.append(n)
        return Rendered(text=text, token_ids=ids, message_end_token_offsets=offsets)
