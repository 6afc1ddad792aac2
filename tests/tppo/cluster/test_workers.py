"""tppo.cluster.workers: what a trainer rank sends for the weight sync is what it holds, byte for byte and no more."""

from __future__ import annotations

import io

import torch

from recipes._hydra import compose
from tppo.cluster.workers import own_storage
from tppo.engine.config import OptimConfig, ParallelConfig
from tppo.engine.engine import MegatronEngine


def pickled_bytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getbuffer().nbytes


def test_own_storage_copies_only_views_of_larger_storages():
    stacked = torch.randn(4, 6, 3)
    whole = torch.randn(5, 2)
    expert = own_storage(stacked[1, :3])
    assert torch.equal(expert, stacked[1, :3])
    assert expert.untyped_storage().nbytes() == expert.numel() * expert.element_size()
    assert own_storage(whole) is whole
    transposed = own_storage(whole.t())  # a whole storage in another layout: compact, row-major
    assert torch.equal(transposed, whole.t()) and transposed.is_contiguous()


def test_a_weight_bucket_of_the_engine_pickles_at_the_size_of_its_tensors():
    cfg = compose("train", ["model.num_experts=8", "model.moe_ffn_hidden_size=64"])
    engine = MegatronEngine(cfg.model, ParallelConfig(), OptimConfig())
    buckets = list(engine.iter_hf_weights(bucket_bytes=64 << 10))
    assert len(buckets) > 2
    for bucket in buckets:
        tensor_bytes = sum(t.numel() * t.element_size() for _, t in bucket)
        sent = [(name, own_storage(t)) for name, t in bucket]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(bucket, sent))
        assert pickled_bytes(sent) < tensor_bytes + 4096 * len(bucket)
    # the expert tensors are slices of each layer's stacked weights: as they are, a bucket ships the stacks
    experts = [(n, t) for bucket in buckets for n, t in bucket if ".experts." in n][:3]
    assert pickled_bytes(experts) > 4 * sum(t.numel() * t.element_size() for _, t in experts)
