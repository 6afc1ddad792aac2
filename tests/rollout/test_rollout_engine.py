"""RolloutEngine against transformers (tokens, log-probs, router picks) and against itself (batching, windows,
seeds, chunked prefill, weight sync) on tiny random Qwen3-MoE and Mixtral checkpoints saved as HF folders."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from rollout_testlib import hf_greedy, hf_logprobs_and_routes, save_tiny_model

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig
from rollout.weights import iter_checkpoint

torch.set_num_threads(2)

PROMPTS = [[5, 7, 9, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [42], [17, 18]]
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_dense_layers": ("qwen3_moe", {"mlp_only_layers": [1], "norm_topk_prob": False}),
    "mixtral": ("mixtral", {}),
}


def small_config(**kw) -> RolloutConfig:
    base = dict(max_model_len=64, max_batch_size=8, kv_cache_tokens=8 * 64)
    base.update(kw)
    return RolloutConfig(**base)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory):
    arch, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(arch, path, seed=1, **overrides)
    return path, hf


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_engine")
    save_tiny_model("qwen3_moe", path, seed=2)
    return path


def test_greedy_logprobs_and_routing_match_transformers(tiny):
    path, hf = tiny
    engine = RolloutEngine.from_pretrained(path, config=small_config())
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 10)
        ref_lp, ref_routes = hf_logprobs_and_routes(hf, prompt + out.token_ids, len(prompt))
        np.testing.assert_allclose(out.logprobs, ref_lp, atol=1e-4, rtol=0)
        assert (
            out.routed_experts.shape == ref_routes.shape == (len(prompt) + 10, engine.spec.num_moe_layers, 2)
        )
        np.testing.assert_array_equal(out.routed_experts, ref_routes)
        assert out.finish_reason == "length" and not out.finished
    dense = [i for i in range(3) if i not in engine.moe_layers]
    assert dense == list(getattr(hf.config, "mlp_only_layers", []))


@pytest.mark.parametrize("capacity", [1, 2, 64])
def test_padded_expert_path_matches_transformers(tiny, capacity):
    """The dense per-expert path (GPU decode) with pairs past an expert's capacity through grouped GEMMs: capacity
    1 and 2 overflow on nearly every expert, 64 never does."""
    path, hf = tiny
    engine = RolloutEngine.from_pretrained(path, config=small_config())
    engine.model.capacity_for = lambda num_pairs, num_experts: capacity
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 6)
        ref_lp, ref_routes = hf_logprobs_and_routes(hf, prompt + out.token_ids, len(prompt))
        np.testing.assert_allclose(out.logprobs, ref_lp, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(out.routed_experts, ref_routes)


def test_padded_capacity_rule():
    from rollout.model import padded_capacity

    assert padded_capacity(256 * 8, 128) == 32  # decode at batch 256, Qwen3-30B-A3B: 16 pairs per expert
    assert padded_capacity(32 * 8, 128) is None  # 2 pairs per expert: grouped GEMMs
    assert padded_capacity(4096 * 8, 128) is None  # prefill: padding would waste compute
    assert padded_capacity(256 * 2, 8) == 128  # Mixtral at batch 256: 64 pairs per expert


def test_compiled_glue_falls_back_to_eager_once(monkeypatch):
    from rollout import model

    def broken_compile(fn, **_):
        def run(*args):
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    glue = model.compiled_or_eager(model.swiglu)
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="torch.compile of swiglu failed .*no compiler here"):
        first = glue(x)
    torch.testing.assert_close(first, model.swiglu(x), rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager from now on: no second attempt, no second warning
        torch.testing.assert_close(glue(x), first, rtol=0, atol=0)
    failing = model.compiled_or_eager(lambda t: t.view(5, 5))
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="shape"):
        failing(x)  # the eager function's own error surfaces


def test_eos_stops_like_transformers(tiny):
    path, hf = tiny
    engine = RolloutEngine.from_pretrained(path, config=small_config())
    free_run = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, temperature=0))[0].token_ids
    eos = free_run[4]
    engine.eos_token_ids = frozenset({eos})
    out = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, temperature=0))[0]
    assert out.token_ids == hf_greedy(hf, PROMPTS[1], 12, eos_token_id=eos)
    assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    assert out.finish_reason == "eos" and out.finished
    assert out.routed_experts.shape[0] == len(PROMPTS[1]) + len(out.token_ids)
    ignored = engine.generate(
        [PROMPTS[1]], SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    )[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"
    stopped = engine.generate(
        [PROMPTS[1]], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[eos], ignore_eos=True)
    )[0]
    assert stopped.token_ids == out.token_ids and stopped.finish_reason == "stop"


def _assert_same(a, b, lp_atol=1e-5):
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=lp_atol, rtol=0)
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    assert a.finish_reason == b.finish_reason


def test_continuous_batching_equals_one_at_a_time(qwen_ckpt):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (3, 9, 1, 14, 6, 2, 11)]
    params = [
        SamplingParams(max_new_tokens=n, temperature=t, seed=s)
        for n, t, s in zip((5, 17, 9, 3, 12, 20, 7), (0, 1.0, 0, 0.7, 1.3, 0, 1.0), range(7))
    ]
    # 3 slots for 7 requests: later requests join as earlier ones finish, survivors get compacted.
    batched = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(max_batch_size=3)).generate(
        prompts, params
    )
    single = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(max_batch_size=1))
    for prompt, p, out in zip(prompts, params, batched):
        _assert_same(out, single.generate([prompt], p)[0])
        assert len(out.token_ids) == p.max_new_tokens


def test_chunked_prefill_equals_whole_prefill(qwen_ckpt):
    prompts = [list(range(2, 15)), list(range(30, 37)), [9]]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    whole = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config()).generate(prompts, params)
    chunked = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(max_prefill_tokens=5))
    for a, b in zip(whole, chunked.generate(prompts, params)):
        _assert_same(a, b)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resumed_window_equals_uninterrupted_run(qwen_ckpt, temperature):
    engine = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config())
    prompt = [4, 8, 15, 16, 23, 42]
    full = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=temperature, seed=5))[0]
    first = engine.generate([prompt], SamplingParams(max_new_tokens=5, temperature=temperature, seed=5))[0]
    assert first.token_ids == full.token_ids[:5] and first.finish_reason == "length"
    resumed = engine.generate(
        [prompt + first.token_ids], SamplingParams(max_new_tokens=7, temperature=temperature, seed=5)
    )[0]
    assert resumed.token_ids == full.token_ids[5:]
    np.testing.assert_allclose(resumed.logprobs, full.logprobs[5:], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(resumed.routed_experts, full.routed_experts)


def test_seeded_sampling_is_reproducible(qwen_ckpt):
    engine = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config())
    prompts = [[1, 2, 3]] * 4
    params = [
        SamplingParams(max_new_tokens=15, temperature=1.0, top_p=0.9, top_k=20, seed=s) for s in (1, 2, 3, 1)
    ]
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    for x, y in zip(a, b):
        _assert_same(x, y, lp_atol=0)
    assert a[0].token_ids == a[3].token_ids  # same seed, same prompt, different rows
    assert len({tuple(o.token_ids) for o in a[:3]}) == 3
    unseeded = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=15))[0]
    again = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=15, seed=unseeded.seed))[0]
    assert again.token_ids == unseeded.token_ids


def test_load_weights_in_place_matches_fresh_engine(qwen_ckpt, tmp_path):
    other = tmp_path / "other"
    hf_other = save_tiny_model("qwen3_moe", other, seed=9)
    target = RolloutEngine.from_pretrained(other, config=small_config())
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = target.generate(PROMPTS, params)
    reference = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config()).generate(PROMPTS, params)
    # Hub per-expert names from the checkpoint, in buckets of 7 tensors.
    named = list(iter_checkpoint(qwen_ckpt))
    for i in range(0, len(named), 7):
        target.load_weights(named[i : i + 7])
    for a, b in zip(target.generate(PROMPTS, params), reference):
        _assert_same(a, b)
    assert any(a.token_ids != b.token_ids for a, b in zip(before, reference))
    # transformers' fused in-memory names (experts.gate_up_proj / down_proj) restore the other model.
    n = target.load_weights(hf_other.state_dict().items())
    assert n == len(target._weight_map.expected_units())
    for a, b in zip(target.generate(PROMPTS, params), before):
        _assert_same(a, b)


def test_bad_inputs_raise_clear_errors(qwen_ckpt):
    engine = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config())
    with pytest.raises(ValueError, match="unknown parameter name"):
        engine.load_weights([("model.layers.0.mlp.experts.99.up_proj.weight", torch.zeros(24, 48))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 60], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1000]], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(kv_cache_tokens=10))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        RolloutEngine.from_pretrained(
            qwen_ckpt, config=small_config(kv_cache_tokens=0, kv_cache_fraction=1e-12)
        )


def test_missing_checkpoint_tensor_is_an_error(qwen_ckpt, tmp_path):
    from safetensors.torch import save_file

    tensors = dict(iter_checkpoint(qwen_ckpt))
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    (tmp_path / "config.json").write_text((qwen_ckpt / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*experts\.5\.down_proj"):
        RolloutEngine.from_pretrained(tmp_path, config=small_config())
