"""A run's own export evaluates on the run's own task: the policy's Hugging Face export carries the tokenizer
the run trained with (the countdown's too), so `python -m recipes.eval checkpoint=<export or run dir>
data=synthetic` loads it and prints the per-problem table."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_testlib import run, train_cmd

HEADER = ["problem", "correct", "majority", "(votes)", "reference", "cons"]

# The default recipe's policy, built in-process (one rank, no Ray) and exported as the run's checkpoints
# export it.
EXPORT = """
import dataclasses
import sys
from pathlib import Path
from recipes._hydra import compose
from tppo.cluster.roles import Trainer, start_trainers
from tppo.loop.run import export_policy
from tppo.loop.tasks import build_task

cfg = compose("train", [])
parallel = dataclasses.replace(cfg.parallel, expert_parallel=1)
group = start_trainers(
    "policy", cfg.model, parallel, cfg.algo.actor_optim, 1, seed=0, total_steps=1, remote=False
)
export_policy(Trainer(group, micro_batch_size=2, routing=False), build_task(cfg), Path(sys.argv[1]))
"""


def _eval(checkpoint: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "recipes.eval", f"checkpoint={checkpoint}", "data=synthetic", "n=4"]
    return run([*cmd, "device=cpu", f"output_dir={out}", "logging=disabled", *extra])


def _check_table(printed: str, out_dir: Path) -> None:
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == HEADER)
    rows = [line.split() for line in lines[header + 2 : header + 2 + 56]]
    assert [r[0] for r in rows] == [f"countdown-{n}" for n in range(4, 60)]  # every start the task draws
    assert all(r[1].endswith("/4") for r in rows)
    assert any(
        line.startswith("synthetic of ") and line.endswith(": 56 problems x 4 samples") for line in lines
    )
    generated = [json.loads(x) for x in (out_dir / "generations.jsonl").read_text().splitlines()]
    assert len(generated) == 56 * 4 and all(1 <= g["num_tokens"] <= 60 for g in generated)


def test_the_exported_policy_evaluates_on_the_countdown(tmp_path):
    export = tmp_path / "policy_hf"
    made = run([sys.executable, "-c", EXPORT, str(export)])
    assert made.returncode == 0, made.stderr[-3000:]
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= {p.name for p in export.iterdir()}
    done = _eval(export, tmp_path / "eval", "run_name=countdown")
    assert done.returncode == 0, done.stderr[-3000:]
    _check_table(done.stdout, tmp_path / "eval" / "countdown")


@pytest.mark.slow
@pytest.mark.dist
def test_a_trained_run_directory_evaluates_on_its_own_task(tmp_path, default_run):
    """`make train` then `python -m recipes.eval checkpoint=runs/default data=synthetic n=4`, on a short
    run."""
    shutil.copytree(
        default_run, tmp_path / "default"
    )  # the refused re-run below must not touch the shared run
    done = _eval(tmp_path / "default", tmp_path / "eval")
    assert done.returncode == 0, done.stderr[-3000:]
    _check_table(done.stdout, tmp_path / "eval" / "default-step_000004-synthetic")
    # The run's checkpoint also keeps the settings it was written with: a re-run with another batch size is
    # refused.
    refused = run([*train_cmd(tmp_path, "default"), "algo.batch_size=4"])
    assert refused.returncode == 2 and refused.stderr.startswith("error: cannot resume: ")
    assert "(algo.batch_size=8 now 4); to start afresh, pick a new run.name" in refused.stderr
