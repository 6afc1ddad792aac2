"""Tasks: where prompts come from and how finished responses are verified, selected by `data.source`.

A task gives the pool a dataset of `Prompt`s, the verifier that scores a finished `Sample`, the token ids that
end a response, and (optionally) demonstrations for a supervised warm start. The synthetic countdown task of
the default recipe lives in rollout/synthetic.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rollout import synthetic
from tppo.config import ExperimentConfig
from tppo.pool import Prompt, Sample


@dataclass(frozen=True)
class Task:
    dataset: object  # len() and [i] -> Prompt
    verifier: Callable[[Sample], float]
    stop_token_ids: tuple[int, ...]
    demonstrate: Callable[[Prompt, np.random.Generator], list[int]] | None = None
    vocab_size: int | None = None


class CountdownDataset:
    """A fixed, seeded set of countdown prompts (rollout.synthetic)."""

    def __init__(self, num_prompts: int, seed: int) -> None:
        self.starts = synthetic.sample_starts(num_prompts, np.random.default_rng(seed))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Prompt:
        n = int(self.starts[index])
        return Prompt(uid=f"countdown-{index}", prompt_ids=np.asarray(synthetic.prompt_ids(n)), answer=str(n))


def _countdown_score(sample: Sample) -> float:
    return synthetic.score(sample.prompt_ids, sample.response_ids)


def _countdown_demo(prompt: Prompt, rng: np.random.Generator) -> list[int]:
    return synthetic.warm_start_response(synthetic.start_of(prompt.prompt_ids), rng)


def build_task(cfg: ExperimentConfig) -> Task:
    if cfg.data.source == "synthetic":
        if cfg.model.vocab_size < synthetic.VOCAB_SIZE:
            raise ValueError(f"the countdown task needs model.vocab_size >= {synthetic.VOCAB_SIZE}")
        if cfg.algo.max_response_length < synthetic.MAX_NUMBER + 1:
            raise ValueError(
                f"the countdown task needs algo.max_response_length >= {synthetic.MAX_NUMBER + 1}"
            )
        return Task(
            dataset=CountdownDataset(4096, cfg.run.seed),
            verifier=_countdown_score,
            stop_token_ids=(synthetic.EOS,),
            demonstrate=_countdown_demo,
            vocab_size=synthetic.VOCAB_SIZE,
        )
    raise NotImplementedError(
        f"data.source={cfg.data.source!r}: the training loop runs the synthetic task so far; dataset tasks "
        "(math with a tokenizer and the math verifier) are wired in recipes.eval, not yet in training"
    )
