"""Cost model: YAML loading, t_gemm, the step-time simulation against loop references, the ideal closed form."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel, ideal_step_cost, moe_lower_bound_us, placement_floor_us, step_cost
from relibra.loads import LoadTrace
from relibra.plan import PlannerState, Topology, static_home_LE
from relibra.planners import PlanContext, run_planner
from relibra.planners.base import home_plan
from relibra.simulate import simulate_trace
from relibra.synthetic import SyntheticLoads, generate_loads

COST = CostModel.from_yaml()


def test_defaults_and_yaml_errors(tmp_path):
    assert COST.hidden_size == 2048 and COST.gemm_tile == 64 and COST.nic_gb_per_s == 50.0
    assert COST.expert_params == 3 * 2048 * 768
    (tmp_path / "bad.yaml").write_text("hidden_size: 1\nnot_a_key: 3\n")
    with pytest.raises(ValueError, match="unknown cost-model keys"):
        CostModel.from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "short.yaml").write_text("hidden_size: 1\n")
    with pytest.raises(ValueError, match="missing"):
        CostModel.from_yaml(tmp_path / "short.yaml")
    with pytest.raises(ValueError, match="non-negative"):
        dataclasses.replace(COST, nic_gb_per_s=-1.0)
    with pytest.raises(ValueError, match="true or false"):
        dataclasses.replace(COST, overlap_optimizer_state=1)
    with pytest.raises(ValueError, match="nic_routing must be one of"):
        dataclasses.replace(COST, nic_routing="rail")
    assert COST.overlap_optimizer_state  # what relibra.executor does
    assert COST.nic_routing == "direct"  # the spec's accounting


def test_gemm_formula():
    a, b, tile = COST.gemm_us_per_token, COST.gemm_us_fixed, COST.gemm_tile
    got = COST.gemm_us(np.array([0, 1, 64, 65, 1000]))
    want = [0.0, a * tile + b, a * tile + b, 2 * a * tile + b, a * tile * math.ceil(1000 / tile) + b]
    np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(
        COST.train_gemm_us(np.array([65])), (1 + COST.backward_factor) * (2 * a * tile + b)
    )


def test_other_expert_shape_scales_gemm_time_and_transfers():
    # Mixtral 8x7B's experts do 4096 x 14336 / (2048 x 768) = 37.33x the work and weight bytes of Qwen3-30B-A3B's.
    mixtral = COST.for_expert_shape(4096, 14336)
    r = 4096 * 14336 / (2048 * 768)
    n = np.array([0, 1, 64, 1000])
    want = COST.gemm_us_per_token * r * COST.gemm_tile * -(-n // COST.gemm_tile) + COST.gemm_us_fixed * r * (
        n > 0
    )
    np.testing.assert_allclose(mixtral.gemm_us(n), want)
    assert mixtral.expert_params == 3 * 4096 * 14336 and mixtral.pair_bytes == 4096 * COST.activation_bytes
    assert (
        mixtral.nic_gb_per_s == COST.nic_gb_per_s
        and mixtral.attention_us_per_token == COST.attention_us_per_token
    )
    assert COST.for_expert_shape(COST.hidden_size, COST.expert_ffn_hidden_size) == COST
    with pytest.raises(ValueError, match="expert shape must be positive"):
        COST.for_expert_shape(0, 768)


def _setup(num_nodes: int):
    G = 4 * num_nodes
    params = SyntheticLoads(
        num_steps=2, num_microbatches=3, num_layers=2, num_source_ranks=G, num_experts=2 * G, topk=4,
        tokens_per_rank=768, group_size=4,
    )  # fmt: skip
    trace = generate_loads(params)
    topo = Topology(G, 4, 2 * G, 2)
    ctx = PlanContext(topo, RelibraConfig(min_replica_tokens=32), COST, 4)
    plan, _ = run_planner("relibra", trace.loads_NMLSE[0], ctx, PlannerState())
    assert (plan.slots_MLGJ[..., 2:] >= 0).any()
    return trace, topo, plan


@pytest.fixture(scope="module")
def setup():
    return _setup(2)


@pytest.fixture(scope="module")
def setup3():
    """Three nodes: with pxn routing a node's sends spread over its NICs by the receivers' local index, which two
    nodes cannot tell apart from direct routing."""
    return _setup(3)


def _reference_step(plan, loads, topk, topo, cost, prev_home):
    """Loop implementation of the cost model (module docstring of relibra.cost_model)."""
    M, L, S, _ = loads.shape
    G, J, H, Q = topo.num_gpus, topo.num_slots, topo.num_home_slots, topo.node_size
    node = [g // Q for g in range(G)]
    pb = cost.hidden_size * cost.activation_bytes
    attn = [[cost.attention_us_per_token * loads[m, 0, s].sum() / topk for s in range(S)] for m in range(M)]
    w_bytes = cost.expert_params * cost.weight_bytes_per_param
    g_bytes = cost.expert_params * cost.grad_bytes_per_param
    compute = alltoall = replication = cross_bytes = 0.0
    for m in range(M):
        for layer in range(L):
            per_gpu = []
            for g in range(G):
                t = 0.0
                for j in range(J):
                    n = int(plan.quota_MLGJS[m, layer, g, j].sum())
                    if n:
                        t += (1 + cost.backward_factor) * (
                            cost.gemm_us_per_token * cost.gemm_tile * math.ceil(n / cost.gemm_tile)
                            + cost.gemm_us_fixed
                        )
                per_gpu.append(t)
            compute += max(per_gpu)
            # Source -> expert GPU and back, each twice (forward and backward).
            for way in ("dispatch", "combine"):
                nic = np.zeros((2, G))  # [out, in]
                nvl = np.zeros((2, G))
                for g in range(G):
                    for s in range(S):
                        n = plan.quota_MLGJS[m, layer, g, :, s].sum() * pb
                        a, b = (s, g) if way == "dispatch" else (g, s)
                        if a == b:
                            continue
                        if node[a] == node[b]:
                            nvl[0, a] += n
                            nvl[1, b] += n
                            continue
                        if way == "dispatch":
                            cross_bytes += 4 * n
                        exit_gpu = a if cost.nic_routing == "direct" else node[a] * Q + b % Q
                        nic[0, exit_gpu] += n
                        nic[1, b] += n
                        if exit_gpu != a:  # pxn: over NVLink to the GPU of the NIC first
                            nvl[0, a] += n
                            nvl[1, exit_gpu] += n
                t = max(nic.max() / (cost.nic_gb_per_s * 1e3), nvl.max() / (cost.nvlink_gb_per_s * 1e3))
                alltoall += 2 * (t + cost.alltoall_latency_us)
            copies = np.zeros(G)
            outgoing = np.zeros(G)
            for g in range(G):
                for j in range(H, J):
                    e = plan.slots_MLGJ[m, layer, g, j]
                    if e >= 0:
                        copies[g] += 1
                        outgoing[plan.home_LE[layer, e]] += 1
            fwd = bwd = 0.0
            for g in range(G):
                c = max(copies[g], outgoing[g])
                if c:
                    lat = cost.transfer_latency_us
                    fwd = max(fwd, lat + c * w_bytes / (cost.nvlink_gb_per_s * 1e3) - attn[m][g])
                    bwd = max(bwd, lat + c * (w_bytes + g_bytes) / (cost.nvlink_gb_per_s * 1e3)
                              - cost.backward_factor * attn[m][g])  # fmt: skip
            replication += fwd + bwd

    def transfer(per_expert: float) -> float:
        sent, recv = np.zeros((2, G)), np.zeros((2, G))
        moved = False
        for layer in range(L):
            for e in range(plan.num_experts):
                a, b = prev_home[layer, e], plan.home_LE[layer, e]
                if a != b:
                    moved = True
                    if node[a] == node[b]:  # [0]: NIC, [1]: NVLink
                        sent[1, a] += per_expert
                        recv[1, b] += per_expert
                        continue
                    exit_gpu = a if cost.nic_routing == "direct" else node[a] * Q + b % Q
                    sent[0, exit_gpu] += per_expert
                    recv[0, b] += per_expert
                    if exit_gpu != a:
                        sent[1, a] += per_expert
                        recv[1, exit_gpu] += per_expert
        if not moved:
            return 0.0
        return (
            max(
                max(sent[0].max(), recv[0].max()) / (cost.nic_gb_per_s * 1e3),
                max(sent[1].max(), recv[1].max()) / (cost.nvlink_gb_per_s * 1e3),
            )
            + cost.transfer_latency_us
        )

    weights = cost.expert_params * cost.weight_bytes_per_param
    state = (
        cost.expert_params
        * (cost.optimizer_bytes_per_param - cost.weight_bytes_per_param)
        / cost.optimizer_shards
    )
    non_moe = sum(L * (1 + cost.backward_factor) * max(attn[m]) for m in range(M))
    if (
        cost.overlap_optimizer_state
    ):  # the state travels during the step, sharing the links with the all-to-alls
        span = alltoall + compute + non_moe
        t = transfer(state)
        migration = transfer(weights) + alltoall / span * min(t, span) + max(0.0, t - span)
    else:
        migration = transfer(weights + state)
    return compute, alltoall, replication, migration, non_moe, cross_bytes


@pytest.mark.parametrize(
    ("attention", "overlap", "shards", "routing", "nodes"),
    [
        (0.15, True, 1, "direct", 2),
        (0.0, True, 1, "direct", 2),
        (0.15, False, 1, "direct", 2),
        (0.15, True, 4, "direct", 2),
        (0.15, True, 1, "direct", 3),
        (0.15, True, 1, "pxn", 3),
        (0.0, False, 1, "pxn", 2),
    ],
)
def test_step_cost_matches_loops(setup, setup3, attention, overlap, shards, routing, nodes):
    trace, topo, plan = setup if nodes == 2 else setup3
    cost = dataclasses.replace(  # attention 0: every push is exposed
        COST,
        attention_us_per_token=attention,
        overlap_optimizer_state=overlap,
        optimizer_shards=shards,
        nic_routing=routing,
    )
    loads = trace.loads_NMLSE[0]
    prev = np.random.default_rng(0).permuted(static_home_LE(2, topo), axis=1)
    got = step_cost(plan, loads, 4, topo, cost, prev)
    want = _reference_step(plan, loads, 4, topo, cost, prev)
    np.testing.assert_allclose(
        [
            got.compute_us,
            got.alltoall_us,
            got.replication_us,
            got.migration_us,
            got.non_moe_us,
            got.cross_node_bytes,
        ],
        want,
        rtol=1e-9,
    )
    if attention == 0.0:
        assert got.replication_us > 0
    if nodes == 3:  # the routing matters with three nodes
        other = dataclasses.replace(cost, nic_routing="pxn" if routing == "direct" else "direct")
        assert step_cost(plan, loads, 4, topo, other, prev).alltoall_us != pytest.approx(got.alltoall_us)


def test_migration_state_is_exposed_where_it_meets_the_alltoalls(setup):
    """One expert moves across nodes: the step waits for its weights, and for its optimizer state as far as the
    transfer, spread over the step, meets the all-to-alls or outlasts the step (or, without the overlap, for
    everything: the paper's accounting)."""
    trace, topo, plan = setup
    loads = trace.loads_NMLSE[0]
    prev = plan.home_LE.copy()
    a = int(np.flatnonzero(topo.node_of_gpu()[prev[0]] == 0)[0])  # an expert of node 0 and one of node 1
    b = int(np.flatnonzero(topo.node_of_gpu()[prev[0]] == 1)[0])
    prev[0, [a, b]] = prev[0, [b, a]]
    lat = COST.transfer_latency_us
    shares = []
    for state_bytes, slow in ((12, 1.0), (12, 1e3), (12_000, 1.0)):  # default; compute-heavy; a huge state
        cost = dataclasses.replace(
            COST,
            gemm_us_per_token=COST.gemm_us_per_token * slow,
            optimizer_bytes_per_param=COST.weight_bytes_per_param + state_bytes,
        )
        weights = cost.expert_params * cost.weight_bytes_per_param / (cost.nic_gb_per_s * 1e3) + lat
        state = cost.expert_params * state_bytes / (cost.nic_gb_per_s * 1e3) + lat
        got = step_cost(plan, loads, 4, topo, cost, prev)
        span = got.alltoall_us + got.compute_us + got.non_moe_us
        share = got.alltoall_us / span
        assert got.alltoall_share == pytest.approx(share, rel=1e-12)
        want = weights + share * min(state, span) + max(0.0, state - span)
        assert got.migration_us == pytest.approx(want, rel=1e-12)
        assert (state > span) == (state_bytes > 12)  # the huge state outlasts the step
        paper = step_cost(
            plan, loads, 4, topo, dataclasses.replace(cost, overlap_optimizer_state=False), prev
        )
        assert paper.migration_us == pytest.approx(
            cost.expert_params * (2 + state_bytes) / (cost.nic_gb_per_s * 1e3) + lat, rel=1e-12
        )
        assert got.migration_us < paper.migration_us
        shares.append(share)
    assert shares[1] < shares[0] / 10  # longer compute: less of the state meets an all-to-all


@pytest.mark.parametrize("routing", ["direct", "pxn"])
def test_ideal_step_time_equals_closed_form(setup3, routing):
    trace, topo, _ = setup3
    cost = dataclasses.replace(COST, nic_routing=routing, nvlink_gb_per_s=COST.nic_gb_per_s)  # NVLink binds
    G, Q = topo.num_gpus, topo.node_size
    pb = COST.hidden_size * COST.activation_bytes
    want = 0.0
    for n in range(trace.num_steps):
        for m in range(trace.loads_NMLSE.shape[1]):
            for layer in range(trace.num_layers):
                W = trace.loads_NMLSE[n, m, layer].sum(axis=0)
                P = W.sum()
                compute = sum((1 + COST.backward_factor) * COST.gemm_us(np.array(w)) for w in W) / G
                nic = P / G * (G - Q) / G * pb / (cost.nic_gb_per_s * 1e3)
                # Uniform traffic: P / G^2 pairs between every two GPUs; with pxn a GPU also relays, over NVLink,
                # what its node's other GPUs send to its rail in the other nodes.
                to_peers = P / G**2 * (Q - 1)
                relayed = P / G**2 * (Q - 1) * (G - Q) / Q if routing == "pxn" else 0.0
                nvl = (to_peers + relayed) * pb / (cost.nvlink_gb_per_s * 1e3)
                want += compute + 4 * (max(nic, nvl) + cost.alltoall_latency_us)
    direct = sum(ideal_step_cost(trace.loads_NMLSE[n], 4, topo, cost).moe_us for n in range(trace.num_steps))
    assert direct == pytest.approx(want, rel=1e-12)
    rows = simulate_trace(trace, topo, RelibraConfig(), cost, plans=["ideal"])
    assert rows[0].moe_us == pytest.approx(want, rel=1e-12)
    assert rows[0].moe_vs_ideal == pytest.approx(1.0)
    assert rows[0].mean_skew == 1.0


def test_ideal_is_a_lower_bound_of_compute(setup):
    """No plan computes faster than the ideal (tile padding and fixed costs only grow when an expert is split)."""
    trace, topo, _plan = setup
    loads = trace.loads_NMLSE[0]
    ideal = ideal_step_cost(loads, 4, topo, COST)
    for name in ("static", "relibra", "eplb_oracle"):
        p, _ = run_planner(name, loads, PlanContext(topo, RelibraConfig(), COST, 4), PlannerState())
        assert (
            step_cost(p, loads, 4, topo, COST, static_home_LE(2, topo)).compute_us >= ideal.compute_us - 1e-9
        )


def test_trace_with_one_node_has_no_cross_traffic():
    trace = generate_loads(SyntheticLoads(num_steps=1, num_microbatches=2, num_layers=1, num_source_ranks=4,
                                          num_experts=8, topk=2, tokens_per_rank=64))  # fmt: skip
    topo = Topology(4, 8, 8, 1)
    rows = simulate_trace(
        LoadTrace(trace.loads_NMLSE, 2), topo, RelibraConfig(), COST, plans=["static", "ideal"]
    )
    assert all(r.cross_node_gb_per_step == 0 for r in rows)


@pytest.mark.parametrize(
    ("attention", "routing"), [(0.15, "direct"), (0.0, "direct"), (0.15, "pxn"), (0.0, "pxn")]
)
def test_lower_bound_holds_for_relibra_style_plans(setup3, attention, routing):
    """Every plan whose copies stay in the owner's node costs at least the bound, replicas exposed or hidden."""
    trace, topo, _plan = setup3
    cost = dataclasses.replace(COST, attention_us_per_token=attention, nic_routing=routing)
    ctx = PlanContext(topo, RelibraConfig(min_replica_tokens=32), cost, 4)
    for n in range(trace.num_steps):
        loads = trace.loads_NMLSE[n]
        bound = moe_lower_bound_us(loads, 4, topo, cost)
        assert bound > 0
        for name in ("static", "greedy_lpt", "reorder_only", "replicate_only", "relibra"):
            plan, _ = run_planner(name, loads, ctx, PlannerState())
            moe = step_cost(plan, loads, 4, topo, cost, plan.home_LE).moe_us  # no migration
            assert moe >= bound - 1e-9, name


@functools.cache
def _placements(E: int, G: int) -> np.ndarray:
    """[P, E]: every distinct assignment of E experts to G GPUs with E / G experts each."""
    seen = set()
    for perm in itertools.permutations(range(E)):
        home = np.empty(E, dtype=int)
        home[list(perm)] = np.repeat(np.arange(G), E // G)
        seen.add(tuple(home))
    return np.array(sorted(seen))


@pytest.mark.parametrize("routing", ["direct", "pxn"])
def test_lower_bound_against_every_placement(routing):
    """Brute force: 8 experts on 4 GPUs in 2 nodes, one micro-batch with a hot expert; with pushes that cannot hide
    (no attention window) copies never pay, so the best placement without copies is the optimum; the bound must
    stay below it without being vacuous."""
    rng = np.random.default_rng(0)
    topo = Topology(4, 2, 8, 0)
    cost = dataclasses.replace(COST, attention_us_per_token=0.0, nic_routing=routing)
    for trial in range(3):
        loads = rng.integers(0, 40, size=(1, 1, 4, 8))
        loads[0, 0, :, trial] += 300  # one hot expert: its GEMM and its far pairs bound every placement
        bound = moe_lower_bound_us(loads, 1, topo, cost)
        best = min(
            step_cost(home_plan(loads, h[None], topo), loads, 1, topo, cost, h[None]).moe_us
            for h in _placements(8, 4)
        )
        assert bound <= best + 1e-9
        assert bound >= 0.75 * best  # measured 0.80-0.82: the bound ignores the send side and NVLink


@pytest.mark.parametrize(
    ("attention", "routing"), [(0.15, "direct"), (0.0, "direct"), (0.15, "pxn"), (0.0, "pxn")]
)
def test_placement_floor_holds_for_every_in_node_plan_on_its_placement(setup3, attention, routing):
    trace, topo, _plan = setup3
    cost = dataclasses.replace(COST, attention_us_per_token=attention, nic_routing=routing)
    ctx = PlanContext(topo, RelibraConfig(min_replica_tokens=32), cost, 4)
    loads = trace.loads_NMLSE[0]
    for name in ("static", "greedy_lpt", "reorder_only", "replicate_only", "relibra"):
        plan, _ = run_planner(name, loads, ctx, PlannerState())
        floor = placement_floor_us(loads, plan.home_LE, topo, cost)
        moe = step_cost(plan, loads, 4, topo, cost, plan.home_LE).moe_us  # no migration
        assert 0 < floor <= moe + 1e-9, name
    # Replicas can only approach the floor of the placement they sit on: relibra's plan beats the bare placement.
    relibra, _ = run_planner("relibra", loads, ctx, PlannerState())
    bare = step_cost(home_plan(loads, relibra.home_LE, topo), loads, 4, topo, cost, relibra.home_LE).moe_us
    assert placement_floor_us(loads, relibra.home_LE, topo, cost) < bare


@pytest.mark.parametrize("routing", ["direct", "pxn"])
def test_placement_floor_is_exact_without_copies_and_tiles(routing):
    """One GPU per node (no copy can exist), tile 1 and no fixed GEMM cost: the floor is the plan's MoE time."""
    trace = generate_loads(SyntheticLoads(num_steps=1, num_microbatches=3, num_layers=2, num_source_ranks=4,
                                          num_experts=8, topk=2, tokens_per_rank=50))  # fmt: skip
    loads = trace.loads_NMLSE[0]
    topo = Topology(4, 1, 8, 2)
    cost = dataclasses.replace(COST, gemm_tile=1, gemm_us_fixed=0.0, nic_routing=routing)
    home = np.random.default_rng(0).permuted(static_home_LE(2, topo), axis=1)
    moe = step_cost(home_plan(loads, home, topo), loads, 2, topo, cost, home).moe_us
    assert placement_floor_us(loads, home, topo, cost) == pytest.approx(moe, rel=1e-12)
