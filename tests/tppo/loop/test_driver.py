"""The driver's step on in-process roles that record what they are given: what the updates see."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from rollout.engine import GenerateStats, GenerationOutput
from tppo.algo.config import AlgoConfig
from tppo.algo.pool import Prompt, SamplePool
from tppo.cluster.config import ClusterConfig
from tppo.cluster.roles import STREAM_AHEAD, PendingCall, RankGroup, Rollout, Trainer
from tppo.cluster.workers import OldLogprobsReport
from tppo.config import ExperimentConfig
from tppo.engine.batch import ForwardOutput, StepResult
from tppo.loop.driver import Roles, rl_step, sync_bucket_bytes

PROMPT_BASE = 100  # prompt i is the single token PROMPT_BASE + i


class _Engines:
    """A rollout worker: every request answers 4 tokens and stops (eos)."""

    def generate(self, prompts, params):
        return [
            GenerationOutput(
                index=i,
                prompt_token_ids=list(p),
                token_ids=[1] * q.max_new_tokens,
                logprobs=np.full(q.max_new_tokens, -1.0, np.float32),
                finish_reason="eos",
                routed_experts=np.zeros((len(p) + q.max_new_tokens, 1, 1), np.uint8),
                seed=q.seed,
            )
            for i, (p, q) in enumerate(zip(prompts, params))
        ]

    def load_weights(self, named_tensors):
        return 0

    def last_stats(self):
        return GenerateStats(
            num_requests=4,
            prefill_s=0.5,
            decode_s=2.0,
            mixed_s=0.5,
            num_decode_steps=4,
            num_decode_rows=12,
            max_seqs=4,
            num_preemptions=1,
            kv_blocks=10,
            kv_blocks_peak=5,
            num_captures=2,
            capture_s=0.25,
            generate_s=3.5,
        )


class _Rank:
    """A trainer rank that keeps its staged micro-batches and records the prompts of the rows each update trains
    (and, given a shared `log`, its name when an update runs)."""

    def __init__(self, name: str = "", log: list[str] | None = None) -> None:
        self.staged, self.trained_prompts = None, []
        self.name, self.log = name, log if log is not None else []

    def forward(self, batches, with_entropy=False, record_routing=False):
        return [
            ForwardOutput(values_BT=torch.zeros(b.shape), end_values_S=torch.zeros(b.shape[0]))
            for b in batches
        ]

    def stage(self, batches):
        self.staged = list(batches)

    def old_logprobs(self, record_routing=False):
        return OldLogprobsReport(metrics={})

    def train(self, objectives, schedule=None, plan=None, loads_MLSE=None, old_from_update=False):
        self.log.append(self.name)
        for b in self.staged:
            live = b.loss_mask_BT.sum(dim=1) > 0
            self.trained_prompts += (b.input_ids_BT[live, 0] - PROMPT_BASE).tolist()
        return [StepResult(loss=0.0, grad_norm=0.0, lr=0.0, skipped=False, num_microbatches=1)] * len(
            objectives
        )

    def hf_weights(self, bucket_bytes):
        return []


def _verifier(sample) -> float:
    """Even prompts: every response right (an uninformative group); odd prompts: one right, one wrong."""
    i = int(sample.prompt_ids[0]) - PROMPT_BASE
    return 1.0 if i % 2 == 0 or sample.uid.endswith(".0") else -1.0


def test_dynamic_sampling_trains_only_informative_groups_and_refills_the_batch():
    algo = AlgoConfig(
        batch_size=8,
        group_size=2,
        window=4,
        max_response_length=4,
        dynamic_sampling=True,
        critic_warmup_steps=0,
        estimator="grpo",
    )
    cfg = replace(ExperimentConfig(), algo=algo)
    dataset = [Prompt(uid=f"p{i}", prompt_ids=np.array([PROMPT_BASE + i])) for i in range(40)]
    pool = SamplePool.from_config(algo, dataset, shuffle=False)
    policy, critic = _Rank(), _Rank()
    roles = Roles(
        policy=Trainer(RankGroup("policy", [policy], remote=False), micro_batch_size=2, routing=False),
        critic=Trainer(RankGroup("critic", [critic], remote=False), micro_batch_size=2, routing=False),
        rollout=Rollout(RankGroup("rollout", [_Engines()], remote=False)),
    )
    metrics = rl_step(0, cfg, pool, roles, _verifier, stop_ids=())
    # Prompts 0-3 first: 1 and 3 are informative; each refill asks for the missing items (4, then 2, then 2):
    # prompts 4-5, 6, 7. Three refills reach a full batch of informative groups.
    assert sorted(policy.trained_prompts) == [1, 1, 3, 3, 5, 5, 7, 7]
    assert sorted(critic.trained_prompts) == [1, 1, 3, 3, 5, 5, 7, 7]
    assert metrics["rollout/dynamic_generated"] == 16.0 and metrics["rollout/dynamic_kept"] == 8.0
    assert metrics["rollout/dynamic_refill_rounds"] == 3.0
    assert metrics["rollout/pool_num_dropped"] == 8.0 and metrics["rollout/pool_num_retired"] == 8.0
    # four generate calls (the batch and three refills), each 12 decode rows over 4 steps of 4 slots
    assert metrics["rollout/decode_s"] == 8.0 and metrics["rollout/prefill_s"] == 2.0
    assert metrics["rollout/decode_rows_mean"] == 3.0 and metrics["rollout/decode_occupancy"] == 0.75
    assert metrics["rollout/mixed_s"] == 2.0 and metrics["rollout/preemptions"] == 4.0
    assert metrics["rollout/kv_blocks_peak"] == 5.0 and metrics["rollout/kv_usage_peak"] == 0.5
    assert metrics["rollout/generate_s"] == 14.0 and metrics["rollout/capture_s"] == 1.0
    assert metrics["rollout/graphs_captured"] == 8.0
    # The bound on over-sampling: one refill round leaves a smaller batch of informative groups.
    bounded = replace(cfg, algo=replace(algo, dynamic_sampling_rounds=1))
    policy.trained_prompts.clear()
    metrics = rl_step(1, bounded, pool, roles, _verifier, stop_ids=())
    assert sorted(policy.trained_prompts) == [9, 9, 11, 11, 13, 13]
    assert metrics["rollout/dynamic_generated"] == 12.0 and metrics["rollout/dynamic_refill_rounds"] == 1.0


def test_weight_sync_buckets_fit_the_object_store_with_the_ones_in_flight():
    def bucket_mb(store_mb: int, bucket_mb: int) -> float:
        cfg = ExperimentConfig()
        cfg = replace(
            cfg,
            cluster=replace(cfg.cluster, object_store_mb=store_mb),
            rollout=replace(cfg.rollout, weight_sync_bucket_mb=bucket_mb),
        )
        return sync_bucket_bytes(cfg) / (1 << 20)

    assert bucket_mb(16384, 256) == 256
    assert bucket_mb(128, 256) == 128 // (STREAM_AHEAD + 1)
    assert bucket_mb(128, 8) == 8
    assert (
        bucket_mb(ClusterConfig().object_store_mb, 1 << 20) * (STREAM_AHEAD + 1)
        <= ClusterConfig().object_store_mb
    )


class _LaterGroup(RankGroup):
    """In-process ranks whose submitted calls run only once their result is asked for (as remote ranks' calls
    finish after the driver has gone on)."""

    def submit(self, method, per_rank=None, *args):
        now = RankGroup(self.name, self.handles, remote=False)
        return _Later(lambda: now.submit(method, per_rank, *args).result())


class _Later(PendingCall):
    def __init__(self, run) -> None:
        self.run = run

    def result(self):
        return self.run()


def test_overlapped_updates_wait_for_the_critic_after_the_policy_and_train_the_same():
    algo = AlgoConfig(batch_size=4, group_size=2, window=4, max_response_length=4, critic_warmup_steps=0)
    dataset = [Prompt(uid=f"p{i}", prompt_ids=np.array([PROMPT_BASE + i])) for i in range(8)]

    def step(overlap: bool) -> tuple[list[str], _Rank, _Rank, dict[str, float]]:
        cfg = replace(ExperimentConfig(), algo=algo)
        cfg = replace(cfg, cluster=replace(cfg.cluster, overlap_updates="on" if overlap else "off"))
        log: list[str] = []
        policy, critic = _Rank("policy", log), _Rank("critic", log)
        roles = Roles(
            policy=Trainer(_LaterGroup("policy", [policy], remote=False), micro_batch_size=2, routing=False),
            critic=Trainer(_LaterGroup("critic", [critic], remote=False), micro_batch_size=2, routing=False),
            rollout=Rollout(RankGroup("rollout", [_Engines()], remote=False)),
        )
        pool = SamplePool.from_config(algo, dataset, shuffle=False)
        return log, policy, critic, rl_step(0, cfg, pool, roles, lambda s: 1.0, stop_ids=())

    log, policy, critic, metrics = step(overlap=False)
    assert log == ["critic", "policy"]
    overlapped_log, overlapped_policy, overlapped_critic, overlapped = step(overlap=True)
    # the critic's update is waited for only after the policy's has run (and the weights are synced)
    assert overlapped_log == ["policy", "critic"]
    assert overlapped_policy.trained_prompts == policy.trained_prompts == [0, 0, 1, 1]
    assert overlapped_critic.trained_prompts == critic.trained_prompts
    assert {k for k in overlapped if not k.startswith("perf/")} == {
        k for k in metrics if not k.startswith("perf/")
    }
    assert overlapped["critic/optimizer_steps"] == metrics["critic/optimizer_steps"] == 1.0
