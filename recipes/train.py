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
    from rollout.data import DataError
    from tppo.base.checkpoint import CheckpointError
    from tppo.base.fields import ConfigError
    from tppo.cluster.roles import RoleError
    from tppo.loop.run import run_dir, train
    from tppo.loop.tasks import TaskError

    try:
        summary = train(cfg)
    except (DataError, TaskError, ConfigError) as err:  # inputs, refused before anything starts
        fail(str(err))
    except RoleError as err:
        fail(f"training stopped: {err}")
    except CheckpointError as err:
        fail(f"cannot resume: {err}")
    print(json.dumps(summary, indent=2))
    print(f"run directory: {run_dir(cfg)}")


if __name__ == "__main__":
    main()
