"""The plan validator catches every broken rule; reroute follows the quotas; served tokens add up to the loads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel
from relibra.plan import Plan, PlannerState, Topology, home_slots_LGH, reroute, static_home_LE
from relibra.planners import PlanContext, run_planner
from relibra.synthetic import SyntheticLoads, generate_loads
from relibra.validate import PlanError, validate_plan

TOPO = Topology(num_gpus=8, gpus_per_node=4, num_experts=16, num_replica_slots=2)


@pytest.fixture(scope="module")
def loads_MLSE():
    params = SyntheticLoads(
        num_steps=1,
        num_microbatches=3,
        num_layers=2,
        num_source_ranks=8,
        num_experts=16,
        topk=4,
        tokens_per_rank=256,
    )
    return generate_loads(params).loads_NMLSE[0]


@pytest.fixture(scope="module")
def relibra_plan(loads_MLSE):
    ctx = PlanContext(TOPO, RelibraConfig(min_replica_tokens=16), CostModel.from_yaml(), topk=4)
    plan, _ = run_planner("relibra", loads_MLSE, ctx, PlannerState())
    assert (plan.slots_MLGJ[..., TOPO.num_home_slots :] >= 0).any(), "the fixture must exercise replicas"
    return plan


def _copy(plan: Plan, **arrays) -> Plan:
    fields = {k: np.array(v, copy=True) for k, v in arrays.items()}
    return dataclasses.replace(plan, **fields)


def test_valid_plan_passes_and_served_adds_up(relibra_plan, loads_MLSE):
    validate_plan(relibra_plan, loads_MLSE, TOPO)
    served = relibra_plan.served_MLGE()
    np.testing.assert_array_equal(served.sum(axis=2), loads_MLSE.sum(axis=2))


def test_quota_mismatch(relibra_plan, loads_MLSE):
    quota = np.array(relibra_plan.quota_MLGJS)
    quota[0, 0, 0, 0, 0] += 1
    with pytest.raises(PlanError, match="add up"):
        validate_plan(_copy(relibra_plan, quota_MLGJS=quota), loads_MLSE, TOPO)


def test_owner_counts(loads_MLSE):
    """GPU 0 owns H + 1 experts: the extra one (taken from GPU 1) sits in a replica slot of GPU 0."""
    H = TOPO.num_home_slots
    home = static_home_LE(2, TOPO)
    slots = np.full((3, 2, 8, H + 2), -1)
    slots[..., :H] = home_slots_LGH(home, TOPO)[None]
    quota = np.zeros(slots.shape + (8,), dtype=np.int64)
    quota[..., :H, :] = loads_MLSE.transpose(0, 1, 3, 2)[:, np.arange(2)[:, None, None], slots[0, :, :, :H]]
    e = H  # first expert of GPU 1
    home[:, e] = 0
    slots[:, :, 0, H] = e
    quota[:, :, 0, H] = quota[:, :, 1, 0]
    slots[:, :, 1, 0] = -1
    quota[:, :, 1, 0] = 0
    with pytest.raises(PlanError, match="exactly"):
        validate_plan(Plan(home, slots, quota, H), loads_MLSE, TOPO)


def test_replica_outside_node(loads_MLSE):
    H = TOPO.num_home_slots
    home = static_home_LE(2, TOPO)
    slots = np.full((3, 2, 8, H + 2), -1)
    slots[..., :H] = home_slots_LGH(home, TOPO)[None]
    quota = np.zeros(slots.shape + (8,), dtype=np.int64)
    quota[..., :H, :] = loads_MLSE.transpose(0, 1, 3, 2)[:, np.arange(2)[:, None, None], slots[0, :, :, :H]]
    plan = Plan(home, slots, quota, H)
    validate_plan(plan, loads_MLSE, TOPO)
    e = 0  # owned by GPU 0 on node 0; put a copy on GPU 5 (node 1) and move one pair there
    src = int(np.flatnonzero(loads_MLSE[0, 0, :, e])[0])
    slots[0, 0, 5, H] = e
    quota[0, 0, 5, H, src] = 1
    quota[0, 0, 0, 0, src] -= 1
    with pytest.raises(PlanError, match="outside its owner's node"):
        validate_plan(Plan(home, slots, quota, H), loads_MLSE, TOPO)
    slots[0, 0, 5, H] = -1
    with pytest.raises(PlanError, match="empty slot"):
        validate_plan(Plan(home, slots, quota, H), loads_MLSE, TOPO)


def test_duplicate_and_self_replica(relibra_plan, loads_MLSE):
    H = TOPO.num_home_slots
    slots = np.array(relibra_plan.slots_MLGJ)
    slots[0, 0, 0, H] = slots[0, 0, 0, 0]  # GPU 0 copies its own expert
    quota = np.array(relibra_plan.quota_MLGJS)
    quota[0, 0, 0, H] = 0
    with pytest.raises(PlanError, match="twice"):
        validate_plan(_copy(relibra_plan, slots_MLGJ=slots, quota_MLGJS=quota), loads_MLSE, TOPO)


def test_home_slot_order(relibra_plan, loads_MLSE):
    slots = np.array(relibra_plan.slots_MLGJ)
    quota = np.array(relibra_plan.quota_MLGJS)
    slots[:, :, 0, [0, 1]] = slots[:, :, 0, [1, 0]]
    quota[:, :, 0, [0, 1]] = quota[:, :, 0, [1, 0]]
    with pytest.raises(PlanError, match="ascending"):
        validate_plan(_copy(relibra_plan, slots_MLGJ=slots, quota_MLGJS=quota), loads_MLSE, TOPO)


def test_shape_errors(relibra_plan, loads_MLSE):
    with pytest.raises(PlanError, match="shape"):
        validate_plan(relibra_plan, loads_MLSE[:2], TOPO)


def test_reroute_follows_quotas(relibra_plan, loads_MLSE):
    rng = np.random.default_rng(0)
    plan, J = relibra_plan, TOPO.num_slots
    for m in range(loads_MLSE.shape[0]):
        for layer in range(loads_MLSE.shape[1]):
            for s in range(TOPO.num_gpus):
                counts = loads_MLSE[m, layer, s]
                # Build token routing with exactly these per-expert counts (distinct experts per token not needed).
                ids = rng.permutation(np.repeat(np.arange(TOPO.num_experts), counts)).reshape(-1, 4)
                phys = reroute(plan, m, layer, s, ids)
                phys2log = plan.phys2log(m, layer)
                np.testing.assert_array_equal(phys2log[phys], ids)  # same logical expert
                got = np.bincount(phys.reshape(-1), minlength=TOPO.num_gpus * J)
                np.testing.assert_array_equal(got, plan.quota_MLGJS[m, layer, :, :, s].reshape(-1))


def test_reroute_rejects_other_routing(relibra_plan):
    ids = np.zeros((3, 4), dtype=int)
    with pytest.raises(ValueError, match="pairs of expert"):
        reroute(relibra_plan, 0, 0, 0, ids)
