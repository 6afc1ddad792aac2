"""Rank-side workers: one Megatron-Core rank of the policy or the critic. A plain class, so the same code runs
as a Ray actor (`ray.remote(TrainerWorker)`) or in-process (single-rank debugging and tests).

Each worker joins its role's own torch.distributed world (gloo on CPU, NCCL on GPU) through the usual
environment variables, set here from the arguments the driver hands out; policy and critic live in
different processes, so their Megatron parallel states never meet.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tppo.config import ModelConfig, OptimConfig, ParallelConfig
from tppo.engine.batch import ForwardOutput, LossOutput, StepResult, TrainBatch, to_device


@dataclass(frozen=True)
class RankSpec:
    """Where one rank sits in its role's world."""

    role: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    num_threads: int = 1


class TrainerWorker:
    """One rank of a policy or critic: forward, train, export weights, save and load its shard."""

    def __init__(
        self,
        spec: RankSpec,
        model: ModelConfig,
        parallel: ParallelConfig,
        optim: OptimConfig,
        total_steps: int | None,
        seed: int,
    ) -> None:
        os.environ.update(
            RANK=str(spec.rank),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_RANK=str(spec.rank),
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.master_port),
        )
        torch.set_num_threads(spec.num_threads)
        from tppo.engine.engine import MegatronEngine

        self.spec = spec
        self.engine = MegatronEngine(
            model, parallel, optim, role=spec.role, total_steps=total_steps, seed=seed
        )

    def ready(self) -> int:
        return self.spec.rank

    def forward(
        self, batches: Sequence[TrainBatch], with_entropy: bool = False, record_routing: bool = False
    ) -> list[ForwardOutput]:
        outs = self.engine.forward(
            list(batches),
            with_entropy=with_entropy,
            record_routing=record_routing,
            require_replay=_replayed(batches),
        )
        return [to_device(o, torch.device("cpu")) for o in outs]

    def train(
        self, batches: Sequence[TrainBatch], objective: Callable[[ForwardOutput, TrainBatch], LossOutput]
    ) -> StepResult:
        return self.engine.train_step(list(batches), objective, require_replay=_replayed(batches))

    def hf_weights(self, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
        """Every rank must call this (the export gathers experts); rank 0 returns the buckets, others []."""
        buckets = [list(b) for b in self.engine.iter_hf_weights(bucket_bytes=bucket_bytes)]
        return buckets if self.spec.rank == 0 else []

    def export_hf(self, out_dir: str) -> None:
        self.engine.export_hf(out_dir)

    def save(self, path: str) -> None:
        from tppo.checkpoint import save_file

        save_file(self.engine.state_dict(), Path(path))

    def load(self, path: str) -> None:
        from tppo.checkpoint import load_file

        self.engine.load_state_dict(load_file(Path(path)))

    def lr(self) -> float:
        return self.engine.lr


def _replayed(batches: Sequence[TrainBatch]) -> bool:
    """Batches that carry routing must be replayed exactly; a batch without routing is never silently mixed in."""
    flags = {b.routed_experts_BTLK is not None for b in batches}
    if len(flags) > 1:
        raise ValueError("routed_experts_BTLK is missing for some micro-batches of a replayed step")
    return flags == {True}
