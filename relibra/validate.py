"""Plan validator: checks a `Plan` against the step's loads and the topology without trusting the planner.

Rules (every plan): shapes agree with the loads and the topology (J = H + R slots per GPU); every logical expert
has exactly one owner (home_LE, a GPU id) and the owner holds an instance of it in every (m, l); slot contents are
logical ids or -1; quotas are non-negative and zero on empty slots; for every (m, l, source s, expert e) the
quotas of e's instances add up exactly to D[m, l, s, e] (served tokens add up to the loads).

ReLibra-style plans (`persistent_replicas=False`): every GPU owns exactly E / EP experts per layer and holds them,
in ascending logical id, in its H home slots in every micro-batch; replica slots (at most R per GPU per (m, l))
hold copies of experts owned by ANOTHER GPU of the SAME node; a GPU never holds two instances of one expert.

EPLB-style plans (`persistent_replicas=True`): one placement for every micro-batch of the step; copies on the
owner's node only when `replicas_within_node` is set.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU, H home slots.
"""

from __future__ import annotations

import numpy as np

from relibra.plan import IdealPlan, Plan, Topology, home_slots_LGH

__all__ = ["PlanError", "validate_plan"]


class PlanError(ValueError):
    """A plan breaks one of the rules in relibra.validate's docstring."""


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _check_shapes(plan: Plan, loads_MLSE: np.ndarray, topo: Topology) -> None:
    M, L, S, E = loads_MLSE.shape
    G, J = topo.num_gpus, topo.num_slots
    expected = {
        "home_LE": (plan.home_LE.shape, (L, E)),
        "slots_MLGJ": (plan.slots_MLGJ.shape, (M, L, G, J)),
        "quota_MLGJS": (plan.quota_MLGJS.shape, (M, L, G, J, S)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise PlanError(f"plan.{name} has shape {tuple(got)}, expected {want}")
    if S != G:
        raise PlanError(f"the loads have {S} source ranks but the topology {G} EP ranks")
    if plan.num_home_slots != topo.num_home_slots:
        raise PlanError(f"plan.num_home_slots={plan.num_home_slots}, expected E/EP={topo.num_home_slots}")
    if not plan.replicas_within_node and not plan.persistent_replicas:
        raise PlanError("per-(m, l) replicas must stay inside the owner's node (replicas_within_node=False)")


def _check_values(plan: Plan, topo: Topology) -> None:
    home, slots, quota = plan.home_LE, plan.slots_MLGJ, plan.quota_MLGJS
    if (home < 0).any() or (home >= topo.num_gpus).any():
        raise PlanError(
            f"home_LE must hold GPU ids in [0, {topo.num_gpus}); bad entry at {_first((home < 0) | (home >= topo.num_gpus))}"
        )
    if (slots < -1).any() or (slots >= topo.num_experts).any():
        raise PlanError(f"slots_MLGJ must hold expert ids in [0, {topo.num_experts}) or -1")
    if (quota < 0).any():
        raise PlanError(f"quota_MLGJS is negative at {_first(quota < 0)}")
    empty_busy = (slots < 0) & (quota.sum(axis=-1) > 0)
    if empty_busy.any():
        raise PlanError(f"an empty slot (m, l, g, j)={_first(empty_busy)} has a non-zero quota")


def _instances_MLGE(plan: Plan, num_experts: int) -> np.ndarray:
    """count[m, l, g, e]: instances of expert e on GPU g."""
    M, L, G, _J = plan.slots_MLGJ.shape
    valid = plan.slots_MLGJ >= 0
    base = (np.arange(M * L * G, dtype=np.int64) * num_experts).reshape(M, L, G, 1)
    flat = (base + np.where(valid, plan.slots_MLGJ, 0))[valid]
    return np.bincount(flat, minlength=M * L * G * num_experts).reshape(M, L, G, num_experts)


def _check_owners(plan: Plan, count_MLGE: np.ndarray) -> None:
    L, E = plan.home_LE.shape
    held = np.take_along_axis(
        count_MLGE, np.broadcast_to(plan.home_LE[None, :, None, :], (count_MLGE.shape[0], L, 1, E)), axis=2
    )
    if (held[:, :, 0] == 0).any():
        m, layer, e = _first(held[:, :, 0] == 0)
        raise PlanError(
            f"expert {e} of layer {layer} has no instance on its owner GPU {plan.home_LE[layer, e]} in micro-batch {m}"
        )


def _check_served(plan: Plan, loads_MLSE: np.ndarray) -> None:
    M, L, S, E = loads_MLSE.shape
    _G, _J = plan.slots_MLGJ.shape[2:]
    slots = np.asarray(plan.slots_MLGJ)
    valid = slots >= 0
    base = (np.arange(M * L, dtype=np.int64) * S * E).reshape(M, L, 1, 1, 1)
    idx = base + np.arange(S).reshape(1, 1, 1, 1, S) * E + np.where(valid, slots, 0)[..., None]
    mask = np.broadcast_to(valid[..., None], idx.shape)
    served = np.bincount(idx[mask], weights=np.asarray(plan.quota_MLGJS)[mask], minlength=M * L * S * E)
    wrong = np.rint(served).astype(np.int64).reshape(M, L, S, E) != loads_MLSE
    if wrong.any():
        m, layer, s, e = _first(wrong)
        raise PlanError(
            f"quotas of expert {e} from source {s} in (micro-batch {m}, layer {layer}) add up to "
            f"{served.reshape(M, L, S, E)[m, layer, s, e]:.0f}, the loads say {loads_MLSE[m, layer, s, e]}"
        )


def _check_relibra_layout(plan: Plan, topo: Topology, count_MLGE: np.ndarray) -> None:
    try:
        slots_LGH = home_slots_LGH(plan.home_LE, topo)
    except ValueError as err:
        raise PlanError(str(err)) from None
    H = topo.num_home_slots
    wrong = plan.slots_MLGJ[..., :H] != slots_LGH[None]
    if wrong.any():
        raise PlanError(
            f"home slot (m, l, g, j)={_first(wrong)} does not hold the owner's expert in ascending order"
        )
    if (count_MLGE > 1).any():
        m, layer, g, e = _first(count_MLGE > 1)
        raise PlanError(f"GPU {g} holds expert {e} twice in (micro-batch {m}, layer {layer})")
    rep = plan.slots_MLGJ[..., H:]
    valid = rep >= 0
    if valid.any():
        _, l_idx, g_idx, _ = np.nonzero(valid)
        owner = plan.home_LE[l_idx, rep[valid]]
        if (owner == g_idx).any():
            raise PlanError("a replica slot holds an expert its own GPU owns")


def _check_persistent_layout(plan: Plan) -> None:
    if (plan.slots_MLGJ != plan.slots_MLGJ[:1]).any():
        raise PlanError(
            "an EPLB-style plan (persistent_replicas) must use one placement for every micro-batch"
        )


def _check_node_scope(plan: Plan, topo: Topology) -> None:
    if not plan.replicas_within_node:
        return
    node = topo.node_of_gpu()
    valid = plan.slots_MLGJ >= 0
    _, l_idx, g_idx, _ = np.nonzero(valid)
    owner = plan.home_LE[l_idx, plan.slots_MLGJ[valid]]
    if (node[owner] != node[g_idx]).any():
        bad = int(np.flatnonzero(node[owner] != node[g_idx])[0])
        raise PlanError(f"a copy on GPU {g_idx[bad]} sits outside its owner's node (owner GPU {owner[bad]})")


def validate_plan(plan: Plan | IdealPlan, loads_MLSE: np.ndarray, topo: Topology) -> None:
    """Raise PlanError (a ValueError) naming the first broken rule; return None for a valid plan."""
    loads = np.asarray(loads_MLSE)
    if isinstance(plan, IdealPlan):
        if (plan.num_layers, plan.num_experts) != (loads.shape[1], loads.shape[3]):
            raise PlanError(
                f"ideal plan for {plan.num_layers} layers / {plan.num_experts} experts, loads {loads.shape}"
            )
        return
    _check_shapes(plan, loads, topo)
    _check_values(plan, topo)
    count = _instances_MLGE(plan, topo.num_experts)
    _check_owners(plan, count)
    if plan.persistent_replicas:
        _check_persistent_layout(plan)
    else:
        _check_relibra_layout(plan, topo, count)
    _check_node_scope(plan, topo)
    _check_served(plan, loads)
