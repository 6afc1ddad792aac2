"""The disaggregated layout (MegaScale-Infer): attention worker + expert workers over gloo give the replica
engine's tokens and routed experts, and its log-probs within 1e-5 (fp32), through continuous batching, mixed
steps, preemption, T-PPO continuations and a weight sync; the pieces (micro-batch split, expert partial sums,
partial weights) against the unsplit model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from disagg_workers import disagg_rank, share
from rollout_testlib import save_tiny_model

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig
from rollout.disagg import (
    ExpertWorker,
    Layout,
    expert_ranges,
    micro_batch_count,
    split_step,
    split_weights,
)
from rollout.model_spec import MoeModelSpec
from rollout.runner import SEQ, StepInputs
from rollout.weights import WeightMap, allocate, iter_checkpoint, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tppo" / "engine"))
from engine_testing import run_ranks


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A tiny Qwen3-MoE with a dense layer (routing stays on the attention side there) and a second set of
    weights for the sync."""
    base = tmp_path_factory.mktemp("disagg")
    kw = dict(num_experts=6, mlp_only_layers=[1])
    save_tiny_model("qwen3_moe", base / "a", seed=4, **kw)
    save_tiny_model("qwen3_moe", base / "b", seed=5, **kw)
    return base / "a", base / "b"


def _config(**kw) -> RolloutConfig:
    base = dict(max_model_len=96, max_batch_size=3, kv_cache_tokens=4 * 96, max_step_tokens=24)
    return RolloutConfig(**{**base, **kw})


def _workload(new_tokens=(9, 17, 5, 12, 20, 7, 14)) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (3, 30, 1, 14, 6, 21, 9)]
    params = [
        SamplingParams(max_new_tokens=n, temperature=t, seed=s)
        for n, t, s in zip(new_tokens, (0, 1.0, 0, 0.7, 1.3, 0, 1.0), range(7))
    ]
    return prompts, params


def _assert_same(a, b) -> None:
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    assert a.finish_reason == b.finish_reason


def _replica_runs(ckpt, sync_ckpt, config, prompts, params, window):
    engine = RolloutEngine.from_pretrained(ckpt, config=config)
    first = engine.generate(prompts, params)
    more = [SamplingParams(**{**vars(p), "max_new_tokens": window}) for p in params]
    runs = [first, engine.generate([o.prompt_token_ids + o.token_ids for o in first], more)]
    if sync_ckpt is not None:
        engine.load_weights(iter_checkpoint(sync_ckpt))
        runs.append(engine.generate(prompts, params))
    return runs


# ------------------------------------------------------------------------------------------- processes
@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("attention_workers", "expert_workers", "micro_batches", "tight", "sync"),
    [
        pytest.param(1, 1, 1, False, False, id="1-to-1-m1"),
        pytest.param(1, 2, 2, False, True, id="1-to-2-m2-sync"),
        # 5 blocks of 16 positions for 4 rows that grow to 2-4 blocks each: the youngest rows are preempted
        pytest.param(1, 2, 3, True, False, id="1-to-2-m3-preemption"),
        # two attention workers with unequal shares (4 and 3 requests): different step counts
        pytest.param(2, 2, 2, False, True, id="2-to-2-m2-sync"),
    ],
)
def test_disaggregated_equals_the_replica_engine(
    ckpts, attention_workers, expert_workers, micro_batches, tight, sync
):
    ckpt, other = ckpts
    prompts, params = _workload((30, 25, 30, 28, 30, 25, 20) if tight else (9, 17, 5, 12, 20, 7, 14))
    room = dict(max_model_len=80, kv_cache_tokens=80, max_batch_size=4) if tight else {}
    config = _config(micro_batches=micro_batches, **room)
    sync_ckpt = str(other) if sync else None
    a = attention_workers
    ranks = run_ranks(
        disagg_rank, a + expert_workers, a, str(ckpt), config, prompts, params, 6, sync_ckpt, timeout_s=240
    )
    for rank in range(a):
        outs, stats = ranks[rank]
        mine = share(prompts, rank, a), share(params, rank, a)
        want = _replica_runs(ckpt, sync_ckpt, config, *mine, 6)
        assert len(outs) == len(want) == (3 if sync else 2)
        for got_run, want_run in zip(outs, want):
            for got, wanted in zip(got_run, want_run, strict=True):
                _assert_same(got, wanted)
        assert stats[0].num_mixed_steps > 0
        assert (sum(s.num_preemptions for s in stats) > 0) == tight
    # every expert worker served every step of the longest attention worker, each MoE layer (2 of the 3 layers)
    # and micro-batch, and every token of every attention worker's steps
    steps = [[ranks[r][1][call].num_steps for r in range(a)] for call in range(len(ranks[0][1]))]
    for served in ranks[a:]:
        assert [s.steps for s in served] == [max(n) for n in steps]
        assert all(2 * s.steps <= s.dispatches <= 2 * s.steps * micro_batches for s in served)
        # routed dispatch: a worker holding some of the experts gets only the tokens routed to them
        assert all(0 < s.tokens <= s.offered for s in served)
        assert all(s.tokens < s.offered for s in served) == (expert_workers > 1)
    if a > 1:
        assert any(len(set(n)) > 1 for n in steps)  # unequal step counts were served


# ------------------------------------------------------------------------------------------- pieces
def test_split_step_covers_every_token_and_sample_once():
    rng = np.random.default_rng(0)
    for m in (1, 2, 3, 4):
        num_decode, piece_lengths = int(rng.integers(0, 6)), rng.integers(1, 9, size=rng.integers(0, 4))
        total = num_decode + int(piece_lengths.sum())
        if total == 0:
            continue
        tok = np.zeros((total, 4), dtype=np.int64)
        tok[:, 0] = np.arange(total) * 10
        starts = num_decode + np.concatenate([[0], np.cumsum(piece_lengths)[:-1]]).astype(int)
        for row, (start, length) in enumerate(zip(starts, piece_lengths)):
            tok[start : start + length, SEQ] = 100 + row
        samples = np.array([*range(num_decode), *(starts + piece_lengths - 1)][::2], dtype=np.int64)
        x = StepInputs(
            tokens_T4=tok,
            num_decode=num_decode,
            pieces=[(int(a), int(b)) for a, b in zip(starts, piece_lengths)],
            samples_S=samples,
            seeds_S=np.arange(len(samples), dtype=np.uint64),
            top_k_S=np.zeros(len(samples), np.int64),
            temperature_S=np.ones(len(samples), np.float32),
            top_p_S=np.ones(len(samples), np.float32),
        )
        parts = split_step(x, m)
        assert 1 <= len(parts) <= m
        np.testing.assert_array_equal(np.sort(np.concatenate([p.tokens for p in parts])), np.arange(total))
        np.testing.assert_array_equal(
            np.sort(np.concatenate([p.samples for p in parts])), np.arange(len(samples))
        )
        for p in parts:
            np.testing.assert_array_equal(p.inputs.tokens_T4, tok[p.tokens])
            assert p.inputs.num_decode <= num_decode and (p.tokens[: p.inputs.num_decode] < num_decode).all()
            for start, length in p.inputs.pieces:  # whole pieces: one sequence, consecutive flat tokens
                seq = p.inputs.tokens_T4[start : start + length, SEQ]
                assert (seq == seq[0]).all() and (np.diff(p.tokens[start : start + length]) == 1).all()
            np.testing.assert_array_equal(p.tokens[p.inputs.samples_S], samples[p.samples])
            np.testing.assert_array_equal(p.inputs.seeds_S, x.seeds_S[p.samples])


def test_expert_partials_sum_to_the_models_experts(ckpts):
    """Each expert worker's partial sum over its experts, added over the workers (any split), equals the
    model's own expert path (grouped GEMMs over all experts) in fp32."""
    ckpt, _ = ckpts
    engine = RolloutEngine.from_pretrained(ckpt, config=_config())
    spec, layer = engine.spec, engine.weights.layers[0]
    gen = torch.Generator().manual_seed(0)
    h_TH = torch.randn(11, spec.hidden_size, generator=gen)
    residual_TH = torch.randn(11, spec.hidden_size, generator=gen)
    weights_TK, ids_TK = engine.model.route(layer, h_TH)
    want_TH = engine.model.experts(layer, h_TH, weights_TK, ids_TK, residual_TH)
    layout = Layout(group=None, attention_ranks=(0,), expert_ranks=(1, 2, 3))
    for n in (1, 2, 4, spec.num_experts):
        workers = [ExpertWorker.from_pretrained(ckpt, r, layout) for r in expert_ranges(spec.num_experts, n)]
        got_TH = residual_TH + sum(w.partial(0, h_TH, weights_TK, ids_TK.int()) for w in workers)
        torch.testing.assert_close(got_TH, want_TH, rtol=1e-5, atol=1e-6)


def test_partial_weights_load_only_what_the_worker_holds(ckpts):
    ckpt, _ = ckpts
    spec = MoeModelSpec.from_pretrained(ckpt)
    attention = allocate(spec, torch.device("cpu"), torch.float32, experts=range(0))
    experts = allocate(spec, torch.device("cpu"), torch.float32, experts=range(2, 4), dense=False)
    assert attention.layers[0].gate_up_EFH.shape[0] == 0 and experts.embed_VH.numel() == 0
    load_checkpoint(WeightMap(spec, attention), ckpt)
    load_checkpoint(WeightMap(spec, experts), ckpt)
    full = RolloutEngine.from_pretrained(ckpt, config=_config()).weights
    torch.testing.assert_close(attention.layers[2].qkv_CH, full.layers[2].qkv_CH, rtol=0, atol=0)
    torch.testing.assert_close(experts.layers[0].down_EHF, full.layers[0].down_EHF[2:4], rtol=0, atol=0)
    named = dict(iter_checkpoint(ckpt))
    expert_name = "model.layers.0.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=r"expert 5 of layer 0 belongs to another expert worker.*holds none"):
        WeightMap(spec, attention).load([(expert_name, named[expert_name])])
    with pytest.raises(ValueError, match=r"expert 5 .* holds experts \[2, 4\)"):
        WeightMap(spec, experts).load([(expert_name, named[expert_name])])
    dense_name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match="held by the attention workers"):
        WeightMap(spec, experts).load([(dense_name, named[dense_name])])
    dense, per_worker = split_weights(named.items(), expert_ranges(spec.num_experts, 3))
    assert all("experts" not in name for name, _ in dense)
    for held, bucket in zip(expert_ranges(spec.num_experts, 3), per_worker):
        assert bucket and all(int(name.split(".experts.")[1].split(".")[0]) in held for name, _ in bucket)
    assert len(dense) + sum(len(b) for b in per_worker) == len(named)


def test_bad_layouts_and_settings_are_refused():
    with pytest.raises(ValueError, match="at least one attention and one expert worker"):
        Layout(group=None, attention_ranks=(0,), expert_ranks=())
    with pytest.raises(ValueError, match="must be distinct"):
        Layout(group=None, attention_ranks=(0, 1), expert_ranks=(1, 2))
    with pytest.raises(ValueError, match="9 expert workers for 8 experts"):
        expert_ranges(8, 9)
    assert [len(r) for r in expert_ranges(8, 3)] == [2, 3, 3]
    assert micro_batch_count(0) == 3 and micro_batch_count(2) == 2
    with pytest.raises(ValueError, match=r"rollout\.micro_batches=5"):
        micro_batch_count(5)
