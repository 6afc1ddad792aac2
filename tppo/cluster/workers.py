"""Rank-side workers: one Megatron-Core rank of the policy or the critic. A plain class, so the same code runs
as a Ray actor (`ray.remote(TrainerWorker)`) or in-process (single-rank debugging and tests).

Each worker joins its role's own torch.distributed world (gloo on CPU, NCCL on GPU) through the usual
environment variables, set here from the arguments the driver hands out; policy and critic live in
different processes, so their Megatron parallel states never meet.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from relibra.plan import Plan, Topology
from relibra.validate import PlanError
from tppo.algo.stages import mismatch_inputs, rollout_mismatch, store_old_logprobs, store_ref_logprobs
from tppo.engine.batch import ForwardOutput, LossOutput, StepResult, TrainBatch, to_device
from tppo.engine.config import BackendConfig, ModelConfig, OptimConfig, ParallelConfig
from tppo.engine.layout import RouterLayout, expert_counts_LE

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """Where one rank sits in its role's world."""

    role: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    num_threads: int = 1


@dataclass(frozen=True)
class OldLogprobsReport:
    """What a rank reports after computing the old log-probs: the rollout/trainer mismatch of the whole batch
    (rank 0; empty elsewhere) and, when it recorded the routing (R2), its expert loads [M, L, E]."""

    metrics: dict[str, float]
    counts_MLE: np.ndarray | None = None


@dataclass(frozen=True)
class ExecutorSpec:
    """The policy ranks' ReLibra executor: the topology the driver's planner plans for (EP group, node size,
    replica slots per rank) and the receive buffers of a migration's optimizer state."""

    topology: Topology
    state_buffer_mb: int


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
        relibra: ExecutorSpec | None = None,
        backend: BackendConfig | None = None,
    ) -> None:
        os.environ.update(
            RANK=str(spec.rank),
            WORLD_SIZE=str(spec.world_size),
            LOCAL_RANK=str(spec.rank),
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.master_port),
        )
        torch.set_num_threads(spec.num_threads)
        self.spec = spec
        self.backend = backend or BackendConfig()
        # The reference policy is a policy network that only ever runs forward: no gradients, no optimizer.
        engine_role = "critic" if spec.role == "critic" else "policy"
        optimizer = "none" if spec.role == "reference" else "auto"
        if self.backend.engine == "deepspeed":
            if relibra is not None:
                raise ValueError(
                    f"{spec.role}: ReLibra needs the Megatron backend (backend.{spec.role}.engine)"
                )
            from tppo.engine.deepspeed_engine import DeepSpeedEngine

            self.engine = DeepSpeedEngine(
                model,
                optim,
                role=engine_role,
                zero=self.backend,
                total_steps=total_steps,
                seed=seed,
                optimizer=optimizer,
            )
        else:
            from tppo.engine.engine import MegatronEngine

            self.engine = MegatronEngine(
                model,
                parallel,
                optim,
                role=engine_role,
                total_steps=total_steps,
                seed=seed,
                optimizer=optimizer,
            )
        self._staged: list[TrainBatch] | None = None
        self.executor = None
        if relibra is not None:
            from relibra.executor.executor import ExpertExecutor

            topo = relibra.topology
            self.executor = ExpertExecutor(
                self.engine,
                num_replica_slots=topo.num_replica_slots,
                gpus_per_node=topo.gpus_per_node,
                state_buffer_mb=relibra.state_buffer_mb,
            )
            if self.executor.topo != topo:
                raise ValueError(f"the planner's topology {topo} is not this rank's {self.executor.topo}")

    def ready(self) -> int:
        return self.spec.rank

    def offload(self) -> None:
        """Free the device for a colocated role (weights and optimizer state to host, gradients dropped); the
        next call that needs them brings them back."""
        if not self.engine.offloaded:
            self.engine.offload()

    def _awake(self) -> None:
        if self.engine.offloaded:
            self.engine.onload()

    def router_layout(self) -> RouterLayout:
        """How this rank pads micro-batches for its routers (the driver counts ReLibra's loads the same way)."""
        return self.engine.router_layout

    def forward(
        self, batches: Sequence[TrainBatch], with_entropy: bool = False, record_routing: bool = False
    ) -> list[ForwardOutput]:
        self._awake()
        outs = self.engine.forward(
            list(batches),
            with_entropy=with_entropy,
            record_routing=record_routing,
            require_replay=_replayed(batches),
        )
        return _on_host(outs)

    def stage(self, batches: Sequence[TrainBatch]) -> None:
        """Keep this step's micro-batches on the rank: the old log-probs, the reference log-probs and the update
        then work on them without the batches travelling again."""
        _replayed(batches)
        self._staged = list(batches)

    def old_logprobs(self, record_routing: bool = False) -> OldLogprobsReport:
        """The pre-update log-probs of the staged batches, stored in them (with R2, the experts the router chose,
        which the update replays). Rank 0 returns the rollout/trainer mismatch of the whole batch (every rank's
        tokens, gathered in rank order); with `record_routing` each rank returns its expert loads."""
        batches = self._staged_batches()
        outs = self.forward(batches, record_routing=record_routing)
        store_old_logprobs(batches, outs, take_routing=record_routing)
        loads = self._expert_counts(batches) if record_routing else None
        return OldLogprobsReport(metrics=self._mismatch(batches), counts_MLE=loads)

    def _mismatch(self, batches: list[TrainBatch]) -> dict[str, float]:
        """The rollout/trainer log-prob mismatch of the whole batch (every rank's tokens, gathered in rank order)
        on rank 0; empty elsewhere."""
        world = self.engine.groups.world
        parts: list | None = [None] * dist.get_world_size(world) if self.spec.rank == 0 else None
        dist.gather_object(mismatch_inputs(batches), parts, dst=dist.get_global_rank(world, 0), group=world)
        return rollout_mismatch(parts) if parts is not None else {}

    def ref_logprobs(self, outs: Sequence[ForwardOutput]) -> None:
        """The reference policy's log-probs of the staged batches (its forward on the same micro-batches)."""
        store_ref_logprobs(self._staged_batches(), outs)

    def _expert_counts(self, batches: list[TrainBatch]) -> np.ndarray:
        """[M, L, E]: this rank's (token, top-k) pairs per expert, on the shapes the engine runs (padding
        included), from the routing the batches replay."""
        num_experts = self.engine.model_cfg.num_experts
        shapes = self.engine.run_shapes(batches)
        return np.stack([expert_counts_LE(b, s, num_experts) for b, s in zip(batches, shapes, strict=True)])

    def _staged_batches(self) -> list[TrainBatch]:
        if self._staged is None:
            raise RuntimeError(
                f"{self.spec.role} rank {self.spec.rank}: no micro-batches staged for this step"
            )
        return self._staged

    def train(
        self,
        objectives: Sequence[Callable[[ForwardOutput, TrainBatch], LossOutput]],
        schedule: Sequence[Sequence[int]] | None = None,
        plan: Plan | None = None,
        loads_MLSE: np.ndarray | None = None,
        old_from_update: bool = False,
    ) -> list[StepResult]:
        """One optimizer step per entry of `schedule` (the staged micro-batches it lists; None: one step over all
        of them) with the matching objective; the staged batches are released afterwards. With a ReLibra `plan`
        the experts are placed by it once and every micro-batch, in the order the steps run it, is routed and
        replicated by its own row of the plan. With `old_from_update` (one step over every staged micro-batch,
        an objective that takes its old log-probs from its own forward) the step's log-probs are the old ones:
        rank 0's last result carries their rollout/trainer mismatch, as `old_logprobs` reports it."""
        self._awake()
        batches = self._staged_batches()
        schedule = [list(range(len(batches)))] if schedule is None else [list(s) for s in schedule]
        if len(objectives) != len(schedule):
            raise ValueError(f"{len(objectives)} objectives for {len(schedule)} optimizer steps")
        if old_from_update and (len(schedule) != 1 or sorted(schedule[0]) != list(range(len(batches)))):
            raise ValueError(
                f"old log-probs from the update need one optimizer step over every staged micro-batch, got {schedule}"
            )
        self._staged = None
        replay = _replayed(batches)
        order = [m for step in schedule for m in step]
        use_plan = plan is not None and self.executor is not None
        applied = use_plan and self._begin_plan(plan.select(order), loads_MLSE[order], len(order))
        try:
            results = [
                self.engine.train_step(
                    [batches[m] for m in step],
                    objective,
                    require_replay=replay,
                    keep_logprobs=old_from_update,
                )
                for step, objective in zip(schedule, objectives, strict=True)
            ]
        except BaseException:
            if applied:
                with contextlib.suppress(Exception):
                    self.executor.end_step()
            raise
        if use_plan:
            last = results[-1]
            last.plan_applied = applied
            last.metrics |= (self.executor.end_step() if applied else {}) | {
                "relibra/exec_refused": float(not applied)
            }
        if old_from_update:
            (step,) = schedule
            outs, results[0].outputs = results[0].outputs, None
            # on the host beside the rollout's log-probs, as `forward` returns them
            store_old_logprobs([batches[m] for m in step], _on_host(outs), take_routing=False)
            results[-1].metrics |= self._mismatch(batches)
        return results

    def _begin_plan(self, plan: Plan, loads_MLSE: np.ndarray, num_microbatches: int) -> bool:
        """Apply `plan` for the coming step; False when the ranks refused it (they vote before anything moves,
        so all refuse together and train under the current placement)."""
        try:
            self.executor.begin_step(plan, loads_MLSE, num_microbatches=num_microbatches)
        except PlanError as err:
            _log.warning(
                "rank %d: ReLibra plan refused, training under the current placement: %s", self.spec.rank, err
            )
            return False
        return True

    def hf_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The weights in buckets of about `bucket_bytes`, one bucket at a time: as a Ray actor method each is its
        own object, gathered while the one before is being loaded, so no process holds the whole model twice.
        Every rank must run it to the end (the export gathers experts); rank 0 yields the buckets, others none."""
        self._awake()
        for bucket in self.engine.iter_hf_weights(bucket_bytes=bucket_bytes):
            if self.spec.rank == 0:
                yield [(name, own_storage(t)) for name, t in bucket]

    def load_hf(self, path: str) -> None:
        """Load a Hugging Face checkpoint's weights (the reference policy from the policy's export)."""
        self._awake()
        if self.backend.engine == "deepspeed":
            self.engine.load_hf(path)
        else:
            from tppo.engine.convert import load_hf_checkpoint

            load_hf_checkpoint(self.engine, path)

    def export_hf(self, out_dir: str) -> None:
        self._awake()
        self.engine.export_hf(out_dir)

    def save(self, path: str, with_optimizer: bool = True) -> None:
        """Write this rank's shard; without the optimizer state for a forward-only copy (the reference policy).
        The DeepSpeed backend writes its own checkpoint, one folder for all ranks beside the shard paths."""
        self._awake()
        if self.backend.engine == "deepspeed":
            self.engine.save(str(deepspeed_dir(path)))
            return
        from tppo.base.checkpoint import save_file

        state = self.engine.state_dict()
        if not with_optimizer:
            state["optimizer"] = None
        save_file(state, Path(path))

    def load(self, path: str) -> None:
        self._awake()
        if self.backend.engine == "deepspeed":
            self.engine.load(str(deepspeed_dir(path)))
            return
        from tppo.base.checkpoint import load_file

        state = load_file(Path(path))
        if self.executor is not None:
            # The checkpoint's placement is the planner's too (saved with the driver): keep it.
            self.executor.load_checkpoint(state, keep_saved_placement=True)
        else:
            self.engine.load_state_dict(state)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a compact copy of it where it views a larger storage (an expert's slice of a layer's stacked
    weights, a parameter inside a contiguous buffer): pickling a view writes its whole storage, so a bucket of
    views would ship the buffers behind them once per bucket."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def deepspeed_dir(shard: str | Path) -> Path:
    """The folder of a DeepSpeed role's checkpoint, shared by its ranks: <dir>/<role>_rank<r>.pt ->
    <dir>/<role>_deepspeed."""
    shard = Path(shard)
    return shard.with_name(re.sub(r"_?rank\d+\.pt$", "", shard.name) + "_deepspeed")


def _on_host(outs: Sequence[ForwardOutput]) -> list[ForwardOutput]:
    """Forward outputs moved to the CPU, where the staged batches (and the rollout's log-probs) live."""
    return [to_device(o, torch.device("cpu")) for o in outs]


def _replayed(batches: Sequence[TrainBatch]) -> bool:
    """Batches that carry routing must be replayed exactly; a batch without routing is never silently mixed in."""
    flags = {b.routed_experts_BTLK is not None for b in batches}
    if len(flags) > 1:
        raise ValueError("routed_experts_BTLK is missing for some micro-batches of a replayed step")
    return flags == {True}
