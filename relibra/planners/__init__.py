"""Planners registered by name in `PLANNERS`: pure functions `(loads_MLSE, ctx, state) -> (plan, next_state)`.

- `static`: Megatron-Core's contiguous placement, no replicas.
- `ideal`: the perfectly balanced reference (an `IdealPlan`, evaluated in closed form by the simulator).
- `eplb_history` / `eplb_oracle`: DeepSeek's EPLB (hierarchical policy, global where groups do not divide among
  nodes) fed a moving average of past steps / the current step's exact load; `*_global` force the global policy.
- `relibra`: simulated-annealing reorder across nodes refined by an exact descent on the placement floor, +
  per-(m, l) intra-node replication with locality-aware splitting.
- ablations: `reorder_only` (annealing and descent, no replicas), `replicate_only` (static homes + replication),
  `greedy_lpt` (LPT reorder + replication).

Every stage of the ReLibra family is independent per layer, so those planners split the layers into
`planner_processes` fixed chunks planned in parallel, this process and spawned workers (`relibra.planners.parallel`);
chunk k draws from the random stream (seed, step, k), so plans depend on the seed and the chunk count only.

Legend: M micro-batches, L layers, S source ranks, E experts.
"""

from __future__ import annotations

import numpy as np

from relibra.cost_model import StepCost, ideal_step_cost, step_cost
from relibra.plan import IdealPlan, Plan, PlannerState, static_home_LE
from relibra.planners.base import PlanContext, PlannerFn, check_loads, home_plan, next_state, previous_home
from relibra.planners.eplb import eplb_plan
from relibra.planners.parallel import ChunkFn, plan_by_layer_chunks
from relibra.planners.refine import refine_home
from relibra.planners.reorder import (
    ReorderWeights,
    anneal_home,
    greedy_lpt_home,
    reorder_objective_L,
    reorder_problem,
)
from relibra.planners.replicate import replicated_plan
from tppo.base.registry import Registry

__all__ = [
    "PARALLEL_PLANNERS",
    "PLANNERS",
    "PlanContext",
    "PlannerFn",
    "no_worse_than_keeping",
    "run_planner",
]

PLANNERS: Registry[PlannerFn] = Registry("relibra planner")


def run_planner(name: str, loads_MLSE: np.ndarray, ctx: PlanContext, state: PlannerState):
    """Look up `name` and plan one step; returns (plan, next_state)."""
    return PLANNERS.get(name)(check_loads(loads_MLSE, ctx.topo), ctx, state)


def no_worse_than_keeping(
    plan: Plan, loads_MLSE: np.ndarray, ctx: PlanContext, prev_home_LE: np.ndarray
) -> tuple[Plan, StepCost, bool]:
    """`plan`, or the plan that keeps the current placement `prev_home_LE` (no migration, no replicas) when the
    cost model prices `plan` (its migration included) no faster; returns the chosen plan, its cost and whether
    the placement was kept. A planner can always stay where it is, so no applied plan is slower than that."""
    cost = step_cost(plan, loads_MLSE, ctx.topk, ctx.topo, ctx.cost, prev_home_LE)
    keep = home_plan(loads_MLSE, prev_home_LE, ctx.topo)
    keep_cost = step_cost(keep, loads_MLSE, ctx.topk, ctx.topo, ctx.cost, prev_home_LE)
    if keep_cost.moe_us <= cost.moe_us:
        return keep, keep_cost, True
    return plan, cost, False


@PLANNERS.register("static")
def plan_static(loads_MLSE: np.ndarray, ctx: PlanContext, state: PlannerState):
    home = static_home_LE(loads_MLSE.shape[1], ctx.topo)
    return home_plan(loads_MLSE, home, ctx.topo), next_state(state, home)


@PLANNERS.register("ideal")
def plan_ideal(loads_MLSE: np.ndarray, ctx: PlanContext, state: PlannerState):
    return IdealPlan(num_layers=loads_MLSE.shape[1], num_experts=ctx.topo.num_experts), next_state(
        state, previous_home(state, loads_MLSE.shape[1], ctx.topo)
    )


def _eplb(loads_MLSE, ctx: PlanContext, state: PlannerState, weight_LE, hierarchical: bool) -> Plan:
    prev = previous_home(state, loads_MLSE.shape[1], ctx.topo)
    return eplb_plan(loads_MLSE, weight_LE, ctx.topo, prev, ctx.config.eplb_num_groups, hierarchical)


def _history_step(loads_MLSE, ctx: PlanContext, state: PlannerState, hierarchical: bool):
    current = loads_MLSE.sum(axis=(0, 2)).astype(np.float64)
    estimate = state.history_LE if state.history_LE is not None else np.ones_like(current)
    plan = _eplb(loads_MLSE, ctx, state, estimate, hierarchical)
    decay = ctx.config.history_decay
    history = current if state.history_LE is None else decay * state.history_LE + (1 - decay) * current
    return plan, next_state(state, plan.home_LE, history)


def _oracle_step(loads_MLSE, ctx: PlanContext, state: PlannerState, hierarchical: bool):
    plan = _eplb(loads_MLSE, ctx, state, loads_MLSE.sum(axis=(0, 2)).astype(np.float64), hierarchical)
    return plan, next_state(state, plan.home_LE)


@PLANNERS.register("eplb_history")
def plan_eplb_history(loads_MLSE, ctx, state):
    return _history_step(loads_MLSE, ctx, state, hierarchical=True)


@PLANNERS.register("eplb_oracle")
def plan_eplb_oracle(loads_MLSE, ctx, state):
    return _oracle_step(loads_MLSE, ctx, state, hierarchical=True)


@PLANNERS.register("eplb_history_global")
def plan_eplb_history_global(loads_MLSE, ctx, state):
    return _history_step(loads_MLSE, ctx, state, hierarchical=False)


@PLANNERS.register("eplb_oracle_global")
def plan_eplb_oracle_global(loads_MLSE, ctx, state):
    return _oracle_step(loads_MLSE, ctx, state, hierarchical=False)


def annealed_home(loads_MLSE: np.ndarray, prev_LE: np.ndarray, ctx: PlanContext, rng) -> np.ndarray:
    """The reorder step of ReLibra: anneal from the better of the previous placement and LPT (per layer), then
    descend on the placement floor (`relibra.planners.refine`)."""
    cfg, topo = ctx.config, ctx.topo
    # How much of a migration's optimizer state the step waits for depends on the all-to-alls' share of the
    # step: the ideal plan's is a placement-free estimate.
    share = ideal_step_cost(loads_MLSE, ctx.topk, topo, ctx.cost).alltoall_share
    weights = ReorderWeights.from_config(cfg, ctx.cost, topo, share)
    prob = reorder_problem(loads_MLSE, prev_LE, topo, weights)
    lpt = greedy_lpt_home(loads_MLSE, topo)
    use_lpt = reorder_objective_L(prob, lpt) < reorder_objective_L(prob, prev_LE)
    start = np.where(use_lpt[:, None], lpt, prev_LE)
    home = anneal_home(
        prob, start, rng, cfg.anneal_iters, cfg.anneal_candidates, cfg.anneal_t0, cfg.anneal_cooling
    )
    return refine_home(prob, home, cfg.refine_rounds, cfg.refine_candidates)


# Chunk planners: module-level, so that worker processes import them by name.
def _relibra_chunk(loads, prev, rng, ctx: PlanContext) -> Plan:
    return replicated_plan(loads, annealed_home(loads, prev, ctx, rng), ctx.topo, ctx.config, ctx.cost)


def _reorder_only_chunk(loads, prev, rng, ctx: PlanContext) -> Plan:
    return home_plan(loads, annealed_home(loads, prev, ctx, rng), ctx.topo)


def _replicate_only_chunk(loads, prev, rng, ctx: PlanContext) -> Plan:
    home = static_home_LE(loads.shape[1], ctx.topo)
    return replicated_plan(loads, home, ctx.topo, ctx.config, ctx.cost)


def _greedy_lpt_chunk(loads, prev, rng, ctx: PlanContext) -> Plan:
    return replicated_plan(loads, greedy_lpt_home(loads, ctx.topo), ctx.topo, ctx.config, ctx.cost)


_CHUNK_PLANNERS: dict[str, ChunkFn] = {
    "relibra": _relibra_chunk,
    "reorder_only": _reorder_only_chunk,
    "replicate_only": _replicate_only_chunk,
    "greedy_lpt": _greedy_lpt_chunk,
}
# The planners that plan by chunks of layers on `planner_processes` processes.
PARALLEL_PLANNERS = frozenset(_CHUNK_PLANNERS)


def _by_layer_chunks(chunk_fn: ChunkFn) -> PlannerFn:
    """The planner that plans a step by chunks of layers in parallel (`relibra.planners.parallel`)."""

    def planner(loads_MLSE: np.ndarray, ctx: PlanContext, state: PlannerState):
        prev = previous_home(state, loads_MLSE.shape[1], ctx.topo)
        plan = plan_by_layer_chunks(chunk_fn, loads_MLSE, prev, ctx, state.num_steps)
        return plan, next_state(state, plan.home_LE)

    return planner


for _name, _chunk_fn in _CHUNK_PLANNERS.items():
    PLANNERS.register(_name)(_by_layer_chunks(_chunk_fn))
