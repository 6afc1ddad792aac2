"""The training recipe ends bad input with one `error:` line and exit status 2 before anything starts (no Ray,
no trainer): a dataset that is missing or malformed, a re-run whose settings differ from those of its
checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes._hydra import compose
from tppo.base import checkpoint
from tppo.loop.run import resume_settings

ROOT = Path(__file__).resolve().parents[2]


def _train(*overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    env.pop("TPPO_DEBUG", None)
    cmd = [
        sys.executable,
        "-m",
        "recipes.train",
        "logging.wandb=disabled",
        "logging.progress=false",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            None,
            "data.path='{path}' does not exist; set data.path to an existing JSONL/Parquet file or folder",
        ),
        ('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": \n', "{path}: row 2: invalid JSON"),
        ('{"question": "1+1", "answer": "2"}\n', "{path}: row 1: field 'problem' is missing"),
    ],
    ids=["missing", "bad_json", "no_prompt_key"],
)
def test_a_bad_dataset_ends_training_with_one_line(tmp_path, content, message):
    path = tmp_path / "gsm8k.jsonl"
    if content is not None:
        path.write_text(content)
    done = _train("experiment=gsm8k_tiny", f"data.path={path}", f"run.output_dir={tmp_path / 'runs'}")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"error: {message.format(path=path)}")


def test_a_rerun_with_another_model_shape_or_batch_size_names_what_changed(tmp_path):
    """The checkpoint holds what `_save` writes of the driver's state (its settings); the re-run changes two
    of them and is refused with one line naming both and what to do, before any process starts."""
    run = [f"run.output_dir={tmp_path}", "run.name=r"]
    ckpt = checkpoint.begin(tmp_path / "r" / "checkpoints", 3)
    checkpoint.save_file(
        {"step": 3, "settings": resume_settings(compose("train", run))}, ckpt.tmp / "driver.pt"
    )
    checkpoint.commit(ckpt, keep=2)
    done = _train(*run, "model.hidden_size=128", "algo.batch_size=16")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: cannot resume: {tmp_path}/r/checkpoints/step_000003 was written with other settings "
        "(model.hidden_size=64 now 128, algo.batch_size=32 now 16); to start afresh, pick a new run.name or "
        f"move {tmp_path}/r away\n"
    )


def test_tppo_debug_shows_the_traceback_instead(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled", "TPPO_DEBUG": "1"}
    cmd = [
        sys.executable,
        "-m",
        "recipes.train",
        "experiment=gsm8k_tiny",
        f"data.path={tmp_path / 'nope.jsonl'}",
    ]
    cmd += [f"run.output_dir={tmp_path / 'runs'}", "logging.wandb=disabled"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "rollout.data.DataError: data.path=" in done.stderr
