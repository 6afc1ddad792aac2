"""Typed records that cross the planner boundary: the topology, a step's `Plan`, and the planner state.

A `Plan` says, for one training step, which GPU owns every logical expert (`home_LE`), which logical expert sits
in every physical slot of every GPU for every (micro-batch, layer) (`slots_MLGJ`), and how many (token, top-k
choice) pairs of every source rank each slot computes (`quota_MLGJS`). Everything else (pairs served per GPU,
the logical -> physical mapping of a micro-batch) is derived from these three arrays.

Physical slot layout per GPU (what an executor allocates): J = H + R slots, slot j < H a home slot, j >= H a
replica slot. Physical slot id p = g * J + j, so there are P = G * J physical experts in a layer.

- ReLibra-style plans (`persistent_replicas=False`): slot j < H of GPU g holds the j-th smallest logical id among
  the experts g owns (the same for every micro-batch of the step); replica slots hold copies of experts owned by
  another GPU of the same node, or -1, and change per (micro-batch, layer).
- EPLB-style plans (`persistent_replicas=True`): one placement for the whole step (all micro-batches equal), any
  slot may hold any copy; `home_LE` names the copy that holds the optimizer state. Copies may cross nodes only if
  `replicas_within_node` is False (EPLB's global policy).

How an executor maps a token's logical expert to a physical slot (reference: `reroute`): on source rank s, for
(micro-batch m, layer l), take the pairs routed to logical expert e in row-major (token, top-k position) order;
give the first quota[m, l, p1, s] of them to the instance of e with the smallest physical id p1, the next
quota[m, l, p2, s] to the next instance, and so on. The quotas of one source add up to exactly its pairs for e.

Legend: M micro-batches, L MoE layers, S source ranks (the EP rank whose tokens they are; S == G), E logical
experts, G GPUs (EP ranks), J slots per GPU (H home + R replica), P = G * J physical slots, T tokens, K top-k.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IdealPlan", "Plan", "PlannerState", "Topology", "home_slots_LGH", "reroute", "static_home_LE"]


@dataclass(frozen=True)
class Topology:
    """The expert-parallel group: G GPUs in nodes of `gpus_per_node`, E experts, R replica slots per GPU.

    An EP group smaller than `gpus_per_node` sits inside one node (node size min(G, gpus_per_node)).
    """

    num_gpus: int
    gpus_per_node: int
    num_experts: int
    num_replica_slots: int

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node", "num_experts"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Topology.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_replica_slots < 0:
            raise ValueError(f"Topology.num_replica_slots must be >= 0, got {self.num_replica_slots}")
        if self.num_experts % self.num_gpus:
            raise ValueError(
                f"num_experts={self.num_experts} must be a multiple of num_gpus={self.num_gpus} (E/EP home slots)"
            )
        if self.num_gpus % self.node_size:
            raise ValueError(
                f"num_gpus={self.num_gpus} must be a multiple of gpus_per_node={self.gpus_per_node}"
            )

    @property
    def node_size(self) -> int:
        return min(self.num_gpus, self.gpus_per_node)

    @property
    def num_nodes(self) -> int:
        return self.num_gpus // self.node_size

    @property
    def num_home_slots(self) -> int:
        return self.num_experts // self.num_gpus

    @property
    def num_slots(self) -> int:
        return self.num_home_slots + self.num_replica_slots

    def node_of_gpu(self) -> np.ndarray:
        return np.arange(self.num_gpus) // self.node_size


@dataclass(frozen=True)
class Plan:
    """Where every logical expert computes during one training step (see the module docstring for the layout).

    home_LE: int [L, E] GPU that owns expert e of layer l (weights, master weights, optimizer state).
    slots_MLGJ: int [M, L, G, J] logical expert held by slot j of GPU g for (m, l); -1 is an empty slot.
    quota_MLGJS: int [M, L, G, J, S] pairs from source rank s that slot (g, j) computes for (m, l).
    num_home_slots: H, the home slots at the front of every GPU's J slots.
    persistent_replicas: True for EPLB-style plans (one placement per step, copies synced once per step);
      False for ReLibra-style plans (replica slots rewritten per (m, l), weights pushed each time).
    replicas_within_node: every copy sits on a GPU of its owner's node (ReLibra's invariant; EPLB hierarchical).
    """

    home_LE: np.ndarray
    slots_MLGJ: np.ndarray
    quota_MLGJS: np.ndarray
    num_home_slots: int
    persistent_replicas: bool = False
    replicas_within_node: bool = True

    @property
    def num_microbatches(self) -> int:
        return self.slots_MLGJ.shape[0]

    @property
    def num_layers(self) -> int:
        return self.home_LE.shape[0]

    @property
    def num_experts(self) -> int:
        return self.home_LE.shape[1]

    @property
    def num_gpus(self) -> int:
        return self.slots_MLGJ.shape[2]

    @property
    def num_slots(self) -> int:
        return self.slots_MLGJ.shape[3]

    def select(self, microbatches: Sequence[int]) -> Plan:
        """The plan for the micro-batches `microbatches`, run in that order (an index may repeat: a micro-batch
        trained again in a later epoch); the placement is unchanged."""
        idx = np.asarray(microbatches, dtype=np.int64)
        return dataclasses.replace(self, slots_MLGJ=self.slots_MLGJ[idx], quota_MLGJS=self.quota_MLGJS[idx])

    def served_MLGJ(self) -> np.ndarray:
        """Pairs computed by each slot: sum over sources of the quota."""
        return self.quota_MLGJS.sum(axis=-1, dtype=np.int64)

    def served_MLGE(self) -> np.ndarray:
        """served[m, l, g, e] = pairs of logical expert e computed on GPU g (home and replica instances)."""
        M, L, G, _ = self.slots_MLGJ.shape
        E = self.num_experts
        slots = self.slots_MLGJ
        valid = slots >= 0
        base = (np.arange(M * L * G, dtype=np.int64) * E).reshape(M, L, G, 1)
        flat = (base + np.where(valid, slots, 0))[valid]
        counts = np.bincount(flat, weights=self.served_MLGJ()[valid], minlength=M * L * G * E)
        return np.rint(counts).astype(np.int64).reshape(M, L, G, E)

    def phys2log(self, m: int, layer: int) -> np.ndarray:
        """int [P]: logical expert of physical slot p = g * J + j for (m, l); -1 where the slot is empty."""
        return np.asarray(self.slots_MLGJ[m, layer]).reshape(-1)


@dataclass(frozen=True)
class IdealPlan:
    """The ideal reference: every GPU gets the mean load of each (m, l), traffic spread evenly, no overhead.

    Not a placement: the simulator evaluates it in closed form (`relibra.cost_model.ideal_step_cost`).
    """

    num_layers: int
    num_experts: int


@dataclass(frozen=True)
class PlannerState:
    """What a planner carries from one step to the next, passed explicitly.

    home_LE: the placement in force before this step (None: Megatron's static placement).
    history_LE: moving average of past steps' per-expert loads (eplb_history); None before the first step.
    num_steps: steps planned so far (seeds the per-step random stream).
    """

    home_LE: np.ndarray | None = None
    history_LE: np.ndarray | None = None
    num_steps: int = 0


def static_home_LE(num_layers: int, topo: Topology) -> np.ndarray:
    """Megatron-Core's contiguous placement: GPU g owns experts [g H, (g + 1) H) in every layer."""
    home_E = np.arange(topo.num_experts) // topo.num_home_slots
    return np.broadcast_to(home_E, (num_layers, topo.num_experts)).copy()


def home_slots_LGH(home_LE: np.ndarray, topo: Topology) -> np.ndarray:
    """int [L, G, H]: the experts each GPU owns, ascending logical id (the home-slot order of a plan).

    Raises ValueError unless every GPU owns exactly H experts in every layer.
    """
    L, E = home_LE.shape
    G, H = topo.num_gpus, topo.num_home_slots
    if home_LE.min(initial=0) < 0 or home_LE.max(initial=0) >= G:
        raise ValueError(f"home_LE must hold GPU ids in [0, {G})")
    flat = (np.arange(L)[:, None] * G + home_LE).reshape(-1)
    counts = np.bincount(flat, minlength=L * G).reshape(L, G)
    if (counts != H).any():
        raise ValueError(f"home_LE must give every one of the {G} GPUs exactly {H} experts per layer")
    order = np.argsort(home_LE.astype(np.int64) * E + np.arange(E), axis=1, kind="stable")
    return order.reshape(L, G, H)


def reroute(plan: Plan, m: int, layer: int, s: int, topk_ids_TK: np.ndarray) -> np.ndarray:
    """Reference logical -> physical mapping of source rank s's routed pairs for (m, l).

    topk_ids_TK: int [T, K] logical experts of the rank's tokens in the replayed routing. Returns int [T, K]
    physical slot ids p = g * J + j. Pairs of expert e, in row-major (token, top-k) order, fill the instances of
    e in ascending physical id, each up to its quota quota_MLGJS[m, l, g, j, s]. Raises ValueError if the pairs
    for some expert differ from the plan's quotas.
    """
    ids = np.asarray(topk_ids_TK)
    flat = ids.reshape(-1)
    phys2log = plan.phys2log(m, layer)
    quota_P = np.asarray(plan.quota_MLGJS[m, layer, :, :, s]).reshape(-1)
    order = np.argsort(flat, kind="stable")  # pairs grouped by expert, row-major inside a group
    sorted_ids = flat[order]
    inst = np.flatnonzero(phys2log >= 0)
    inst = inst[np.argsort(phys2log[inst], kind="stable")]  # instances grouped by expert, ascending p
    inst_e, inst_q = phys2log[inst], quota_P[inst]
    need = np.bincount(sorted_ids, minlength=plan.num_experts)
    have = np.bincount(inst_e, weights=inst_q, minlength=plan.num_experts)
    if len(have) != len(need) or (np.rint(have).astype(np.int64) != need).any():
        bad = int(np.flatnonzero(np.rint(have).astype(np.int64) != need)[0])
        raise ValueError(
            f"topk_ids_TK routes {need[bad]} pairs of expert {bad} from source {s}, the plan's quotas {have[bad]:.0f}"
        )
    out = np.repeat(inst, inst_q)  # one physical id per pair, grouped by expert in the same order
    result = np.empty_like(flat)
    result[order] = out
    return result.reshape(ids.shape)
