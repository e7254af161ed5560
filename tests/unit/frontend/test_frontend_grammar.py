"""Grammar-constrained sampling on the tiny model always yields schema-valid JSON; mask contract."""

from __future__ import annotations

import json

import pytest
import torch

from flared.frontend.grammar import GrammarCompiler, GrammarSpec, apply_bitmask, mask_words

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
          "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}  # fmt: skip


def _valid(doc: dict) -> bool:
    return (set(doc) == {"n", "ok", "tag"} and isinstance(doc["n"], int)
            and isinstance(doc["ok"], bool) and doc["tag"] in ("a", "b"))  # fmt: skip


def test_apply_bitmask_bit_order() -> None:
    v = 70
    mask = torch.zeros(2, mask_words(v), dtype=torch.int32)
    mask[0, 0] = 1 << 3
    mask[0, 2] = 1 << 5  # token 69
    mask[1].fill_(-1)  # all ones: unconstrained
    out = apply_bitmask(torch.zeros(2, v), mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 69]
    assert torch.isfinite(out[1]).all()


@pytest.fixture(scope="module")
def model_and_compiler(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from prep.tiny import make_tiny_checkpoint

    d = make_tiny_checkpoint(tmp_path_factory.mktemp("g") / "ckpt", "qwen3")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(str(d)).eval()
    eos = tok.token_to_id("<|im_end|>")
    return model, tok, GrammarCompiler(tok, model.config.vocab_size, [eos], max_threads=2), eos


def _generate(model, tok, grammar, prompt, seed, max_new=64):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    mask = torch.empty(1, grammar.num_words, dtype=torch.int32)
    out: list[int] = []
    past, step = None, ids
    with torch.no_grad():
        for _ in range(max_new):
            res = model(torch.tensor([step]), past_key_values=past, use_cache=True)
            past, logits = res.past_key_values, res.logits[:, -1, :]  # [1, V]
            grammar.fill(mask, 0)
            probs = torch.softmax(apply_bitmask(logits, mask) / 1.5, dim=-1)
            t = int(torch.multinomial(probs, 1, generator=g))
            assert grammar.accept(t)
            step = [t]
            out.append(t)
            if grammar.is_terminated:
                break
    return out


def test_constrained_json_always_validates(model_and_compiler) -> None:  # type: ignore[no-untyped-def]
    model, tok, gc, eos = model_and_compiler
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    prompt = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n").ids
    done = 0
    for seed in range(10):
        out = _generate(model, tok, gc.matcher(spec), prompt, seed)
        text = tok.decode([t for t in out if t != eos], skip_special_tokens=False)
        if out and out[-1] == eos:
            assert _valid(json.loads(text)), text
            done += 1
        else:  # budget ran out: still a valid prefix, never a violation
            assert text.lstrip().startswith("{")
    assert done >= 6


def test_reasoning_then_grammar(model_and_compiler) -> None:  # type: ignore[no-untyped-def]
    _model, tok, gc, _eos = model_and_compiler
    g = gc.matcher(GrammarSpec("regex", "(yes|no)"), reasoning_open=True)
    mask = torch.empty(1, g.num_words, dtype=torch.int32)
    g.fill(mask, 0)
    assert (mask == -1).all()  # reasoning: unconstrained
    assert g.accept(tok.token_to_id("</think>"))
    g.fill(mask, 0)
    allowed = apply_bitmask(torch.zeros(1, gc.vocab_size), mask).isfinite().nonzero()[:, 1]
    texts = {tok.decode([int(t)]) for t in allowed}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def test_tool_call_escape_releases_grammar(model_and_compiler) -> None:  # type: ignore[no-untyped-def]
    _model, tok, gc, _eos = model_and_compiler
    g = gc.matcher(GrammarSpec("json_object"), allow_tool_calls=True)
    mask = torch.empty(1, g.num_words, dtype=torch.int32)
    g.fill(mask, 0)
    tc = tok.token_to_id("<tool_call>")
    assert (int(mask[0, tc >> 5]) >> (tc & 31)) & 1
    assert g.accept(tc)
    g.fill(mask, 0)
    assert (mask == -1).all()
