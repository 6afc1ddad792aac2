"""Intra-batch replication inside a node, per (micro-batch, layer), and locality-aware token splitting.

Greedy (specs/relibra.md, vectorised over every (m, l, node) problem at once). Every home expert's pairs are two
items: NEAR pairs (sources on the node: NVLink or local) and FAR pairs (sources on other nodes: they arrive over
the receiving GPU's NIC). A GPU carries compute load C_g (all its pairs) and NIC load F_g (its far pairs), with
targets T_C = ceil(sum C / Q) and T_F = sum F / Q over the node's Q GPUs. While some GPU exceeds a target by more
than eps and a move is possible:
  pick the binding resource: NIC if kappa (max F - T_F) > max C - T_C, else compute, where kappa = (4 bytes /
  B_nic) / (a (1 + f_bwd)) prices a far pair's all-to-all time in compute pairs; the hot GPU h is the one with
  the largest load of that resource;
  compute-bound: move NEAR pairs first (compute only), then FAR pairs as long as the destination's NIC load stays
  at or below the node's current maximum; NIC-bound: move FAR pairs (both loads), whatever that adds to the
  destination's compute (later compute moves and the relaxation level it with near pairs);
  destinations: GPUs of the node other than h holding a replica of the expert (top-up) or with a free replica
  slot (new replica), below the target(s) the move adds to; amount x = min(excess of h, slack of the
  destination, movable pairs), rounded down to the GEMM tile unless it empties the item; a new replica needs
  x >= min_replica_tokens (tiny GEMMs are inefficient) and may take up to max(excess, min_replica_tokens);
  take the expert with the most movable pairs that has a legal move and its least loaded destination.
A resource whose move is impossible is skipped until some move succeeds; the problem stops when both are.
When the greedy stalls, a relaxation (`_Greedy.relax`; one round, three after the last pass) levels compute along the
copies already made (pairs move between an owner and its copy, half the load difference, near pairs first, copies
stay >= the minimum quota), which frees slack on GPUs whose replica slots are taken, and levels each GPU pair's NIC
load at equal compute (far pairs one way, as many near pairs the other); then the greedy runs again (`num_passes`,
2 by default). A problem also stops after
`patience` (2 Q) moves in a row that did not lower max C + kappa max F (measured: otherwise a few problems trade
a few hundred pairs back and forth between the two resources for ~100 lockstep steps). With kappa = 0 (one node,
or no cost model) and one pass this is the spec's token greedy.

Departures (ours): the spec levels tokens only; measured on the generator, the GPUs owning far-sourced experts
then held the NIC bottleneck of the all-to-all (1.3x the ideal receive volume) while compute was level, so the
greedy levels both loads and decides which pairs (near or far) each replica serves ("joint replica placement and
token splitting"). "Hottest splittable expert" is the one with the most movable pairs that has a legal move. The
relaxation pass is ours too (measured: one greedy pass left 56% of the (m, l, node) problems above tolerance because
the slack sat on GPUs whose slots were full; intra-node compute skew 1.039 -> 1.013 with it). So are the bottleneck
floors (`bottleneck_floors`): a node is levelled only down to the slowest node's compute target and, for NIC
receives, to the busiest source's sends, which no copy can lower; below that a move cannot shorten the step
(measured on the generator: MoE time / ideal 1.124 -> 1.120 at EP 32, 1.055 -> 1.053 at EP 16, as NIC moves stop
squeezing compute room where the receive side is not the bottleneck). NIC moves are not capped at the node's
compute maximum, and the relaxation moves far pairs too and levels owner/copy NIC loads at equal compute, for three
rounds after the last pass: otherwise a GPU filled by a NIC move (its copy all far pairs) stays above its compute
target and the NIC loads stay where the first moves left them (bench/RESULTS.md, session 21, has the measurements).
Planning a step costs ~0.05-0.1 s more for it at EP 32 (one thread; ~0.5 s more under pxn routing, whose four far
classes leave every problem with a NIC load above target, so the relaxation works on all of them).

Routing (`relibra.cost_model`, `nic_routing`): the above is for direct routing. Under pxn only the two dispatch-like
all-to-alls see where a far pair is served (kappa halves), and a source's sends stop bounding a GPU's receive (they
meet in the other all-to-alls: no Send_s floor). With more than two nodes, node z's pairs to every GPU of local index
r leave through z's NIC r, so what counts is each GPU's receive FROM EACH source node: the far pairs come in K = Z
classes (one per source node) and the NIC resource is the (GPU, class) furthest above its class's target
T_F,k = sum_g F_g,k / Q; a NIC move moves that class's pairs, a compute move the far pairs of the class the hot GPU
has most above target. Measured (generator EP 32, pxn): MoE time / ideal 1.40 -> 1.19 (a GPU's home experts serve
mostly one node's prompts, so without classes a node's sends crowd onto a few of its NICs); 1.17 with the relaxation
levelling NIC loads, whose per-class targets then leave every problem above one, so it works on all of them.

Token split: instance i of an expert serves FAR_i far pairs and NEAR_i near pairs (decided above; the home keeps
the rest). Locality first: each instance takes the near pairs of the source on its own GPU (no transfer) up to
NEAR_i; then far sources fill the far shares and the remaining near sources the near shares by prefix sums
(north-west corner rule, sources in rank order, instances home first then replicas by slot; with far classes, one
share per class, so each source node's pairs fill that node's shares).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, Z nodes, Q GPUs per node, H home slots,
R replica slots, J = H + R, B problems (m, l, z), X replicated experts, I instances of one expert, K far classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cost_model import NUM_ALLTOALLS, CostModel
from relibra.plan import Plan, Topology, home_slots_LGH
from relibra.planners.base import empty_quota_MLGJS

__all__ = ["ReplicaSet", "greedy_replicas", "northwest_segments", "replicated_plan", "split_quota_MLGJS"]


@dataclass(frozen=True)
class ReplicaSet:
    """Replicas of one step, per problem b = (m * L + l) * Z + z.

    local_BQR: home slot (q_owner * H + h) copied into replica slot r of GPU q, -1 if empty.
    near_BQR / far_BQRK: near / far pairs (per far class k) that copy computes.
    near_left_BQH / far_left_BQHK: near / far pairs (per far class) each home instance keeps.
    """

    local_BQR: np.ndarray
    near_BQR: np.ndarray
    far_BQRK: np.ndarray
    near_left_BQH: np.ndarray
    far_left_BQHK: np.ndarray

    @property
    def far_BQR(self) -> np.ndarray:
        return self.far_BQRK.sum(axis=-1)

    @property
    def far_left_BQH(self) -> np.ndarray:
        return self.far_left_BQHK.sum(axis=-1)


def _split_loads_BQH(
    loads_MLSE: np.ndarray, slots_LGH: np.ndarray, topo: Topology, by_source_node: bool = False
):
    """(near, far) pairs [B, Q, H] of every home expert: near from sources on the owner's node, far the rest;
    with `by_source_node` far is [B, Q, H, Z], the far pairs of each source node (0 for the owner's own)."""
    M, L, _S, E = loads_MLSE.shape
    Z, Q, H = topo.num_nodes, topo.node_size, topo.num_home_slots
    lidx = np.arange(L)[:, None, None]
    near_MLZE = loads_MLSE.reshape(M, L, Z, Q, E).sum(axis=3)
    node_LGH = np.broadcast_to(topo.node_of_gpu()[None, :, None], slots_LGH.shape)
    near = near_MLZE[:, lidx, node_LGH, slots_LGH]
    shape = (M * L * Z, Q, H)
    if by_source_node:
        from_MLGHZ = near_MLZE.transpose(0, 1, 3, 2)[:, lidx, slots_LGH]
        own_LGHZ = node_LGH[..., None] == np.arange(Z)
        far = np.where(own_LGHZ[None], 0, from_MLGHZ).reshape(*shape, Z)
    else:
        far = (loads_MLSE.sum(axis=2)[:, lidx, slots_LGH] - near).reshape(shape)
    return near.reshape(shape).astype(np.int64), far.astype(np.int64)


def _fill(budget_n: np.ndarray, caps_nK: np.ndarray) -> np.ndarray:
    """int [n, K]: take up to caps[:, k] from each class in order until budget is spent (negative caps count as 0)."""
    caps = np.maximum(caps_nK, 0).astype(np.int64)
    before = np.cumsum(caps, axis=1) - caps
    return np.clip(np.asarray(budget_n, dtype=np.int64)[:, None] - before, 0, caps)


class _Greedy:
    """Vectorised state of the greedy over all problems (see the module docstring).

    Per-GPU rows are flattened to b * Q + q so that the hot GPU's experts are one row take; `copy` [B * Q * H, Q]
    (row b * Q * H + expert) holds 1 + the replica slot of GPU q that copies the expert (0: no copy), and
    `num_free` [B, Q] the free replica slots (slots fill in order and never empty), so no step scans the slots.
    """

    def __init__(
        self,
        near_BQH,
        far_BQH,
        num_replica_slots: int,
        min_pairs: int,
        eps: float,
        tile: int,
        kappa,
        patience,
    ):
        B, Q, H = near_BQH.shape
        R = num_replica_slots
        far_BQHK = far_BQH if far_BQH.ndim == 4 else far_BQH[..., None]
        K = far_BQHK.shape[-1]
        self.B, self.Q, self.H, self.R, self.K = B, Q, H, R, K
        self.min_pairs, self.eps, self.tile, self.kappa = max(min_pairs, 1), eps, tile, kappa
        self.near = np.array(near_BQH, dtype=np.int64).reshape(B * Q, H)  # remaining at home (a copy)
        self.far = np.array(far_BQHK, dtype=np.int64).reshape(B * Q, H, K)
        self.load_C = (self.near.sum(axis=1) + self.far.sum(axis=(1, 2))).reshape(B, Q).astype(np.float64)
        self.load_F = self.far.sum(axis=1).reshape(B, Q, K).astype(np.float64)
        self.T_C = np.ceil(self.load_C.sum(axis=-1) / Q)
        self.T_F = self.load_F.sum(axis=1) / Q  # [B, K]
        self.local = np.full((B, Q, R), -1, dtype=np.int64)
        self.rep_near = np.zeros((B, Q, R), dtype=np.int64)
        self.rep_far = np.zeros((B, Q, R, K), dtype=np.int64)
        self.copy = np.zeros((B * Q * H, Q), dtype=np.int8)
        self.num_free = np.full((B, Q), R, dtype=np.int64)
        self.blocked = np.zeros((B, 2), dtype=bool)  # resource 0 compute, 1 NIC
        self.patience = patience
        self.restart()

    def restart(self) -> None:
        """Start a pass: every problem unblocked, no stale moves."""
        self.blocked[:] = False
        self.best_obj = np.full(self.B, np.inf)
        self.stale = np.zeros(self.B, dtype=np.int64)

    def result(self) -> ReplicaSet:
        B, Q, H = self.B, self.Q, self.H
        return ReplicaSet(
            self.local,
            self.rep_near,
            self.rep_far,
            self.near.reshape(B, Q, H),
            self.far.reshape(B, Q, H, self.K),
        )

    def step(self, active: np.ndarray) -> np.ndarray:
        """One move in every active problem; returns the problems that stay active."""
        Q, H, K = self.Q, self.H, self.K
        C, F_all = self.load_C[active], self.load_F[active]  # [A, Q], [A, Q, K]
        T_C, T_F_all = self.T_C[active], self.T_F[active]  # [A], [A, K]
        max_C = C.max(axis=1)
        # The NIC resource is the (GPU, far class) furthest above its class's target.
        over_qk = (F_all - T_F_all[:, None, :] * (1 + self.eps)).reshape(len(active), Q * K)
        hot_F = over_qk.argmax(axis=1)
        # How far the hottest GPU is above each target, in compute pairs (0 within eps or when blocked).
        over_C = np.maximum(max_C - T_C * (1 + self.eps), 0.0)
        over_F = self.kappa * np.maximum(over_qk[np.arange(len(active)), hot_F], 0.0)  # T_F = inf: kappa is 0
        blocked = self.blocked[active]
        over_C[blocked[:, 0]] = 0.0
        over_F[blocked[:, 1]] = 0.0
        # A problem whose max C + kappa max F has not fallen for `patience` moves is done: what is left are tiny
        # moves that trade one resource's maximum for the other's (measured: cycles of a few hundred pairs).
        # (F is taken above its target so that classes with different targets compare; the shift is constant.)
        obj = max_C + (self.kappa * (F_all - T_F_all[:, None, :]).max(axis=(1, 2)) if self.kappa else 0.0)
        improved = obj < self.best_obj[active] - 0.5
        self.best_obj[active] = np.where(improved, obj, self.best_obj[active])
        self.stale[active] = np.where(improved, 0, self.stale[active] + 1)
        live = ((over_C > 0) | (over_F > 0)) & (self.stale[active] <= self.patience)
        if not live.all():
            active, C, F_all, T_C, T_F_all, over_C, over_F, max_C, hot_F = (
                a[live] for a in (active, C, F_all, T_C, T_F_all, over_C, over_F, max_C, hot_F)
            )
        if not len(active):
            return active
        nic = over_F > over_C  # NIC-bound: move far pairs
        res = nic.astype(np.int64)
        rows = np.arange(len(active))
        hot_C = C.argmax(axis=1)
        # Compute moves take the far pairs of the class whose load the hot GPU has most above its target.
        k_C = (F_all[rows, hot_C] - T_F_all).argmax(axis=1)
        own = np.where(nic, hot_F // K, hot_C)  # hot GPU
        cls = np.where(nic, hot_F % K, k_C)  # the far class that moves
        F, T_F = F_all[rows, :, cls], T_F_all[rows, cls]  # [A, Q], [A]
        max_F = F.max(axis=1)
        excess = np.where(nic, F[rows, own] - T_F, C[rows, own] - T_C)
        near, far = (
            self.near.take(active * Q + own, axis=0),
            self.far.take(active * Q + own, axis=0)[rows, :, cls],
        )  # [A, H]
        # Compute moves take near pairs first, then far pairs up to what keeps the destination's NIC load at or
        # below the node's current maximum. NIC moves take far pairs whatever they add to the destination's
        # compute: a far pair weighs kappa compute pairs (5.9 on the Hopper defaults), and the compute moves and
        # the relaxation level compute again with near pairs (module docstring: capping it cost all-to-all time).
        if self.kappa:
            nic_room = np.floor(np.maximum(max_F, T_F)[:, None] - F)
        else:
            nic_room = np.full(F.shape, np.inf)
        nic_col = nic[:, None]
        slack = np.where(nic_col, T_F[:, None] - F, T_C[:, None] - C)
        cold = np.where(nic_col, F, C)
        key = np.where(nic_col, far, near + far)
        order = np.argsort(-key, axis=1, kind="stable")  # hottest movable expert first
        free = self.num_free[active] > 0  # [A, Q]
        not_own = np.arange(Q)[None, :] != own[:, None]
        pick_h = np.full(len(active), -1)
        pick_q = np.zeros(len(active), dtype=np.int64)
        pick_x = np.zeros(len(active), dtype=np.int64)
        pending = rows
        for k in range(H):  # try experts hottest first until one has a legal move
            h = order[pending, k]
            go = key[pending, h] > 0
            pending, h = pending[go], h[go]
            if not len(pending):
                break
            n, f = near[pending, h][:, None], far[pending, h][:, None]
            movable = np.where(nic_col[pending], f, n + np.minimum(f, nic_room[pending]))  # [P, Q]
            existing = self.copy.take((active[pending] * Q + own[pending]) * H + h, axis=0) > 0
            ex = excess[pending, None]
            want = np.where(existing, ex, np.maximum(ex, self.min_pairs))
            amount = np.minimum(np.floor(np.minimum(want, slack[pending])), movable).astype(np.int64)
            amount = np.where(amount < movable, amount - amount % self.tile, amount)
            feasible = (
                not_own[pending] & (amount > 0) & (existing | (free[pending] & (amount >= self.min_pairs)))
            )
            has = feasible.any(axis=1)
            dest = np.where(feasible, cold[pending], np.inf).argmin(axis=1)
            done = pending[has]
            pick_h[done], pick_q[done] = h[has], dest[has]
            pick_x[done] = amount[np.flatnonzero(has), dest[has]]
            pending = pending[~has]
        ok = pick_h >= 0
        self.blocked[active[~ok], res[~ok]] = True
        self._apply(active[ok], res[ok], own[ok], pick_h[ok], pick_q[ok], pick_x[ok], cls[ok])
        return active

    def relax(self, num_rounds: int) -> None:
        """Level along the existing copies, for each replica slot in turn (one per problem, so no two updates touch
        the same GPU pair), in the problems with a GPU above a target (levelling the others shortens nothing):

        - compute: move pairs between the owner's home instance and the copy, half the load difference, never
          leaving a copy below the minimum quota; near pairs first, then far pairs of each class as far as the
          receiving GPU's NIC load stays at or below its class's maximum (or target, if higher). A copy that a NIC
          move made holds far pairs only: without them the GPU it filled could not hand load back;
        - NIC (with kappa > 0): per far class, far pairs go to whichever of the two GPUs receives less, as many near
          pairs the other way (compute unchanged), half the difference.

        No maximum rises; compute levelling frees slack on GPUs whose slots are taken so that the greedy can
        continue ("chains" of moves through existing copies)."""
        Q, H = self.Q, self.H
        for _ in range(num_rounds):
            above_C = self.load_C.max(axis=1) > self.T_C
            above_F = (self.load_F.max(axis=1) > self.T_F * (1 + self.eps)).any(axis=1)
            hot = np.flatnonzero(above_C | above_F)
            for q in range(Q):
                for r in range(self.R):
                    e = self.local[hot, q, r]
                    b, e = hot[e >= 0], e[e >= 0]
                    if len(b):
                        o, h = e // H, e % H
                        self._level_compute(b, o, b * Q + o, h, q, r)
                        if self.kappa:
                            self._level_nic(b, o, b * Q + o, h, q, r)

    def _level_compute(self, b, o, home_row, h, q: int, r: int) -> None:
        """The compute move of `relax` in problems b between home instance (o, h) and its copy in slot r of GPU q."""
        gap = self.load_C[b, o] - self.load_C[b, q]
        to_copy = gap > 0
        want = np.floor(np.abs(gap) / 2).astype(np.int64)
        copy_near, copy_far = self.rep_near[b, q, r], self.rep_far[b, q, r]  # [n], [n, K]
        # What the copy may give back without falling below the minimum quota.
        spare = np.maximum(copy_near + copy_far.sum(axis=-1) - self.min_pairs, 0)
        x = np.where(
            to_copy, np.minimum(want, self.near[home_row, h]), -np.minimum(np.minimum(want, copy_near), spare)
        )
        self.near[home_row, h] -= x
        self.rep_near[b, q, r] += x
        budget = np.where(to_copy, want - x, np.minimum(want + x, spare + x))  # x <= 0 when to_home
        i = np.flatnonzero(budget > 0) if self.kappa else []
        if len(i):  # then far pairs, class after class, within the receiving GPU's NIC room
            b_i, o_i, row_i, h_i = b[i], o[i], home_row[i], h[i]
            F = self.load_F[b_i]  # [i, Q, K]
            top = np.maximum(F.max(axis=1), self.T_F[b_i])  # [i, K]: no class's maximum rises
            room = np.where(
                to_copy[i, None],
                np.minimum(self.far[row_i, h_i], np.floor(top - F[:, q])),
                np.minimum(copy_far[i], np.floor(top - F[np.arange(len(i)), o_i])),
            )
            y = _fill(budget[i], room) * np.where(to_copy[i], 1, -1)[:, None]
            self.far[row_i, h_i] -= y
            self.rep_far[b_i, q, r] += y
            self.load_F[b_i, o_i] -= y
            self.load_F[b_i, q] += y
            x[i] += y.sum(axis=1)
        self.load_C[b, o] -= x
        self.load_C[b, q] += x

    def _level_nic(self, b, o, home_row, h, q: int, r: int) -> None:
        """The NIC move of `relax`: far pairs for near pairs between home instance (o, h) and its copy (q, r)."""
        gap = self.load_F[b, o] - self.load_F[b, q]  # [n, K]
        want = np.floor(np.abs(gap) / 2)
        out = _fill(self.rep_near[b, q, r], np.where(gap > 0, np.minimum(want, self.far[home_row, h]), 0))
        back = _fill(self.near[home_row, h], np.where(gap < 0, np.minimum(want, self.rep_far[b, q, r]), 0))
        y = out - back  # far pairs to the copy, per class; as many near pairs come home
        i = np.flatnonzero(y.any(axis=1))
        b, o, home_row, h, y = b[i], o[i], home_row[i], h[i], y[i]
        self.far[home_row, h] -= y
        self.rep_far[b, q, r] += y
        self.near[home_row, h] += y.sum(axis=1)
        self.rep_near[b, q, r] -= y.sum(axis=1)
        self.load_F[b, o] -= y
        self.load_F[b, q] += y

    def _apply(self, b, res, own, h, q, x, k) -> None:
        Q, H = self.Q, self.H
        home_row = b * Q + own
        copy_row = home_row * H + h
        slot = self.copy[copy_row, q].astype(np.int64)
        r = np.where(slot > 0, slot - 1, self.R - self.num_free[b, q])
        x_near = np.where(res == 1, 0, np.minimum(x, self.near[home_row, h]))
        x_far = x - x_near
        self.near[home_row, h] -= x_near
        self.far[home_row, h, k] -= x_far
        self.load_C[b, own] -= x
        self.load_C[b, q] += x
        self.load_F[b, own, k] -= x_far
        self.load_F[b, q, k] += x_far
        self.local[b, q, r] = own * H + h
        self.copy[copy_row, q] = r + 1
        self.num_free[b, q] -= slot == 0
        self.rep_near[b, q, r] += x_near
        self.rep_far[b, q, r, k] += x_far
        self.blocked[b] = False


def greedy_replicas(
    near_BQH: np.ndarray,
    far_BQH: np.ndarray,
    num_replica_slots: int,
    min_pairs: int,
    eps: float,
    tile: int = 1,
    kappa: float = 0.0,
    max_moves: int = 0,
    num_passes: int = 2,
    num_relax_rounds: int = 3,
    patience: int | None = None,
    floor_C_B: np.ndarray | None = None,
    floor_F_B: np.ndarray | None = None,
) -> ReplicaSet:
    """Run the greedy of the module docstring on every problem; near/far_BQH int [B, Q, H] pairs of home experts,
    or far_BQH [B, Q, H, K]: K classes of far pairs, each levelled on its own (source nodes, under pxn routing).

    kappa = 0 ignores NIC balance: the spec's token greedy (copies take near pairs first, then far ones).
    num_relax_rounds: rounds of the relaxation after the last pass (one after each earlier pass: it only has to free
    slack for the next; the rounds at the end level what no move can).
    patience: moves without a fall of max C + kappa max F before a problem stops (default 2 Q: enough to lower
    every GPU of a tie at the maximum).
    floor_C_B / floor_F_B: per problem, no GPU is levelled below these (pairs): the targets rise to floor / (1 + eps)
    so the tolerated level is max(T (1 + eps), floor); a node need not be levelled below what the step time waits
    for anyway (`bottleneck_floors`).
    """
    B, Q, H = near_BQH.shape
    patience = 2 * Q if patience is None else patience
    state = _Greedy(near_BQH, far_BQH, num_replica_slots, min_pairs, eps, tile, kappa, patience)
    if floor_C_B is not None:
        state.T_C = np.maximum(state.T_C, floor_C_B / (1 + eps))
    if floor_F_B is not None:
        state.T_F = np.maximum(state.T_F, floor_F_B[:, None] / (1 + eps))
    if kappa == 0:
        state.T_F[:] = np.inf  # NIC load is not balanced: never the binding resource
    if num_replica_slots == 0 or Q == 1:
        return state.result()
    for i in range(num_passes):
        state.restart()
        active = np.arange(B)
        for _ in range(max_moves or 4 * Q * (num_replica_slots + H)):
            if not len(active):
                break
            active = state.step(active)
        state.relax(num_relax_rounds if i == num_passes - 1 else 1)
    return state.result()


def northwest_segments(demand_XS: np.ndarray, capacity_XK: np.ndarray):
    """North-west corner rule on every row: (row, source, instance, pairs) of the non-empty overlaps of source s's
    and instance k's intervals on the prefix-sum axis (rows need equal demand and capacity totals).

    Sparse: merge the two prefix-sum sequences of a row; a non-empty segment [end_{j-1}, end_j) belongs to the
    source (instance) whose count of ends before position j it is. At most S + K - 1 segments per row.
    """
    X, S = demand_XS.shape
    ends = np.concatenate(
        [np.cumsum(demand_XS, axis=1, dtype=np.int64), np.cumsum(capacity_XK, axis=1, dtype=np.int64)], axis=1
    )
    order = np.argsort(ends, axis=1, kind="stable")
    ends = np.take_along_axis(ends, order, axis=1)
    is_source = order < S
    src = np.cumsum(is_source, axis=1) - is_source  # source ends strictly before position j
    inst = np.arange(ends.shape[1])[None] - src  # the other ends before j are instance ends
    length = ends.copy()
    length[:, 1:] -= ends[:, :-1]
    keep = length > 0
    row = np.broadcast_to(np.arange(X)[:, None], ends.shape)[keep]
    return row, src[keep], inst[keep], length[keep]


@dataclass(frozen=True)
class _Groups:
    """Experts with replicas, one row each; instance 0 is the home copy, padding has q_XI = -1 and 0 pairs."""

    b_X: np.ndarray
    owner_X: np.ndarray
    q_XI: np.ndarray
    slot_XI: np.ndarray
    near_XI: np.ndarray
    far_XIK: np.ndarray


def _instance_groups(replicas: ReplicaSet, H: int) -> _Groups:
    b, q, r = np.nonzero(replicas.local_BQR >= 0)
    owner = replicas.local_BQR[b, q, r]
    key = b * (replicas.local_BQR.shape[1] * H) + owner
    order = np.lexsort((r, q, key))
    first = np.r_[True, key[order][1:] != key[order][:-1]]
    starts = np.flatnonzero(first)
    size = np.diff(np.r_[starts, len(order)])
    X, width = len(starts), int(size.max()) + 1
    pos = np.arange(len(order)) - np.repeat(starts, size) + 1
    row = np.repeat(np.arange(X), size)
    head = order[starts]
    hb, ho = b[head], owner[head]
    q_XI = np.full((X, width), -1, dtype=np.int64)
    slot_XI = np.zeros((X, width), dtype=np.int64)
    near_XI = np.zeros((X, width), dtype=np.int64)
    K = replicas.far_BQRK.shape[-1]
    far_XIK = np.zeros((X, width, K), dtype=np.int64)
    q_XI[:, 0], slot_XI[:, 0] = ho // H, ho % H
    near_XI[:, 0] = replicas.near_left_BQH[hb, ho // H, ho % H]
    far_XIK[:, 0] = replicas.far_left_BQHK[hb, ho // H, ho % H]
    o = order
    q_XI[row, pos], slot_XI[row, pos] = q[o], H + r[o]
    near_XI[row, pos], far_XIK[row, pos] = (
        replicas.near_BQR[b[o], q[o], r[o]],
        replicas.far_BQRK[b[o], q[o], r[o]],
    )
    return _Groups(hb, ho, q_XI, slot_XI, near_XI, far_XIK)


def split_quota_MLGJS(
    loads_MLSE: np.ndarray, slots_LGH: np.ndarray, replicas: ReplicaSet, topo: Topology
) -> tuple[np.ndarray, np.ndarray]:
    """Slots [M, L, G, J] and per-source quotas [M, L, G, J, S] of the home + replica instances (module doc)."""
    M, L, S, _E = loads_MLSE.shape
    G, H, R, Z, Q = topo.num_gpus, topo.num_home_slots, topo.num_replica_slots, topo.num_nodes, topo.node_size
    slots = np.full((M, L, G, H + R), -1, dtype=np.int32)
    slots[..., :H] = slots_LGH[None]
    quota = empty_quota_MLGJS(loads_MLSE, slots_LGH, R)
    if not (replicas.local_BQR >= 0).any():
        return slots, quota
    groups = _instance_groups(replicas, H)
    gb = groups.b_X
    gm, gl, gz = gb // (L * Z), (gb // Z) % L, gb % Z
    ge = slots_LGH[gl, gz * Q + groups.owner_X // H, groups.owner_X % H]
    valid = groups.q_XI >= 0
    gpu_XI = np.where(valid, gz[:, None] * Q + groups.q_XI, -1)
    rep_rows, rep_cols = np.nonzero(valid[:, 1:])
    slots[
        gm[rep_rows], gl[rep_rows], gpu_XI[rep_rows, rep_cols + 1], groups.slot_XI[rep_rows, rep_cols + 1]
    ] = ge[rep_rows]
    X = len(gb)
    J = H + R
    base_XI = (
        (gm[:, None] * L + gl[:, None]) * G + np.maximum(gpu_XI, 0)
    ) * J + groups.slot_XI  # (m, l, g, j)
    flat = quota.reshape(-1, S)
    # Locality first; a dummy source column S absorbs the padding so that fancy updates never collide.
    demand = np.zeros((X, S + 1), dtype=np.int64)
    demand[:, :S] = flat.take(base_XI[:, 0], axis=0)  # the home row holds every pair of the expert
    rows = np.arange(X)[:, None]
    src = np.where(valid, gpu_XI, S)
    local = np.where(valid, np.minimum(demand[rows, src], groups.near_XI), 0)
    demand[rows, src] -= local
    demand = demand[:, :S]
    # North-west passes: far sources fill the far shares, then near sources the near ones (the totals match). With
    # a far share per source node (pxn) the far sources come in node order, and so do the shares' columns: the prefix
    # sums then meet at every node's boundary, so each node's pairs fill exactly that node's shares.
    node_S = topo.node_of_gpu()
    order_ZS = np.argsort(
        node_S[None, :] == np.arange(Z)[:, None], axis=1, kind="stable"
    )  # far sources first
    order = order_ZS[gz]
    flat[base_XI[:, 0]] = 0  # the north-west passes and the local pairs refill the home rows
    size_X = valid.sum(axis=1)
    shares = np.take_along_axis(demand, order, axis=1)
    near_left = groups.near_XI - local
    for n in np.unique(size_X):  # rows with n instances: no padded capacities in the merge
        sel = np.flatnonzero(size_X == n)
        far_caps = groups.far_XIK[sel, :n].transpose(0, 2, 1).reshape(len(sel), -1)  # class-major
        x, s_sorted, k, pairs = northwest_segments(
            shares[sel], np.concatenate([far_caps, near_left[sel, :n]], axis=1)
        )
        x = sel[x]  # a source is far or near, so (x, s, instance) is unique: plain assignment
        flat.reshape(-1)[base_XI[x, k % n] * S + order[x, s_sorted]] = pairs
    xi, ij = np.nonzero(valid & (local > 0))
    flat.reshape(-1)[base_XI[xi, ij] * S + gpu_XI[xi, ij]] += local[xi, ij]
    return slots, quota


def levels_by_source_node(cost: CostModel | None, topo: Topology) -> bool:
    """Whether the greedy levels each GPU's far pairs per source node: under pxn routing with more than two nodes,
    node z's pairs to GPUs of local index r leave through z's NIC r, so a GPU's receive from each node counts (with
    two nodes that is the GPU's whole receive)."""
    return cost is not None and cost.nic_routing == "pxn" and topo.num_nodes > 2


def nic_weight(cost: CostModel, topo: Topology) -> float:
    """kappa: the all-to-all time of one far pair at a GPU's NIC in units of one pair's expert compute time (under
    pxn routing only the two dispatch-like all-to-alls see where a pair is served: the combine-like ones leave the
    GPU through its node's NICs of the sources' local indices)."""
    if topo.num_nodes == 1:
        return 0.0
    per_pair = cost.gemm_us_per_token * (1.0 + cost.backward_factor)
    num_alltoalls = NUM_ALLTOALLS if cost.nic_routing == "direct" else NUM_ALLTOALLS // 2
    return num_alltoalls * float(cost.nic_us(cost.pair_bytes)) / per_pair


def bottleneck_floors(
    loads_MLSE: np.ndarray,
    home_LE: np.ndarray,
    near_BQH: np.ndarray,
    far_BQH: np.ndarray,
    topo: Topology,
    sends_bind: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Per problem b = (m, l, z): the compute and NIC loads (pairs) below which levelling node z cannot shorten
    (m, l), since the step waits for the slowest GPU of the whole EP group and copies never leave a node:

      floor_C = max_z' ceil(C_z' / Q),   floor_F = max(max_z' F_z' / Q, max_s Send_s),

    C_z' / F_z' the pairs / far pairs node z' serves, Send_s the pairs source rank s sends to other nodes (fixed by
    the homes: a replica serves pairs in its owner's node, so it moves no source's NIC traffic). `sends_bind` False
    (pxn routing: a GPU's receive and a source's sends meet in different all-to-alls) leaves Send_s out.
    """
    M, L, S, _E = loads_MLSE.shape
    Z, Q = topo.num_nodes, topo.node_size
    T_C = np.ceil((near_BQH.sum(axis=(1, 2)) + far_BQH.sum(axis=(1, 2))) / Q).reshape(M * L, Z)
    T_F = (far_BQH.sum(axis=(1, 2)) / Q).reshape(M * L, Z)
    floor_F = T_F.max(axis=1)
    if sends_bind:
        away_LSE = (home_LE // Q)[:, None, :] != topo.node_of_gpu()[None, :, None]
        send_MLS = np.einsum("mlse,lse->mls", loads_MLSE, away_LSE)
        floor_F = np.maximum(floor_F, send_MLS.reshape(M * L, S).max(axis=1))
    return np.repeat(T_C.max(axis=1), Z), np.repeat(floor_F, Z)


def replicated_plan(
    loads_MLSE: np.ndarray, home_LE: np.ndarray, topo: Topology, cfg, cost: CostModel | None = None
) -> Plan:
    """Home placement `home_LE` plus greedy replicas per (m, l, node) and the locality-aware split.

    Without a cost model the greedy levels tokens only (kappa = 0) and does not round to the GEMM tile.
    """
    slots_LGH = home_slots_LGH(home_LE, topo)
    by_node = levels_by_source_node(cost, topo)
    near, far = _split_loads_BQH(loads_MLSE, slots_LGH, topo, by_source_node=by_node)
    kappa = nic_weight(cost, topo) if cost is not None else 0.0
    tile = cost.gemm_tile if cost is not None else 1
    far_total = far.sum(axis=-1) if by_node else far
    direct = cost is None or cost.nic_routing == "direct"
    floor_C, floor_F = bottleneck_floors(loads_MLSE, home_LE, near, far_total, topo, sends_bind=direct)
    replicas = greedy_replicas(
        near, far, topo.num_replica_slots, cfg.min_replica_tokens, cfg.imbalance_tolerance, tile, kappa,
        floor_C_B=floor_C, floor_F_B=None if by_node else floor_F,
    )  # fmt: skip
    slots, quota = split_quota_MLGJS(loads_MLSE, slots_LGH, replicas, topo)
    return Plan(home_LE=home_LE, slots_MLGJ=slots, quota_MLGJS=quota, num_home_slots=topo.num_home_slots)
