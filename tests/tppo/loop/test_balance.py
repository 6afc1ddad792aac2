"""ReLibra in the loop: the loads the driver plans for, and a policy update that applies the plan on EP=2 ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from relibra.config import RelibraConfig
from relibra.cost_model import step_cost
from relibra.plan import PlannerState, static_home_LE
from relibra.planners import run_planner
from relibra.planners.base import home_plan
from tppo.algo.batching import place, policy_batch, select_microbatches, split_for_ranks, update_schedule
from tppo.algo.objectives import supervised_objective
from tppo.algo.pool import Sample
from tppo.base.fields import ConfigError, check_fields
from tppo.cluster.config import ClusterConfig
from tppo.cluster.roles import Trainer, start_trainers
from tppo.cluster.session import ray_session
from tppo.config import ExperimentConfig
from tppo.engine.config import ModelConfig, OptimConfig, ParallelConfig
from tppo.engine.layout import RouterLayout
from tppo.loop.balance import LoadPlanner, executor_spec, loads_from_batches

NUM_LAYERS, K, E = 2, 2, 8


def _sample(uid: str, length: int, rng: np.random.Generator, hot: bool) -> Sample:
    """A response whose routing is skewed towards experts 0 and 1 (both homed on EP rank 0) when `hot`."""
    prompt = rng.integers(1, 60, 3)
    s = Sample(uid=uid, group_id=0, prompt_uid="p", prompt_ids=prompt, max_response_length=64)
    n = len(prompt) + length
    routes = np.stack([rng.permutation(E)[:K] for _ in range(n * NUM_LAYERS)]).reshape(n, NUM_LAYERS, K)
    if hot:
        routes[: n - n // 4] = [0, 1]
    s.max_new_tokens = length
    s.add_window(rng.integers(1, 60, length), np.zeros(length), routed_experts=routes)
    return s


def _batches(samples: list[Sample], ranks: int, mbs: int):
    split = split_for_ranks(samples, place(len(samples), ranks, mbs))
    return [
        [policy_batch(ss, ff, [np.zeros(s.num_response_tokens) for s in ss], routing=True) for ss, ff in rank]
        for rank in split
    ]


def _policy_with_planner(cfg: ExperimentConfig, optim: OptimConfig) -> tuple[Trainer, LoadPlanner]:
    """Two EP policy ranks (Ray actors) with ReLibra's executor, and the loop's planner for them."""
    group = start_trainers(
        "policy", cfg.model, cfg.parallel, optim, 2, seed=0, total_steps=8, executor=executor_spec(cfg)
    )
    policy = Trainer(group, micro_batch_size=2, routing=True)
    return policy, LoadPlanner(cfg.relibra, cfg.model, policy.router_layout())


def _real_pairs(samples: list[Sample], layer: int) -> np.ndarray:
    """Brute force over the samples' own records: the real tokens' (token, expert) pairs of one layer."""
    counts = np.zeros(E, dtype=np.int64)
    for s in samples:
        n = len(s.prompt_ids) + s.num_response_tokens
        for t in range(n):
            for e in s.routed_experts[min(t, len(s.routed_experts) - 1), layer]:
                counts[e] += 1
    return counts


@pytest.mark.parametrize("aligned", [True, False])
def test_loads_count_real_pairs_and_spread_padding_evenly(aligned):
    rng = np.random.default_rng(0)
    samples = [_sample(str(i), int(n), rng, hot=i % 2 == 0) for i, n in enumerate(rng.integers(2, 20, 7))]
    batches = _batches(samples, ranks=2, mbs=2)
    layout = RouterLayout(ep=2, aligned=aligned)
    loads = loads_from_batches(batches, layout, E)
    placement = place(len(samples), 2, 2)
    for m in range(loads.shape[0]):
        shapes = [batches[r][m].shape for r in range(2)]
        if aligned:
            shapes = [tuple(max(x) for x in zip(*shapes))] * 2
        for r in range(2):
            mine = [samples[i] for i in placement.rows[r][m]]
            for layer in range(NUM_LAYERS):
                total = loads[m, layer, r]
                assert total.sum() == shapes[r][0] * shapes[r][1] * K  # every token the router sees
                padding = total - _real_pairs(mine, layer)
                assert padding.min() >= 0
                # Padding goes round robin over the experts: their counts differ by at most one.
                assert padding.max() - padding.min() <= 1


@pytest.mark.slow
@pytest.mark.dist
def test_policy_update_applies_the_plan_and_matches_the_static_update(tmp_path: Path, ray_instance):
    """The executor's measured pairs-per-rank skew equals the simulator's skew of the plan on the same loads, and
    the update under the plan gives the same model as the update under the static placement."""
    cfg = ExperimentConfig()
    assert (cfg.model.num_experts, cfg.model.moe_topk) == (E, K)
    cfg.parallel = ParallelConfig(expert_parallel=2, micro_batch_size=2)
    cfg.relibra = RelibraConfig(gpus_per_node=2, replica_slots=1, min_replica_tokens=0)
    rng = np.random.default_rng(1)
    samples = [_sample(str(i), int(n), rng, hot=True) for i, n in enumerate(rng.integers(8, 24, 8))]
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        policy, planner = _policy_with_planner(cfg, cfg.algo.actor_optim)
        batches = policy.policy_batches(samples, [np.zeros(s.num_response_tokens) for s in samples])
        shards = [tmp_path / f"rank{r}.pt" for r in range(2)]
        policy.save(shards)

        # ReLibra's own plan, not the adapter's choice: at these few tokens the cost model prices keeping the
        # placement faster, and the executor must be shown moving and replicating experts.
        loads = loads_from_batches(batches, planner.layout, E)
        plan, _ = run_planner("relibra", loads, planner.ctx, PlannerState())
        static_home = static_home_LE(NUM_LAYERS, planner.topo)

        def skew(p) -> float:
            return float(
                np.nanmean(step_cost(p, loads, K, planner.topo, planner.ctx.cost, static_home).skew_ML)
            )

        assert skew(plan) < skew(home_plan(loads, static_home, planner.topo))
        result = policy.train(batches, supervised_objective(batches), plan, loads)
        m = result.metrics
        assert m["relibra/exec_refused"] == 0.0 and result.plan_applied is True
        assert m["relibra/exec_migrated_experts"] + m["relibra/exec_replicas_per_mb_layer"] > 0
        assert m["relibra/exec_skew_measured"] == pytest.approx(skew(plan), rel=1e-9)
        with_plan = policy.forward(batches)

        policy.load(shards)  # back to the static placement and the old weights
        reference = policy.train(batches, supervised_objective(batches))
        static = policy.forward(batches)
    assert result.loss == pytest.approx(reference.loss, rel=1e-5)
    for rank_a, rank_b in zip(with_plan, static):
        for a, b in zip(rank_a, rank_b):
            torch.testing.assert_close(a.logprobs_BT, b.logprobs_BT, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.dist
def test_mini_batch_epochs_under_the_plan_equal_a_plain_loop_of_static_updates(tmp_path: Path, ray_instance):
    """algo.mini_batches=2 x algo.epochs=2 in one call, the step's plan sliced to each optimizer step's
    micro-batches (in the shuffled order), gives the same model as a plain loop of single-step updates over the
    same shuffled micro-batches under the static placement."""
    cfg = ExperimentConfig()
    cfg.parallel = ParallelConfig(expert_parallel=2, micro_batch_size=2)
    cfg.relibra = RelibraConfig(gpus_per_node=2, replica_slots=1, min_replica_tokens=0)
    rng = np.random.default_rng(4)
    samples = [_sample(str(i), int(n), rng, hot=True) for i, n in enumerate(rng.integers(8, 24, 12))]
    optim = OptimConfig(lr=1e-2, grad_clip=0.0)  # steps large enough to tell the steps' order apart
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        policy, planner = _policy_with_planner(cfg, optim)
        batches = policy.policy_batches(samples, [np.zeros(s.num_response_tokens) for s in samples])
        assert len(batches[0]) == 3
        shards = [tmp_path / f"rank{r}.pt" for r in range(2)]
        policy.save(shards)
        before = policy.forward(batches)
        schedule = update_schedule(3, 2, 2, np.random.default_rng(0))
        assert len(schedule) == 4 and sorted(m for s in schedule[:2] for m in s) == [0, 1, 2]
        objectives = [supervised_objective(select_microbatches(batches, s)) for s in schedule]
        step_plan = planner.plan(batches)
        results = policy.update(batches, objectives, schedule, step_plan.plan, step_plan.loads_MLSE).result()
        assert results[-1].plan_applied is True and results[-1].metrics["relibra/exec_refused"] == 0.0
        planned = policy.forward(batches)

        policy.load(shards)
        plain = [policy.train(select_microbatches(batches, s), o) for s, o in zip(schedule, objectives)]
        static = policy.forward(batches)
    assert [r.loss for r in results] == pytest.approx([r.loss for r in plain], rel=1e-5)
    moved = max(
        float((a.logprobs_BT - b.logprobs_BT).abs().max())
        for ra, rb in zip(planned, before)
        for a, b in zip(ra, rb)
    )
    assert moved > 1e-2  # four steps at lr 1e-2 moved the model: the comparison below is not of two no-ops
    for rank_a, rank_b in zip(planned, static):
        for a, b in zip(rank_a, rank_b):
            torch.testing.assert_close(a.logprobs_BT, b.logprobs_BT, rtol=1e-4, atol=1e-5)


def test_planner_rolls_back_a_refused_plan():
    rng = np.random.default_rng(2)
    samples = [_sample(str(i), 12, rng, hot=True) for i in range(4)]
    planner = LoadPlanner(
        dataclasses.replace(RelibraConfig(), gpus_per_node=2, replica_slots=1, min_replica_tokens=0),
        ModelConfig(num_experts=E, moe_topk=K),
        RouterLayout(ep=2, aligned=True),
    )
    before = planner.state
    planner.plan(_batches(samples, ranks=2, mbs=2))
    planner.refused()
    assert planner.state is before


def test_background_plans_read_the_routing_when_they_start_and_plan_in_order():
    """What the driver does: start a step's plan, change the batches (old log-probs fill them), start the next
    step's before the first is read; the plans equal those planned one after the other."""
    rng = np.random.default_rng(3)
    steps = [[_sample(f"{n}-{i}", 12, rng, hot=n % 2 == 0) for i in range(4)] for n in range(3)]
    cfg = dataclasses.replace(RelibraConfig(), gpus_per_node=2, replica_slots=1, min_replica_tokens=0)
    model, layout = ModelConfig(num_experts=E, moe_topk=K), RouterLayout(ep=2, aligned=True)
    in_order = LoadPlanner(cfg, model, layout)
    expected = [in_order.plan(_batches(samples, ranks=2, mbs=2)) for samples in steps]
    background = LoadPlanner(cfg, model, layout)
    started = []
    for samples in steps:
        batches = _batches(samples, ranks=2, mbs=2)
        started.append(background.start(batches))
        for rank in batches:
            for batch in rank:
                batch.routed_experts_BTLK.zero_()
    for future, want in zip(started, expected, strict=True):
        got = future.result()
        np.testing.assert_array_equal(got.loads_MLSE, want.loads_MLSE)
        np.testing.assert_array_equal(got.plan.home_LE, want.plan.home_LE)
        np.testing.assert_array_equal(got.plan.quota_MLGJS, want.plan.quota_MLGJS)
    assert background.state.num_steps == len(steps)
    np.testing.assert_array_equal(background.state.home_LE, in_order.state.home_LE)


def test_planner_takes_the_configured_nic_routing():
    """`relibra.nic_routing` overrides the cost model's routing; the planner plans with it."""
    cfg = dataclasses.replace(RelibraConfig(), gpus_per_node=1, replica_slots=1)
    layout = RouterLayout(ep=4, aligned=True)
    model = ModelConfig(num_experts=E, moe_topk=K)
    assert LoadPlanner(cfg, model, layout).ctx.cost.nic_routing == "direct"  # the packaged YAML's
    pxn = LoadPlanner(dataclasses.replace(cfg, nic_routing="pxn"), model, layout)
    assert pxn.ctx.cost.nic_routing == "pxn"
    with pytest.raises(ConfigError, match="nic_routing"):
        check_fields(dataclasses.replace(cfg, nic_routing="rail"))


def test_the_planner_keeps_the_placement_when_its_plan_is_no_faster():
    """A few dozen tokens per micro-batch (as here): every copy or move costs more than it saves under the cost
    model, so the step keeps the current (static) placement, says so, and plans on from it."""
    rng = np.random.default_rng(2)
    samples = [_sample(str(i), 12, rng, hot=True) for i in range(4)]
    planner = LoadPlanner(
        dataclasses.replace(RelibraConfig(), gpus_per_node=2, replica_slots=1, min_replica_tokens=0),
        ModelConfig(num_experts=E, moe_topk=K),
        RouterLayout(ep=2, aligned=True),
    )
    step = planner.plan(_batches(samples, ranks=2, mbs=2))
    assert step.metrics["relibra/kept_placement"] == 1.0
    assert (
        step.metrics["relibra/sim_moe_speedup"] == pytest.approx(1.0)
        and step.metrics["relibra/migration_bytes"] == 0
    )
    np.testing.assert_array_equal(planner.state.home_LE, static_home_LE(NUM_LAYERS, planner.topo))
    np.testing.assert_array_equal(step.plan.home_LE, planner.state.home_LE)
