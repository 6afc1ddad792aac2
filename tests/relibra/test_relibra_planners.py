"""Planners: valid plans on random and real loads, the annealing against brute force, the replication greedy against
scipy's MILP, EPLB's properties, determinism."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel, ideal_step_cost, step_cost
from relibra.loads import loads_from_vllm_logs
from relibra.plan import IdealPlan, Plan, PlannerState, Topology, home_slots_LGH, static_home_LE
from relibra.planners import PLANNERS, PlanContext, no_worse_than_keeping, run_planner
from relibra.planners.base import home_plan, home_quota_MLGHS
from relibra.planners.eplb import eplb_rebalance, replicate_experts
from relibra.planners.packing import balanced_packing
from relibra.planners.reorder import (
    ReorderWeights,
    _Annealer,
    anneal_home,
    reorder_objective_L,
    reorder_problem,
)
from relibra.planners.replicate import (
    _split_loads_BQH,
    bottleneck_floors,
    greedy_replicas,
    nic_weight,
    replicated_plan,
    split_quota_MLGJS,
)
from relibra.synthetic import SyntheticLoads, generate_loads
from relibra.validate import validate_plan

COST = CostModel.from_yaml()
ROUTING = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "routing" / "qwen3-30b-a3b-vllm"


def _synthetic(G: int, E: int = 32, M: int = 4, L: int = 3, N: int = 2, tokens: int = 512):
    params = SyntheticLoads(
        num_steps=N, num_microbatches=M, num_layers=L, num_source_ranks=G, num_experts=E, topk=4,
        tokens_per_rank=tokens, group_size=4,
    )  # fmt: skip
    return generate_loads(params)


def _run_all_steps(name, trace, topo, cfg):
    ctx = PlanContext(topo, cfg, COST, trace.topk)
    state, plans = PlannerState(), []
    for n in range(trace.num_steps):
        plan, state = run_planner(name, trace.loads_NMLSE[n], ctx, state)
        validate_plan(plan, trace.loads_NMLSE[n], topo)
        plans.append(plan)
    return plans


@pytest.mark.parametrize("name", PLANNERS.names())
@pytest.mark.parametrize(("G", "Q", "R"), [(8, 4, 2), (4, 8, 1), (8, 8, 0)])
def test_every_planner_is_valid_on_random_loads(name, G, Q, R):
    trace = _synthetic(G)
    topo = Topology(G, Q, 32, R)
    _run_all_steps(name, trace, topo, RelibraConfig(min_replica_tokens=32, anneal_iters=400))


@pytest.mark.skipif(not ROUTING.is_dir(), reason=f"real routing logs not found at {ROUTING}")
@pytest.mark.parametrize("name", PLANNERS.names())
def test_every_planner_is_valid_on_real_loads(name):
    logs = [ROUTING / "token_distri_8.jsonl", ROUTING / "token_distri_16.jsonl"]
    trace = loads_from_vllm_logs(logs, microbatch_tokens=256, num_source_ranks=16)
    from relibra.loads import LoadTrace

    trace = LoadTrace(trace.loads_NMLSE[:, :3, :4], trace.topk)  # 3 micro-batches, 4 layers: fast
    cfg = RelibraConfig(min_replica_tokens=16, anneal_iters=400, reorder_migration_weight=0.0)
    plans = _run_all_steps(name, trace, Topology(16, 8, 128, 2), cfg)
    if name == "relibra":
        assert any((p.slots_MLGJ[..., 8:] >= 0).any() for p in plans), (
            "a small min quota must create replicas"
        )


@pytest.mark.parametrize("name", ["relibra", "eplb_history", "greedy_lpt"])
def test_plans_are_deterministic(name):
    trace = _synthetic(8)
    topo = Topology(8, 4, 32, 2)
    cfg = RelibraConfig(min_replica_tokens=32, anneal_iters=400)
    a, b = _run_all_steps(name, trace, topo, cfg), _run_all_steps(name, trace, topo, cfg)
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p.home_LE, q.home_LE)
        np.testing.assert_array_equal(p.quota_MLGJS, q.quota_MLGJS)


def _problem(G=8, Q=4, E=16, seed=0, migration=1.0):
    loads = _synthetic(G, E=E, M=3, L=4, N=1, tokens=256).loads_NMLSE[0]
    topo = Topology(G, Q, E, 0)
    cfg = RelibraConfig(reorder_migration_weight=migration)
    prev = np.random.default_rng(seed).permuted(static_home_LE(4, topo), axis=1)
    return reorder_problem(loads, prev, topo, ReorderWeights.from_config(cfg, COST, topo)), topo


def test_annealing_deltas_match_full_objective():
    prob, topo = _problem()
    rng = np.random.default_rng(1)
    home = static_home_LE(4, topo)
    state = _Annealer(prob, home, num_candidates=5)
    G, H = topo.num_gpus, topo.num_home_slots
    for _ in range(20):
        x1 = rng.integers(0, G * H, size=(4, 5))
        x2 = ((x1 // H + rng.integers(1, G, size=(4, 5))) % G) * H + rng.integers(0, H, size=(4, 5))
        delta, d = state.deltas(x1, x2)
        before = reorder_objective_L(prob, state.home_LE)
        for layer in range(4):
            for c in range(5):
                trial = state.home_LE.copy()
                e1, e2 = state.slot_LX[layer, x1[layer, c]], state.slot_LX[layer, x2[layer, c]]
                trial[layer, e1], trial[layer, e2] = trial[layer, e2], trial[layer, e1]
                want = reorder_objective_L(prob, trial)[layer] - before[layer]
                assert delta[layer, c] == pytest.approx(want, rel=2e-3, abs=1e-3 * abs(before[layer]) / 1e3)
        pick = rng.integers(0, 5, size=4)
        layers = np.arange(4)
        state.apply(layers, x1[layers, pick], x2[layers, pick], d[layers, pick])
        np.testing.assert_array_equal(
            np.sort(state.slot_LX, axis=1), np.tile(np.arange(topo.num_experts), (4, 1))
        )


@functools.cache
def _balanced_placements(E: int, G: int) -> np.ndarray:
    """[P, E]: every distinct assignment of E experts to G GPUs with E / G experts each."""
    H = E // G
    seen = set()
    for perm in itertools.permutations(range(E)):
        home = np.empty(E, dtype=int)
        home[list(perm)] = np.repeat(np.arange(G), H)
        seen.add(tuple(home))
    return np.array(sorted(seen))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_annealing_finds_the_brute_force_optimum(seed):
    """8 experts on 4 GPUs in 2 nodes (2520 distinct placements): annealing reaches the exact minimum of J."""
    loads = _synthetic(4, E=8, M=3, L=2, N=1, tokens=128).loads_NMLSE[0]
    loads = np.random.default_rng(seed).permuted(loads, axis=3)
    topo = Topology(4, 2, 8, 0)
    prev = static_home_LE(2, topo)
    prob = reorder_problem(loads, prev, topo, ReorderWeights.from_config(RelibraConfig(), COST, topo))
    candidates = _balanced_placements(8, 4)
    best = np.array([
        min(reorder_objective_L(prob, np.tile(h, (2, 1)))[layer] for h in candidates) for layer in range(2)
    ])  # fmt: skip
    got = anneal_home(prob, prev, np.random.default_rng(seed), 3000, 8, 0.05, 0.998)
    np.testing.assert_allclose(reorder_objective_L(prob, got), best, rtol=1e-9)


def _lpt_reference(weights, packs):
    cap = len(weights) // packs
    load, count, out = np.zeros(packs), np.zeros(packs, int), np.empty(len(weights), int)
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        open_packs = [p for p in range(packs) if count[p] < cap]
        p = min(open_packs, key=lambda p: (load[p], p))
        out[i], load[p], count[p] = p, load[p] + weights[i], count[p] + 1
    return out


def test_balanced_packing_rule_and_brute_force_bound():
    rng = np.random.default_rng(0)
    for _ in range(30):
        w = rng.integers(1, 100, size=8).astype(float)
        pack, rank = balanced_packing(w[None], 4)
        np.testing.assert_array_equal(pack[0], _lpt_reference(w, 4))
        assert (np.bincount(pack[0], minlength=4) == 2).all()
        assert sorted(rank[0][pack[0] == 0]) == [0, 1]
        got = np.bincount(pack[0], weights=w, minlength=4).max()
        placements = _balanced_placements(8, 4)
        opt = (np.eye(4)[placements] * w[None, :, None]).sum(axis=1).max(axis=1).min()
        assert opt <= got <= 4 / 3 * opt + 1e-9


def _milp_max_load(W_QH: np.ndarray, R: int, min_q: int) -> float:
    """Exact optimum: integer pairs x[e, g] on replicas (binary y[e, g]) of other GPUs, <= R per GPU, each either 0
    or >= min_q pairs; minimise the largest GPU load."""
    Q, H = W_QH.shape
    experts = [(q, h) for q in range(Q) for h in range(H)]
    pairs = [(i, g) for i, (q, _) in enumerate(experts) for g in range(Q) if g != q]
    n = len(pairs)
    nv = 2 * n + 1
    rows, lo, hi = [], [], []

    def add(row, a, b):
        rows.append(row)
        lo.append(a)
        hi.append(b)

    for g in range(Q):
        row = np.zeros(nv)
        row[[n + k for k, (_, gg) in enumerate(pairs) if gg == g]] = 1
        add(row, -np.inf, R)
    for k, (i, _) in enumerate(pairs):
        q, h = experts[i]
        row = np.zeros(nv)
        row[k], row[n + k] = 1, -W_QH[q, h]
        add(row, -np.inf, 0)
        row = np.zeros(nv)
        row[k], row[n + k] = 1, -min_q
        add(row, 0, np.inf)
    for i, (q, h) in enumerate(experts):
        row = np.zeros(nv)
        row[[k for k, (ii, _) in enumerate(pairs) if ii == i]] = 1
        add(row, -np.inf, W_QH[q, h])
    for g in range(Q):
        row = np.zeros(nv)
        for k, (i, gg) in enumerate(pairs):
            row[k] += (gg == g) - (experts[i][0] == g)
        row[-1] = -1
        add(row, -np.inf, -W_QH[g].sum())
    integrality = np.r_[np.ones(2 * n), 0]
    bounds = Bounds(np.zeros(nv), np.r_[np.full(n, np.inf), np.ones(n), np.inf])
    res = milp(np.r_[np.zeros(2 * n), 1], constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=integrality, bounds=bounds)  # fmt: skip
    assert res.success
    return res.fun


def test_replication_greedy_against_milp():
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(25):
        W = rng.integers(0, 400, (4, 2)) * (rng.random((4, 2)) < 0.8)
        W[rng.integers(4), rng.integers(2)] += rng.integers(200, 1500)
        min_q = int(rng.choice([0, 32, 100]))
        rs = greedy_replicas(W[None], np.zeros_like(W)[None], 2, min_q, eps=0.0)
        load = (
            rs.near_left_BQH[0].sum(1)
            + rs.far_left_BQH[0].sum(1)
            + rs.near_BQR[0].sum(1)
            + rs.far_BQR[0].sum(1)
        )
        assert load.sum() == W.sum()
        placed = rs.near_BQR[0] + rs.far_BQR[0]
        assert (placed[rs.local_BQR[0] >= 0] >= max(min_q, 1)).all()
        best = _milp_max_load(W, 2, min_q)
        assert load.max() >= best - 1e-6  # the MILP is a lower bound
        ratios.append(load.max() / best)
    # Measured: optimal on most instances, at most ~1.18x on these (the greedy fills destinations to the target
    # in order and can strand a later hot GPU without a free slot).
    assert max(ratios) <= 1.2
    assert np.mean(ratios) <= 1.05


def test_replication_greedy_levels_nic_and_compute():
    """Two nodes: joint greedy lowers max compute + kappa max NIC below the token-only greedy's."""
    trace = _synthetic(8, E=16, M=4, L=2, N=1, tokens=1024)
    topo = Topology(8, 4, 16, 2)
    cfg = RelibraConfig(min_replica_tokens=32)
    loads = trace.loads_NMLSE[0]
    home = static_home_LE(2, topo)
    joint = step_cost(replicated_plan(loads, home, topo, cfg, COST), loads, 4, topo, COST, home)
    tokens_only = step_cost(replicated_plan(loads, home, topo, cfg, None), loads, 4, topo, COST, home)
    assert nic_weight(COST, topo) > 1
    assert joint.compute_us + joint.alltoall_us < tokens_only.compute_us + tokens_only.alltoall_us


def test_replicate_experts_is_the_optimal_apportionment():
    rng = np.random.default_rng(0)
    for _ in range(20):
        w = rng.integers(1, 50, size=5).astype(float)
        phy2log, _rank, count = replicate_experts(w[None], 9)
        assert count.sum() == 9 and (count >= 1).all()
        np.testing.assert_array_equal(np.bincount(phy2log[0], minlength=5), count[0])
        got = (w / count[0]).max()
        best = min(
            (w / np.array(c)).max() for c in itertools.product(range(1, 6), repeat=5) if sum(c) == 9
        )  # fmt: skip
        assert got == pytest.approx(best)


@pytest.mark.parametrize("hierarchical", [True, False])
def test_eplb_slot_budget_and_counts(hierarchical):
    rng = np.random.default_rng(0)
    L, E, G, J, Z = 3, 16, 8, 3, 2
    weight = rng.gamma(0.5, 100, size=(L, E))
    groups, nodes = (E, Z) if hierarchical else (1, 1)
    phy2log, logcnt = eplb_rebalance(weight, G * J, groups, nodes, G)
    assert phy2log.shape == (L, G * J)
    for layer in range(L):
        np.testing.assert_array_equal(np.bincount(phy2log[layer], minlength=E), logcnt[layer])
        assert logcnt[layer].sum() == G * J and (logcnt[layer] >= 1).all()
        # More load never gets fewer copies (copies follow load).
        order = np.argsort(weight[layer])
        assert (np.diff(logcnt[layer][order]) >= 0).all()
        if hierarchical:  # every expert's copies sit in one node: slots [z * P / Z, (z + 1) * P / Z)
            node = np.arange(G * J) // (G * J // Z)
            for e in range(E):
                assert len(set(node[phy2log[layer] == e])) == 1


def test_eplb_plan_splits_evenly():
    trace = _synthetic(8)
    topo = Topology(8, 4, 32, 2)
    plans = _run_all_steps("eplb_oracle", trace, topo, RelibraConfig())
    plan = plans[0]
    loads = trace.loads_NMLSE[0]
    for layer in range(loads.shape[1]):
        slots = plan.slots_MLGJ[0, layer].reshape(-1)
        quota = plan.quota_MLGJS[:, layer].reshape(loads.shape[0], -1, topo.num_gpus)
        for e in np.unique(slots):
            copies = quota[:, slots == e, :]  # [M, copies, S]
            assert (copies.max(axis=1) - copies.min(axis=1) <= 1).all()


def test_relibra_beats_baselines_on_synthetic_loads():
    trace = _synthetic(16, E=64, M=4, L=2, N=2, tokens=2048)
    topo = Topology(16, 8, 64, 2)
    cfg = RelibraConfig(min_replica_tokens=64)
    moe = {}
    for name in ("static", "reorder_only", "relibra"):
        plans = _run_all_steps(name, trace, topo, cfg)
        prev, total = static_home_LE(2, topo), 0.0
        for n, plan in enumerate(plans):
            assert not isinstance(plan, IdealPlan)
            total += step_cost(plan, trace.loads_NMLSE[n], 4, topo, COST, prev).moe_us
            prev = plan.home_LE
        moe[name] = total
    ideal = sum(ideal_step_cost(trace.loads_NMLSE[n], 4, topo, COST).moe_us for n in range(2))
    assert ideal < moe["relibra"] < moe["reorder_only"] < moe["static"]


def _greedy_inputs(seed: int):
    """Two-node problems of 8 GPUs with a few hot experts: [B, Q, H] near and far pairs."""
    rng = np.random.default_rng(seed)
    near = rng.integers(0, 300, (40, 8, 4)) * (rng.random((40, 8, 4)) < 0.7)
    far = rng.integers(0, 300, (40, 8, 4)) * (rng.random((40, 8, 4)) < 0.7)
    near[np.arange(40), rng.integers(0, 8, 40), rng.integers(0, 4, 40)] += rng.integers(500, 3000, 40)
    return near, far


def _served_loads_BQ(rs):
    """Compute load C and far (NIC) load F per GPU of every problem: home instances plus copies."""
    F = rs.far_left_BQH.sum(-1) + rs.far_BQR.sum(-1)
    return rs.near_left_BQH.sum(-1) + rs.near_BQR.sum(-1) + F, F


def test_replication_greedy_keeps_inputs_and_pairs():
    near, far = _greedy_inputs(0)
    before = near.copy(), far.copy()
    rs = greedy_replicas(near, far, 2, 64, 0.02, tile=16, kappa=3.0)
    np.testing.assert_array_equal(near, before[0])
    np.testing.assert_array_equal(far, before[1])
    # Every pair is served exactly once, near ones as near and far ones as far.
    copies = rs.local_BQR >= 0
    B, _Q, H = near.shape
    for b in range(B):
        got_near, got_far = rs.near_left_BQH[b].copy(), rs.far_left_BQH[b].copy()
        for q, r in zip(*np.nonzero(copies[b])):
            owner, h = divmod(int(rs.local_BQR[b, q, r]), H)
            assert owner != q
            got_near[owner, h] += rs.near_BQR[b, q, r]
            got_far[owner, h] += rs.far_BQR[b, q, r]
        np.testing.assert_array_equal(got_near, near[b])
        np.testing.assert_array_equal(got_far, far[b])
    assert ((rs.near_BQR + rs.far_BQR)[copies] >= 64).all()


def test_replication_greedy_keeps_pairs_per_far_class():
    """With far pairs in classes (source nodes, for pxn routing) every class's pairs are served exactly once."""
    near, far = _greedy_inputs(3)
    rng = np.random.default_rng(3)
    share = rng.dirichlet(np.ones(3), size=far.shape)  # [B, Q, H, 3]
    far_K = np.floor(far[..., None] * share).astype(np.int64)
    rs = greedy_replicas(near, far_K, 2, 64, 0.02, tile=16, kappa=3.0)
    H = near.shape[2]
    for b in range(near.shape[0]):
        got = rs.far_left_BQHK[b].copy()
        for q, r in zip(*np.nonzero(rs.local_BQR[b] >= 0)):
            owner, h = divmod(int(rs.local_BQR[b, q, r]), H)
            got[owner, h] += rs.far_BQRK[b, q, r]
        np.testing.assert_array_equal(got, far_K[b])
    assert rs.far_BQRK.sum() > 0  # copies took far pairs


def test_replication_greedy_levels_each_far_class():
    """Three GPUs whose far receive is level in total, but GPU 0 takes node A's pairs and GPU 1 node B's: the
    greedy copies experts until every GPU receives a third of each node's pairs (and levels compute too)."""
    near = np.array([[[0], [0], [1024]]])  # [B, Q, H]
    far = np.array([[[[2048, 0]], [[0, 2048]], [[1024, 1024]]]])  # [B, Q, H, K]: K = source nodes A, B
    rs = greedy_replicas(near, far, 2, 64, 0.0, tile=64, kappa=3.0)
    F = rs.far_left_BQHK.sum(axis=2) + rs.far_BQRK.sum(axis=2)  # [B, Q, K]
    np.testing.assert_array_equal(F[0], np.full((3, 2), 1024))
    C = rs.near_left_BQH.sum(-1) + rs.near_BQR.sum(-1) + F.sum(-1)
    assert C.max() <= np.ceil(C.sum() / 3) + 64  # within a GEMM tile of the mean


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replication_greedy_patience_loses_nothing(seed):
    """Stopping a problem after 2 Q moves without progress gives the same objective as running to the move cap."""
    near, far = _greedy_inputs(seed)
    kappa = 3.0

    def objective(rs):
        C, F = _served_loads_BQ(rs)
        return C.max(axis=1) + kappa * F.max(axis=1)

    start = (near + far).sum(-1).max(axis=1) + kappa * far.sum(-1).max(axis=1)
    quick = objective(greedy_replicas(near, far, 2, 64, 0.02, 16, kappa))
    full = objective(greedy_replicas(near, far, 2, 64, 0.02, 16, kappa, patience=10**9))
    assert (quick <= start).all()
    np.testing.assert_allclose(quick.mean(), full.mean(), rtol=2e-3)


def test_replication_greedy_against_the_levelling_bound_fixed_seed_change_detector():
    """A change detector on three fixed seeds, with thin margins on purpose (it catches a greedy that got a few
    tenths of a point worse; the independent check is the bound itself, which no split beats). Per problem,
    max C + kappa max F against perfect levelling, ceil(sum C / Q) + kappa sum F / Q, which no split
    beats: never below it, on average within 8.4% of it on these two-node problems and compute within 1.6%
    (measured 8.1% and 1.45%). Fails with NIC moves capped at the node's compute maximum (9.2%), without the
    relaxation's NIC levelling (8.6%), without far pairs in its compute levelling (compute 1.8%) or with one
    relaxation round after the last pass (compute 1.9%)."""
    kappa, objective, compute = 3.0, [], []
    for seed in range(3):
        near, far = _greedy_inputs(seed)
        rs = greedy_replicas(near, far, 2, 64, 0.02, 16, kappa)
        C, F = _served_loads_BQ(rs)
        Q = near.shape[1]
        T_C, T_F = np.ceil((near + far).sum(axis=(1, 2)) / Q), far.sum(axis=(1, 2)) / Q
        objective.append((C.max(axis=1) + kappa * F.max(axis=1)) / (T_C + kappa * T_F))
        compute.append(C.max(axis=1) / T_C)
    objective, compute = np.concatenate(objective), np.concatenate(compute)
    assert objective.min() >= 1.0 and compute.min() >= 1.0
    assert objective.mean() <= 1.084
    assert compute.mean() <= 1.016


def test_home_quota_against_loops():
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 50, (2, 3, 4, 8))
    slots = np.stack([rng.permutation(8).reshape(4, 2) for _ in range(3)])
    got = home_quota_MLGHS(loads, slots)
    for m, layer, g, h, s in itertools.product(range(2), range(3), range(4), range(2), range(4)):
        assert got[m, layer, g, h, s] == loads[m, layer, s, slots[layer, g, h]]


def test_bottleneck_floors_against_loops():
    loads = _synthetic(8, E=16, M=2, L=2, N=1, tokens=256).loads_NMLSE[0]
    topo = Topology(8, 4, 16, 2)
    home = np.random.default_rng(0).permuted(static_home_LE(2, topo), axis=1)

    near, far = _split_loads_BQH(loads, home_slots_LGH(home, topo), topo)
    floor_C, floor_F = bottleneck_floors(loads, home, near, far, topo)
    _, floor_F_pxn = bottleneck_floors(loads, home, near, far, topo, sends_bind=False)
    M, L, S, E = loads.shape
    Z, Q = 2, 4
    for m, layer in itertools.product(range(M), range(L)):
        node_pairs, node_far = [0] * Z, [0] * Z
        send = [0] * S
        for s, e in itertools.product(range(S), range(E)):
            z_e, z_s = home[layer, e] // Q, s // Q
            node_pairs[z_e] += loads[m, layer, s, e]
            if z_e != z_s:
                node_far[z_e] += loads[m, layer, s, e]
                send[s] += loads[m, layer, s, e]
        want_C = max(-(-p // Q) for p in node_pairs)
        want_F = max(max(f / Q for f in node_far), max(send))
        for z in range(Z):
            b = (m * L + layer) * Z + z
            assert floor_C[b] == want_C and floor_F[b] == pytest.approx(want_F)
            assert floor_F_pxn[b] == pytest.approx(max(f / Q for f in node_far))


def test_far_pairs_by_source_node_against_loops():
    loads = _synthetic(12, E=24, M=2, L=2, N=1, tokens=256).loads_NMLSE[0]
    topo = Topology(12, 4, 24, 2)
    home = np.random.default_rng(1).permuted(static_home_LE(2, topo), axis=1)
    slots = home_slots_LGH(home, topo)
    near, far = _split_loads_BQH(loads, slots, topo)
    near_k, far_k = _split_loads_BQH(loads, slots, topo, by_source_node=True)
    np.testing.assert_array_equal(near_k, near)
    np.testing.assert_array_equal(far_k.sum(-1), far)
    Z, Q, H = 3, 4, 2
    for m, layer, g, h, z in itertools.product(range(2), range(2), range(12), range(H), range(Z)):
        b = (m * 2 + layer) * Z + g // Q
        e = slots[layer, g, h]
        want = 0 if z == g // Q else loads[m, layer, z * Q : (z + 1) * Q, e].sum()
        assert far_k[b, g % Q, h, z] == want


def test_pxn_replicas_spread_each_source_nodes_sends():
    """Under pxn routing with three nodes, replicas that level each GPU's receive per source node make the
    simulated all-to-alls faster than replicas planned for direct routing, on the same placement."""
    trace = _synthetic(24, E=96, M=4, L=2, N=1, tokens=2048)
    loads = trace.loads_NMLSE[0]
    topo = Topology(24, 8, 96, 2)
    pxn = dataclasses.replace(COST, nic_routing="pxn")
    home = np.random.default_rng(0).permuted(static_home_LE(2, topo), axis=1)
    cfg = RelibraConfig()
    a2a = {}
    for name, planned_for in (("direct", COST), ("pxn", pxn)):
        plan = replicated_plan(loads, home, topo, cfg, planned_for)
        validate_plan(plan, loads, topo)
        a2a[name] = step_cost(plan, loads, 4, topo, pxn, home).alltoall_us
    assert a2a["pxn"] < 0.95 * a2a["direct"]


def test_floors_keep_the_step_time():
    """Levelling each node only down to the (m, l)'s bottleneck never makes the simulated step slower here."""
    trace = _synthetic(16, E=64, M=4, L=2, N=1, tokens=2048)
    topo = Topology(16, 8, 64, 2)
    loads = trace.loads_NMLSE[0]

    home = static_home_LE(2, topo)
    slots = home_slots_LGH(home, topo)
    near, far = _split_loads_BQH(loads, slots, topo)
    floors = bottleneck_floors(loads, home, near, far, topo)
    cost = {}
    for name, (fc, ff) in {"floors": floors, "node targets": (None, None)}.items():
        rs = greedy_replicas(
            near, far, 2, 64, 0.02, COST.gemm_tile, nic_weight(COST, topo), floor_C_B=fc, floor_F_B=ff
        )
        plan = Plan(home, *split_quota_MLGJS(loads, slots, rs, topo), num_home_slots=topo.num_home_slots)
        validate_plan(plan, loads, topo)
        c = step_cost(plan, loads, 4, topo, COST, home)
        cost[name] = c.compute_us + c.alltoall_us
    assert cost["floors"] <= cost["node targets"] * 1.001


def test_a_plan_priced_no_faster_than_keeping_the_placement_is_not_applied():
    """Uniform loads: moving away from the current placement only adds migration, so the static placement (a
    move, from a permuted current one) is replaced by keeping the current one; on skewed loads where the current
    placement stacks the hot experts on one GPU, ReLibra's plan beats keeping it and is applied."""
    topo = Topology(4, 2, 8, 1)
    ctx = PlanContext(topo, RelibraConfig(min_replica_tokens=0), COST, 2)
    uniform = np.full((2, 2, 4, 8), 64, dtype=np.int64)
    current = np.stack([np.roll(static_home_LE(2, topo)[0], 1)] * 2)
    static, _ = run_planner("static", uniform, ctx, PlannerState(home_LE=current))
    assert not np.array_equal(static.home_LE, current)
    chosen, cost, kept = no_worse_than_keeping(static, uniform, ctx, current)
    assert kept and np.array_equal(chosen.home_LE, current) and cost.migration_bytes == 0
    assert cost.moe_us < step_cost(static, uniform, 2, topo, COST, current).moe_us
    skewed = np.full((2, 2, 4, 8), 8, dtype=np.int64)
    skewed[..., :2] = 400  # experts 0 and 1 both live on GPU 0 under the static placement
    home = static_home_LE(2, topo)
    plan, _ = run_planner("relibra", skewed, ctx, PlannerState(home_LE=home))
    chosen, cost, kept = no_worse_than_keeping(plan, skewed, ctx, home)
    assert not kept and chosen is plan
    assert cost.moe_us < step_cost(home_plan(skewed, home, topo), skewed, 2, topo, COST, home).moe_us
