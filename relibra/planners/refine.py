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

Under pxn routing (the cost model's `nic_routing`) the floor's two dispatch-like all-to-alls wait for
max(max_z Recv, max_z Sent) and its two combine-like ones for Q max(max_{z, r} Rail, max_s Send), Sent[m, z] the
sends of node z's sources and Rail[m, z, r] the pairs of the sources of local index r outside node z to experts
homed on z (their results leave node z through its NIC r, whichever GPU computed them); F then has w_X / 2 times
the sum of the two where direct routing has w_X max(...), and the screen below prices those four bottlenecks the
same way (a node's sends: A_ze leaves with e; a rail (zL, rL): Q RX_{zL, e, rL}, the pairs of e from the sources of
index rL outside node zL, comes with e). Measured on the generator at EP 32 under pxn (seed 0): 1.169 of ideal with
the descent on the direct floor, 1.162 on pxn's floor with the direct screen, 1.160 with pxn's screen.

Each round, all layers in lockstep:
- screen: the subgradient of F prices moving expert e from its node a to node t,
    g(e, t) = sum_m w_N W_e[m] ([t = zN_m] - [a = zN_m]) + w_X (r_e(t) - r_e(a) + q_e(a) - q_e(t)),
  zN_m the busiest node of micro-batch m; where a node's receives bind the NIC term (node zR_m), r_e(z) =
  sum_m [z = zR_m] (W_e[m] - A_ze[m]) (A_ze: pairs of e from node z's sources); where a source's sends bind (source
  sS_m), q_e(z) = sum_m [z = node(sS_m)] Q D_{sS_m, e}[m];
- for every node pair (a, b), the k experts of a with the lowest g(e, b) and those of b with the lowest g(e, a)
  make k^2 candidate swaps; each is evaluated exactly (only nodes a and b and their sources change); k is the
  screen width that fits `num_candidates` swaps per layer over the Z (Z - 1) / 2 node pairs (`screen_width`), so a
  round costs about the same at every EP size;
- the best candidate of a layer is applied if it lowers F; a layer where none does is done (its state, hence its
  candidates, would not change); the descent stops when every layer is done or after `max_rounds` rounds.
Measured on the generator (32 micro-batches x 4096 tokens per rank, 48 layers, the step after a warm-up step), floor
over ideal MoE time at EP 16 / 32: 1.035 / 1.092 after the annealing alone; 1.017 / 1.079 with 256 candidates per
layer and round (k = 16 / 6; ~0.2 s more planning at EP 32); with the default 384 (k = 19 / 8), over three steps of
three seeds, 1.018-1.023 / 1.073-1.075 where 256 gave 1.019-1.024 / 1.078 (~0.1 s more); 1.015 / 1.072 with 1536
(seconds). An
exhaustive best-swap descent (every cross-node swap priced each round) took single layers from 1.047-1.053 /
1.080-1.088 to 1.022-1.029 / 1.059-1.064 in 7-19 swaps, at ~0.1-0.2 s per layer: that is the headroom left at EP 32.

Legend: M micro-batches, L layers, S source ranks, E experts, Z nodes, Q GPUs per node, C candidate swaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from relibra.planners.reorder import ReorderProblem, _gpu_loads_LGM, _node_terms, migration_cost, migration_L

__all__ = ["floor_objective_L", "refine_home", "screen_width"]


@dataclass(frozen=True)
class _Screen:
    """Candidate swaps of n layers on a grid: for node pair p = (a, b), expert ea[:, p, i] of node a with expert
    eb[:, p, j] of node b. Flat column c = (p k + i) k + j, so that e1 [n, C], e2 [n, C] and pair_C [C] list them."""

    ea_nPK: np.ndarray
    eb_nPK: np.ndarray

    @property
    def e1(self) -> np.ndarray:
        n, _P, k = self.ea_nPK.shape
        return np.repeat(self.ea_nPK, k, axis=2).reshape(n, -1)

    @property
    def e2(self) -> np.ndarray:
        n, _P, k = self.eb_nPK.shape
        return np.tile(self.eb_nPK, (1, 1, k)).reshape(n, -1)

    @property
    def pair_C(self) -> np.ndarray:
        _n, P, k = self.ea_nPK.shape
        return np.repeat(np.arange(P), k * k)


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
        away_LZ1E = (~in_node_LZE[:, :, None, :]).astype(np.float32)  # source node z, expert e
        self.SD = (away_LZ1E @ self.D.reshape(L, Z, E, Q * M)).reshape(L, Z * Q, M)
        self.pxn = prob.weights.pxn
        if self.pxn:
            # RX[l, z, e] = pairs of the sources of every local index r outside node z to expert e [Q, M]: what e
            # adds to node z's rails when homed there. SZ: the sends of each node's sources, RL: the rails.
            self.RX = self.D.sum(axis=1, keepdims=True) - self.D
            self.SZ = self.SD.reshape(L, Z, Q, M).sum(axis=2)
            in_node_LZ1E = in_node_LZE[:, :, None, :].astype(np.float32)
            self.RL = (in_node_LZ1E @ self.RX.reshape(L, Z, E, Q * M)).reshape(L, Z * Q, M)

    def per_micro_batch(self, NL_max, RC_max, SD_max, SZ_max=None, RL_max=None):
        """Direct routing: the four all-to-alls wait for max(RC, Q SD); pxn: two for max(RC, SZ), two for
        Q max(RL, SD) (`relibra.cost_model.placement_floor_us`, in pairs times Q)."""
        if not self.pxn:
            return self.wN * NL_max + self.wX * np.maximum(RC_max, self.Q * SD_max)
        dispatch = np.maximum(RC_max, SZ_max)
        combine = self.Q * np.maximum(RL_max, SD_max)
        return self.wN * NL_max + 0.5 * self.wX * (dispatch + combine)

    def current(self, act: np.ndarray) -> np.ndarray:
        """F without migration of the layers `act`."""
        NL, RC, SD = self.NL[act], self.RC[act], self.SD[act]
        pxn = (self.SZ[act].max(axis=1), self.RL[act].max(axis=1)) if self.pxn else ()
        return self.per_micro_batch(NL.max(axis=1), RC.max(axis=1), SD.max(axis=1), *pxn).sum(axis=-1)

    def subgradient(self, act: np.ndarray) -> np.ndarray:
        """[n, E, Z]: g(e, t) of the module docstring for the layers `act` (under pxn, the same terms for the
        dispatch's and the combine's bottlenecks, half weight each)."""
        prob, M, Z, Q = self.prob, self.M, self.Z, self.Q
        NL, RC, SD = self.NL[act], self.RC[act], self.SD[act]
        eye = np.eye(Z)
        W, A = prob.W_LEM[act], prob.A_LZEM[act]
        here = (self.home_LE[act] // Q)[..., None]
        at = lambda t: np.take_along_axis(t, here, axis=2)  # noqa: E731
        away = lambda t: t - at(t)  # noqa: E731  what moving e from its node to node t adds

        def per_node(X_nZEM: np.ndarray, ind_nMZ: np.ndarray) -> np.ndarray:
            """[n, E, Z]: sum_m ind[m, z] X[z, e, m] (matmul: several times faster than einsum here)."""
            return (X_nZEM @ ind_nMZ.transpose(0, 2, 1)[..., None])[..., 0].transpose(0, 2, 1)

        g = self.wN * away(W @ eye[NL.argmax(axis=1)])
        top_src = SD.argmax(axis=1)  # [n, M]
        d_top = self.D[act[:, None], top_src // Q, :, top_src % Q, np.arange(M)[None, :]]  # [n, M, E]
        send = lambda binds: Q * (d_top.transpose(0, 2, 1) @ (eye[top_src // Q] * binds))  # noqa: E731
        if not self.pxn:
            recv_binds = (RC.max(axis=1) >= Q * SD.max(axis=1))[..., None]
            recv_ind = eye[RC.argmax(axis=1)] * recv_binds
            t_recv = W @ recv_ind - per_node(A, recv_ind)
            return g + self.wX * (away(t_recv) - away(send(~recv_binds)))
        SZ, RL = self.SZ[act], self.RL[act]
        recv_binds = (RC.max(axis=1) >= SZ.max(axis=1))[..., None]  # dispatch: receives or a node's sends
        recv_ind = eye[RC.argmax(axis=1)] * recv_binds
        t_recv = W @ recv_ind - per_node(A, recv_ind)
        t_sent = per_node(A, eye[SZ.argmax(axis=1)] * ~recv_binds)
        rail_binds = (RL.max(axis=1) >= SD.max(axis=1))[..., None]  # combine: a rail or a source's sends
        top_rail = RL.argmax(axis=1)
        d_rail = self.RX[act[:, None], top_rail // Q, :, top_rail % Q, np.arange(M)[None, :]]  # [n, M, E]
        t_rail = Q * (d_rail.transpose(0, 2, 1) @ (eye[top_rail // Q] * rail_binds))
        dispatch, combine = away(t_recv) - away(t_sent), away(t_rail) - away(send(~rail_binds))
        return g + 0.5 * self.wX * (dispatch + combine)

    def candidates(self, act: np.ndarray, top_k: int) -> _Screen:
        """For every node pair (a, b), the top_k experts of a cheapest to move to b and those of b to a."""
        g = self.subgradient(act)
        node_nE = self.home_LE[act] // self.Q
        k = min(top_k, self.E // self.Z)

        def cheapest(z: int, t: int) -> np.ndarray:  # [n, k]: experts of node z cheapest to move to node t
            return np.argpartition(np.where(node_nE == z, g[..., t], np.inf), k - 1, axis=1)[:, :k]

        ea = np.stack([cheapest(a, b) for a, b in self.pairs], axis=1)
        eb = np.stack([cheapest(b, a) for a, b in self.pairs], axis=1)
        return _Screen(ea, eb)

    def _others_max(self, X_nZM: np.ndarray) -> np.ndarray | float:
        """[n, P, 1, 1, M]: max of X over the nodes outside each node pair (-inf with two nodes)."""
        if self.Z == 2:
            return -np.inf
        out = np.stack([np.delete(X_nZM, [a, b], axis=1).max(axis=1) for a, b in self.pairs], axis=1)
        return out[:, :, None, None]

    def evaluate(self, act: np.ndarray, screen: _Screen) -> np.ndarray:
        """[n, C]: the exact change of F for every screened swap of the layers `act` (columns as in `_Screen`).

        Swapping e1 (node a) with e2 (node b) adds W2 - W1 to node a's load, (W2 - A_a2) - (W1 - A_a1) to its
        receives and D_a1 - D_a2 to the sends of its sources (and the mirror image to node b); every term is a
        difference of a row of e1 and a row of e2, so the grid is two gathers per side and one broadcast.
        """
        prob, Q = self.prob, self.Q
        ea, eb = screen.ea_nPK, screen.eb_nPK
        n, P, k = ea.shape
        rows = act[:, None, None]
        a, b = self.first[None, :, None], self.second[None, :, None]
        grid = lambda x_i, x_j: x_j[:, :, None] - x_i[:, :, :, None]  # noqa: E731  [n, P, k, k, ...]: x_j - x_i
        Wa, Wb = prob.W_LEM[rows, ea], prob.W_LEM[rows, eb]
        A = prob.A_LZEM
        dW = grid(Wa, Wb)
        d_ra = grid(Wa - A[rows, a, ea], Wb - A[rows, a, eb])
        d_rb = -grid(Wa - A[rows, b, ea], Wb - A[rows, b, eb])
        n_rows = np.arange(n)[:, None]
        at = lambda X, z: X[n_rows, z][:, :, None, None]  # noqa: E731  node rows [n, P, 1, 1, ...]
        NL, RC = self.NL[act], self.RC[act]
        SD = self.SD[act].reshape(n, self.Z, Q, self.M)
        send_a = SD[n_rows, self.first][:, :, None] + self.D[rows, a, ea]  # [n, P, k, Q, M] before e2 arrives
        send_b = SD[n_rows, self.second][:, :, None] + self.D[rows, b, eb]
        new_send_a = _max_over_sources(send_a[:, :, :, None], self.D[rows, a, eb][:, :, None])
        new_send_b = _max_over_sources(send_b[:, :, None], self.D[rows, b, ea][:, :, :, None])
        pxn = ()
        if self.pxn:
            SZ = self.SZ[act]
            new_sz = np.maximum(
                np.maximum(at(SZ, self.first) - grid(A[rows, a, ea], A[rows, a, eb]),
                           at(SZ, self.second) + grid(A[rows, b, ea], A[rows, b, eb])),
                self._others_max(SZ),
            )  # fmt: skip
            RL = self.RL[act].reshape(n, self.Z, Q, self.M)
            RX = self.RX
            rail_a = RL[n_rows, self.first][:, :, None] - RX[rows, a, ea]  # [n, P, k, Q, M] before e2 arrives
            rail_b = RL[n_rows, self.second][:, :, None] - RX[rows, b, eb]
            new_rail_a = _max_over_sources(rail_a[:, :, :, None], -RX[rows, a, eb][:, :, None])
            new_rail_b = _max_over_sources(rail_b[:, :, None], -RX[rows, b, ea][:, :, :, None])
            new_rl = np.maximum(np.maximum(new_rail_a, new_rail_b), self._others_max(RL.max(axis=2)))
            pxn = (new_sz, new_rl)
        new = self.per_micro_batch(
            np.maximum(np.maximum(at(NL, self.first) + dW, at(NL, self.second) - dW), self._others_max(NL)),
            np.maximum(
                np.maximum(at(RC, self.first) + d_ra, at(RC, self.second) + d_rb), self._others_max(RC)
            ),
            np.maximum(np.maximum(new_send_a, new_send_b), self._others_max(SD.max(axis=2))),
            *pxn,
        ).sum(axis=-1)
        g1, g2 = self.home_LE[rows, ea][..., :, None], self.home_LE[rows, eb][..., None, :]
        e1, e2, L_X = ea[..., :, None], eb[..., None, :], act[:, None, None, None]
        mig = migration_cost(prob, e1, g2, L_X) + migration_cost(prob, e2, g1, L_X)
        mig -= migration_cost(prob, e1, g1, L_X) + migration_cost(prob, e2, g2, L_X)
        delta = new - self.current(act)[:, None, None, None] + mig
        return delta.reshape(n, P * k * k)

    def apply(self, layers: np.ndarray, e1: np.ndarray, e2: np.ndarray, pair: np.ndarray) -> None:
        """Swap expert e1[i] (node a of node pair pair[i]) with e2[i] (node b) in layer layers[i]."""
        prob, Q = self.prob, self.Q
        a, b = self.first[pair], self.second[pair]
        W1, W2 = prob.W_LEM[layers, e1], prob.W_LEM[layers, e2]
        A = prob.A_LZEM
        self.NL[layers, a] += W2 - W1
        self.NL[layers, b] -= W2 - W1
        self.RC[layers, a] += (W2 - A[layers, a, e2]) - (W1 - A[layers, a, e1])
        self.RC[layers, b] += (W1 - A[layers, b, e1]) - (W2 - A[layers, b, e2])
        src = np.arange(Q)[None, :]
        self.SD[layers[:, None], a[:, None] * Q + src] += self.D[layers, a, e1] - self.D[layers, a, e2]
        self.SD[layers[:, None], b[:, None] * Q + src] += self.D[layers, b, e2] - self.D[layers, b, e1]
        if self.pxn:
            self.SZ[layers, a] += A[layers, a, e1] - A[layers, a, e2]
            self.SZ[layers, b] += A[layers, b, e2] - A[layers, b, e1]
            RX = self.RX
            self.RL[layers[:, None], a[:, None] * Q + src] += RX[layers, a, e2] - RX[layers, a, e1]
            self.RL[layers[:, None], b[:, None] * Q + src] += RX[layers, b, e1] - RX[layers, b, e2]
        g1, g2 = self.home_LE[layers, e1], self.home_LE[layers, e2]
        self.home_LE[layers, e1], self.home_LE[layers, e2] = g2, g1


def _max_over_sources(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """max over the source axis (-2) of x - y, one source at a time: the full difference is never materialised."""
    out = x[..., 0, :] - y[..., 0, :]
    for q in range(1, x.shape[-2]):
        np.maximum(out, x[..., q, :] - y[..., q, :], out=out)
    return out


def floor_objective_L(prob: ReorderProblem, home_LE: np.ndarray) -> np.ndarray:
    """F of every layer for placement home_LE (the full evaluation the descent's deltas must agree with)."""
    return _Descent(prob, home_LE).current(np.arange(home_LE.shape[0])) + migration_L(prob, home_LE)


def screen_width(num_candidates: int, num_nodes: int, num_experts: int) -> int:
    """k: the most experts per node and node pair whose k^2 swaps over all Z (Z - 1) / 2 node pairs fit in
    `num_candidates` (at least 1 when num_candidates > 0), at most the E / Z experts of a node; 0 when there is
    nothing to screen."""
    pairs = num_nodes * (num_nodes - 1) // 2
    if num_candidates <= 0 or pairs == 0:
        return 0
    return int(min(max(math.isqrt(num_candidates // pairs), 1), num_experts // num_nodes))


def refine_home(
    prob: ReorderProblem, home_LE: np.ndarray, max_rounds: int, num_candidates: int
) -> np.ndarray:
    """Best-improvement swap descent on F from `home_LE` (module docstring), pricing about `num_candidates` swaps
    per layer and round; F never rises."""
    top_k = screen_width(num_candidates, prob.topo.num_nodes, home_LE.shape[1])
    if max_rounds == 0 or top_k == 0:
        return home_LE.copy()
    state = _Descent(prob, home_LE)
    act = np.arange(home_LE.shape[0])
    for _ in range(max_rounds):
        screen = state.candidates(act, top_k)
        delta = state.evaluate(act, screen)
        pick = np.argmin(delta, axis=1)
        best = delta[np.arange(len(act)), pick]
        improves = best < -1e-9 * np.maximum(np.abs(state.current(act)), 1.0)
        # A layer without an improving candidate is done: its state, hence its screened candidates, stay the same.
        sel = np.flatnonzero(improves)
        if not len(sel):
            break
        picks = pick[sel]
        state.apply(act[sel], screen.e1[sel, picks], screen.e2[sel, picks], screen.pair_C[picks])
        act = act[sel]
    return state.home_LE
