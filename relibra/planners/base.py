"""What every planner shares: the planning context, the registry's function type, and plan assembly helpers.

A planner is a pure function `(loads_MLSE, ctx, state) -> (plan, next_state)`: the load tensor of one step, the
topology / config / cost model, and the state carried from the previous step (placement in force, load history).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, H home slots, R replica slots, J = H + R.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel
from relibra.plan import IdealPlan, Plan, PlannerState, Topology, home_slots_LGH, static_home_LE

__all__ = [
    "PlanContext",
    "PlannerFn",
    "check_loads",
    "empty_quota_MLGJS",
    "home_plan",
    "home_quota_MLGHS",
    "next_state",
    "previous_home",
]


@dataclass(frozen=True)
class PlanContext:
    """Everything a planner reads besides the loads: topology, knobs, cost model, router top-k."""

    topo: Topology
    config: RelibraConfig
    cost: CostModel
    topk: int


PlannerFn = Callable[[np.ndarray, PlanContext, PlannerState], tuple[Plan | IdealPlan, PlannerState]]


def check_loads(loads_MLSE: np.ndarray, topo: Topology) -> np.ndarray:
    """The loads as int64 [M, L, S, E] with S == G and E == the topology's experts; ValueError otherwise."""
    loads = np.asarray(loads_MLSE)
    if loads.ndim != 4:
        raise ValueError(f"loads_MLSE must be [M, L, S, E], got shape {loads.shape}")
    if loads.shape[2] != topo.num_gpus or loads.shape[3] != topo.num_experts:
        raise ValueError(
            f"loads_MLSE has {loads.shape[2]} source ranks and {loads.shape[3]} experts; the topology has "
            f"{topo.num_gpus} EP ranks and {topo.num_experts} experts"
        )
    return loads.astype(np.int64, copy=False)


def previous_home(state: PlannerState, num_layers: int, topo: Topology) -> np.ndarray:
    """The placement in force before this step: the state's, or Megatron's static one on the first step."""
    if state.home_LE is None:
        return static_home_LE(num_layers, topo)
    if state.home_LE.shape != (num_layers, topo.num_experts):
        raise ValueError(
            f"state.home_LE has shape {state.home_LE.shape}, expected {(num_layers, topo.num_experts)}"
        )
    return state.home_LE


def next_state(
    state: PlannerState, home_LE: np.ndarray, history_LE: np.ndarray | None = None
) -> PlannerState:
    history = state.history_LE if history_LE is None else history_LE
    return PlannerState(home_LE=home_LE, history_LE=history, num_steps=state.num_steps + 1)


def home_quota_MLGHS(loads_MLSE: np.ndarray, slots_LGH: np.ndarray) -> np.ndarray:
    """quota[m, l, g, h, s] = D[m, l, s, slots_LGH[l, g, h]]: every home instance serves all its pairs (int32)."""
    return empty_quota_MLGJS(loads_MLSE, slots_LGH, 0)


def empty_quota_MLGJS(loads_MLSE: np.ndarray, slots_LGH: np.ndarray, num_replica_slots: int) -> np.ndarray:
    """[M, L, G, H + R, S] int32: home slots serve all their pairs, replica slots nothing yet.

    One expert-column gather per layer, written straight into the home slots (measured ~2x faster than a global
    fancy-index gather plus a concatenation at M = 32, L = 48, S = 32, E = 128)."""
    M, L, S, _E = loads_MLSE.shape
    _, G, H = slots_LGH.shape
    out = np.zeros((M, L, G, H + num_replica_slots, S), dtype=np.int32)
    for layer in range(L):
        cols = loads_MLSE[:, layer].take(slots_LGH[layer].reshape(-1), axis=2)  # [M, S, G * H]
        out[:, layer, :, :H] = cols.transpose(0, 2, 1).reshape(M, G, H, S)
    return out


def home_plan(loads_MLSE: np.ndarray, home_LE: np.ndarray, topo: Topology) -> Plan:
    """A plan without replicas: every expert computes all its pairs on its owner."""
    M, L = loads_MLSE.shape[:2]
    G, H, R = topo.num_gpus, topo.num_home_slots, topo.num_replica_slots
    slots_LGH = home_slots_LGH(home_LE, topo)
    slots = np.full((M, L, G, H + R), -1, dtype=np.int32)
    slots[..., :H] = slots_LGH[None]
    quota = empty_quota_MLGJS(loads_MLSE, slots_LGH, R)
    return Plan(home_LE=home_LE, slots_MLGJ=slots, quota_MLGJS=quota, num_home_slots=H)
