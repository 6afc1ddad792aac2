"""The recipes run as a user runs them: a subprocess from the repository root, wandb off, Ray without auth."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def train_cmd(out: Path, name: str, *extra: str) -> list[str]:
    """The default recipe, 5 short steps with checkpoints after steps 1, 3 and 4 (the last two kept)."""
    return [
        sys.executable,
        "-m",
        "recipes.train",
        f"run.output_dir={out}",
        f"run.name={name}",
        "run.num_steps=5",
        "run.save_every=2",
        "algo.warm_start_steps=3",
        "algo.critic_warmup_steps=1",
        "algo.batch_size=8",
        "logging.wandb=disabled",
        "logging.progress=false",
        *extra,
    ]


def recipe_env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}


def run(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=recipe_env(), capture_output=True, text=True, timeout=timeout)
