"""Exact descent on the placement floor: the last stage of ReLibra's reordering (ours).

The annealing (`relibra.planners.reorder`) minimises a smoothed objective: log-sum-exp maxima, the send side per
node, and a per-GPU term that in-node replicas make moot. What a step costs on a placement is bounded below by its
floor (`relibra.cost_model.placement_floor_us`), the MoE time the best in-node replicas could reach. This stage
lowers that floor, plus migration, per layer, by best-improvement swaps of two experts on different nodes:

  F(home) = sum_m [ w_N max_z NL[m, z] + w_X max(max_z Recv[m, z], Q max_s Send[m, s]) ] + sum_e mig(e, home(e))

with NL the pairs of the experts homed on node z, Recv those of them from other nodes' sources, Send the pairs of
source rank s to experts homed on other nodes, w_N = alpha c_pair / Q and w_X = beta c_x the annealing's node and
cross-node weights and mig its migration cost; with alpha = beta = 1, F is the floor minus its latency constant,
plus migration. Swapped experts exchange GPUs, so every GPU keeps H experts and the annealing's arrangement inside
a node stays (the replicas level it).

Each round, all layers in lockstep:
- screen: the subgradient of F prices moving expert e from its node a to node t,
    g(e, t) = sum_m w_N W_e[m] ([t = zN_m] - [a = zN_m]) + w_X (r_e(t) - r_e(a) + q_e(a) - q_e(t)),
  zN_m the busiest node of micro-batch m; where a node's receives bind the NIC term (node zR_m), r_e(z) =
  sum_m [z = zR_m] (W_e[m] - A_ze[m]) (A_ze: pairs of e from node z's sources); where a source's sends bind (source
  sS_m), q_e(z) = sum_m [z = node(sS_m)] Q D_{sS_m, e}[m];
- for every node pair (a, b), the `top_k` experts of a with the lowest g(e, b) and those of b with the lowest
  g(e, a) make top_k^2 candidate swaps; each is evaluated exactly (only nodes a and b and their sources change);
- the best candidate of a layer is applied if it lowers F; a layer where none does is done (its state, hence its
  candidates, would not change); the descent stops when every layer is done or after `max_rounds` rounds.
Measured on the generator (32 micro-batches x 4096 tokens per rank, 48 layers, the step after a warm-up step), floor
over ideal MoE time at EP 16 / 32: 1.032 / 1.093 after the annealing alone; 1.029 / 1.090 with the default screen
(2 experts per node and node pair, ~0.05 s more planning at EP 32); 1.016 / 1.074 screening 16 (seconds of planning).
An exhaustive best-swap descent (every cross-node swap priced each round) took single layers from 1.047-1.053 /
1.080-1.088 to 1.022-1.029 / 1.059-1.064 in 7-19 swaps, at ~0.1-0.2 s per layer: that is the headroom left.

Legend: M micro-batches, L layers, S source ranks, E experts, Z nodes, Q GPUs per node, C candidate swaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.planners.reorder import ReorderProblem, _gpu_loads_LGM, _node_terms, migration_cost, migration_L

__all__ = ["floor_objective_L", "refine_home"]


@dataclass
class _Swaps:
    """Exact evaluation of candidate swaps [n, C] of n layers: the change of F and the load changes to apply."""

    delta_LC: np.ndarray
    dW_LCM: np.ndarray  # change of node a's load (node b's is the opposite)
    d_recv_a_LCM: np.ndarray
    d_recv_b_LCM: np.ndarray
    d_send_a_LCQM: np.ndarray  # change of the sends of node a's sources
    d_send_b_LCQM: np.ndarray


class _Descent:
    """Node loads NL [L, Z, M], receives RC [L, Z, M] and sends SD [L, S, M] of the current placement.

    The per-source loads are kept as D [L, Z, E, Q, M] (float32, exact for counts below 2^24) so that the sends of a
    node's Q sources to one expert are one contiguous block.
    """

    def __init__(self, prob: ReorderProblem, home_LE: np.ndarray) -> None:
        self.prob, self.home_LE = prob, home_LE.copy()
        L, E, M = prob.W_LEM.shape
        self.L, self.E, self.M = L, E, M
        Z, Q = prob.topo.num_nodes, prob.topo.node_size
        self.Z, self.Q = Z, Q
        self.wN, self.wX = prob.weights.node, prob.weights.cross
        self.pairs = [(a, b) for a in range(Z) for b in range(a + 1, Z)]
        self.first = np.array([a for a, _ in self.pairs])
        self.second = np.array([b for _, b in self.pairs])
        self.D = np.ascontiguousarray(
            prob.D_LSEM.reshape(L, Z, Q, E, M).transpose(0, 1, 3, 2, 4), dtype=np.float32
        )
        self.NL, self.RC, _ = _node_terms(prob, home_LE, _gpu_loads_LGM(prob, home_LE))
        in_node_LZE = (home_LE[:, None, :] // Q) == np.arange(Z)[None, :, None]
        away_LZ1E = (~in_node_LZE[:, :, None, :]).astype(np.float64)  # source node z, expert e
        self.SD = (away_LZ1E @ self.D.reshape(L, Z, E, Q * M)).reshape(L, Z * Q, M)

    def per_micro_batch(self, NL_max, RC_max, SD_max):
        return self.wN * NL_max + self.wX * np.maximum(RC_max, self.Q * SD_max)

    def current(self, act: np.ndarray) -> np.ndarray:
        """F without migration of the layers `act`."""
        NL, RC, SD = self.NL[act], self.RC[act], self.SD[act]
        return self.per_micro_batch(NL.max(axis=1), RC.max(axis=1), SD.max(axis=1)).sum(axis=-1)

    def subgradient(self, act: np.ndarray) -> np.ndarray:
        """[n, E, Z]: g(e, t) of the module docstring for the layers `act`."""
        prob, M, Z, Q = self.prob, self.M, self.Z, self.Q
        NL, RC, SD = self.NL[act], self.RC[act], self.SD[act]
        eye = np.eye(Z)
        node_ind = eye[NL.argmax(axis=1)]  # [n, M, Z]
        recv_binds = (RC.max(axis=1) >= Q * SD.max(axis=1))[..., None]
        recv_ind = eye[RC.argmax(axis=1)] * recv_binds
        top_src = SD.argmax(axis=1)  # [n, M]
        send_ind = eye[top_src // Q] * ~recv_binds
        d_top = self.D[act[:, None], top_src // Q, :, top_src % Q, np.arange(M)[None, :]]  # [n, M, E]
        W = prob.W_LEM[act]
        # matmul, not einsum: several times faster for these batched products
        A_recv = (prob.A_LZEM[act] @ recv_ind.transpose(0, 2, 1)[..., None])[..., 0]  # [n, Z, E]
        t_node = W @ node_ind
        t_recv = W @ recv_ind - A_recv.transpose(0, 2, 1)
        t_send = Q * (d_top.transpose(0, 2, 1) @ send_ind)
        here = (self.home_LE[act] // Q)[..., None]
        at = lambda t: np.take_along_axis(t, here, axis=2)  # noqa: E731
        return self.wN * (t_node - at(t_node)) + self.wX * (t_recv - at(t_recv) + at(t_send) - t_send)

    def candidates(self, act: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """e1 [n, C] on node a, e2 [n, C] on node b, and the index of the node pair (a, b) of every column."""
        g = self.subgradient(act)
        node_nE = self.home_LE[act] // self.Q
        k = min(top_k, self.E // self.Z)
        e1s, e2s = [], []
        for a, b in self.pairs:
            best_a = np.argpartition(np.where(node_nE == a, g[..., b], np.inf), k - 1, axis=1)[:, :k]
            best_b = np.argpartition(np.where(node_nE == b, g[..., a], np.inf), k - 1, axis=1)[:, :k]
            e1s.append(np.repeat(best_a, k, axis=1))
            e2s.append(np.tile(best_b, (1, k)))
        pair_C = np.repeat(np.arange(len(self.pairs)), k * k)
        return np.concatenate(e1s, axis=1), np.concatenate(e2s, axis=1), pair_C

    def _others_max(self, X_nZM: np.ndarray, pair_C: np.ndarray) -> np.ndarray | float:
        """[n, C, M]: max of X over the nodes outside each candidate's node pair (-inf with two nodes)."""
        if self.Z == 2:
            return -np.inf
        out = np.stack([np.delete(X_nZM, [a, b], axis=1).max(axis=1) for a, b in self.pairs], axis=1)
        return out[:, pair_C]

    def evaluate(self, act: np.ndarray, e1: np.ndarray, e2: np.ndarray, pair_C: np.ndarray) -> _Swaps:
        """Exact change of F for every candidate swap of the layers `act`."""
        prob, rows, Q = self.prob, act[:, None], self.Q
        a_C, b_C = self.first[pair_C][None, :], self.second[pair_C][None, :]
        W1, W2 = prob.W_LEM[rows, e1], prob.W_LEM[rows, e2]
        dW = W2 - W1
        A = lambda z, e: prob.A_LZEM[rows, z, e]  # noqa: E731
        d_ra = (W2 - A(a_C, e2)) - (W1 - A(a_C, e1))
        d_rb = (W1 - A(b_C, e1)) - (W2 - A(b_C, e2))
        d_sa = self.D[rows, a_C, e1] - self.D[rows, a_C, e2]  # [n, C, Q, M]
        d_sb = self.D[rows, b_C, e2] - self.D[rows, b_C, e1]
        NL, RC = self.NL[act], self.RC[act]
        SD = self.SD[act].reshape(len(act), self.Z, Q, self.M)
        n_rows = np.arange(len(act))[:, None]
        pick = lambda X, z: X[n_rows, z]  # noqa: E731
        new = self.per_micro_batch(
            np.maximum(np.maximum(pick(NL, a_C) + dW, pick(NL, b_C) - dW), self._others_max(NL, pair_C)),
            np.maximum(np.maximum(pick(RC, a_C) + d_ra, pick(RC, b_C) + d_rb), self._others_max(RC, pair_C)),
            np.maximum(
                np.maximum((pick(SD, a_C) + d_sa).max(axis=2), (pick(SD, b_C) + d_sb).max(axis=2)),
                self._others_max(SD.max(axis=2), pair_C),
            ),
        ).sum(axis=-1)
        g1, g2 = self.home_LE[rows, e1], self.home_LE[rows, e2]
        L_C = np.broadcast_to(rows, e1.shape)
        mig = migration_cost(prob, e1, g2, L_C) + migration_cost(prob, e2, g1, L_C)
        mig -= migration_cost(prob, e1, g1, L_C) + migration_cost(prob, e2, g2, L_C)
        return _Swaps(new - self.current(act)[:, None] + mig, dW, d_ra, d_rb, d_sa, d_sb)

    def apply(
        self, act: np.ndarray, sel: np.ndarray, picks: np.ndarray, e1, e2, pair_C, swaps: _Swaps
    ) -> None:
        """Apply candidate picks[i] to layer act[sel[i]]."""
        Q, layers = self.Q, act[sel]
        take = lambda x: x[sel, picks]  # noqa: E731
        a, b = self.first[pair_C[picks]], self.second[pair_C[picks]]
        self.NL[layers, a] += take(swaps.dW_LCM)
        self.NL[layers, b] -= take(swaps.dW_LCM)
        self.RC[layers, a] += take(swaps.d_recv_a_LCM)
        self.RC[layers, b] += take(swaps.d_recv_b_LCM)
        src = np.arange(Q)[None, :]
        self.SD[layers[:, None], a[:, None] * Q + src] += take(swaps.d_send_a_LCQM)
        self.SD[layers[:, None], b[:, None] * Q + src] += take(swaps.d_send_b_LCQM)
        x1, x2 = take(e1), take(e2)
        g1, g2 = self.home_LE[layers, x1], self.home_LE[layers, x2]
        self.home_LE[layers, x1], self.home_LE[layers, x2] = g2, g1


def floor_objective_L(prob: ReorderProblem, home_LE: np.ndarray) -> np.ndarray:
    """F of every layer for placement home_LE (the full evaluation the descent's deltas must agree with)."""
    return _Descent(prob, home_LE).current(np.arange(home_LE.shape[0])) + migration_L(prob, home_LE)


def refine_home(prob: ReorderProblem, home_LE: np.ndarray, max_rounds: int, top_k: int) -> np.ndarray:
    """Best-improvement swap descent on F from `home_LE` (module docstring); F never rises."""
    if prob.topo.num_nodes == 1 or max_rounds == 0 or top_k == 0:
        return home_LE.copy()
    state = _Descent(prob, home_LE)
    act = np.arange(home_LE.shape[0])
    for _ in range(max_rounds):
        e1, e2, pair_C = state.candidates(act, top_k)
        swaps = state.evaluate(act, e1, e2, pair_C)
        pick = np.argmin(swaps.delta_LC, axis=1)
        best = swaps.delta_LC[np.arange(len(act)), pick]
        improves = best < -1e-9 * np.maximum(np.abs(state.current(act)), 1.0)
        # A layer without an improving candidate is done: its state, hence its screened candidates, stay the same.
        sel = np.flatnonzero(improves)
        if not len(sel):
            break
        state.apply(act, sel, pick[sel], e1, e2, pair_C, swaps)
        act = act[sel]
    return state.home_LE
