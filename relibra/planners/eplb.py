"""DeepSeek's EPLB (expert-parallel load balancer), reimplemented from its published algorithm, as a baseline.

Input: a load estimate weight[L, E], P = G (H + R) physical slots (the redundant experts are packed into the
same slot budget ReLibra gets), expert groups, nodes, GPUs. Output phy2log[L, P] and logcnt[L, E].

- Hierarchical policy (groups divide evenly among nodes): (1) pack expert groups onto nodes by balanced packing
  (heaviest first into the lightest pack with room, exactly groups / nodes per node); (2) inside each node, add
  replicas one at a time to the expert with the highest load per replica until the node's P / Z slots are used;
  (3) pack the node's physical experts onto its GPUs by balanced packing with load w / count.
- Global policy: the same with one group and one node, so copies may land on any GPU.

Tokens of an expert are split EVENLY across its copies, per source rank (copy i of c takes floor(D / c) plus one
of the remainder when (i - s) mod c < D mod c). One placement serves the whole step (all micro-batches).
"eplb_history" feeds a moving average of past steps' loads (uniform before the first step), "eplb_oracle" the
exact load of the current step. Owner of an expert (optimizer state): its previous owner if that GPU still holds a
copy, else the GPU of its lowest-numbered copy. With no expert groups in the model (Qwen3), `eplb_num_groups = 0`
makes every expert its own group.

Legend: L layers, E experts, P physical slots, G GPUs, J slots per GPU, Z nodes, M micro-batches, S sources,
X rows of a batched problem, N items of a row.
"""

from __future__ import annotations

import numpy as np

from relibra.plan import Plan, Topology
from relibra.planners.packing import balanced_packing

__all__ = ["eplb_plan", "eplb_rebalance", "replicate_experts"]


def replicate_experts(weight_XN: np.ndarray, num_phys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give each row's N experts num_phys >= N copies: one each, then one at a time to argmax weight / count.

    Returns phy2log_XP (expert of every copy), rank_XP (copy index of that expert), count_XN.
    """
    weight = np.asarray(weight_XN, dtype=np.float64)
    X, N = weight.shape
    if num_phys < N:
        raise ValueError(f"num_phys={num_phys} must be >= the {N} experts of a row")
    phy2log = np.concatenate(
        [np.broadcast_to(np.arange(N), (X, N)), np.zeros((X, num_phys - N), int)], axis=1
    )
    rank = np.zeros((X, num_phys), dtype=np.int64)
    count = np.ones((X, N), dtype=np.int64)
    rows = np.arange(X)
    for p in range(N, num_phys):
        pick = np.argmax(weight / count, axis=1)
        phy2log[:, p] = pick
        rank[:, p] = count[rows, pick]
        count[rows, pick] += 1
    return phy2log, rank, count


def _inverse(perm_XN: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm_XN)
    np.put_along_axis(inv, perm_XN, np.broadcast_to(np.arange(perm_XN.shape[1]), perm_XN.shape), axis=1)
    return inv


def eplb_rebalance(
    weight_LE: np.ndarray, num_phys: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray]:
    """EPLB: phy2log[L, P] (slot p on GPU p // (P / G)) and logcnt[L, E]; hierarchical if groups % nodes == 0."""
    L, E = weight_LE.shape
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1
    if E % num_groups or num_phys % num_gpus or num_gpus % num_nodes:
        raise ValueError(
            f"EPLB needs E={E} divisible by groups={num_groups}, P={num_phys} by GPUs={num_gpus}, "
            f"GPUs by nodes={num_nodes}"
        )
    group_size = E // num_groups
    weight = np.asarray(weight_LE, dtype=np.float64)
    # (1) groups -> nodes.
    group_pack, group_rank = balanced_packing(weight.reshape(L, num_groups, group_size).sum(-1), num_nodes)
    groups_per_node = num_groups // num_nodes
    log2mlog = (group_pack * groups_per_node + group_rank)[:, :, None] * group_size + np.arange(group_size)
    log2mlog = log2mlog.reshape(L, E)  # node-major order of the logical experts
    mlog2log = _inverse(log2mlog)
    # (2) replicas inside each node.
    per_node = E // num_nodes
    w_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * num_nodes, per_node)
    phy2mlog, _, mlogcnt = replicate_experts(w_mlog, num_phys // num_nodes)
    # (3) the node's physical experts -> its GPUs.
    w_phy = np.take_along_axis(w_mlog / mlogcnt, phy2mlog, axis=1)
    pack, rank = balanced_packing(w_phy, num_gpus // num_nodes)
    phys_per_gpu = num_phys // num_gpus
    pphy2phy = _inverse(pack * phys_per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * per_node)[None, :, None]).reshape(L, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, E), log2mlog, axis=1)
    return phy2log, logcnt


def _copy_index_LP(phy2log_LP: np.ndarray, num_experts: int) -> np.ndarray:
    """Index of each copy among the copies of its expert, in ascending physical slot order."""
    _L, P = phy2log_LP.shape
    order = np.argsort(phy2log_LP * P + np.arange(P), axis=1, kind="stable")
    sorted_e = np.take_along_axis(phy2log_LP, order, axis=1)
    first = np.ones_like(sorted_e, dtype=bool)
    first[:, 1:] = sorted_e[:, 1:] != sorted_e[:, :-1]
    start = np.maximum.accumulate(np.where(first, np.arange(P)[None], 0), axis=1)
    idx = np.empty_like(order)
    np.put_along_axis(idx, order, np.arange(P)[None] - start, axis=1)
    return idx


def _owners_LE(phy2log_LP: np.ndarray, copy_LP: np.ndarray, prev_LE: np.ndarray, slots_per_gpu: int):
    L, P = phy2log_LP.shape
    E = prev_LE.shape[1]
    gpu_LP = np.arange(P)[None] // slots_per_gpu
    rows = np.arange(L)[:, None]
    first_gpu = np.empty((L, E), dtype=np.int64)
    is_first = copy_LP == 0
    first_gpu[np.broadcast_to(rows, (L, P))[is_first], phy2log_LP[is_first]] = np.broadcast_to(
        gpu_LP, (L, P)
    )[is_first]
    on_prev = gpu_LP == prev_LE[rows, phy2log_LP]
    keep = np.zeros((L, E), dtype=bool)
    keep[np.broadcast_to(rows, (L, P))[on_prev], phy2log_LP[on_prev]] = True
    return np.where(keep, prev_LE, first_gpu)


def eplb_plan(
    loads_MLSE: np.ndarray,
    weight_LE: np.ndarray,
    topo: Topology,
    prev_LE: np.ndarray,
    num_groups: int,
    hierarchical: bool,
) -> Plan:
    """The EPLB placement for `weight_LE` and the even split of the step's actual loads across copies."""
    M, L, S, E = loads_MLSE.shape
    G, J = topo.num_gpus, topo.num_slots
    groups = num_groups or E
    nodes = topo.num_nodes if hierarchical else 1
    if not hierarchical:
        groups = 1
    phy2log, _ = eplb_rebalance(weight_LE, G * J, groups, nodes, G)
    copy = _copy_index_LP(phy2log, E)
    count = np.take_along_axis(
        np.bincount((np.arange(L)[:, None] * E + phy2log).reshape(-1), minlength=L * E).reshape(L, E),
        phy2log,
        axis=1,
    )  # copies of each slot's expert
    demand_MLPS = loads_MLSE.transpose(0, 1, 3, 2)[:, np.arange(L)[:, None], phy2log]
    c = count[None, :, :, None]
    extra = ((copy[None, :, :, None] - np.arange(S)) % c) < (demand_MLPS % c)
    quota = (demand_MLPS // c + extra).astype(np.int32).reshape(M, L, G, J, S)
    slots = np.broadcast_to(phy2log.reshape(1, L, G, J).astype(np.int32), (M, L, G, J))
    home = _owners_LE(phy2log, copy, prev_LE, J)
    within = hierarchical and groups % topo.num_nodes == 0
    return Plan(
        home_LE=home,
        slots_MLGJ=slots,
        quota_MLGJS=quota,
        num_home_slots=topo.num_home_slots,
        persistent_replicas=True,
        replicas_within_node=within or topo.num_nodes == 1,
    )
