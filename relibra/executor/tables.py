"""Pure NumPy tables an executor derives from a `Plan` for one EP rank (no torch, no communication).

- `check_plan`: `relibra.validate.validate_plan` plus what the executor itself needs (the engine's layer count,
  replica slots, micro-batch count); it runs before any tensor moves.
- `reroute_tables`: per (micro-batch, layer), for this rank's tokens (source s), the instances of every logical
  expert in ascending physical id with their cumulative quotas. A pair of expert e whose rank among e's pairs
  (in token order) is r goes to the first instance whose cumulative quota exceeds r; pairs beyond the plan's
  quotas (e.g. the padding tokens the engine adds for its dispatcher) go to e's home slot. With quotas that
  match the tokens exactly this is `relibra.plan.reroute`. Any assignment among instances of the same expert
  computes the same thing, so a mismatch costs balance, never correctness.
- `replica_exchanges`: per (micro-batch, layer), which home slots this rank sends to which replica holders, and
  which replica slots it receives from which owners (ordered by (holder, replica slot) on both sides).
- `migration_moves`: which slot contents go where when the home placement changes (reordering).

Physical slot id p = g * J + j (J = H + R slots per GPU), as in relibra.plan.

Legend: M micro-batches, L layers, E logical experts, G GPUs (EP ranks), J slots per GPU, H home slots, R replica
slots, I instances per expert (padded, one more than the most any expert has), P = G * J physical slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.plan import Plan, Topology, home_slots_LGH
from relibra.validate import PlanError, validate_plan

__all__ = [
    "MigrationMoves",
    "ReplicaExchange",
    "check_plan",
    "migration_moves",
    "replica_exchanges",
    "reroute_tables",
]

_NO_LIMIT = np.iinfo(np.int64).max


def check_plan(
    plan: Plan,
    loads_MLSE: np.ndarray,
    topo: Topology,
    *,
    num_layers: int,
    num_microbatches: int | None = None,
) -> None:
    """Raise PlanError (a ValueError) unless the executor can apply `plan` to an engine of `num_layers` MoE layers.

    Checks every rule of relibra.validate against the loads, then the executor's own: a ReLibra-style plan
    (per-(m, l) replicas, not EPLB's persistent copies), the engine's layer count, the micro-batch count if given.
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"the executor applies a relibra.plan.Plan, got {type(plan).__name__}")
    if plan.persistent_replicas:
        raise PlanError("the executor applies ReLibra-style plans only (persistent_replicas=False)")
    if plan.num_layers != num_layers:
        raise PlanError(f"the plan covers {plan.num_layers} MoE layers, the engine has {num_layers}")
    if num_microbatches is not None and plan.num_microbatches != num_microbatches:
        raise PlanError(
            f"the plan covers {plan.num_microbatches} micro-batches, the step runs {num_microbatches}"
        )
    validate_plan(plan, loads_MLSE, topo)


def _owner_phys_LE(home_LE: np.ndarray, topo: Topology) -> np.ndarray:
    """int [L, E]: physical id g * J + j of every expert's home slot (J = topo.num_slots)."""
    slots_LGH = home_slots_LGH(home_LE, topo)
    L, G, H = slots_LGH.shape
    phys_LE = np.empty((L, topo.num_experts), dtype=np.int64)
    base_GH = np.arange(G)[:, None] * topo.num_slots + np.arange(H)[None, :]
    for layer in range(L):
        phys_LE[layer, slots_LGH[layer].reshape(-1)] = base_GH.reshape(-1)
    return phys_LE


def reroute_tables(
    plan: Plan, topo: Topology, source: int, layers: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(inst_MLEI, cum_MLEI) for source rank `source` and the given plan layers (in that order).

    inst[m, l, e, i]: physical id of the i-th instance of e (ascending p); columns past e's instances hold e's
    home slot. cum[m, l, e, i]: sum of the quotas of instances 0..i for this source; past the instances, no limit.
    """
    M = plan.num_microbatches
    E, J = topo.num_experts, topo.num_slots
    owner_LE = _owner_phys_LE(plan.home_LE, topo)
    counts_MLGE = (plan.slots_MLGJ[..., None] == np.arange(E)).sum(axis=(2, 3))
    num_inst = int(counts_MLGE[:, layers].max(initial=1)) + 1
    inst = np.empty((M, len(layers), E, num_inst), dtype=np.int64)
    cum = np.full((M, len(layers), E, num_inst), _NO_LIMIT, dtype=np.int64)
    for li, layer in enumerate(layers):
        inst[:, li] = owner_LE[layer][None, :, None]
        for m in range(M):
            p2l = plan.phys2log(m, layer)
            quota_P = np.asarray(plan.quota_MLGJS[m, layer, :, :, source], dtype=np.int64).reshape(-1)
            phys = np.flatnonzero(p2l >= 0)
            phys = phys[np.lexsort((phys, p2l[phys]))]  # grouped by expert, ascending p inside a group
            experts = p2l[phys]
            first = np.searchsorted(experts, experts, side="left")
            running = np.cumsum(quota_P[phys])
            before = running[first] - quota_P[phys][first]
            inst[m, li, experts, np.arange(len(phys)) - first] = phys
            cum[m, li, experts, np.arange(len(phys)) - first] = running - before
    assert J * topo.num_gpus > inst.max(initial=0)
    return inst, cum


@dataclass(frozen=True)
class ReplicaExchange:
    """One rank's replica traffic for one (micro-batch, layer).

    sends: (peer EP rank, home slot) pairs, the weights this rank owns that `peer` computes with;
    recvs: (peer EP rank, replica index r = j - H) pairs, the replica slots this rank fills from owner `peer`.
    Both lists are ordered by (holder rank, replica index), so each pair of ranks agrees on message order.
    """

    sends: tuple[tuple[int, int], ...]
    recvs: tuple[tuple[int, int], ...]

    @property
    def empty(self) -> bool:
        return not self.sends and not self.recvs


def replica_exchanges(
    plan: Plan, topo: Topology, rank: int, layers: list[int]
) -> list[list[ReplicaExchange]]:
    """exchanges[m][li] for the given plan layers: what `rank` sends and receives to fill replica slots."""
    H = topo.num_home_slots
    slots_LGH = home_slots_LGH(plan.home_LE, topo)
    out = []
    for m in range(plan.num_microbatches):
        row = []
        for layer in layers:
            sends, recvs = [], []
            rep_GR = plan.slots_MLGJ[m, layer, :, H:]
            for g, r in zip(*np.nonzero(rep_GR >= 0), strict=True):
                e = int(rep_GR[g, r])
                owner = int(plan.home_LE[layer, e])
                if owner == rank:
                    sends.append((int(g), int(np.flatnonzero(slots_LGH[layer, owner] == e)[0])))
                if g == rank:
                    recvs.append((owner, int(r)))
            row.append(ReplicaExchange(tuple(sends), tuple(recvs)))
        out.append(row)
    return out


@dataclass(frozen=True)
class MigrationMoves:
    """One rank's slot moves for one layer when the home placement changes.

    local: (new slot, old slot) pairs whose content stays on this rank;
    sends: (peer, old slot) pairs, in the peer's new-slot order; recvs: (peer, new slot) pairs, ascending new slot.
    """

    local: tuple[tuple[int, int], ...]
    sends: tuple[tuple[int, int], ...]
    recvs: tuple[tuple[int, int], ...]

    @property
    def identity(self) -> bool:
        return not self.sends and not self.recvs and all(a == b for a, b in self.local)


def migration_moves(old_GH: np.ndarray, new_GH: np.ndarray, rank: int) -> MigrationMoves:
    """Moves of one layer from slot contents old_GH[g, j] (logical ids) to new_GH[g, j] for EP rank `rank`.

    Raises ValueError unless both hold every expert exactly once.
    """
    old, new = np.asarray(old_GH), np.asarray(new_GH)
    if old.shape != new.shape or sorted(old.reshape(-1)) != sorted(new.reshape(-1)):
        raise ValueError("old and new placements must hold the same experts, each exactly once")
    if len(set(old.reshape(-1).tolist())) != old.size:
        raise ValueError("a placement holds some expert twice")
    where = {int(e): divmod(i, old.shape[1]) for i, e in enumerate(old.reshape(-1))}
    local, recvs, sends = [], [], []
    for j, e in enumerate(new[rank]):
        g, jo = where[int(e)]
        (local.append((j, jo)) if g == rank else recvs.append((g, j)))
    for g in range(new.shape[0]):
        if g == rank:
            continue
        for e in new[g]:
            src, jo = where[int(e)]
            if src == rank:
                sends.append((g, jo))
    return MigrationMoves(tuple(local), tuple(sends), tuple(recvs))
