"""Reward functions, registered by name: `REWARDS.get(name)(responses, answers) -> list[float]`.

- "math": 1.0 when the response's final answer (last \\boxed{...}, else a marked final answer) is mathematically
  equal to the reference (math-verify in worker processes with a hard time limit), else 0.0.
- "exact": 1.0 when the stripped response equals the stripped reference (the built-in synthetic task).

Importing this package is light: math-verify is only imported inside the verification worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout.rewards import math as math_reward
from tppo.base.registry import Registry

RewardFn = Callable[[Sequence[str], Sequence[str]], list[float]]
REWARDS: Registry[RewardFn] = Registry("reward function")


@REWARDS.register("math")
def math_rewards(responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    return math_reward.score_batch(responses, answers)


@REWARDS.register("exact")
def exact_rewards(responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 if response.strip() == answer.strip(), else 0.0."""
    if len(responses) != len(answers):
        raise ValueError(
            f"responses ({len(responses)}) and answers ({len(answers)}) must have the same length"
        )
    return [1.0 if r.strip() == a.strip() else 0.0 for r, a in zip(responses, answers)]


__all__ = ["REWARDS", "RewardFn", "exact_rewards", "math_rewards"]
