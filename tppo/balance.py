"""ReLibra in the training loop: the load tensor of each step from the replayed routing, and a plan for it.

The routing that the policy update replays (R3: the rollout's; R2: the trainer's own old-log-prob pass) and the
deterministic placement of samples on (data-parallel rank, micro-batch) give D[m, l, s, e] before the update
runs. The planner registered under `relibra.planner` plans it; the simulator prices the static placement and the
plan, and the step reports skew and simulated MoE speed-up under `relibra/`. The executor that moves experts
inside Megatron-Core is separate (relibra executor issue): until it lands, plans are computed and reported, not
applied, and training keeps the static placement.

Legend: M micro-batches, L MoE layers, S source (EP) ranks, E experts, B rows, T tokens, K top-k.
"""

from __future__ import annotations

import time

import numpy as np

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel, step_cost
from relibra.plan import PlannerState, Topology, static_home_LE
from relibra.planners import PlanContext, run_planner
from tppo.engine.batch import TrainBatch


def loads_from_batches(batches: list[list[TrainBatch]], ep: int, num_experts: int) -> np.ndarray:
    """D[m, l, s, e]: (token, top-k) pairs of rank r's micro-batch m (source rank r % ep), real tokens only."""
    num_mb = len(batches[0])
    routes = batches[0][0].routed_experts_BTLK
    num_layers = int(routes.shape[2])
    loads = np.zeros((num_mb, num_layers, ep, num_experts), dtype=np.int64)
    for r, rank_batches in enumerate(batches):
        for m, b in enumerate(rank_batches):
            valid = b.attention_mask_BT.bool() & (b.loss_mask_BT.sum(dim=1, keepdim=True) > 0)
            ids_NLK = b.routed_experts_BTLK[valid].long().numpy()
            for layer in range(num_layers):
                loads[m, layer, r % ep] += np.bincount(ids_NLK[:, layer].ravel(), minlength=num_experts)
    return loads


class LoadPlanner:
    """Plans every step's expert placement from its exact loads, keeping the planner state between steps."""

    def __init__(self, cfg: RelibraConfig, num_experts: int, ep: int, topk: int, seed: int = 0) -> None:
        self.topo = Topology(
            num_gpus=ep,
            gpus_per_node=cfg.gpus_per_node,
            num_experts=num_experts,
            num_replica_slots=cfg.replica_slots,
        )
        self.ctx = PlanContext(
            topo=self.topo, config=cfg, cost=CostModel.from_yaml(cfg.cost_model), topk=topk
        )
        self.name, self.ep, self.num_experts = cfg.planner, ep, num_experts
        self.state = PlannerState()
        self.expert_load_LE: np.ndarray | None = None

    def plan(self, batches: list[list[TrainBatch]]) -> dict[str, float]:
        loads = loads_from_batches(batches, self.ep, self.num_experts)
        per_expert = loads.sum(axis=(0, 2))
        self.expert_load_LE = per_expert if self.expert_load_LE is None else self.expert_load_LE + per_expert
        prev_home = (
            self.state.home_LE
            if self.state.home_LE is not None
            else static_home_LE(loads.shape[1], self.topo)
        )
        start = time.perf_counter()
        plan, self.state = run_planner(self.name, loads, self.ctx, self.state)
        planner_s = time.perf_counter() - start
        static, _ = run_planner("static", loads, self.ctx, PlannerState())
        static_cost = step_cost(static, loads, self.ctx.topk, self.topo, self.ctx.cost, static.home_LE)
        out = {
            "relibra/planner_s": planner_s,
            "relibra/skew_static": _mean(static_cost.skew_ML),
            "relibra/skew_max_static": _max(static_cost.skew_ML),
        }
        if hasattr(plan, "served_MLGJ"):
            cost = step_cost(plan, loads, self.ctx.topk, self.topo, self.ctx.cost, prev_home)
            out |= {
                "relibra/skew_planned": _mean(cost.skew_ML),
                "relibra/skew_max_planned": _max(cost.skew_ML),
                "relibra/sim_moe_speedup": static_cost.moe_us / max(cost.moe_us, 1e-9),
                "relibra/migration_bytes": float(cost.migration_bytes),
                "relibra/replicas_per_mb_layer": _replicas(plan),
            }
        return out


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
