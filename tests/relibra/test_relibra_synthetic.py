"""Synthetic RL-like loads: valid tensors, seeded, drifting hot sets, and statistics close to the real routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relibra.loads import loads_from_vllm_logs, validate_loads
from relibra.synthetic import SyntheticLoads, cap_probabilities, generate_loads

ROUTING = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "routing" / "qwen3-30b-a3b-vllm"
SMALL = SyntheticLoads(num_steps=3, num_microbatches=4, num_layers=3, num_source_ranks=4, num_experts=32,
                       topk=4, tokens_per_rank=256, group_size=2)  # fmt: skip


def test_valid_and_seeded():
    a, b = generate_loads(SMALL), generate_loads(SMALL)
    validate_loads(a.loads_NMLSE, a.topk)
    np.testing.assert_array_equal(a.loads_NMLSE, b.loads_NMLSE)
    assert a.loads_NMLSE.shape == (3, 4, 3, 4, 32)
    np.testing.assert_array_equal(a.loads_NMLSE.sum(axis=-1), 256 * 4)
    other = generate_loads(SyntheticLoads(**{**SMALL.__dict__, "seed": 1}))
    assert (other.loads_NMLSE != a.loads_NMLSE).any()


def test_cap_probabilities():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(20, 0.1), size=50)
    capped = cap_probabilities(p, 0.125)
    np.testing.assert_allclose(capped.sum(axis=1), 1.0)
    assert (capped <= 0.125 + 1e-12).all()
    untouched = p.max(axis=1) <= 0.125
    np.testing.assert_allclose(capped[untouched], p[untouched])


def test_drift_changes_hot_sets():
    def top_overlap(drift):
        trace = generate_loads(SyntheticLoads(**{**SMALL.__dict__, "drift": drift, "num_steps": 2}))
        W = trace.loads_NMLSE.sum(axis=(1, 3))  # [N, L, E]
        top = np.argsort(-W, axis=-1)[..., :8]
        return np.mean([len(set(top[0, layer]) & set(top[1, layer])) for layer in range(W.shape[1])])

    assert top_overlap(0.9) < top_overlap(0.0)


def test_parameter_errors():
    with pytest.raises(ValueError, match="topk"):
        SyntheticLoads(num_experts=4, topk=8)
    with pytest.raises(ValueError, match="drift"):
        SyntheticLoads(drift=2.0)


def _stats(loads_NMLSE: np.ndarray, num_gpus: int):
    W = loads_NMLSE.sum(axis=3)  # [N, M, L, E]
    busiest = np.median(W.max(-1) / W.mean(-1))
    gpu = W.reshape(*W.shape[:-1], num_gpus, -1).sum(-1)
    return busiest, (gpu.max(-1) / gpu.mean(-1)).mean()


@pytest.mark.skipif(not ROUTING.is_dir(), reason=f"real routing logs not found at {ROUTING}")
def test_statistics_close_to_real_routing():
    """At the real logs' scale (256-token micro-batches, one prompt's tokens per micro-batch) the default scales give
    the measured skew: busiest expert ~11x the mean, static 8-GPU skew ~1.7."""
    logs = [ROUTING / f for f in ("ep_states.jsonl", "token_distri_8.jsonl", "token_distri_16.jsonl")]
    real = loads_from_vllm_logs(logs, microbatch_tokens=256, num_source_ranks=8)
    syn = generate_loads(SyntheticLoads(num_steps=3, num_microbatches=7, num_source_ranks=8, tokens_per_rank=32,
                                        responses_per_rank=1, group_size=16))  # fmt: skip
    real_busiest, real_skew = _stats(real.loads_NMLSE, 8)
    syn_busiest, syn_skew = _stats(syn.loads_NMLSE, 8)
    assert 9 < real_busiest < 13 and 1.6 < real_skew < 1.85  # what SOURCES.md reports
    assert syn_busiest == pytest.approx(real_busiest, rel=0.25)
    assert syn_skew == pytest.approx(real_skew, rel=0.1)
