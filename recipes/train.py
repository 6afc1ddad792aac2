"""The training recipe: T-PPO with EGAE on Megatron-Core, routing replay, ReLibra.

    python -m recipes.train                                  # the default recipe (CPU, minutes)
    python -m recipes.train experiment=qwen3_30b_a3b_tppo    # a real model on a Slurm allocation

Re-running the same command (same run.name) resumes from the run's last complete checkpoint.
"""

from __future__ import annotations

import json

from recipes._hydra import fail, recipe
from tppo.config import ExperimentConfig


@recipe("train")
def main(cfg: ExperimentConfig) -> None:
    from tppo.base.checkpoint import CheckpointError
    from tppo.cluster.roles import RoleError
    from tppo.loop.run import run_dir, train

    try:
        summary = train(cfg)
    except RoleError as err:
        fail(f"training stopped: {err}")
    except CheckpointError as err:
        fail(f"cannot resume: {err}")
    print(json.dumps(summary, indent=2))
    print(f"run directory: {run_dir(cfg)}")


if __name__ == "__main__":
    main()
