"""RolloutWorker: the rollout engine behind a small interface for the driver (generate, load_weights).

A plain class: tests and single-GPU debugging use it in-process; the driver places it with
`ray.remote(num_gpus=1)(RolloutWorker).remote(...)`. Its arguments and results are picklable (the config is a
dataclass, outputs are `GenerationOutput` records of lists and numpy arrays), and weight buckets arrive as
lists of (hf_name, tensor) pairs, so nothing here depends on Ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from rollout.config import RolloutConfig
from rollout.engine import GenerateStats, GenerationOutput, RolloutEngine
from rollout.params import SamplingParams


@dataclass(frozen=True)
class WorkerInfo:
    device: str
    dtype: str
    num_slots: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    num_moe_layers: int
    top_k: int
    num_experts: int


class RolloutWorker:
    """One engine on one device (see the module docstring)."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "auto",
        config: RolloutConfig | None = None,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.engine = RolloutEngine.from_pretrained(model_path, device=device, dtype=dtype, config=config)

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            str(e.device),
            str(e.dtype).removeprefix("torch."),
            e.num_slots,
            e.max_model_len,
            tuple(sorted(e.eos_token_ids)),
            e.spec.num_moe_layers,
            e.spec.top_k,
            e.spec.num_experts,
        )

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        return self.engine.generate(prompt_token_ids, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One bucket of (hf_name, tensor) pairs, copied in place; returns the number of hub tensors written."""
        return self.engine.load_weights(named_tensors)

    def last_stats(self) -> GenerateStats:
        return self.engine.last_stats
