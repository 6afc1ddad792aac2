"""ReLibra in the training loop: the load tensor of each step from the replayed routing, and a plan for it.

The routing that the policy update replays (R3: the rollout's; R2: the trainer's own old-log-prob pass) and the
deterministic placement of samples on (data-parallel rank, micro-batch) give D[m, l, s, e] before the update
runs. The planner registered under `relibra.planner` plans it; the simulator prices the static placement and the
plan, and the step reports skew and simulated MoE speed-up under `relibra/`. A plan the simulator prices no faster
than keeping the current placement (its migration included) is replaced by keeping it (`relibra/kept_placement`).
The policy's ranks apply the plan with relibra.executor around the update (tppo.cluster.workers); what they
measured comes back as `relibra/exec_*`.

The loads count padding too (the experts compute it): the engine pads every micro-batch to the shape its routers
run, and `tppo.engine.layout` says how (the engine uses the same rule), so the plan's quotas cover exactly the pairs
each rank routes.

Legend: M micro-batches, L MoE layers, S source (EP) ranks, E experts, B rows, T tokens, K top-k.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel, step_cost
from relibra.plan import Plan, PlannerState, Topology, static_home_LE
from relibra.planners import PARALLEL_PLANNERS, PlanContext, no_worse_than_keeping, run_planner
from relibra.planners.parallel import start_workers
from tppo.cluster.workers import ExecutorSpec
from tppo.config import ExperimentConfig
from tppo.engine.batch import TrainBatch
from tppo.engine.config import ModelConfig
from tppo.engine.layout import RouterLayout, expert_counts_LE, router_shapes


def relibra_applies(cfg: ExperimentConfig) -> bool:
    """ReLibra plans the policy update when it is on, routing is replayed and experts are split over ranks."""
    return cfg.relibra.enabled and cfg.algo.routing_replay != "off" and cfg.parallel.expert_parallel > 1


def executor_spec(cfg: ExperimentConfig) -> ExecutorSpec | None:
    """The policy ranks' executor of ReLibra plans, when plans exist, on the planner's topology."""
    if not relibra_applies(cfg):
        return None
    topo = relibra_topology(cfg.relibra, cfg.model.num_experts, cfg.parallel.expert_parallel)
    return ExecutorSpec(topology=topo, state_buffer_mb=cfg.relibra.state_buffer_mb)


def relibra_topology(cfg: RelibraConfig, num_experts: int, ep: int) -> Topology:
    """The expert-parallel group ReLibra plans for and the policy ranks execute on."""
    return Topology(
        num_gpus=ep,
        gpus_per_node=cfg.gpus_per_node,
        num_experts=num_experts,
        num_replica_slots=cfg.replica_slots,
    )


def loads_from_batches(batches: list[list[TrainBatch]], layout: RouterLayout, num_experts: int) -> np.ndarray:
    """D[m, l, s, e]: the (token, top-k) pairs the routers of rank r (source s = r mod EP) send to expert e in
    micro-batch m, padding included, on the shapes the engine runs (tppo.engine.layout)."""
    run_shapes = router_shapes([[b.shape for b in rank] for rank in batches], layout)
    counts = [
        np.stack([expert_counts_LE(b, shape, num_experts) for b, shape in zip(rank, shapes, strict=True)])
        for rank, shapes in zip(batches, run_shapes, strict=True)
    ]
    return loads_from_ranks(counts, layout.ep)


def loads_from_ranks(counts_MLE: Sequence[np.ndarray], ep: int) -> np.ndarray:
    """D[m, l, s, e] from each rank's own counts [M, L, E] (rank r routes as source s = r mod EP; the copies of
    the EP group add up)."""
    num_mb, num_layers, num_experts = counts_MLE[0].shape
    loads = np.zeros((num_mb, num_layers, ep, num_experts), dtype=np.int64)
    for r, counts in enumerate(counts_MLE):
        loads[:, :, r % ep] += counts
    return loads


@dataclass
class StepPlan:
    """A step's plan for the policy update: what the executor applies (`plan`, None for a non-applicable
    planner output such as `ideal`) with the loads it was made for, and the metrics of planning it."""

    plan: Plan | None
    loads_MLSE: np.ndarray
    metrics: dict[str, float]


class LoadPlanner:
    """Plans every step's expert placement from its exact loads, keeping the planner state between steps."""

    def __init__(self, cfg: RelibraConfig, model: ModelConfig, layout: RouterLayout) -> None:
        num_experts = model.num_experts
        self.topo = relibra_topology(cfg, num_experts, layout.ep)
        # The cost model's hardware, at the trained model's expert shape (replica pushes, GEMM times, NIC weight).
        cost = CostModel.from_yaml(cfg.cost_model, cfg.nic_routing).for_expert_shape(
            model.hidden_size, model.moe_ffn_hidden_size
        )
        self.ctx = PlanContext(topo=self.topo, config=cfg, cost=cost, topk=model.moe_topk)
        if cfg.planner in PARALLEL_PLANNERS:
            start_workers(cfg.planner_processes)  # here, so that the first step's planner_s is planning only
        self.name, self.layout, self.num_experts = cfg.planner, layout, num_experts
        self.state = PlannerState()
        self._before = PlannerState()
        self.expert_load_LE: np.ndarray | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relibra-planner")

    def plan(self, batches: list[list[TrainBatch]]) -> StepPlan:
        return self.start(batches).result()

    def start(self, batches: list[list[TrainBatch]]) -> Future[StepPlan]:
        """Plan in the background, on one thread so that steps plan in order, while the driver waits for the
        critic update and the old log-probs (the plan is needed only by the policy update). The routing is read
        here, so the batches may change once this returns; `refused` must wait for the result."""
        return self.start_loads(loads_from_batches(batches, self.layout, self.num_experts))

    def start_loads(self, loads: np.ndarray) -> Future[StepPlan]:
        """`start` from the step's load tensor D[m, l, s, e] (counted where the routing is: R2 on the ranks)."""
        per_expert = loads.sum(axis=(0, 2))
        self.expert_load_LE = per_expert if self.expert_load_LE is None else self.expert_load_LE + per_expert
        return self._thread.submit(self._plan, loads)

    def _plan(self, loads: np.ndarray) -> StepPlan:
        prev_home = (
            self.state.home_LE
            if self.state.home_LE is not None
            else static_home_LE(loads.shape[1], self.topo)
        )
        start = time.perf_counter()
        self._before = self.state
        plan, self.state = run_planner(self.name, loads, self.ctx, self.state)
        planner_s = time.perf_counter() - start
        static, _ = run_planner("static", loads, self.ctx, PlannerState())
        static_cost = step_cost(static, loads, self.ctx.topk, self.topo, self.ctx.cost, static.home_LE)
        out = {
            "relibra/planner_s": planner_s,
            "relibra/skew_static": _mean(static_cost.skew_ML),
            "relibra/skew_max_static": _max(static_cost.skew_ML),
        }
        if not isinstance(plan, Plan):
            return StepPlan(None, loads, out)
        plan, cost, kept = no_worse_than_keeping(plan, loads, self.ctx, prev_home)
        if kept:
            self.state = dataclasses.replace(self.state, home_LE=prev_home)
        out |= {
            "relibra/kept_placement": float(kept),
            "relibra/skew_planned": _mean(cost.skew_ML),
            "relibra/skew_max_planned": _max(cost.skew_ML),
            "relibra/sim_moe_speedup": static_cost.moe_us / max(cost.moe_us, 1e-9),
            "relibra/migration_bytes": float(cost.migration_bytes),
            "relibra/replicas_per_mb_layer": _replicas(plan),
        }
        return StepPlan(plan, loads, out)

    def state_dict(self) -> dict[str, Any]:
        """The placement the planner continues from and the routed load so far (the report's expert load), as
        plain arrays and numbers."""
        s = self.state
        return {
            "home_LE": s.home_LE,
            "history_LE": s.history_LE,
            "num_steps": s.num_steps,
            "expert_load_LE": self.expert_load_LE,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = PlannerState(state["home_LE"], state["history_LE"], int(state["num_steps"]))
        self.expert_load_LE = state["expert_load_LE"]

    def refused(self) -> None:
        """The trainer could not apply the last plan: its placement did not change, so neither does ours."""
        self.state = self._before


def _replicas(plan) -> float:
    """Mean number of filled replica slots per (micro-batch, layer)."""
    replica_slots = plan.slots_MLGJ[..., plan.num_home_slots :]
    return float((replica_slots >= 0).sum(axis=(2, 3)).mean()) if replica_slots.size else 0.0


def _mean(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(finite.mean()) if finite.size else float("nan")


def _max(x: np.ndarray) -> float:
    finite = x[np.isfinite(x)]
    return float(finite.max()) if finite.size else float("nan")
