"""Cost model of a MoE training step under a plan, and the step-time simulation of specs/relibra.md "Cost model".

Per (micro-batch m, layer l), everything in microseconds:

- compute(m, l) = max_g sum_{instances i on g} (1 + f_bwd) t_gemm(n_i),
  t_gemm(n) = a ceil(n / tile) tile + b [n > 0].
- all-to-all(m, l) = 2 dispatch-like (source -> expert: forward dispatch, backward combine) + 2 combine-like
  (expert -> source), each max over GPUs and directions of max(nic_bytes / B_nic, nvlink_bytes / B_nvl) + lat;
  bytes = pairs x hidden x 2 (bf16); pairs computed on their own source GPU cost nothing. Which NIC a cross-node
  pair uses is `nic_routing`:
    direct: the sender's own NIC out, the receiver's own NIC in (NCCL with PXN off); the two kinds then cost the
      same (one is the other's mirror);
    pxn: NCCL's default on rail-optimised nodes (NCCL_P2P_PXN_LEVEL=2: the send side of a peer connection uses the
      NIC of the sending node's GPU with the receiver's local index, reached over NVLink; the receiver uses its
      own NIC): a pair to GPU (node y, local index r) leaves through NIC r of the sender's node, after an NVLink
      hop to that GPU when the sender's local index is not r.
- replication(m, l) (per-(m, l) replicas): forward max_g max(0, push_g / B_nvl - attn_g), backward
  max_g max(0, (push_g + grads_g) / B_nvl - f_bwd attn_g), where push_g / grads_g are the bf16 weights / fp32
  gradients GPU g receives or sends (the larger), attn_g its attention time (the window that hides them).
- Step time = sum over (m, l) of [compute + all-to-all + replication] + non-MoE + migration, where
  non-MoE = sum over (m, l) of (1 + f_bwd) max_s attn_s and migration is the exposed part of moving every
  expert whose owner changed: its bf16 weights (2 bytes per parameter) before the step, and its optimizer state
  (12: fp32 master + 2 Adam moments, split over optimizer shards) either before the step too
  (`overlap_optimizer_state: false`, the paper's accounting) or during it, as relibra.executor does it. The
  executor sends the state in chunks as earlier ones land, not timed to the phases of the step, so the transfer
  is taken as spread over the step: what coincides with the all-to-alls delays them (the links are shared),
  what falls into expert compute or attention is hidden, and what outlasts the step is exposed:
    migration = T(weights) + share min(T(state), span) + max(0, T(state) - span),
    span = all-to-all + compute + non-MoE,  share = all-to-all / span,  T = one batch of transfers.

Departures (ours): EPLB-style plans (persistent copies) pay once per step to push weights to every copy and
reduce its gradients to the owner, counted as exposed; a transfer batch adds `transfer_latency_us` once. The ideal
reference (`ideal_step_cost`) computes sum_e t_gemm(W_e) / G per (m, l) (the plan-independent work spread
perfectly), moves P / G pairs in and out of every GPU with the node mix of uniform traffic, and has no
replication or migration. "MoE time" below is everything except non-MoE.

The ideal is a reference, not a bound: a placement that keeps traffic inside nodes can beat its all-to-all.
`moe_lower_bound_us` is a true lower bound of the MoE time of every plan whose copies stay in their owner's node
and are rewritten per (m, l) (ReLibra's family, static and reorder-only included); `placement_floor_us` is one for
the plans of that family with a given placement: what the best replicas could reach on it.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU, Z nodes, P pairs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from relibra.plan import Plan, Topology

__all__ = [
    "NIC_ROUTINGS",
    "CostModel",
    "StepCost",
    "ideal_step_cost",
    "moe_lower_bound_us",
    "placement_floor_us",
    "step_cost",
]

NUM_ALLTOALLS = 4  # dispatch + combine, forward + backward
NIC_ROUTINGS = ("direct", "pxn")


@dataclass(frozen=True)
class CostModel:
    """Calibratable parameters (units in the YAML file next to this module, which holds the Hopper defaults)."""

    hidden_size: int
    expert_ffn_hidden_size: int
    gemm_us_per_token: float
    gemm_us_fixed: float
    gemm_tile: int
    backward_factor: float
    nvlink_gb_per_s: float
    nic_gb_per_s: float
    alltoall_latency_us: float
    transfer_latency_us: float
    attention_us_per_token: float
    activation_bytes: int = 2
    weight_bytes_per_param: int = 2
    grad_bytes_per_param: int = 4
    optimizer_bytes_per_param: int = 14
    optimizer_shards: int = 1
    overlap_optimizer_state: bool = True
    nic_routing: str = "direct"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"CostModel.{f.name} must be true or false, got {value!r}")
            elif f.type == "str":
                if value not in NIC_ROUTINGS:
                    raise ValueError(f"CostModel.{f.name} must be one of {NIC_ROUTINGS}, got {value!r}")
            elif not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CostModel.{f.name} must be a non-negative number, got {value!r}")
        for name in ("gemm_tile", "nvlink_gb_per_s", "nic_gb_per_s", "optimizer_shards", "hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostModel.{name} must be > 0, got {getattr(self, name)!r}")

    @classmethod
    def from_yaml(cls, path: str | Path | None = None, nic_routing: str | None = None) -> CostModel:
        """Read a cost-model YAML; None reads the packaged Hopper defaults. Unknown or missing keys raise.
        `nic_routing` (not None) overrides the file's."""
        import yaml  # local: keep `import relibra.cost_model` light for config modules

        if path is None:
            text = resources.files("relibra").joinpath("cost_model_hopper.yaml").read_text()
            where = "relibra/cost_model_hopper.yaml"
        else:
            text, where = Path(path).read_text(), str(path)
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping of cost-model parameters")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{where}: unknown cost-model keys {sorted(unknown)}; known: {sorted(known)}")
        if nic_routing is not None:
            data["nic_routing"] = nic_routing
        try:
            return cls(**data)
        except TypeError as err:
            raise ValueError(f"{where}: {err}") from None

    def for_expert_shape(self, hidden_size: int, expert_ffn_hidden_size: int) -> CostModel:
        """The same hardware for another expert shape: transfers follow the new sizes, and the expert GEMM time
        scales with the work per pair and the weight bytes, both proportional to hidden x ffn:

            a' = a r,  b' = b r,  r = (H' F') / (H F)

        The attention time per token (the window that hides replica pushes) depends on the attention shape and is
        kept; calibrate it in a YAML for a model whose attention differs much from the calibrated one.
        """
        if hidden_size <= 0 or expert_ffn_hidden_size <= 0:
            raise ValueError(f"expert shape must be positive, got ({hidden_size}, {expert_ffn_hidden_size})")
        r = hidden_size * expert_ffn_hidden_size / (self.hidden_size * self.expert_ffn_hidden_size)
        return dataclasses.replace(
            self,
            hidden_size=hidden_size,
            expert_ffn_hidden_size=expert_ffn_hidden_size,
            gemm_us_per_token=self.gemm_us_per_token * r,
            gemm_us_fixed=self.gemm_us_fixed * r,
        )

    @property
    def expert_params(self) -> int:
        """Parameters of one SwiGLU expert: gate, up and down projections."""
        return 3 * self.hidden_size * self.expert_ffn_hidden_size

    @property
    def pair_bytes(self) -> int:
        return self.hidden_size * self.activation_bytes

    def gemm_us(self, n: np.ndarray) -> np.ndarray:
        """Forward t_gemm(n) = a ceil(n / tile) tile + b [n > 0] for an array of pair counts."""
        n = np.asarray(n)
        tiles = -(-n // self.gemm_tile)
        return self.gemm_us_per_token * self.gemm_tile * tiles + self.gemm_us_fixed * (n > 0)

    def train_gemm_us(self, n: np.ndarray) -> np.ndarray:
        """Forward plus backward expert time (1 + f_bwd) t_gemm(n)."""
        return (1.0 + self.backward_factor) * self.gemm_us(n)

    def nvlink_us(self, num_bytes: np.ndarray) -> np.ndarray:
        return np.asarray(num_bytes) / (self.nvlink_gb_per_s * 1e3)

    def nic_us(self, num_bytes: np.ndarray) -> np.ndarray:
        return np.asarray(num_bytes) / (self.nic_gb_per_s * 1e3)

    def migration_bytes_per_expert(self) -> tuple[float, float]:
        """(weights, optimizer state) bytes one GPU sends to move one expert: the bf16 weights whole, the rest of
        `optimizer_bytes_per_param` (fp32 master and moments) split over the distributed optimizer's shards."""
        weights = self.expert_params * self.weight_bytes_per_param
        state = self.expert_params * (self.optimizer_bytes_per_param - self.weight_bytes_per_param)
        return float(weights), state / self.optimizer_shards

    def exposed_migration_bytes_per_expert(self, alltoall_share: float) -> float:
        """Bytes of a moved expert the step waits for: the weights, and of the optimizer state all if it moves
        before the step, else the `alltoall_share` of the step's time that its transfer shares with the
        all-to-alls (module docstring)."""
        weights, state = self.migration_bytes_per_expert()
        return weights + state * (alltoall_share if self.overlap_optimizer_state else 1.0)


@dataclass(frozen=True)
class StepCost:
    """Simulated time of one training step (microseconds, summed over its (m, l)) and its load metrics.

    skew_ML: max/mean pairs per GPU for every (m, l) (NaN where the micro-batch routes nothing).
    cross_node_bytes: dispatch/combine bytes that cross a node boundary (all four all-to-alls).
    migration_bytes: bytes moved (weights and optimizer state) because owners changed; migration_us counts the
    part of their transfer the step waits for.
    """

    compute_us: float
    alltoall_us: float
    replication_us: float
    migration_us: float
    non_moe_us: float
    cross_node_bytes: float
    migration_bytes: float
    skew_ML: np.ndarray

    @property
    def moe_us(self) -> float:
        return self.compute_us + self.alltoall_us + self.replication_us + self.migration_us

    @property
    def step_us(self) -> float:
        return self.moe_us + self.non_moe_us

    @property
    def alltoall_share(self) -> float:
        """The fraction of the step's dispatch, compute and attention time that the all-to-alls take."""
        return _share(self.alltoall_us, self.compute_us + self.non_moe_us)


def _share(alltoall_us: float, idle_us: float) -> float:
    span = alltoall_us + idle_us
    return alltoall_us / span if span > 0 else 0.0


def _attention_us_MG(loads_MLSE: np.ndarray, topk: int, cost: CostModel) -> np.ndarray:
    tokens_MS = loads_MLSE[:, 0].sum(axis=-1) / topk
    return cost.attention_us_per_token * tokens_MS


def _non_moe_us(loads_MLSE: np.ndarray, topk: int, cost: CostModel) -> float:
    L = loads_MLSE.shape[1]
    return float(
        L * (1.0 + cost.backward_factor) * _attention_us_MG(loads_MLSE, topk, cost).max(axis=1).sum()
    )


def _skew_ML(tokens_MLG: np.ndarray) -> np.ndarray:
    mean = tokens_MLG.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, tokens_MLG.max(axis=-1) / np.where(mean > 0, mean, 1), np.nan)


def _link_time_us(nic_bytes: np.ndarray, nvl_bytes: np.ndarray, cost: CostModel, axis) -> np.ndarray:
    """max over the given axes of max(nic / B_nic, nvlink / B_nvl)."""
    return np.maximum(cost.nic_us(nic_bytes.max(axis=axis)), cost.nvlink_us(nvl_bytes.max(axis=axis)))


def _one_way_us(flow_MLAB: np.ndarray, topo: Topology, cost: CostModel) -> np.ndarray:
    """Link time [M, L] of one all-to-all whose pairs go from GPU a to GPU b (module docstring, `nic_routing`)."""
    M, L, G, _ = flow_MLAB.shape
    Z, Q = topo.num_nodes, topo.node_size
    node = topo.node_of_gpu()
    same = node[:, None] == node[None, :]
    cross = flow_MLAB * ~same
    intra = flow_MLAB * (same & ~np.eye(G, dtype=bool))
    nic_in, nvl_out, nvl_in = cross.sum(axis=2), intra.sum(axis=3), intra.sum(axis=2)
    if cost.nic_routing == "direct":
        nic_out = cross.sum(axis=3)
    else:
        # [m, l, sender node, sender index, receiver node, receiver index]
        cross6 = cross.reshape(M, L, Z, Q, Z, Q)
        nic_out = cross6.sum(axis=(3, 4)).reshape(M, L, G)  # NIC (sender node, receiver index)
        by_rail = cross6.sum(axis=4)  # [m, l, sender node, sender index, receiver index]
        own = np.einsum("mlzqq->mlzq", by_rail)  # no hop: the sender holds the receiver's index
        nvl_out = nvl_out + (by_rail.sum(axis=-1) - own).reshape(M, L, G)
        nvl_in = nvl_in + (by_rail.sum(axis=3) - own).reshape(M, L, G)
    nic = np.concatenate([nic_out, nic_in], axis=-1) * cost.pair_bytes
    nvl = np.concatenate([nvl_out, nvl_in], axis=-1) * cost.pair_bytes
    return _link_time_us(nic, nvl, cost, axis=-1)


def _alltoall(plan: Plan, topo: Topology, cost: CostModel) -> tuple[float, float]:
    traffic_MLGS = plan.quota_MLGJS.sum(axis=3, dtype=np.int64)  # dest GPU g, source rank s
    combine = _one_way_us(traffic_MLGS, topo, cost)
    if cost.nic_routing == "direct":
        dispatch = combine  # the mirror of the combine: the same sends and receives
    else:
        dispatch = _one_way_us(traffic_MLGS.transpose(0, 1, 3, 2), topo, cost)
    busy = traffic_MLGS.sum(axis=(2, 3)) > 0
    per_ml = (NUM_ALLTOALLS // 2) * (dispatch + combine) + NUM_ALLTOALLS * cost.alltoall_latency_us * busy
    node = topo.node_of_gpu()
    cross_pairs = (traffic_MLGS * (node[:, None] != node[None, :])).sum()
    return float(per_ml.sum()), NUM_ALLTOALLS * float(cross_pairs) * cost.pair_bytes


def _transient_replication_us(plan: Plan, attn_MG: np.ndarray, cost: CostModel) -> float:
    """Exposed push / gradient-return time of per-(m, l) replicas (ReLibra-style plans)."""
    M, L, G, _ = plan.slots_MLGJ.shape
    rep = plan.slots_MLGJ[..., plan.num_home_slots :]
    valid = rep >= 0
    if not valid.any():
        return 0.0
    m_idx, l_idx, _, _ = np.nonzero(valid)
    owner = plan.home_LE[l_idx, rep[valid]]
    outgoing_MLG = np.bincount((m_idx * L + l_idx) * G + owner, minlength=M * L * G).reshape(M, L, G)
    copies_MLG = np.maximum(valid.sum(axis=-1), outgoing_MLG)
    w_bytes = cost.expert_params * cost.weight_bytes_per_param
    g_bytes = cost.expert_params * cost.grad_bytes_per_param
    latency = cost.transfer_latency_us * (copies_MLG > 0)
    attn = attn_MG[:, None, :]
    fwd = np.maximum(0.0, latency + cost.nvlink_us(copies_MLG * w_bytes) - attn)
    bwd = np.maximum(
        0.0, latency + cost.nvlink_us(copies_MLG * (w_bytes + g_bytes)) - cost.backward_factor * attn
    )
    return float(fwd.max(axis=-1).sum() + bwd.max(axis=-1).sum())


def _persistent_replication_us(plan: Plan, topo: Topology, cost: CostModel) -> float:
    """EPLB-style copies: once per step, push weights to every non-owner copy and reduce its gradients back."""
    slots_LGJ = np.asarray(plan.slots_MLGJ[0])
    _L, _G, _J = slots_LGJ.shape
    valid = slots_LGJ >= 0
    l_idx, g_idx, _ = np.nonzero(valid)
    owner = plan.home_LE[l_idx, slots_LGJ[valid]]
    per_copy = cost.expert_params * (cost.weight_bytes_per_param + cost.grad_bytes_per_param)
    time, _ = _transfer_us(owner, g_idx, np.full(len(owner), float(per_copy)), topo, cost)
    return time


def _transfer_us(src_X: np.ndarray, dst_X: np.ndarray, bytes_X: np.ndarray, topo: Topology, cost: CostModel):
    """Time of one batch of point-to-point transfers: max over GPUs and directions, NIC vs NVLink, + latency
    (cross-node transfers leave through the NIC that `nic_routing` picks, as in the all-to-alls)."""
    moving = src_X != dst_X
    if not moving.any():
        return 0.0, 0.0
    src, dst, nbytes = src_X[moving], dst_X[moving], bytes_X[moving]
    node = topo.node_of_gpu()
    cross = node[src] != node[dst]
    G, Q = topo.num_gpus, topo.node_size
    exit_gpu = src if cost.nic_routing == "direct" else node[src] * Q + dst % Q
    hop = cross & (exit_gpu != src)
    nic = np.zeros(2 * G)
    nvl = np.zeros(2 * G)
    np.add.at(nic, exit_gpu[cross], nbytes[cross])
    np.add.at(nic, G + dst[cross], nbytes[cross])
    np.add.at(nvl, src[~cross], nbytes[~cross])
    np.add.at(nvl, G + dst[~cross], nbytes[~cross])
    np.add.at(nvl, src[hop], nbytes[hop])
    np.add.at(nvl, G + exit_gpu[hop], nbytes[hop])
    time = float(max(cost.nic_us(nic.max()), cost.nvlink_us(nvl.max()))) + cost.transfer_latency_us
    return time, float(nbytes[cross].sum())


def _migration(
    prev_home_LE: np.ndarray,
    home_LE: np.ndarray,
    topo: Topology,
    cost: CostModel,
    alltoall_us: float,
    idle_us: float,
):
    """(exposed time, bytes) of moving experts from prev_home_LE to home_LE, in a step whose all-to-alls take
    `alltoall_us` and whose expert compute and attention take `idle_us` (module docstring)."""
    weights, state = cost.migration_bytes_per_expert()
    src, dst = prev_home_LE.reshape(-1), home_LE.reshape(-1)
    if not cost.overlap_optimizer_state:
        return _transfer_us(src, dst, np.full(len(src), weights + state), topo, cost)
    t_weights, b_weights = _transfer_us(src, dst, np.full(len(src), weights), topo, cost)
    t_state, b_state = _transfer_us(src, dst, np.full(len(src), state), topo, cost)
    span = alltoall_us + idle_us
    exposed = _share(alltoall_us, idle_us) * min(t_state, span) + max(0.0, t_state - span)
    return t_weights + exposed, b_weights + b_state


def step_cost(
    plan: Plan, loads_MLSE: np.ndarray, topk: int, topo: Topology, cost: CostModel, prev_home_LE: np.ndarray
) -> StepCost:
    """Simulated time of one step under `plan` (module docstring); `prev_home_LE` is the placement before it."""
    attn_MG = _attention_us_MG(loads_MLSE, topk, cost)
    served_MLGJ = plan.served_MLGJ()
    compute = float(cost.train_gemm_us(served_MLGJ).sum(axis=-1).max(axis=-1).sum())
    alltoall, cross_bytes = _alltoall(plan, topo, cost)
    if plan.persistent_replicas:
        replication = _persistent_replication_us(plan, topo, cost)
    else:
        replication = _transient_replication_us(plan, attn_MG, cost)
    non_moe = _non_moe_us(loads_MLSE, topk, cost)
    migration, migration_bytes = _migration(
        prev_home_LE, plan.home_LE, topo, cost, alltoall, compute + non_moe
    )
    return StepCost(
        compute_us=compute,
        alltoall_us=alltoall,
        replication_us=replication,
        migration_us=migration,
        non_moe_us=non_moe,
        cross_node_bytes=cross_bytes,
        migration_bytes=migration_bytes,
        skew_ML=_skew_ML(served_MLGJ.sum(axis=-1)),
    )


def ideal_step_cost(loads_MLSE: np.ndarray, topk: int, topo: Topology, cost: CostModel) -> StepCost:
    """Closed form of the ideal reference: per (m, l), with W_e the pairs of expert e and P = sum_e W_e,

    compute = (1 + f_bwd) sum_e t_gemm(W_e) / G,
    all-to-all = 4 (max((P / G) ((G - Q) / G) bytes / B_nic, (P / G) v bytes / B_nvl) + lat [P > 0]),
    v = (Q - 1) / G (direct routing; with pxn the pairs to other nodes' GPUs of another local index add an NVLink
    hop: v = (Q - 1) / G + ((G - Q) / G) ((Q - 1) / Q) = (Q - 1) / Q), no replication, no migration; skew 1.
    """
    G, Q = topo.num_gpus, topo.node_size
    W_MLE = loads_MLSE.sum(axis=2)
    P_ML = W_MLE.sum(axis=-1).astype(np.float64)
    compute = float(cost.train_gemm_us(W_MLE).sum() / G)
    per_gpu_bytes = P_ML / G * cost.pair_bytes
    nvl_share = (Q - 1) / G if cost.nic_routing == "direct" else (Q - 1) / Q
    link = np.maximum(cost.nic_us(per_gpu_bytes * (G - Q) / G), cost.nvlink_us(per_gpu_bytes * nvl_share))
    alltoall = NUM_ALLTOALLS * float((link + cost.alltoall_latency_us * (P_ML > 0)).sum())
    cross_bytes = NUM_ALLTOALLS * float(P_ML.sum()) * (G - Q) / G * cost.pair_bytes
    return StepCost(
        compute_us=compute,
        alltoall_us=alltoall,
        replication_us=0.0,
        migration_us=0.0,
        non_moe_us=_non_moe_us(loads_MLSE, topk, cost),
        cross_node_bytes=cross_bytes,
        migration_bytes=0.0,
        skew_ML=np.where(P_ML > 0, 1.0, np.nan),
    )


def moe_lower_bound_us(loads_MLSE: np.ndarray, topk: int, topo: Topology, cost: CostModel) -> float:
    """A lower bound of `step_cost(plan, ...).moe_us` for every plan whose replicas stay in the owner's node and are
    rewritten per (m, l), whatever the placement (even one per micro-batch) and ignoring migration.

    Per (m, l), with W_e the pairs of expert e, t(n) = (1 + f_bwd) t_gemm(n), far_e = min_z (W_e - A_ze) the fewest
    pairs of e that come from outside the node serving it (A_ze: pairs of e from node z's sources), lat = the
    all-to-all latency if the micro-batch routes anything:
      no copy:   max(sum_e t(W_e) / G, max_e t(W_e)) + 4 (max(sum_e far_e / G, max_e far_e) bytes / B_nic + lat)
      any copy:  sum_e t(W_e) / G + 4 (sum_e far_e / G bytes / B_nic + lat) + rep,
    (with pxn routing only the 2 dispatch-like all-to-alls count max_e far_e: the combine-like ones send an
    expert's results through all NICs of its node),
    rep = max(0, lat_p + w / B_nvl - attn) + max(0, lat_p + (w + g) / B_nvl - f_bwd attn) (one expert's weights w
    pushed and gradients g returned, attn the largest attention window of a source rank); the bound is the sum over
    (m, l) of the smaller of the two. Why it holds: splitting a GEMM never lowers its total time (t is subadditive),
    a GPU computes at least the mean, an unsplit expert sits on one GPU; all pairs of an expert are served in one
    node, so at least far_e of them cross a NIC (at least the mean per GPU, all into one GPU's own NIC without
    copies); a copy costs at least one push and gradient return on the GPU that gets it.
    """
    M, L, _S, E = loads_MLSE.shape
    G, Q, Z = topo.num_gpus, topo.node_size, topo.num_nodes
    W_MLE = loads_MLSE.sum(axis=2)
    t_MLE = cost.train_gemm_us(W_MLE)
    comp_split = t_MLE.sum(axis=-1) / G
    comp_whole = np.maximum(comp_split, t_MLE.max(axis=-1))
    A_MLZE = loads_MLSE.reshape(M, L, Z, Q, E).sum(axis=3)
    far_MLE = (W_MLE[:, :, None, :] - A_MLZE).min(axis=2)
    lat_ML = cost.alltoall_latency_us * (W_MLE.sum(axis=-1) > 0)
    nic_split = cost.nic_us(far_MLE.sum(axis=-1) / G * cost.pair_bytes)
    nic_whole = np.maximum(nic_split, cost.nic_us(far_MLE.max(axis=-1) * cost.pair_bytes))
    attn_M1 = _attention_us_MG(loads_MLSE, topk, cost).max(axis=1)[:, None]
    w_bytes = cost.expert_params * cost.weight_bytes_per_param
    g_bytes = cost.expert_params * cost.grad_bytes_per_param
    rep_M1 = np.maximum(0.0, cost.transfer_latency_us + cost.nvlink_us(w_bytes) - attn_M1) + np.maximum(
        0.0, cost.transfer_latency_us + cost.nvlink_us(w_bytes + g_bytes) - cost.backward_factor * attn_M1
    )
    whole_share = 1.0 if cost.nic_routing == "direct" else 0.5
    nic_no_copy = whole_share * nic_whole + (1.0 - whole_share) * nic_split
    whole = comp_whole + NUM_ALLTOALLS * (nic_no_copy + lat_ML)
    split = comp_split + NUM_ALLTOALLS * (nic_split + lat_ML) + rep_M1
    return float(np.minimum(whole, split).sum())


def placement_floor_us(loads_MLSE: np.ndarray, home_LE: np.ndarray, topo: Topology, cost: CostModel) -> float:
    """A lower bound of `step_cost(plan, ...).moe_us - migration_us` for every plan with placement `home_LE` whose
    copies stay in their owner's node (rewritten per (m, l)): the floor that replication cannot go below, so that
    MoE time / ideal splits into what the placement costs and what the replicas leave on top.

    Per (m, l), with NL_z the pairs of experts homed on node z, Recv_z those of them from other nodes' sources,
    Send_s the pairs of source rank s to experts homed on other nodes, c = a (1 + f_bwd), lat the all-to-all latency
    if the micro-batch routes anything:

      direct routing:  c max_z NL_z / Q + 4 (max(max_z Recv_z / Q, max_s Send_s) bytes / B_nic + lat),
      pxn routing:     c max_z NL_z / Q + 2 (max(max_z Recv_z / Q, max_z Sent_z / Q) bytes / B_nic + lat)
                                        + 2 (max(max_{z, r} Rail_zr, max_s Send_s) bytes / B_nic + lat),
    Sent_z = sum of Send_s over node z's sources, Rail_zr = the pairs of the sources of local index r on other nodes
    to experts homed on node z (so sum_r Rail_zr = Recv_z).

    Why it holds: t(n) >= c n / (1 + f_bwd) (the tile only rounds up); node z's pairs are computed on its Q GPUs, so
    one of them computes at least NL_z / Q; they also receive Recv_z over their NICs, one at least Recv_z / Q; a
    pair of source s to another node's expert is served in that node and crosses s's own NIC (direct: both ways;
    pxn: only on its way back, its way out leaves through one of the Q NICs of s's node); under pxn the results for
    the sources of local index r leave node z through its NIC r, whichever of its GPUs computed them (Rail_zr, fixed
    by the placement); replica transfers only add time.
    """
    M, L, _S, E = loads_MLSE.shape
    Z, Q = topo.num_nodes, topo.node_size
    node_LE = np.asarray(home_LE) // Q
    in_node_LZE = node_LE[:, None, :] == np.arange(Z)[None, :, None]
    W_MLE = loads_MLSE.sum(axis=2, dtype=np.int64)
    A_MLZE = loads_MLSE.reshape(M, L, Z, Q, E).sum(axis=3, dtype=np.int64)
    NL_MLZ = np.einsum("mle,lze->mlz", W_MLE, in_node_LZE)
    recv_MLZ = NL_MLZ - np.einsum("mlze,lze->mlz", A_MLZE, in_node_LZE)
    away_LSE = node_LE[:, None, :] != topo.node_of_gpu()[None, :, None]
    send_MLS = np.einsum("mlse,lse->mls", loads_MLSE, away_LSE)
    compute = cost.gemm_us_per_token * (1.0 + cost.backward_factor) * NL_MLZ.max(axis=-1) / Q
    recv = recv_MLZ.max(axis=-1) / Q
    combine = np.maximum(recv, send_MLS.max(axis=-1))
    if cost.nic_routing == "direct":
        dispatch = combine
    else:
        dispatch = np.maximum(recv, send_MLS.reshape(M, L, Z, Q).sum(axis=-1).max(axis=-1) / Q)
        to_node_MLZQY = np.einsum("mlse,lye->mlsy", loads_MLSE, in_node_LZE).reshape(M, L, Z, Q, Z)
        away_ZY = ~np.eye(Z, dtype=bool)
        rail_MLRY = np.einsum("mlzry,zy->mlry", to_node_MLZQY, away_ZY)
        combine = np.maximum(rail_MLRY.max(axis=(-2, -1)), send_MLS.max(axis=-1))
    nic_us = cost.nic_us((dispatch + combine) * cost.pair_bytes) * (NUM_ALLTOALLS // 2)
    lat = cost.alltoall_latency_us * (W_MLE.sum(axis=-1) > 0)
    return float((compute + nic_us + NUM_ALLTOALLS * lat).sum())
