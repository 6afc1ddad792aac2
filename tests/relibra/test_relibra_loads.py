"""Load tensors: builders against loop references, validation errors, the .npz format, the real vLLM logs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relibra.loads import (
    LoadTrace,
    load_loads,
    loads_from_routed_experts,
    loads_from_token_stream,
    loads_from_vllm_logs,
    read_vllm_routing_log,
    save_loads,
    validate_loads,
)

ROUTING = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "routing" / "qwen3-30b-a3b-vllm"
LOGS = [ROUTING / f for f in ("ep_states.jsonl", "token_distri_8.jsonl", "token_distri_16.jsonl")]
needs_logs = pytest.mark.skipif(not ROUTING.is_dir(), reason=f"real routing logs not found at {ROUTING}")


def _topk_ids(rng, T, L, K, E):
    """Distinct experts per token, like a router's top-k."""
    return np.argsort(rng.random((T, L, E)), axis=-1)[..., :K]


def test_routed_experts_match_loop():
    rng = np.random.default_rng(0)
    M, S, E, L, K = 3, 4, 10, 2, 3
    samples = [_topk_ids(rng, int(rng.integers(1, 9)), L, K, E) for _ in range(9)]
    micro = rng.integers(0, M, size=9)
    dp = rng.integers(0, 2 * S, size=9)  # dp wider than EP: ranks fold onto dp % S
    got = loads_from_routed_experts(samples, micro, dp, M, S, E)
    want = np.zeros((M, L, S, E), dtype=np.int64)
    for ids, m, d in zip(samples, micro, dp):
        for t in range(ids.shape[0]):
            for layer in range(L):
                for e in ids[t, layer]:
                    want[m, layer, d % S, e] += 1
    np.testing.assert_array_equal(got, want)
    validate_loads(got[None], K)


def test_routed_experts_errors():
    ids = np.zeros((2, 1, 1), dtype=int)
    with pytest.raises(ValueError, match="one entry per sample"):
        loads_from_routed_experts([ids], [0, 1], [0], 1, 1, 2)
    with pytest.raises(ValueError, match="microbatch_B"):
        loads_from_routed_experts([ids], [3], [0], 1, 1, 2)
    with pytest.raises(ValueError, match="outside"):
        loads_from_routed_experts([ids + 5], [0], [0], 1, 1, 2)


def test_token_stream_cut_matches_loop():
    rng = np.random.default_rng(1)
    T, L, K, E, S, mb = 53, 2, 2, 7, 3, 10
    ids = _topk_ids(rng, T, L, K, E)
    got = loads_from_token_stream(ids, mb, S, E)
    M = T // mb
    want = np.zeros((M, L, S, E), dtype=np.int64)
    for t in range(M * mb):
        m, pos = divmod(t, mb)
        s = np.searchsorted(np.cumsum([4, 3, 3]), pos, side="right")  # array_split(10, 3) = 4, 3, 3
        for layer in range(L):
            for e in ids[t, layer]:
                want[m, layer, s, e] += 1
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="full micro-batches"):
        loads_from_token_stream(ids, mb, S, E, num_microbatches=M + 1)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: a[0], "5 dims"),
        (lambda a: a.astype(float), "integer"),
        (lambda a: a - 100, "non-negative"),
        (lambda a: a + (np.arange(a.shape[-1]) == 0), "multiple of topk"),
        (lambda a: np.concatenate([a[:, :, :1], a[:, :, 1:] * 2], axis=2), "every token passes"),
    ],
)
def test_validation_errors(mutate, message):
    rng = np.random.default_rng(2)
    loads = loads_from_token_stream(_topk_ids(rng, 40, 2, 2, 6), 20, 2, 6)[None]
    validate_loads(loads, 2)
    with pytest.raises(ValueError, match=message):
        validate_loads(mutate(loads), 2)


def test_expert_cannot_exceed_tokens():
    loads = np.zeros((1, 1, 1, 1, 3), dtype=np.int64)
    loads[..., 0] = 2  # one token, top-2, both picks on expert 0
    with pytest.raises(ValueError, match="more pairs than there are tokens"):
        validate_loads(loads, 2)


def test_npz_roundtrip_and_missing_keys(tmp_path):
    rng = np.random.default_rng(3)
    trace = LoadTrace(loads_from_token_stream(_topk_ids(rng, 40, 2, 2, 6), 20, 2, 6)[None], 2)
    save_loads(tmp_path / "l.npz", trace)
    back = load_loads(tmp_path / "l.npz")
    np.testing.assert_array_equal(back.loads_NMLSE, trace.loads_NMLSE)
    assert back.topk == 2
    np.savez(tmp_path / "bad.npz", loads=trace.loads_NMLSE)
    with pytest.raises(ValueError, match="topk"):
        load_loads(tmp_path / "bad.npz")


@needs_logs
def test_real_log_skips_idle_passes():
    passes = read_vllm_routing_log(LOGS[0])
    # 32 passes in the file; the 4-token passes that repeat byte for byte (keep-alives) are dropped
    assert [p.shape[0] for p in passes] == [15, 4, 1960]
    assert all(p.shape[1:] == (48, 8) for p in passes)
    assert all((np.sort(p, axis=-1)[..., 1:] != np.sort(p, axis=-1)[..., :-1]).all() for p in passes)


@needs_logs
def test_real_logs_to_trace():
    trace = loads_from_vllm_logs(LOGS, microbatch_tokens=256, num_source_ranks=16)
    assert trace.loads_NMLSE.shape == (3, 7, 48, 16, 128)
    assert trace.topk == 8
    per_rank = trace.loads_NMLSE.sum(axis=-1) // 8
    np.testing.assert_array_equal(per_rank, 16)  # 256 tokens dealt to 16 ranks
