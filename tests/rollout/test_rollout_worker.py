"""RolloutWorker in-process and as a Ray actor on a tiny local cluster: same outputs as the engine, and a
weight bucket sent through Ray changes generation exactly like an in-process load."""

from __future__ import annotations

import os

import numpy as np
import pytest
from rollout_testlib import save_tiny_model

from rollout import SamplingParams
from rollout.config import RolloutConfig
from rollout.weights import iter_checkpoint
from rollout.worker import RolloutWorker

CONFIG = RolloutConfig(max_model_len=64, max_batch_size=4, kv_cache_tokens=256)
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5]]
PARAMS = [
    SamplingParams(max_new_tokens=6, temperature=0),
    SamplingParams(max_new_tokens=9, temperature=1.0, seed=3),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("worker_a"), tmp_path_factory.mktemp("worker_b")
    save_tiny_model("mixtral", a, seed=4)
    save_tiny_model("mixtral", b, seed=5)
    return a, b


def _same(xs, ys):
    for x, y in zip(xs, ys):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)
        np.testing.assert_array_equal(x.routed_experts, y.routed_experts)


def test_worker_in_process(checkpoints):
    a, b = checkpoints
    worker = RolloutWorker(str(a), config=CONFIG, num_threads=1)
    info = worker.info()
    assert (info.max_seqs, info.max_model_len, info.num_moe_layers, info.top_k) == (4, 64, 3, 2)
    before = worker.generate(PROMPTS, PARAMS)
    assert worker.load_weights(list(iter_checkpoint(b))) > 0
    after = worker.generate(PROMPTS, PARAMS)
    _same(after, RolloutWorker(str(b), config=CONFIG).generate(PROMPTS, PARAMS))
    assert any(x.token_ids != y.token_ids for x, y in zip(before, after))


def test_sleep_releases_memory_and_wakes_to_the_same_outputs(checkpoints):
    """Colocated time-sharing: asleep, the KV cache and weights hold no device bytes; generate after waking is
    identical, and a weight bucket loaded into a sleeping worker lands like one loaded awake."""
    a, b = checkpoints
    worker = RolloutWorker(str(a), config=CONFIG, num_threads=1)
    before = worker.generate(PROMPTS, PARAMS)
    worker.sleep()
    e = worker.engine
    assert worker.asleep and all(t.untyped_storage().nbytes() == 0 for t in e.cache.tensors())
    assert e.weights.embed_VH.untyped_storage().nbytes() == 0
    _same(worker.generate(PROMPTS, PARAMS), before)
    assert not worker.asleep
    worker.sleep()
    worker.load_weights(list(iter_checkpoint(b)))
    _same(worker.generate(PROMPTS, PARAMS), RolloutWorker(str(b), config=CONFIG).generate(PROMPTS, PARAMS))


@pytest.mark.dist
def test_worker_as_ray_actor(checkpoints):
    ray = pytest.importorskip("ray")
    a, b = checkpoints
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=1, object_store_memory=100 * 1024 * 1024, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=1)(RolloutWorker).remote(str(a), config=CONFIG, num_threads=1)
        local = RolloutWorker(str(a), config=CONFIG)
        _same(ray.get(actor.generate.remote(PROMPTS, PARAMS), timeout=120), local.generate(PROMPTS, PARAMS))
        bucket = list(iter_checkpoint(b))
        for i in range(0, len(bucket), 10):  # weight sync in buckets
            ray.get(actor.load_weights.remote(bucket[i : i + 10]), timeout=60)
        local.load_weights(bucket)
        _same(ray.get(actor.generate.remote(PROMPTS, PARAMS), timeout=120), local.generate(PROMPTS, PARAMS))
    finally:
        ray.shutdown()
