"""The driver's Rollout handle over the disaggregated layout on Ray (two engines sharing two expert workers,
over gloo): the same generate and load_weights calls give the replica engines' outputs; each expert worker gets
only its experts' tensors; settings that cannot work are refused with both named; an engine that cannot be built
fails the start, not the first step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from recipes._hydra import compose
from rollout import SamplingParams
from rollout.config import RolloutConfig
from rollout.weights import iter_checkpoint
from tppo.base.fields import ConfigError
from tppo.cluster.config import ClusterConfig
from tppo.cluster.placement import layout
from tppo.cluster.roles import RoleError, start_rollout
from tppo.cluster.session import ray_session

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "rollout"))
from rollout_testlib import save_tiny_model


def _run(ckpt: Path, other: Path, expert_workers: int) -> list[list]:
    config = RolloutConfig(max_model_len=64, max_batch_size=2, kv_cache_tokens=128, micro_batches=2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (4, 11, 2, 7, 5)]
    params = [
        SamplingParams(max_new_tokens=9, temperature=t, seed=s) for s, t in enumerate((0, 1, 0, 0.8, 1))
    ]
    rollout = start_rollout(ckpt, "cpu", "float32", config, 2, True, expert_workers=expert_workers)
    first = rollout.generate(prompts, params)
    assert len(rollout.info()) == len(rollout.last_stats()) == 2
    rollout.load_weights(list(iter_checkpoint(other)))
    return [first, rollout.generate(prompts, params)]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_disaggregated_rollout_equals_replicas(tmp_path):
    ckpt, other = tmp_path / "a", tmp_path / "b"
    save_tiny_model("qwen3_moe", ckpt, seed=1, num_experts=4)
    save_tiny_model("qwen3_moe", other, seed=2, num_experts=4)
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)):
        want = _run(ckpt, other, expert_workers=0)
        got = _run(ckpt, other, expert_workers=2)
    for got_run, want_run in zip(got, want):
        for a, b in zip(got_run, want_run, strict=True):
            assert a.token_ids == b.token_ids
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


@pytest.mark.dist
def test_an_engine_that_cannot_be_built_fails_the_start(tmp_path):
    # the worker's constructor reads the checkpoint: its error surfaces here, before any generate call
    with (
        ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)),
        pytest.raises(
            RoleError, match=r"^rollout rank 0 could not be built \(pid \d+\): FileNotFoundError: .*missing'"
        ),
    ):
        start_rollout(tmp_path / "missing", "cpu", "float32", RolloutConfig(max_model_len=64), 1, True)


def test_disaggregated_layout_counts_and_rules():
    cluster = ClusterConfig(rollout_workers=2, rollout_layout="disaggregated", expert_workers=3)
    assert cluster.rollout_ranks == 5 and len(layout(cluster).seats["rollout"]) == 5
    assert compose("train", ["cluster.rollout_layout=disaggregated"]).cluster.rollout_ranks == 2
    gpus = ["cluster.gpus_per_node=8", "cluster.rollout_layout=disaggregated"]
    with pytest.raises(
        ConfigError, match=r"rollout_layout=disaggregated .*placement=colocated.*offload=auto"
    ):
        compose("train", gpus)
    separate = ["cluster.gpus_per_node=5", "cluster.placement=separate", "cluster.expert_workers=3"]
    with pytest.raises(ConfigError, match=r"policy_ranks \+ critic_ranks \+ rollout processes = 8 GPUs"):
        compose("train", [*separate, "cluster.rollout_layout=disaggregated"])
