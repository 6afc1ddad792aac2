"""The training loop's periodic evaluation: checked before the run, the same `evaluate` through the rollout role,
files per step and `eval/` metrics; an oracle backend gives exactly 100% and 0%."""

from __future__ import annotations

import dataclasses
import json

import pytest
from eval_testlib import Oracle, right, wrong

from rollout.config import DataConfig, RolloutConfig
from tppo.algo.config import AlgoConfig
from tppo.base.fields import ConfigError
from tppo.cluster.roles import RankGroup, Rollout
from tppo.config import ExperimentConfig, RunConfig
from tppo.eval.config import EvalConfig
from tppo.eval.periodic import due, prepare_loop_eval, run_loop_eval


def _config(aime2024, **eval_kw) -> ExperimentConfig:
    data = DataConfig(source="dataset", path=str(aime2024), template="math_chat", shuffle=False)
    cfg = ExperimentConfig(
        data=data,
        run=RunConfig(eval_every=2),
        rollout=RolloutConfig(max_model_len=1200),
        algo=AlgoConfig(window=16, max_response_length=64),
        eval=EvalConfig(data=data, n=2, max_new_tokens=64, limit=5, **eval_kw),
    )
    return cfg.validate()


def _prepare(cfg: ExperimentConfig, tokenizer):
    return prepare_loop_eval(cfg.eval, cfg.run.eval_every, cfg.rollout.max_model_len, tokenizer, ())


@pytest.mark.parametrize(("respond", "expected"), [(right, 1.0), (wrong, 0.0)])
def test_periodic_eval_scores_through_the_rollout_role_and_writes_the_step(
    tmp_path, aime2024, qwen_tokenizer, respond, expected
):
    loop_eval = _prepare(_config(aime2024), qwen_tokenizer)
    assert len(loop_eval.records) == 5 and loop_eval.cfg.name == "aime2024"
    oracle = Oracle(qwen_tokenizer, loop_eval.records, respond)
    metrics = run_loop_eval(
        loop_eval, Rollout(RankGroup("rollout", [oracle], remote=False)), tmp_path, step=3
    )
    assert metrics["eval/aime2024/avg@2"] == expected and metrics["eval/aime2024/pass@2"] == expected
    out = tmp_path / "eval" / "step_000003"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 3 and summary["sampling"]["n"] == 2
    lines = (out / "generations.jsonl").read_text().splitlines()
    assert len(lines) == 10 and all(json.loads(x)["correct"] == bool(expected) for x in lines)
    assert (out / "table.txt").read_text().count("\n") > 5


def test_periodic_eval_inputs_fail_before_the_run(aime2024, qwen_tokenizer):
    cfg = _config(aime2024)
    with pytest.raises(ConfigError, match=r"exceeds rollout\.max_model_len=100"):
        _prepare(dataclasses.replace(cfg, rollout=RolloutConfig(max_model_len=100)), qwen_tokenizer)
    with pytest.raises(ConfigError, match="needs a task with a tokenizer"):
        _prepare(cfg, None)
    synthetic = dataclasses.replace(cfg, data=DataConfig())
    with pytest.raises(ConfigError, match="needs a dataset task"):
        synthetic.validate()
    no_path = dataclasses.replace(cfg, eval=EvalConfig(data=DataConfig(source="dataset")))
    with pytest.raises(ConfigError, match=r"needs eval\.data\.path"):
        _prepare(no_path, qwen_tokenizer)
    bad_k = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, ks=[4]))
    with pytest.raises(ConfigError, match="eval: ks contains 4"):
        bad_k.validate()
    assert _prepare(dataclasses.replace(cfg, run=RunConfig()), qwen_tokenizer) is None


def test_eval_is_due_every_n_steps():
    cfg = ExperimentConfig(run=RunConfig(eval_every=3))
    assert [s for s in range(10) if due(cfg.run.eval_every, s)] == [2, 5, 8]
    assert not any(due(ExperimentConfig().run.eval_every, s) for s in range(10))
