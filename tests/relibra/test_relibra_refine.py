"""The exact descent on the placement floor: its objective is the cost model's floor plus migration, its incremental
evaluation agrees with the full one, and with every swap screened it stops only in a swap-local optimum."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from relibra.config import RelibraConfig
from relibra.cost_model import NUM_ALLTOALLS, CostModel, placement_floor_us
from relibra.plan import Topology, static_home_LE
from relibra.planners.refine import _Descent, floor_objective_L, refine_home, screen_width
from relibra.planners.reorder import ReorderWeights, reorder_problem
from relibra.synthetic import SyntheticLoads, generate_loads

COST = CostModel.from_yaml()


def _problem(G: int, Q: int, E: int, seed: int = 0, M: int = 3, L: int = 3, routing: str = "direct"):
    loads = generate_loads(
        SyntheticLoads(num_steps=1, num_microbatches=M, num_layers=L, num_source_ranks=G, num_experts=E, topk=2,
                       tokens_per_rank=96, group_size=2, seed=seed)
    ).loads_NMLSE[0]  # fmt: skip
    topo = Topology(G, Q, E, 2)
    rng = np.random.default_rng(seed)
    prev = rng.permuted(static_home_LE(L, topo), axis=1)
    home = rng.permuted(static_home_LE(L, topo), axis=1)
    cost = dataclasses.replace(COST, nic_routing=routing)
    prob = reorder_problem(loads, prev, topo, ReorderWeights.from_config(RelibraConfig(), cost, topo))
    return loads, topo, prev, home, prob


def _swapped(home_LE: np.ndarray, layer: int, e1: int, e2: int) -> np.ndarray:
    out = home_LE.copy()
    out[layer, e1], out[layer, e2] = home_LE[layer, e2], home_LE[layer, e1]
    return out


ROUTED = [(8, 4, "direct"), (12, 4, "direct"), (8, 4, "pxn"), (12, 4, "pxn"), (16, 4, "pxn")]


@pytest.mark.parametrize("G, Q, routing", ROUTED)
def test_objective_is_the_placement_floor_plus_migration(G, Q, routing):
    loads, topo, prev, home, prob = _problem(G, Q, E=2 * G, routing=routing)
    F = floor_objective_L(prob, home).sum()
    latency = NUM_ALLTOALLS * COST.alltoall_latency_us * (loads.sum(axis=(2, 3)) > 0).sum()
    node = np.arange(G) // Q
    per_expert = COST.exposed_migration_bytes_per_expert(1.0)  # _problem's weights count all of the state
    moved = home != prev
    same_node = node[home] == node[prev]
    migration = (moved & ~same_node).sum() * COST.nic_us(per_expert) / G
    migration += (moved & same_node).sum() * COST.nvlink_us(per_expert) / G
    want = placement_floor_us(loads, home, topo, dataclasses.replace(COST, nic_routing=routing)) - latency
    want += migration
    assert want == pytest.approx(F, rel=1e-9)


@pytest.mark.parametrize("G, Q, routing", ROUTED)
def test_incremental_deltas_and_updates_match_full_evaluation(G, Q, routing):
    _loads, _topo, _prev, home, prob = _problem(G, Q, E=2 * G, seed=1, routing=routing)
    state = _Descent(prob, home)
    act = np.arange(home.shape[0])
    rng = np.random.default_rng(2)
    for _ in range(4):
        screen = state.candidates(act, top_k=3)
        e1, e2, pair_C = screen.e1, screen.e2, screen.pair_C
        delta = state.evaluate(act, screen)
        before = floor_objective_L(prob, state.home_LE)
        for layer in act:
            for c in range(e1.shape[1]):
                assert state.home_LE[layer, e1[layer, c]] // Q == state.first[pair_C[c]]
                assert state.home_LE[layer, e2[layer, c]] // Q == state.second[pair_C[c]]
                trial = _swapped(state.home_LE, layer, e1[layer, c], e2[layer, c])
                want = floor_objective_L(prob, trial)[layer] - before[layer]
                assert delta[layer, c] == pytest.approx(want, rel=1e-9, abs=1e-6)
        picks = rng.integers(0, e1.shape[1], size=len(act))
        state.apply(act, e1[act, picks], e2[act, picks], pair_C[picks])
        fresh = _Descent(prob, state.home_LE)
        for name in ("NL", "RC", "SD") + (("SZ", "RL") if routing == "pxn" else ()):
            np.testing.assert_allclose(getattr(state, name), getattr(fresh, name), atol=1e-6)


@pytest.mark.parametrize(
    "G, Q, seed, routing", [(4, 2, 0, "direct"), (4, 2, 1, "direct"), (6, 2, 2, "direct"), (6, 2, 3, "pxn")]
)
def test_descent_with_every_swap_screened_ends_in_a_swap_local_optimum(G, Q, seed, routing):
    E = 2 * G
    _loads, _topo, _prev, home, prob = _problem(G, Q, E, seed=seed, M=4, L=2, routing=routing)
    start = floor_objective_L(prob, home)
    # E^2 candidates cover every node pair's (E / Z)^2 swaps: every swap is screened
    assert screen_width(E * E, G // Q, E) == E // (G // Q)
    got = refine_home(prob, home, max_rounds=200, num_candidates=E * E)
    final = floor_objective_L(prob, got)
    assert (final <= start + 1e-9).all()
    assert (final < start - 1e-9).any()  # the random start is not already optimal
    np.testing.assert_array_equal(np.sort(np.bincount(got[0], minlength=G)), np.full(G, E // G))
    node = got // Q
    for layer in range(got.shape[0]):
        for e1, e2 in itertools.combinations(range(E), 2):
            if node[layer, e1] != node[layer, e2]:
                trial = floor_objective_L(prob, _swapped(got, layer, e1, e2))[layer]
                assert trial >= final[layer] - 1e-9 * abs(final[layer])


def test_one_node_or_no_rounds_leave_the_placement():
    _loads, _topo, _prev, home, prob = _problem(4, 4, 8)
    np.testing.assert_array_equal(refine_home(prob, home, 10, 4), home)
    _loads, _topo, _prev, home, prob = _problem(8, 4, 16)
    np.testing.assert_array_equal(refine_home(prob, home, 0, 4), home)
    np.testing.assert_array_equal(refine_home(prob, home, 10, 0), home)


@pytest.mark.parametrize(
    "budget, Z, E, want",
    [(128, 2, 128, 11), (128, 4, 128, 4), (256, 4, 128, 6), (1, 4, 128, 1), (10**6, 4, 128, 32), (0, 4, 128, 0),
     (128, 1, 128, 0)],
)  # fmt: skip
def test_screen_width_fits_the_candidate_budget(budget, Z, E, want):
    k = screen_width(budget, Z, E)
    assert k == want
    pairs = Z * (Z - 1) // 2
    if 0 < k < E // Z and budget >= pairs:  # the widest screen within the budget
        assert pairs * k * k <= budget < pairs * (k + 1) ** 2
