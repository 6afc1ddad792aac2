"""Compose, validate and print a training configuration without running anything.

    python -m recipes.check experiment=qwen3_30b_a3b_tppo algo.window=4096

Exit status 0 when the configuration is valid; a bad key or value prints one message and exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json

from recipes._hydra import recipe
from tppo.config import ExperimentConfig


@recipe("train")
def main(cfg: ExperimentConfig) -> None:
    print(json.dumps(dataclasses.asdict(cfg), indent=2))


if __name__ == "__main__":
    main()
