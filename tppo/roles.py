"""Driver-side handles of the roles: the policy and critic trainers (groups of Megatron ranks) and the rollout
engine, as Ray actors in the run's placement group (tppo.placement), or in-process objects for single-rank
debugging.

The driver talks to a role through a handful of methods (values, log-probs, update, weights); this module turns
pool samples into per-rank micro-batches (tppo.batching) and back. A dead actor ends the run with a message that
names the role and rank, never a hang: every remote call waits with a timeout.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tppo.balance import RouterLayout, StepPlan
from tppo.batching import Placement, critic_batch, place, policy_batch, split_for_ranks
from tppo.config import ExperimentConfig, ParallelConfig
from tppo.engine.batch import StepResult, TrainBatch
from tppo.engine.parallel import reserved_port
from tppo.objectives import (
    PolicyObjective,
    SupervisedObjective,
    ValueObjective,
    live_rows,
    positive_tokens,
)
from tppo.placement import Reservation
from tppo.pool import Sample
from tppo.workers import ExecutorSpec, RankSpec, TrainerWorker

CALL_TIMEOUT_S = 1800.0


class RoleError(RuntimeError):
    """A role's process died or failed; the message names the role and rank."""


class RankGroup:
    """The ranks of one role. Every call goes to all ranks (they run collectives together)."""

    def __init__(self, name: str, handles: list[Any], remote: bool) -> None:
        self.name, self.handles, self.remote = name, handles, remote

    @property
    def size(self) -> int:
        return len(self.handles)

    def call(self, method: str, per_rank: Sequence[tuple] | None = None, *args: Any) -> list[Any]:
        """Call `method` on every rank, with per-rank arguments or the same `args`, and wait for all."""
        arg_lists = list(per_rank) if per_rank is not None else [args] * self.size
        if not self.remote:
            return [getattr(h, method)(*a) for h, a in zip(self.handles, arg_lists)]
        import ray

        refs = [getattr(h, method).remote(*a) for h, a in zip(self.handles, arg_lists)]
        try:
            return ray.get(refs, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as err:
            raise RoleError(f"a {self.name} rank died during {method}(): {err}") from err
        except ray.exceptions.GetTimeoutError as err:
            raise RoleError(f"{self.name}.{method}() did not finish within {CALL_TIMEOUT_S:.0f} s") from err
        except ray.exceptions.RayTaskError as err:
            raise RoleError(f"{self.name}.{method}() failed: {err}") from err


def generate_split(rollout: RankGroup, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
    """Generate on every rollout worker at once, each taking a contiguous share of the requests; outputs come
    back in request order (a request's seed, not its worker, decides what it samples)."""
    n = len(prompts)
    bounds = [n * w // rollout.size for w in range(rollout.size + 1)]
    shares = [([list(p) for p in prompts[a:b]], list(params[a:b])) for a, b in itertools.pairwise(bounds)]
    return [out for outs in rollout.call("generate", shares) for out in outs]


def start_trainers(
    role: str,
    cfg: ExperimentConfig,
    parallel: ParallelConfig,
    num_ranks: int,
    remote: bool,
    total_steps: int,
    placement: Reservation | None = None,
) -> RankGroup:
    """Start `num_ranks` TrainerWorkers of `role` (Ray actors when `remote`, in `placement`'s bundles when
    given), wait until all are built (the rendezvous port stays reserved until then)."""
    optim = cfg.algo.critic_optim if role == "critic" else cfg.algo.actor_optim
    with reserved_port() as port:
        handles = []
        for rank in range(num_ranks):
            spec = RankSpec(
                role=role, rank=rank, world_size=num_ranks, master_addr="127.0.0.1", master_port=port
            )
            args = (
                spec,
                cfg.model,
                parallel,
                optim,
                total_steps,
                cfg.run.seed + (1 if role == "critic" else 0),
                executor_spec(cfg) if role == "policy" else None,
            )
            if remote:
                import ray

                options = placement.options(role, rank) if placement else {"num_cpus": 0.01}
                handles.append(ray.remote(TrainerWorker).options(**options).remote(*args))
            else:
                handles.append(TrainerWorker(*args))
        group = RankGroup(role, handles, remote)
        group.call("ready")
    return group


def executor_spec(cfg: ExperimentConfig) -> ExecutorSpec | None:
    """The policy applies ReLibra plans when they exist: the planner runs and the update replays routing."""
    if not relibra_applies(cfg):
        return None
    return ExecutorSpec(
        replica_slots=cfg.relibra.replica_slots,
        gpus_per_node=cfg.relibra.gpus_per_node,
        state_buffer_mb=cfg.relibra.state_buffer_mb,
    )


def relibra_applies(cfg: ExperimentConfig) -> bool:
    return cfg.relibra.enabled and cfg.algo.routing_replay != "off" and cfg.parallel.expert_parallel > 1


@dataclass
class Trainer:
    """A policy or critic: turns samples into per-rank micro-batches and runs them on its ranks."""

    ranks: RankGroup
    micro_batch_size: int
    routing: bool

    def placement(self, num_samples: int) -> Placement:
        return place(num_samples, self.ranks.size, self.micro_batch_size)

    def _run(self, method: str, per_rank_batches: list[list[TrainBatch]], *extra: Any) -> list[Any]:
        return self.ranks.call(method, [(b, *extra) for b in per_rank_batches])

    def policy_batches(
        self, samples: Sequence[Sample], advantages: Sequence[np.ndarray]
    ) -> list[list[TrainBatch]]:
        adv = {s.uid: a for s, a in zip(samples, advantages)}
        split = split_for_ranks(samples, self.placement(len(samples)))
        return [
            [policy_batch(ss, ff, [adv[s.uid] for s in ss], self.routing) for ss, ff in rank]
            for rank in split
        ]

    def critic_batches(self, samples: Sequence[Sample]) -> list[list[TrainBatch]]:
        split = split_for_ranks(samples, self.placement(len(samples)))
        return [[critic_batch(ss, ff, self.routing) for ss, ff in rank] for rank in split]

    def forward(
        self, batches: list[list[TrainBatch]], with_entropy: bool = False, record_routing: bool = False
    ) -> list[list[Any]]:
        return self._run("forward", batches, with_entropy, record_routing)

    def train(
        self, batches: list[list[TrainBatch]], objective: Any, step_plan: StepPlan | None = None
    ) -> StepResult:
        """One update on every rank; the result of rank 0 (losses and norms are reduced over the ranks)."""
        if step_plan is None or step_plan.plan is None:
            return self._run("train", batches, objective)[0]
        return self._run("train", batches, objective, step_plan.plan, step_plan.loads_MLSE)[0]

    def router_layout(self) -> RouterLayout:
        return self.ranks.call("router_layout")[0]

    def weights(self, bucket_bytes: int) -> list[list[tuple[str, Any]]]:
        return self.ranks.call("hf_weights", None, bucket_bytes)[0]


def policy_objective(cfg: ExperimentConfig, batches: list[list[TrainBatch]]) -> PolicyObjective:
    a = cfg.algo
    return PolicyObjective(
        num_window_tokens=sum(int(b.payload.window_mask_BT.sum()) for rank in batches for b in rank),
        num_positive_tokens=positive_tokens(batches),
        num_window_samples=live_rows(batches, "window_mask_BT"),
        loss_agg=a.loss_agg,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        dual_clip=a.dual_clip,
        log_ratio_clamp=a.log_ratio_clamp,
        tis_cap=a.tis_cap,
        pos_lm_coef=a.pos_lm_coef,
        entropy_coef=a.entropy_coef,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
    )


def value_objective(cfg: ExperimentConfig, batches: list[list[TrainBatch]]) -> ValueObjective:
    return ValueObjective(
        num_samples=live_rows(batches), clip_low=cfg.algo.value_clip_low, clip_high=cfg.algo.value_clip_high
    )


def supervised_objective(batches: list[list[TrainBatch]]) -> SupervisedObjective:
    return SupervisedObjective(num_tokens=sum(int(b.loss_mask_BT.sum()) for rank in batches for b in rank))
