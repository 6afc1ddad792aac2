"""RolloutWorker: the rollout engine behind a small interface for the driver (generate, load_weights).

`sleep` / `wake` time-share the device with colocated trainers (generate and load_weights wake it).

In the disaggregated layout (`rollout.disagg`) a replica is one attention worker and its expert workers, each a
RolloutWorker with a `DisaggSeat`: the attention worker runs the engine without experts, an expert worker holds
a range of experts and answers the attention worker's transfers while the driver's `generate` call runs on it
(its outputs are empty); the driver sends each its own part of a weight sync.

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
from rollout.disagg import DisaggregatedEngine, DisaggSeat, ExpertWorker, init_group
from rollout.engine import GenerateStats, GenerationOutput, RolloutEngine
from rollout.params import SamplingParams


@dataclass(frozen=True)
class WorkerInfo:
    device: str
    dtype: str
    max_seqs: int
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
        seat: DisaggSeat | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.seat = seat
        self.expert: ExpertWorker | None = None
        if seat is None:
            self.engine = RolloutEngine.from_pretrained(model_path, device=device, dtype=dtype, config=config)
        else:
            init_group(seat.rank, seat.world_size, seat.init_method)
            if seat.experts is None:
                self.engine = DisaggregatedEngine.from_pretrained(
                    model_path, seat.layout, device, dtype, config
                )
            else:
                self.expert = ExpertWorker.from_pretrained(
                    model_path, seat.experts, seat.layout, device, dtype
                )
        self._asleep = None
        self._graphs = config.cuda_graphs if config is not None else True

    def ready(self) -> bool:
        """Returns once the worker is built (in the disaggregated layout: once its whole replica joined)."""
        return True

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            str(e.device),
            str(e.dtype).removeprefix("torch."),
            e.max_seqs,
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
        if self.expert is not None:  # serve the attention worker until its generate call ends
            self.expert.serve()
            return []
        if not prompt_token_ids and self.seat is None:  # a worker whose share of a small batch is empty
            self.engine.last_stats = GenerateStats()
            return []
        self.wake()
        return self.engine.generate(prompt_token_ids, params)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """One bucket of (hf_name, tensor) pairs, copied in place; returns the number of hub tensors written."""
        if self.expert is not None:
            return self.expert.load_weights(named_tensors)
        self.wake()
        return self.engine.load_weights(named_tensors)

    def last_stats(self) -> GenerateStats:
        return self.engine.last_stats

    # ---------------------------------------------------------------------------------- colocated memory
    def sleep(self) -> None:
        """Give the device memory to colocated trainers between generate calls: the KV cache is released
        without a copy (it never outlives a generate call), step CUDA graphs are dropped (they hold the old
        storages' addresses; the next generate captures again), the weights are copied to host memory."""
        from tppo.base.offload import StorageOffloader

        if self.seat is not None:
            raise RuntimeError(
                "rollout workers of the disaggregated layout do not time-share their devices: run them with "
                "cluster.placement=separate or cluster.offload=off"
            )
        if self._asleep is not None:
            return
        e = self.engine
        # A failed capture (e.g. fp32 grouped GEMMs, which sync with the host) stays failed: do not retry it.
        self._graphs = e.runner.use_cuda_graphs
        e.runner = None
        if e.device.type == "cuda":
            torch.cuda.synchronize(e.device)
        self._asleep = StorageOffloader()
        self._asleep.offload(e.weights.tensors(), drop=e.cache.tensors())
        if e.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Restore what `sleep` released (weights bit-exact, the KV cache zeroed) and the step runner."""
        if self._asleep is None:
            return
        self._asleep.onload()
        self._asleep = None
        e = self.engine
        e.runner = e.new_runner(self._graphs)

    @property
    def asleep(self) -> bool:
        return self._asleep is not None
