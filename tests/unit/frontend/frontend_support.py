"""Frontend fixtures: the tiny tokenizer with a fixture template, as Flare and Transformers see it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

TEMPLATES = Path(__file__).resolve().parents[2] / "fixtures" / "templates"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]  # fmt: skip


def template_dir(base: Path, out: Path, name: str) -> Path:
    """A tokenizer dir: the tiny tokenizer (+ Llama specials for llama3) and a fixture template."""
    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    cfg: dict[str, Any] = json.loads((base / "tokenizer_config.json").read_text())
    if name == "llama3":
        tok.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIALS]
        )
        cfg["bos_token"] = "<|begin_of_text|>"
        cfg["eos_token"] = "<|eot_id|>"
        for t in LLAMA_SPECIALS:
            cfg["added_tokens_decoder"][str(tok.token_to_id(t))] = {
                "content": t, "special": True, "lstrip": False, "rstrip": False,
                "normalized": False, "single_word": False,
            }  # fmt: skip
    cfg["chat_template"] = (TEMPLATES / f"{name}.jinja").read_text()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prep.tiny import write_tokenizer

    out = tmp_path_factory.mktemp("frontend-tok")
    write_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tdirs(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("frontend-templates")
    names = ["qwen3", "qwen3_coder", "qwen35", "llama3"]
    return {n: template_dir(tiny_ckpt, root / n, n) for n in names}


def frontend_for(d: Path) -> Any:
    from flared.frontend.text import TextFrontend

    cfg = json.loads((d / "tokenizer_config.json").read_text())
    return TextFrontend.from_files(d / "tokenizer.json", d / "tokenizer_config.json",
                                   cfg["chat_template"], [0])  # fmt: skip


def reference_render(fe: Any, case: dict[str, Any]) -> tuple[list[int], int | None, int | None]:
    """(endpoints, rewritten message index, first rewritten token) by rendering every prefix of
    the conversation in full: the definition that the frontend's window renders must match."""
    from flared.engine.errors import InvalidRequest
    from flared.frontend.text import _Cuts

    msgs, tools = case["messages"], case["tools"]
    opts = {"add_generation_prompt": False, **case["opts"]}
    gen, cont = opts.pop("add_generation_prompt"), opts.pop("continue_final_message", False)
    text = fe.render_text(msgs, tools, gen, continue_final_message=cont, **opts)
    enc = fe.tokenizer.encode(text, add_special_tokens=False)
    cuts = _Cuts(enc.offsets)

    def prefix(k: int, g: bool) -> str | None:
        try:
            return str(fe.render_text(msgs[: k + 1], tools, g, **opts))
        except InvalidRequest:
            return None

    ends: list[int] = []
    rewrite_char = rewrite_msg = None
    for i in range(len(msgs) - (1 if cont else 0)):
        p = prefix(i, False)
        stable = p is not None and text.startswith(p)
        if p is not None and stable:
            n = cuts.exact(len(p))
            if n is not None and 0 < n < len(enc.ids) and (not ends or ends[-1] < n):
                ends.append(n)
        if msgs[i].get("role") != "assistant" or rewrite_msg is not None:
            continue
        for seen in (prefix(i - 1, True) if i else "", None if stable else p):
            if seen is not None and not text.startswith(seen):
                at = next(
                    (j for j, (x, y) in enumerate(zip(seen, text)) if x != y),
                    min(len(seen), len(text)),
                )
                rewrite_char = at if rewrite_char is None else min(rewrite_char, at)
                rewrite_msg = i
    first = None if rewrite_char is None else cuts.tokens_before(rewrite_char)
    return ends, rewrite_msg, first
