"""The executor's pure parts: reroute (torch) against relibra.plan.reroute, gate-probability gradients,
replica exchanges and migration moves against brute force, the plan check."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_executor_workers as W

from relibra.executor.reroute import permute_routing, reroute_routing
from relibra.executor.tables import (
    check_plan,
    migration_moves,
    replica_exchanges,
    reroute_tables,
)
from relibra.plan import Plan, Topology, reroute
from relibra.validate import PlanError


def _case(seed: int, num_tokens: int = 12, topo: Topology | None = None):
    rng = np.random.default_rng(seed)
    topo = topo or Topology(num_gpus=4, gpus_per_node=2, num_experts=8, num_replica_slots=2)
    M, L, K = 2, 3, 2
    ids_MLSTK = np.stack(
        [
            np.stack(
                [
                    np.stack([rng.choice(topo.num_experts, K, replace=False) for _ in range(num_tokens)])
                    for _ in range(topo.num_gpus)
                ]
            )
            for _ in range(M * L)
        ]
    ).reshape(M, L, topo.num_gpus, num_tokens, K)
    loads = np.zeros((M, L, topo.num_gpus, topo.num_experts), dtype=np.int64)
    for idx in np.ndindex(M, L, topo.num_gpus):
        loads[idx] = np.bincount(ids_MLSTK[idx].reshape(-1), minlength=topo.num_experts)
    plan = W.random_plan(loads, topo, rng, replicas=True)
    return topo, plan, loads, ids_MLSTK


def _dense(ids_TK: np.ndarray, num_experts: int, probs_TK: torch.Tensor):
    T = ids_TK.shape[0]
    idx = torch.as_tensor(ids_TK)
    routing = torch.zeros(T, num_experts, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.zeros(T, num_experts, dtype=probs_TK.dtype).scatter(1, idx, probs_TK)
    return probs, routing


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reroute_follows_the_reference_mapping(seed):
    topo, plan, loads, ids = _case(seed)
    check_plan(plan, loads, topo, num_layers=3)
    P = topo.num_gpus * topo.num_slots
    for s in range(topo.num_gpus):
        inst, cum = reroute_tables(plan, topo, s, [0, 1, 2])
        for m, layer in np.ndindex(2, 3):
            want_TK = reroute(plan, m, layer, s, ids[m, layer, s])
            probs_TK = torch.rand(ids.shape[3], ids.shape[4], dtype=torch.float64)
            probs, routing = _dense(ids[m, layer, s], topo.num_experts, probs_TK)
            got_p, got_map = reroute_routing(
                probs, routing, torch.as_tensor(inst[m, layer]), torch.as_tensor(cum[m, layer]), P
            )
            want_p, want_map = _dense(want_TK, P, probs_TK)
            assert torch.equal(got_map, want_map)
            assert torch.equal(got_p, want_p)


def test_reroute_keeps_gate_gradients_and_sends_extra_pairs_home():
    topo, plan, _loads, ids = _case(5)
    P = topo.num_gpus * topo.num_slots
    inst, cum = reroute_tables(plan, topo, 1, [0])
    # Twice the tokens the plan knows about: every pair past the quotas must land on the owner's home slot.
    ids_TK = np.concatenate([ids[0, 0, 1], ids[0, 0, 1]])
    logits = torch.randn(ids_TK.shape[0], topo.num_experts, dtype=torch.float64, requires_grad=True)
    probs_all = torch.softmax(logits, dim=-1)
    routing = torch.zeros_like(probs_all, dtype=torch.bool).scatter_(1, torch.as_tensor(ids_TK), True)
    probs = probs_all * routing
    got_p, got_map = reroute_routing(
        probs, routing, torch.as_tensor(inst[0, 0]), torch.as_tensor(cum[0, 0]), P
    )
    half = ids_TK.shape[0] // 2
    p2l = plan.phys2log(0, 0)
    owner = {
        int(plan.slots_MLGJ[0, 0, g, j]): g * topo.num_slots + j
        for g in range(4)
        for j in range(topo.num_home_slots)
    }
    for t in range(half, ids_TK.shape[0]):
        assert sorted(np.flatnonzero(got_map[t].numpy()).tolist()) == sorted(owner[int(e)] for e in ids_TK[t])
    assert (p2l[np.flatnonzero(got_map.any(0).numpy())] >= 0).all()
    # Gradients: d(sum w * probs_NP) / d logits equals d(sum w[phys] * probs_NE) / d logits.
    w = torch.randn(P, dtype=torch.float64)
    (g_got,) = torch.autograd.grad((got_p * w).sum(), logits, retain_graph=True)
    phys_of = torch.zeros_like(probs, dtype=torch.long)
    phys_of[got_map.nonzero()[:, 0], torch.as_tensor(p2l)[got_map.nonzero()[:, 1]]] = got_map.nonzero()[:, 1]
    (g_want,) = torch.autograd.grad((probs * w[phys_of] * routing).sum(), logits)
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=1e-15)


def test_permute_routing_is_a_column_permutation():
    perm = torch.tensor([3, 1, 0, 2])
    probs = torch.rand(5, 4)
    routing = probs > 0.5
    p, r = permute_routing(probs, routing, perm)
    assert torch.equal(p, probs[:, perm]) and torch.equal(r, routing[:, perm])


def test_replica_exchanges_match_the_slots():
    topo, plan, _loads, _ids = _case(3)
    H = topo.num_home_slots
    ex = [replica_exchanges(plan, topo, g, [0, 1, 2]) for g in range(topo.num_gpus)]
    for m, li in np.ndindex(2, 3):
        sent = sorted(
            (g, peer, plan.slots_MLGJ[m, li, g, j]) for g in range(4) for peer, j in ex[g][m][li].sends
        )
        got = sorted(
            (owner, g, plan.slots_MLGJ[m, li, g, H + r]) for g in range(4) for owner, r in ex[g][m][li].recvs
        )
        want = sorted(
            (int(plan.home_LE[li, e]), g, e)
            for g in range(4)
            for e in plan.slots_MLGJ[m, li, g, H:]
            if e >= 0
        )
        assert got == want
        assert sent == want


def test_migration_moves_reach_the_new_placement():
    rng = np.random.default_rng(0)
    old = rng.permutation(12).reshape(3, 4)
    new = rng.permutation(12).reshape(3, 4)
    result = np.full_like(old, -1)
    for g in range(3):
        mv = migration_moves(old, new, g)
        for j, jo in mv.local:
            result[g, j] = old[g, jo]
        for peer, j in mv.recvs:
            sent = [jo for dst, jo in migration_moves(old, new, peer).sends if dst == g]
            k = [jj for pp, jj in mv.recvs if pp == peer].index(j)
            result[g, j] = old[peer, sent[k]]
    assert np.array_equal(result, new)
    assert migration_moves(old, old, 1).identity
    with pytest.raises(ValueError, match="same experts"):
        migration_moves(old, np.zeros_like(old), 0)


def test_check_plan_refuses_broken_plans():
    topo, plan, loads, _ = _case(4)
    check_plan(plan, loads, topo, num_layers=3, num_microbatches=2)
    with pytest.raises(PlanError, match="MoE layers"):
        check_plan(plan, loads, topo, num_layers=4)
    with pytest.raises(PlanError, match="micro-batches"):
        check_plan(plan, loads, topo, num_layers=3, num_microbatches=3)
    cross = Topology(num_gpus=4, gpus_per_node=1, num_experts=8, num_replica_slots=2)
    with pytest.raises(PlanError, match="node"):
        check_plan(plan, loads, cross, num_layers=3)
    fewer = Topology(num_gpus=4, gpus_per_node=2, num_experts=8, num_replica_slots=1)
    with pytest.raises(PlanError, match="shape"):
        check_plan(plan, loads, fewer, num_layers=3)
    slots = plan.slots_MLGJ.copy()
    slots[0, 0, 1, 0] = slots[0, 0, 0, 0]  # one expert in two home slots
    two = Plan(plan.home_LE, slots, plan.quota_MLGJS, plan.num_home_slots)
    with pytest.raises(PlanError):
        check_plan(two, loads, topo, num_layers=3)
