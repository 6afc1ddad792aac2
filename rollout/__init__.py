"""Generation side: the MoE rollout engine (KV cache, continuous batching, T-PPO windows, routing capture),
tokenizers, prompt data and rewards.

`from rollout import RolloutEngine, SamplingParams` works without importing torch at `import rollout` time
(tppo.config imports rollout.config, which every entry point loads): the names resolve lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.engine import GenerationOutput, RolloutEngine
    from rollout.params import SamplingParams

__all__ = ["GenerationOutput", "RolloutEngine", "SamplingParams"]

_LAZY = {
    "RolloutEngine": "rollout.engine",
    "GenerationOutput": "rollout.engine",
    "SamplingParams": "rollout.params",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
