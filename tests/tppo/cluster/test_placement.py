"""Placement of the roles: the bundle layout for colocated and separate runs, reserving it on Ray (a layout the
cluster cannot hold is a clear error, not a hang), and generation split over several rollout workers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollout.params import SamplingParams
from tppo.cluster.config import ClusterConfig
from tppo.cluster.placement import layout, reserve
from tppo.cluster.roles import Rollout, share_by_cost, start_group
from tppo.cluster.session import ray_session


def test_colocated_ranks_share_bundles_and_split_each_gpu():
    plan = layout(ClusterConfig(gpus_per_node=4, policy_ranks=4, critic_ranks=2, rollout_workers=1))
    assert [b["GPU"] for b in plan.bundles] == [1.0] * 4
    assert [s.bundle for s in plan.seats["policy"]] == [0, 1, 2, 3]
    assert [s.bundle for s in plan.seats["critic"]] == [0, 1] and plan.seats["rollout"][0].bundle == 0
    for i in range(4):  # every bundle's GPU is handed out exactly once
        shares = [s.num_gpus for seats in plan.seats.values() for s in seats if s.bundle == i]
        assert sum(shares) == pytest.approx(1.0)
    assert plan.seats["policy"][0].num_gpus == pytest.approx(1 / 3)
    with_ref = layout(ClusterConfig(gpus_per_node=2, policy_ranks=2, critic_ranks=2), reference_ranks=2)
    assert [s.bundle for s in with_ref.seats["reference"]] == [0, 1]
    assert with_ref.seats["reference"][1].num_gpus == pytest.approx(1 / 3)  # policy, critic, reference


def test_separate_ranks_get_a_whole_gpu_each_and_cpu_runs_ask_for_none():
    plan = layout(ClusterConfig(gpus_per_node=8, placement="separate", policy_ranks=4, critic_ranks=2))
    seats = [s for role in ("policy", "critic", "rollout") for s in plan.seats[role]]
    assert [s.bundle for s in seats] == list(range(7)) and len(plan.bundles) == 7
    assert all(s.num_gpus == 1.0 for s in seats)
    cpu = layout(ClusterConfig(policy_ranks=2, critic_ranks=2))
    assert all("GPU" not in b for b in cpu.bundles)
    assert all(s.num_gpus == 0.0 for seats in cpu.seats.values() for s in seats)


@pytest.mark.dist
def test_reserving_more_than_the_cluster_has_is_a_clear_error():
    cluster = ClusterConfig(object_store_mb=100, cpus_per_node=2)
    with ray_session(cluster):
        with reserve(dataclasses.replace(cluster, policy_ranks=2, critic_ranks=2)) as placement:
            assert len(placement.layout.bundles) == 2
        too_big = dataclasses.replace(cluster, gpus_per_node=1, policy_ranks=2)
        with (
            pytest.raises(RuntimeError, match=r"need 2 bundles \(2 GPUs.*has 0 GPUs"),
            reserve(too_big, timeout_s=3),
        ):
            pass


class _Echo:
    def __init__(self, name: str) -> None:
        self.name, self.calls = name, 0

    def generate(self, prompts, params):
        self.calls += 1
        return [(self.name, p[0], q) for p, q in zip(prompts, params)]


@pytest.mark.parametrize(("workers", "requests"), [(1, 5), (3, 7), (4, 2)])
def test_generation_splits_over_workers_and_keeps_request_order(workers, requests):
    rollout = Rollout(start_group("rollout", _Echo, [(f"w{i}",) for i in range(workers)], remote=False))
    echoes = rollout.ranks.handles  # in-process: the workers themselves
    params = [SamplingParams(max_new_tokens=1 + i % 3, seed=i) for i in range(requests)]
    outs = rollout.generate([[i] for i in range(requests)], params)
    assert [(o[1], o[2]) for o in outs] == [(i, params[i]) for i in range(requests)]
    used = {o[0] for o in outs}
    assert len(used) == min(workers, requests)
    assert sum(e.calls for e in echoes) == workers  # in-process workers, one call each


def test_continuations_spread_over_the_engines_by_expected_tokens():
    """The pool puts continuations (long prefixes) first: a contiguous split would give one engine all of them.
    Shared by expected tokens, every engine's total is within one request of the mean."""
    prompts = [list(range(1000))] * 4 + [list(range(50))] * 12
    costs = [len(p) + 100 for p in prompts]
    shares = share_by_cost(costs, 2)
    assert sorted(i for share in shares for i in share) == list(range(16))
    assert all(share == sorted(share) for share in shares)
    totals = [sum(costs[i] for i in share) for share in shares]
    assert max(totals) - min(totals) <= max(costs)
    assert [sum(i < 4 for i in share) for share in shares] == [2, 2]
    rng = np.random.default_rng(0)
    for workers in (1, 3, 8):
        costs = rng.integers(1, 5000, 40).tolist()
        totals = [sum(costs[i] for i in share) for share in share_by_cost(costs, workers)]
        assert max(totals) <= sum(costs) / workers + max(costs)
