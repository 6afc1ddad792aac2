"""Roles on Ray: a dead actor is a clear error naming the role; a non-finite loss skips the update; the old
log-probs stay on the ranks."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
import torch

from tppo.algo.objectives import SupervisedObjective, policy_objective, value_objective
from tppo.algo.pool import Sample
from tppo.cluster.config import ClusterConfig
from tppo.cluster.roles import RankGroup, RoleError, Trainer, start_trainers
from tppo.cluster.session import ray_session
from tppo.config import ExperimentConfig
from tppo.engine.batch import LossOutput
from tppo.engine.config import ParallelConfig
from tppo.loop.balance import loads_from_batches, loads_from_ranks

pytestmark = [pytest.mark.dist, pytest.mark.usefixtures("ray_instance")]


class _Fragile:
    def ok(self) -> int:
        return 1

    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os._exit(1)

    def wait_for(self, path: str) -> bool:
        deadline = time.monotonic() + 20
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def touch(self, path: str) -> None:
        open(path, "w").close()

    def die_if(self, me: bool) -> None:
        if me:
            os._exit(1)
        time.sleep(5)  # the others wait, as ranks in a collective would


@dataclasses.dataclass(frozen=True)
class NaNObjective:
    def __call__(self, out, batch) -> LossOutput:
        return LossOutput(loss_sum=out.logprobs_BT.sum() * float("nan"), denominator=1)


def test_dead_actor_is_a_clear_error():
    import ray

    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        handle = ray.remote(num_cpus=0.01)(_Fragile).remote()
        group = RankGroup("policy", [handle], remote=True)
        assert group.call(_Fragile.ok) == [1]
        with pytest.raises(RoleError, match=r"^policy rank 0 died during die\(\) \(pid \d+"):
            group.call(_Fragile.die)


def test_the_death_message_names_the_role_and_the_rank_that_died():
    import ray

    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        handles = [ray.remote(num_cpus=0.01)(_Fragile).remote() for _ in range(3)]
        group = RankGroup("critic", handles, remote=True)
        pids = group.call(_Fragile.pid)
        with pytest.raises(RoleError) as err:
            group.call(_Fragile.die_if, [(rank == 1,) for rank in range(3)])
    message = str(err.value)
    assert message.startswith(f"critic rank 1 died during die_if() (pid {pids[1]}; ")
    assert len(message.splitlines()) == 1


def test_a_submitted_call_runs_while_the_driver_calls_another_role(tmp_path):
    import ray

    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        critic = RankGroup("critic", [ray.remote(num_cpus=0.01)(_Fragile).remote() for _ in range(2)], True)
        policy = RankGroup("policy", [ray.remote(num_cpus=0.01)(_Fragile).remote()], True)
        flag = str(tmp_path / "policy_ran")
        # the critic's ranks finish only once the policy has run: a submit that waited would time out here
        running = critic.submit(_Fragile.wait_for, None, flag)
        policy.call(_Fragile.touch, None, flag)
        assert running.result() == [True, True]
        dying = critic.submit(_Fragile.die_if, [(rank == 1,) for rank in range(2)])
        with pytest.raises(RoleError, match=r"^critic rank 1 died during die_if\(\)"):
            dying.result()


def _sample(uid: str) -> Sample:
    s = Sample(uid=uid, group_id=0, prompt_uid="p", prompt_ids=np.array([60, 5, 62]), max_response_length=8)
    s.max_new_tokens = 3
    s.add_window([4, 3, 2], np.zeros(3))
    return s


@pytest.mark.slow
def test_non_finite_loss_skips_the_update_and_weights_stay():
    cfg = ExperimentConfig()
    cfg.parallel = ParallelConfig(micro_batch_size=2)
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        group = start_trainers(
            "policy", cfg.model, cfg.parallel, cfg.algo.actor_optim, 1, seed=0, total_steps=4
        )
        trainer = Trainer(group, micro_batch_size=2, routing=False)
        batches = trainer.policy_batches([_sample("a"), _sample("b")], [np.zeros(3), np.zeros(3)])
        before = trainer.forward(batches)[0][0].logprobs_BT
        result = trainer.train(batches, NaNObjective())
        after = trainer.forward(batches)[0][0].logprobs_BT
        assert result.skipped
        assert torch.equal(before, after)


@pytest.mark.slow
def test_a_rank_holding_only_filler_rows_trains_without_hanging(monkeypatch):
    """One finished sample on two expert-parallel critic ranks: rank 1 gets a zero-mask filler row and must
    still run the same backward collectives as rank 0."""
    import tppo.cluster.roles

    monkeypatch.setattr(tppo.cluster.roles, "CALL_TIMEOUT_S", 180.0)
    cfg = ExperimentConfig()
    parallel = ParallelConfig(expert_parallel=2, micro_batch_size=2)
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        group = start_trainers("critic", cfg.model, parallel, cfg.algo.critic_optim, 2, seed=1, total_steps=4)
        critic = Trainer(group, micro_batch_size=2, routing=False)
        sample = _sample("only")
        sample.finished, sample.reward = True, 1.0
        batches = critic.critic_batches([sample])
        assert batches[1][0].payload.mask_BT.sum() == 0  # the filler
        result = critic.train(batches, value_objective(cfg.algo, batches))
        assert not result.skipped and result.grad_norm > 0


@pytest.mark.slow
def test_old_logprobs_stay_on_the_ranks_and_only_metrics_and_loads_come_back():
    """Two expert-parallel policy ranks record their routing (R2) while computing the old log-probs of staged
    micro-batches: the mismatch equals a NumPy reference over the same forward's log-probs, the per-rank expert
    counts equal the driver's count of the recorded routing on the engine's padded shapes, and the update then
    trains on the staged batches (which it releases)."""
    cfg = ExperimentConfig()
    parallel = ParallelConfig(expert_parallel=2, micro_batch_size=2)
    rng = np.random.default_rng(0)
    samples = []
    for i, n in enumerate((3, 5, 2, 4, 6)):
        s = Sample(
            uid=str(i), group_id=0, prompt_uid="p", prompt_ids=rng.integers(1, 60, 3), max_response_length=8
        )
        s.max_new_tokens = n
        s.add_window(rng.integers(1, 60, n), rng.normal(-2.0, 0.5, n))
        samples.append(s)
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        group = start_trainers("policy", cfg.model, parallel, cfg.algo.actor_optim, 2, seed=0, total_steps=4)
        policy = Trainer(group, micro_batch_size=2, routing=False)
        batches = policy.policy_batches(samples, [np.zeros(n) for n in (3, 5, 2, 4, 6)])
        reference = policy.forward(batches, record_routing=True)
        policy.stage(batches)
        old = policy.old_logprobs(record_routing=True)
        layout = policy.router_layout()
        result = policy.train(None, SupervisedObjective(num_tokens=20))
        with pytest.raises(RoleError, match="no micro-batches staged"):
            policy.train(None, SupervisedObjective(num_tokens=20))
    diffs, window = [], []
    for rank_batches, rank_outs in zip(batches, reference):
        for b, out in zip(rank_batches, rank_outs):
            mask = b.payload.window_mask_BT.numpy() > 0
            diff = np.clip(out.logprobs_BT.numpy() - b.payload.rollout_logprobs_BT.numpy(), -20, 20)
            diffs.append(np.abs(diff[mask]))
            window.append(mask.sum())
            b.routed_experts_BTLK = out.routed_experts_BTLK
    all_diffs = np.concatenate(diffs)
    assert sum(window) == 20
    assert old.metrics["mismatch/abs_diff"] == pytest.approx(all_diffs.mean(), rel=1e-5)
    assert old.metrics["mismatch/abs_diff_max"] == pytest.approx(all_diffs.max(), rel=1e-5)
    expected = loads_from_batches(batches, layout, cfg.model.num_experts)
    np.testing.assert_array_equal(loads_from_ranks(old.counts_MLE, layout.ep), expected)
    assert expected.sum() > 0 and not result.skipped


@pytest.mark.slow
def test_old_logprobs_from_the_update_train_as_their_own_pass_does(tmp_path):
    """Two expert-parallel policy ranks, one update of one optimizer step from the same saved state: with the old
    log-probs from a pass of their own, then with them from the update's forward (no pass). Same loss, gradient
    norm and mismatch metrics, and the policy moves the same (its log-probs after either update)."""
    cfg = ExperimentConfig()
    assert cfg.algo.old_logprobs_from_update  # the default recipe's one-step update
    parallel = ParallelConfig(expert_parallel=2, micro_batch_size=2)
    rng = np.random.default_rng(1)
    samples, advantages = [], []
    for i, n in enumerate((3, 5, 2, 4, 6, 3)):
        s = Sample(
            uid=str(i), group_id=0, prompt_uid="p", prompt_ids=rng.integers(1, 60, 3), max_response_length=8
        )
        s.max_new_tokens = n
        s.add_window(rng.integers(1, 60, n), rng.normal(-2.0, 0.5, n))
        samples.append(s)
        advantages.append(rng.normal(0.0, 1.0, n))
    shards = [tmp_path / f"policy_rank{r}.pt" for r in range(2)]
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        optim = dataclasses.replace(cfg.algo.actor_optim, lr=1e-2)
        group = start_trainers("policy", cfg.model, parallel, optim, 2, seed=0, total_steps=4)
        policy = Trainer(group, micro_batch_size=2, routing=False)
        batches = policy.policy_batches(samples, advantages)
        fused = policy_objective(cfg.algo, batches)
        before = policy.forward(batches)
        policy.save(shards)
        policy.stage(batches)
        old = policy.old_logprobs()
        (by_pass,) = policy.update(None, [dataclasses.replace(fused, old_from_forward=False)]).result()
        after_pass = policy.forward(batches)
        policy.load(shards)
        policy.stage(batches)
        (by_update,) = policy.update(None, [fused], old_from_update=True).result()
        after_update = policy.forward(batches)
        policy.stage(batches)
        with pytest.raises(RoleError, match="one optimizer step over every staged micro-batch"):
            policy.update(None, [fused, fused], [[0], [1]], old_from_update=True).result()
    assert old.metrics and by_pass.grad_norm > 0
    for key, value in old.metrics.items():
        assert by_update.metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert by_update.loss == pytest.approx(by_pass.loss, rel=1e-6)
    assert by_update.grad_norm == pytest.approx(by_pass.grad_norm, rel=1e-5)
    assert by_update.metrics["tppo/ratio_max"] == 1.0 and by_pass.metrics["tppo/ratio_max"] == pytest.approx(
        1.0
    )
    for outs_a, outs_b in zip(after_pass, after_update):
        for a, b in zip(outs_a, outs_b):
            torch.testing.assert_close(a.logprobs_BT, b.logprobs_BT, rtol=1e-5, atol=1e-6)
    moved = max(
        float((a.logprobs_BT - b.logprobs_BT).abs().max())
        for outs_a, outs_b in zip(after_pass, before)
        for a, b in zip(outs_a, outs_b)
    )
    assert moved > 1e-3  # the update moved the policy: the agreement above is not that of two no-ops


class _Streamer:
    """A rank of a role whose generator method yields on rank 0 only, as TrainerWorker.hf_weights does."""

    def __init__(self, rank: int) -> None:
        self.rank, self.finished = rank, False

    def buckets(self, n: int, fail_at: int = -1, stall_s: float = 0.0, failing_rank: int | None = None):
        for i in range(n):
            if i == fail_at and failing_rank in (None, self.rank):
                raise ValueError(f"rank {self.rank}: bucket {i} cannot be gathered")
            time.sleep(stall_s)
            if self.rank == 0:
                yield [(f"w{i}", torch.full((4,), float(i)))]
        self.finished = True

    def ran_to_the_end(self) -> bool:
        return self.finished


class _Sink:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, float]] = []

    def load(self, bucket) -> int:
        self.loaded += [(name, float(t[0])) for name, t in bucket]
        return len(bucket)

    def seen(self) -> list[tuple[str, float]]:
        return self.loaded


def test_a_stream_hands_rank_zeros_items_to_another_actor_without_the_driver_reading_them():
    import ray

    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        group = RankGroup("policy", [ray.remote(num_cpus=0.01)(_Streamer).remote(r) for r in range(2)], True)
        sink = RankGroup("rollout", [ray.remote(num_cpus=0.01)(_Sink).remote()], True)
        items = []
        for ref in group.stream(_Streamer.buckets, 5):
            items.append(ref)
            assert sink.call(_Sink.load, None, ref) == [1]
        assert all(isinstance(ref, ray.ObjectRef) for ref in items)
        assert sink.call(_Sink.seen) == [[(f"w{i}", float(i)) for i in range(5)]]
        assert group.call(_Streamer.ran_to_the_end) == [True, True]


def test_a_failing_or_silent_stream_is_a_role_error(monkeypatch):
    import ray

    import tppo.cluster.roles as roles

    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        group = RankGroup("policy", [ray.remote(num_cpus=0.01)(_Streamer).remote(r) for r in range(2)], True)
        sink = RankGroup("rollout", [ray.remote(num_cpus=0.01)(_Sink).remote()], True)
        # rank 0's failure is its last item: the reader's call fails and names the producer and the cause
        with pytest.raises(
            RoleError,
            match=r"^rollout\.load\(\) could not read its input: _Streamer\.buckets\(\) failed: "
            r"ValueError: rank 0: bucket 2 cannot be gathered$",
        ):
            for ref in group.stream(_Streamer.buckets, 3, 2, 0.0, 0):
                sink.call(_Sink.load, None, ref)
        # another rank's failure: the stream itself, once rank 0's items are read
        with pytest.raises(
            RoleError, match=r"(?s)^policy rank 1: buckets\(\) failed: .*rank 1: bucket 2 cannot"
        ):
            for ref in group.stream(_Streamer.buckets, 3, 2, 0.0, 1):
                sink.call(_Sink.load, None, ref)
        # the disaggregated layout reads each bucket on the driver: the same failure, the producer named
        with pytest.raises(
            RoleError,
            match=r"(?s)^rollout\.load_weights\(\) could not read its input: .*_Streamer\.buckets\(\).*"
            r"rank 0: bucket 2 cannot be gathered",
        ):
            for ref in group.stream(_Streamer.buckets, 3, 2, 0.0, 0):
                with sink._role_errors("load_weights"):
                    roles._materialized(ref)
        monkeypatch.setattr(roles, "CALL_TIMEOUT_S", 1.0)
        with pytest.raises(RoleError, match=r"^policy\.buckets\(\) did not finish within 1 s"):
            list(group.stream(_Streamer.buckets, 2, -1, 5.0))


def test_in_process_stream_yields_the_items_and_runs_every_rank():
    ranks = [_Streamer(0), _Streamer(1)]
    items = list(RankGroup("policy", ranks, remote=False).stream(_Streamer.buckets, 3))
    assert [name for bucket in items for name, _ in bucket] == ["w0", "w1", "w2"]
    assert all(r.finished for r in ranks)
