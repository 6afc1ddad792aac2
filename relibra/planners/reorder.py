"""Inter-batch expert reordering: choose home(l, e) -> GPU once per step (H experts per GPU), layers independent.

Objective of one layer (specs/relibra.md), in microseconds, summed over micro-batches m:

  J(home) = alpha  c_pair / Q   sum_m smax_z NodeLoad[m, z]
          + alpha' c_pair       sum_m smax_g GpuLoad[m, g]
          + beta   c_x          sum_m smax_{z, dir} CrossPairs[m, z, dir]
          + gamma  sum_e mig(e, home(e))

with c_pair = a (1 + f_bwd) (expert time per pair), c_x = 4 bytes_per_pair / (Q B_nic) (a node's NICs, four
all-to-alls), CrossPairs the pairs node z sends to / receives from other nodes, mig(e, g) = 0 if g is e's
previous GPU, else the bytes of an expert's migration the step waits for (its weights, and the share of its
optimizer state that travels while the all-to-alls run) over G NICs (G NVLinks inside a node): the spread-out cost
of moving it. smax_k x_k = (s / b) log sum_k exp(b x_k / s) with s the mean node load of (m, l) and b the
config's `smooth_beta` (the "objective smoothing").

Solver: simulated annealing over swaps of two experts on different GPUs, all layers advanced in lockstep
(vectorised). Each move evaluates `anneal_candidates` random swaps per layer by incremental (delta) evaluation of
J from per-expert per-micro-batch load vectors, proposes the best, accepts it by Metropolis with temperature
t0 * cooling^(swaps tried) relative to the layer's starting objective, and keeps the best placement seen.
`anneal_iters` counts swaps tried. Departure (ours): the start of every layer is the better of the previous
placement (warm start) and the greedy-LPT placement, both judged by J including migration.

`greedy_lpt_home` is the ablation baseline: balanced packing (LPT) of experts onto GPUs by aggregate load.
The annealed placement is then refined by an exact descent on its floor (`relibra.planners.refine`).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, H home slots, Z nodes, Q GPUs per node,
C candidate swaps, X slot positions (G * H).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cost_model import NUM_ALLTOALLS, CostModel
from relibra.plan import Topology
from relibra.planners.packing import balanced_packing

__all__ = [
    "ReorderProblem",
    "ReorderWeights",
    "anneal_home",
    "greedy_lpt_home",
    "migration_L",
    "migration_cost",
    "reorder_objective_L",
    "reorder_problem",
]

_EXP_CLIP = 700.0


@dataclass(frozen=True)
class ReorderWeights:
    """Coefficients of J in microseconds: per pair (node, gpu, cross) and per moved expert (migration)."""

    node: float
    gpu: float
    cross: float
    migrate_nic: float
    migrate_nvlink: float
    beta: float
    # The cost model routes pxn (relibra.cost_model): the descent prices that routing's floor.
    pxn: bool = False

    @classmethod
    def from_config(cls, cfg, cost: CostModel, topo: Topology, alltoall_share: float = 1.0) -> ReorderWeights:
        """`alltoall_share`: the part of a step the all-to-alls take, which decides how much of a migration's
        optimizer state the step waits for (relibra.cost_model); 1 counts all of it."""
        c_pair = cost.gemm_us_per_token * (1.0 + cost.backward_factor)
        Q, G = topo.node_size, topo.num_gpus
        per_expert = cost.exposed_migration_bytes_per_expert(alltoall_share)
        return cls(
            node=cfg.reorder_node_weight * c_pair / Q,
            gpu=cfg.reorder_gpu_weight * c_pair,
            cross=cfg.reorder_comm_weight * NUM_ALLTOALLS * float(cost.nic_us(cost.pair_bytes)) / Q,
            migrate_nic=cfg.reorder_migration_weight * float(cost.nic_us(per_expert)) / G,
            migrate_nvlink=cfg.reorder_migration_weight * float(cost.nvlink_us(per_expert)) / G,
            beta=cfg.smooth_beta,
            pxn=cost.nic_routing == "pxn",
        )


@dataclass(frozen=True)
class ReorderProblem:
    """Per-layer inputs of J: W_LEM pairs of expert e in micro-batch m, A_LZEM those from node z's sources, D_LSEM
    those from source rank s (the loads, transposed), scale_LM the smoothing scale s (mean node load, at least 1),
    prev_LE the previous placement."""

    W_LEM: np.ndarray
    A_LZEM: np.ndarray
    D_LSEM: np.ndarray
    scale_LM: np.ndarray
    prev_LE: np.ndarray
    topo: Topology
    weights: ReorderWeights


def reorder_problem(loads_MLSE: np.ndarray, prev_LE: np.ndarray, topo: Topology, weights) -> ReorderProblem:
    M, L, _S, E = loads_MLSE.shape
    Z, Q = topo.num_nodes, topo.node_size
    W_LEM = np.ascontiguousarray(loads_MLSE.sum(axis=2).transpose(1, 2, 0), dtype=np.float64)
    A_LZEM = np.ascontiguousarray(
        loads_MLSE.reshape(M, L, Z, Q, E).sum(axis=3).transpose(1, 2, 3, 0), dtype=np.float64
    )
    D_LSEM = loads_MLSE.transpose(
        1, 2, 3, 0
    )  # a view: `relibra.planners.refine` copies it into its own layout
    scale_LM = np.maximum(W_LEM.sum(axis=1) / Z, 1.0)
    return ReorderProblem(W_LEM, A_LZEM, D_LSEM, scale_LM, np.asarray(prev_LE), topo, weights)


def _gpu_loads_LGM(prob: ReorderProblem, home_LE: np.ndarray) -> np.ndarray:
    L, _E, M = prob.W_LEM.shape
    G = prob.topo.num_gpus
    out = np.zeros((L, G, M))
    np.add.at(out, (np.arange(L)[:, None], home_LE), prob.W_LEM)
    return out


def _node_terms(prob: ReorderProblem, home_LE: np.ndarray, GL_LGM: np.ndarray):
    """Node loads [L, Z, M], cross-node received and sent pairs [L, Z, M] of a placement."""
    L, _E, M = prob.W_LEM.shape
    Z, Q = prob.topo.num_nodes, prob.topo.node_size
    NL = GL_LGM.reshape(L, Z, Q, M).sum(axis=2)
    in_node_LZE = (home_LE[:, None, :] // Q) == np.arange(Z)[None, :, None]
    local_LZM = np.einsum("lze,lzem->lzm", in_node_LZE, prob.A_LZEM)
    recv = NL - local_LZM
    send = prob.A_LZEM.sum(axis=2) - local_LZM
    return NL, recv, send


def _smax_LM(x_LKM: np.ndarray, scale_LM: np.ndarray, beta: float) -> np.ndarray:
    z = beta * x_LKM / scale_LM[:, None, :]
    top = z.max(axis=1, keepdims=True)
    return scale_LM / beta * (np.log(np.exp(z - top).sum(axis=1)) + top[:, 0])


def migration_cost(prob: ReorderProblem, e_X: np.ndarray, g_X: np.ndarray, l_X: np.ndarray) -> np.ndarray:
    """mig(e, g) of J for arrays of (expert, GPU, layer): 0 where g is e's previous GPU, else the spread-out
    migration time over NVLink (same node) or the NICs."""
    Q = prob.topo.node_size
    prev = prob.prev_LE[l_X, e_X]
    w = prob.weights
    return np.where(g_X == prev, 0.0, np.where(g_X // Q == prev // Q, w.migrate_nvlink, w.migrate_nic))


def migration_L(prob: ReorderProblem, home_LE: np.ndarray) -> np.ndarray:
    """sum_e mig(e, home(e)) of every layer."""
    L, E = home_LE.shape
    l_X = np.repeat(np.arange(L), E)
    return migration_cost(prob, np.tile(np.arange(E), L), home_LE.reshape(-1), l_X).reshape(L, E).sum(axis=1)


def reorder_objective_L(prob: ReorderProblem, home_LE: np.ndarray) -> np.ndarray:
    """J of every layer for placement home_LE (the full evaluation the annealing's deltas must agree with)."""
    w = prob.weights
    GL = _gpu_loads_LGM(prob, home_LE)
    NL, recv, send = _node_terms(prob, home_LE, GL)
    total = w.gpu * _smax_LM(GL, prob.scale_LM, w.beta).sum(axis=1)
    if prob.topo.num_nodes > 1:
        total += w.node * _smax_LM(NL, prob.scale_LM, w.beta).sum(axis=1)
        cross = np.concatenate([recv, send], axis=1)
        total += w.cross * _smax_LM(cross, prob.scale_LM, w.beta).sum(axis=1)
    else:  # one node: the node term is a constant, keep it so J is comparable across topologies
        total += w.node * NL[:, 0].sum(axis=-1)
    return total + migration_L(prob, home_LE)


def greedy_lpt_home(loads_MLSE: np.ndarray, topo: Topology) -> np.ndarray:
    """LPT reorder: per layer, experts by descending step load into the least-loaded GPU with a free home slot."""
    W_LE = loads_MLSE.sum(axis=(0, 2))
    pack, _ = balanced_packing(W_LE, topo.num_gpus)
    return pack


class _Annealer:
    """State of the lockstep annealing: placement, GPU / node / cross loads per layer and micro-batch.

    Loads are integer sums kept in float32 when they fit its 24-bit mantissa (exact there; float32 exp / log
    are several times faster than float64 on these CPUs), else in float64. Arrays are flattened to rows
    [layer x item, M] so that gathers are row takes; sums over M are matrix-vector products.
    """

    def __init__(self, prob: ReorderProblem, home_LE: np.ndarray, num_candidates: int) -> None:
        self.prob = prob
        topo = prob.topo
        L, E, M = prob.W_LEM.shape
        self.L, self.E, self.M, self.C = L, E, M, num_candidates
        self.G, self.Z = topo.num_gpus, topo.num_nodes
        self.H, self.Q, self.multi_node = topo.num_home_slots, topo.node_size, topo.num_nodes > 1
        exact32 = prob.W_LEM.sum(axis=1).max(initial=0) < 2**24
        self.dtype = np.float32 if exact32 else np.float64
        dt = self.dtype
        self.W = prob.W_LEM.reshape(L * E, M).astype(dt)
        self.A = prob.A_LZEM.reshape(L * self.Z * E, M).astype(dt)
        beta = prob.weights.beta
        self.b_over_s = (beta / prob.scale_LM).astype(dt)  # [L, M]
        self.b_over_s_rows = np.repeat(self.b_over_s, num_candidates, axis=0)  # [L * C, M]
        self.s_over_b = (prob.scale_LM / beta).astype(dt)
        self.ones_M = np.ones(M, dtype=dt)
        self.slot_LX = np.argsort(
            home_LE * E + np.arange(E), axis=1, kind="stable"
        )  # GPU of slot x is x // H
        self.home_LE = home_LE.copy()
        GL = _gpu_loads_LGM(prob, home_LE)
        NL, recv, send = _node_terms(prob, home_LE, GL)
        self.GL = GL.reshape(L * self.G, M).astype(dt)
        self.NL = NL.reshape(L * self.Z, M).astype(dt)
        self.X = np.concatenate([recv, send], axis=1).reshape(L * 2 * self.Z, M).astype(dt)
        self.rows = np.arange(L)[:, None]

    def _shifted_exp(self, x_RM: np.ndarray, per_layer: int) -> tuple[np.ndarray, np.ndarray]:
        """exp(b x / s - top) of every entry and the exp-sums [L, M] (top = the layer's max, so sums >= 1)."""
        z = x_RM.reshape(self.L, per_layer, self.M) * self.b_over_s[:, None, :]
        ez = np.exp(z - z.max(axis=1, keepdims=True))
        return ez.reshape(self.L * per_layer, self.M), ez.sum(axis=1)

    def _delta_lse(self, sums_LM: np.ndarray, change_RM: np.ndarray) -> np.ndarray:
        """[L, C]: sum_m s / b (log(S + change) - log S), the change of a smoothed max whose exp-sum moves."""
        ratio = 1.0 + change_RM.reshape(self.L, self.C, self.M) / sums_LM[:, None, :]
        logs = np.log(np.maximum(ratio, 1e-30)) * self.s_over_b[:, None, :]
        return (logs.reshape(-1, self.M) @ self.ones_M).reshape(self.L, self.C)

    def _exp_scaled(self, x_RM: np.ndarray) -> np.ndarray:
        """exp(b x / s) for a change x of one entry (clipped against overflow)."""
        return np.exp(np.clip(x_RM * self.b_over_s_rows, -80.0, 80.0))

    def deltas(self, x1: np.ndarray, x2: np.ndarray):
        """Change of J for swapping the experts at slot positions x1, x2 ([L, C]) of every layer.

        An entry x of a smoothed max moving by delta changes its shifted exp by exp(b x / s - top) (exp(b delta / s)
        - 1), so one exp of the load difference d (and two for the cross-node entries) prices every candidate.
        """
        prob, w, rows = self.prob, self.prob.weights, self.rows
        e1, e2 = self.slot_LX[rows, x1], self.slot_LX[rows, x2]
        g1, g2 = x1 // self.H, x2 // self.H
        d = self.W.take((rows * self.E + e2).ravel(), axis=0) - self.W.take(
            (rows * self.E + e1).ravel(), axis=0
        )
        up = self._exp_scaled(d)
        up_m1, down_m1 = up - 1.0, 1.0 / up - 1.0
        eg, sums = self._shifted_exp(self.GL, self.G)
        ig1, ig2 = (rows * self.G + g1).ravel(), (rows * self.G + g2).ravel()
        change = eg.take(ig1, axis=0) * up_m1 + eg.take(ig2, axis=0) * down_m1
        delta = w.gpu * self._delta_lse(sums, change)
        if self.multi_node:
            Z = self.Z
            z1, z2 = g1 // self.Q, g2 // self.Q
            en, sums = self._shifted_exp(self.NL, Z)
            iz1, iz2 = (rows * Z + z1).ravel(), (rows * Z + z2).ravel()
            node = self._delta_lse(sums, en.take(iz1, axis=0) * up_m1 + en.take(iz2, axis=0) * down_m1)
            # Sent pairs of z1 change by a11 - a12, of z2 by a22 - a21; received ones by d + that, -d + that.
            a_row = lambda z, e: ((rows * Z + z) * self.E + e).ravel()  # noqa: E731
            ds1 = self.A.take(a_row(z1, e1), axis=0) - self.A.take(a_row(z1, e2), axis=0)
            ds2 = self.A.take(a_row(z2, e2), axis=0) - self.A.take(a_row(z2, e1), axis=0)
            es1, es2 = self._exp_scaled(ds1), self._exp_scaled(ds2)
            ex, sums = self._shifted_exp(self.X, 2 * Z)
            r1, r2 = (rows * 2 * Z + z1).ravel(), (rows * 2 * Z + z2).ravel()
            change = ex.take(r1, axis=0) * (up * es1 - 1.0) + ex.take(r2, axis=0) * (es2 / up - 1.0)
            change += ex.take(r1 + Z, axis=0) * (es1 - 1.0) + ex.take(r2 + Z, axis=0) * (es2 - 1.0)
            cross = self._delta_lse(sums, change)
            delta += np.where(z1 == z2, 0.0, w.node * node + w.cross * cross)
        L_X = np.broadcast_to(rows, x1.shape)
        mig = migration_cost(prob, e2, g1, L_X) + migration_cost(prob, e1, g2, L_X)
        mig -= migration_cost(prob, e1, g1, L_X) + migration_cost(prob, e2, g2, L_X)
        return delta + mig, d.reshape(self.L, self.C, self.M)

    def apply(self, layers: np.ndarray, x1: np.ndarray, x2: np.ndarray, d_AM: np.ndarray) -> None:
        """Swap the experts at x1, x2 in the given layers and update the load state."""
        e1, e2 = self.slot_LX[layers, x1], self.slot_LX[layers, x2]
        g1, g2 = x1 // self.H, x2 // self.H
        self.GL[layers * self.G + g1] += d_AM
        self.GL[layers * self.G + g2] -= d_AM
        if self.multi_node:
            Z, E = self.Z, self.E
            z1, z2 = g1 // self.Q, g2 // self.Q
            self.NL[layers * Z + z1] += d_AM
            self.NL[layers * Z + z2] -= d_AM
            for e, za, zb in ((e1, z1, z2), (e2, z2, z1)):  # move e from node za to node zb
                W = self.W[layers * E + e]
                a_from, a_to = self.A[(layers * Z + za) * E + e], self.A[(layers * Z + zb) * E + e]
                base = layers * 2 * Z
                self.X[base + za] -= W - a_from
                self.X[base + Z + za] += a_from
                self.X[base + zb] += W - a_to
                self.X[base + Z + zb] -= a_to
        self.slot_LX[layers, x1], self.slot_LX[layers, x2] = e2, e1
        self.home_LE[layers, e1], self.home_LE[layers, e2] = g2, g1


def anneal_home(
    prob: ReorderProblem,
    start_LE: np.ndarray,
    rng: np.random.Generator,
    num_swaps: int,
    num_candidates: int,
    t0: float,
    cooling: float,
) -> np.ndarray:
    """Simulated annealing of every layer's placement from `start_LE`; returns the best placement seen."""
    L, _E = start_LE.shape
    G, H = prob.topo.num_gpus, prob.topo.num_home_slots
    if G == 1 or num_swaps == 0:
        return start_LE.copy()
    state = _Annealer(prob, start_LE, num_candidates)
    obj = reorder_objective_L(prob, start_LE)
    scale = np.where(obj > 0, obj, 1.0)
    best_obj, best = obj.copy(), start_LE.copy()
    num_moves = max(1, num_swaps // num_candidates)
    all_layers = np.arange(L)
    for it in range(num_moves):
        x1 = rng.integers(0, G * H, size=(L, num_candidates))
        shift = rng.integers(1, G, size=(L, num_candidates))
        x2 = ((x1 // H + shift) % G) * H + rng.integers(0, H, size=(L, num_candidates))
        delta, d = state.deltas(x1, x2)
        pick = np.argmin(delta, axis=1)
        best_delta = delta[all_layers, pick]
        temp = t0 * cooling ** (it * num_candidates) * scale
        with np.errstate(over="ignore", divide="ignore"):
            accept = (best_delta < 0) | (rng.random(L) < np.exp(-best_delta / np.maximum(temp, 1e-300)))
        layers = np.flatnonzero(accept)
        if len(layers):
            state.apply(layers, x1[layers, pick[layers]], x2[layers, pick[layers]], d[layers, pick[layers]])
            obj[layers] += best_delta[layers]
            better = layers[obj[layers] < best_obj[layers] - 1e-9 * np.abs(best_obj[layers])]
            best[better] = state.home_LE[better]
            best_obj[better] = obj[better]
    return best
