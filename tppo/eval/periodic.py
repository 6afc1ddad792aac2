"""The evaluation the training loop runs every `run.eval_every` steps: `tppo.eval.evaluation.evaluate` on `eval.data`
with the rollout engine the loop already holds (its weights are the policy's after the step's sync).

Inputs are checked when the run starts, before any generation: the dataset rows (DataError names file and row),
and prompt + eval.max_new_tokens within the rollout engine's rollout.max_model_len. Each evaluation writes
generations.jsonl, summary.json and table.txt under `<run dir>/eval/step_NNNNNN/`; its metrics go to the run's
metrics under `eval/<name>/` at the step it followed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.data import PromptRecord
from rollout.tokenizer import Tokenizer
from tppo.base.fields import ConfigError
from tppo.eval.config import EvalConfig

if TYPE_CHECKING:
    from tppo.eval.evaluation import Generator


@dataclass(frozen=True)
class LoopEval:
    """What every periodic evaluation of a run reuses: the settings, the problems, the task's tokenizer."""

    cfg: EvalConfig
    records: list[PromptRecord]
    tokenizer: Tokenizer
    stop_token_ids: tuple[int, ...]


def prepare_loop_eval(
    cfg: EvalConfig,
    eval_every: int,
    max_model_len: int,
    tokenizer: Tokenizer | None,
    stop_token_ids: tuple[int, ...],
) -> LoopEval | None:
    """The periodic evaluation of a run that evaluates every `eval_every` steps (None when 0) with a rollout engine
    of `max_model_len` positions, its inputs checked."""
    if not eval_every:
        return None
    from tppo.eval.evaluation import dataset_name, eval_records

    if tokenizer is None:
        raise ConfigError("run.eval_every needs a task with a tokenizer (data.source=dataset)")
    if not cfg.data.path:
        raise ConfigError(
            f"run.eval_every={eval_every} needs eval.data.path (a JSONL/Parquet file or a hub name)"
        )
    ecfg = dataclasses.replace(cfg, name=cfg.name or dataset_name(cfg.data))
    records = eval_records(ecfg, tokenizer)
    if not records:
        raise ConfigError(f"eval.data ({cfg.data.path}) has no problems to evaluate")
    longest = max(len(r.prompt_token_ids) for r in records)
    if longest + ecfg.max_new_tokens > max_model_len:
        raise ConfigError(
            f"eval: the longest prompt ({longest} tokens) + eval.max_new_tokens={ecfg.max_new_tokens} exceeds "
            f"rollout.max_model_len={max_model_len}"
        )
    return LoopEval(ecfg, records, tokenizer, stop_token_ids)


def due(eval_every: int, step: int) -> bool:
    return bool(eval_every) and (step + 1) % eval_every == 0


def run_loop_eval(loop_eval: LoopEval, rollout: Generator, out_dir: Path, step: int) -> dict[str, float]:
    """Evaluate with the loop's rollout engines (tppo.cluster.roles.Rollout), write the step's files, return
    `eval/` metrics."""
    from tppo.eval.evaluation import evaluate, format_report, write_outputs

    result = evaluate(
        rollout,
        loop_eval.records,
        loop_eval.cfg,
        loop_eval.tokenizer,
        stop_token_ids=loop_eval.stop_token_ids,
    )
    source = {"step": step, "tokenizer": loop_eval.tokenizer.name}
    write_outputs(
        result,
        out_dir / "eval" / f"step_{step:06d}",
        format_report(result),
        loop_eval.cfg,
        loop_eval.records,
        source,
    )
    return result.log_metrics()
