"""RolloutEngine against transformers (tokens, log-probs, router picks) and against itself (batching, mixed
prefill + decode steps, preemption, windows, seeds, weight sync, paged vs slot cache layout) on tiny random
Qwen3-MoE and Mixtral checkpoints saved as HF folders."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from rollout_testlib import hf_greedy, hf_logprobs_and_routes, interpreter_results, save_tiny_model

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


# Blocks of 16 positions (prompt + 10 tokens cross a block boundary) and the slot layout (one 64-position block
# per sequence, what the engine had before paging).
@pytest.mark.parametrize("block", [16, 0], ids=["paged16", "slot"])
def test_greedy_logprobs_and_routing_match_transformers(tiny, block):
    path, hf = tiny
    engine = RolloutEngine.from_pretrained(path, config=small_config(kv_block_size=block))
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
    # 3 rows for 7 requests: later requests join as earlier ones finish, prefilled in the decode steps.
    engine = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(max_batch_size=3))
    batched = engine.generate(prompts, params)
    stats = engine.last_stats
    assert stats.num_mixed_steps >= 3 and stats.num_preemptions == 0
    assert stats.generate_s >= stats.prefill_s + stats.decode_s > 0  # mixed_s is part of decode_s
    assert stats.num_captures == 0 and stats.capture_s == 0.0  # no CUDA graphs on the CPU
    single = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(max_batch_size=1))
    for prompt, p, out in zip(prompts, params, batched):
        _assert_same(out, single.generate([prompt], p)[0])
        assert len(out.token_ids) == p.max_new_tokens


def test_chunked_prefill_in_mixed_steps_equals_whole_prefill(qwen_ckpt):
    """A 5-token step budget: prompts are cut into chunks (one crossing a block boundary) that share steps with
    the decoding rows."""
    prompts = [list(range(2, 21)), list(range(30, 37)), [9]]
    params = SamplingParams(max_new_tokens=6, temperature=0)
    whole = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config()).generate(prompts, params)
    config = small_config(max_batch_size=3, max_step_tokens=5, trace_steps=True)
    engine = RolloutEngine.from_pretrained(qwen_ckpt, config=config)
    for a, b in zip(whole, engine.generate(prompts, params)):
        _assert_same(a, b)
    stats = engine.last_stats
    assert stats.num_prefill_tokens == sum(map(len, prompts)) and len(stats.steps) == stats.num_steps
    assert max(t.num_decode + t.num_prefill for t in stats.steps) == 5
    assert stats.num_mixed_steps == sum(1 for t in stats.steps if t.num_decode and t.num_prefill) > 0


@pytest.mark.parametrize("step_tokens", [2048, 4], ids=["budget2048", "budget4"])
def test_blocks_running_out_preempt_without_losing_or_changing_anything(qwen_ckpt, step_tokens):
    """5 blocks of 16 positions for 4 requests that grow to 3-4 blocks each: the youngest are
    preempted (blocks freed, re-queued, prefilled again with their tokens) and every request comes back with the
    tokens, log-probs and routing of a run with room for all of them."""
    prompts = [[5, 7, 9, 11], list(range(1, 14)), [42, 43], list(range(60, 70))]
    params = [
        SamplingParams(max_new_tokens=n, temperature=t, seed=s)
        for n, t, s in zip((40, 33, 45, 37), (1.0, 0.0, 0.8, 1.0), (3, 4, 5, 6))
    ]
    roomy = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config()).generate(prompts, params)
    tight_cfg = small_config(max_batch_size=4, kv_cache_tokens=5 * 16, max_step_tokens=step_tokens)
    tight = RolloutEngine.from_pretrained(qwen_ckpt, config=tight_cfg)
    outs = tight.generate(prompts, params)
    stats = tight.last_stats
    assert stats.num_preemptions > 0 and stats.kv_blocks == 5 and stats.kv_blocks_peak == 5
    assert [o.index for o in outs] == [0, 1, 2, 3]
    for a, b, p in zip(outs, roomy, params):
        _assert_same(a, b)
        assert len(a.token_ids) == p.max_new_tokens and a.num_tokens == len(a.routed_experts)
    # the recomputed prefixes are extra prefill work, counted
    assert stats.num_prefill_tokens > sum(map(len, prompts))


@pytest.mark.parametrize(
    "config",
    [{}, {"max_batch_size": 3, "max_step_tokens": 5}, {"max_batch_size": 4, "kv_cache_tokens": 5 * 16}],
    ids=["roomy", "chunked", "preempting"],
)
def test_overlapped_steps_equal_waited_steps(qwen_ckpt, config):
    """Scheduling step t + 1 before step t's tokens are read (its decoding rows fed from the device) changes no
    token, log-prob, route, finish or schedule: responses end by EOS, stop tokens and length at every step, one
    request draws a single token, and (preempting) the youngest rows are preempted and recomputed."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (3, 9, 1, 14, 6, 2, 11, 5)]
    params = [
        SamplingParams(max_new_tokens=n, temperature=t, seed=s, stop_token_ids=stop)
        for n, t, s, stop in zip(
            (30, 17, 1, 33, 12, 40, 7, 25),
            (1.0, 1.3, 1.0, 0.7, 1.0, 1.0, 0, 1.0),
            range(8),
            ([4, 25], [], [7], [84, 91], [], [51], [], [28, 1]),
        )
    ]
    runs = {}
    for overlap in (True, False):
        engine = RolloutEngine.from_pretrained(
            qwen_ckpt, config=small_config(**config, overlap_steps=overlap, trace_steps=True)
        )
        engine.eos_token_ids = frozenset({15, 18})
        fed, launch = [], engine.runner.launch
        engine.runner.launch = lambda x, fed=fed, launch=launch: fed.append(x.feed_D is not None) or launch(x)
        runs[overlap] = engine.generate(prompts, params), engine.last_stats, fed
    (overlapped, a, fed), (waited, b, not_fed) = runs[True], runs[False]
    assert sum(fed) > 0 and not any(not_fed)
    for x, y in zip(overlapped, waited):
        _assert_same(x, y, lp_atol=0)
        assert x.num_tokens == len(x.routed_experts)
    assert {o.finish_reason for o in waited} == {"eos", "stop", "length"}
    assert [(t.num_decode, t.num_prefill, t.kv_positions) for t in a.steps] == [
        (t.num_decode, t.num_prefill, t.kv_positions) for t in b.steps
    ]
    assert (a.num_preemptions, a.num_prefill_tokens, a.peak_running) == (
        b.num_preemptions,
        b.num_prefill_tokens,
        b.peak_running,
    )
    assert (a.num_preemptions > 0) == ("kv_cache_tokens" in config)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "config",
    [{}, {"max_batch_size": 2, "max_step_tokens": 3}, {"kv_block_size": 0}],
    ids=["paged", "chunked", "slot"],
)
def test_resumed_window_equals_uninterrupted_run(qwen_ckpt, temperature, config):
    engine = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(**config))
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
    with pytest.raises(ValueError, match=r"exceed rollout\.max_model_len=64"):
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
    with pytest.raises(ValueError, match=r"max_step_tokens=4 is below rollout\.max_batch_size=8"):
        RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(max_step_tokens=4))
    with pytest.raises(ValueError, match="kv_block_size=24 is not a multiple of 16"):
        RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(kv_block_size=24))
    with pytest.raises(
        ValueError, match=r"max_model_len=600 exceeds the model's max_position_embeddings=512"
    ):
        RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(max_model_len=600))


def test_max_model_len_defaults_to_the_models_limit(tmp_path):
    hf = save_tiny_model("qwen3_moe", tmp_path, seed=3, max_position_embeddings=256)
    engine = RolloutEngine.from_pretrained(tmp_path)
    assert engine.max_model_len == 256
    prompt = [t % 90 + 1 for t in range(200)]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=56, temperature=0))[0]
    assert out.num_tokens == 256
    ref_lp, ref_routes = hf_logprobs_and_routes(hf, prompt + out.token_ids, len(prompt))
    np.testing.assert_allclose(out.logprobs, ref_lp, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(out.routed_experts, ref_routes)


def test_missing_checkpoint_tensor_is_an_error(qwen_ckpt, tmp_path):
    from safetensors.torch import save_file

    tensors = dict(iter_checkpoint(qwen_ckpt))
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    (tmp_path / "config.json").write_text((qwen_ckpt / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*experts\.5\.down_proj"):
        RolloutEngine.from_pretrained(tmp_path, config=small_config())


ENGINE_PERSISTENT = """
import json, sys
import numpy as np
from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig

import rollout.kernels.tiling as tiling

# Steps of at most 6 tokens: decode rows and prompt chunks share steps, so the kernel sees both phases. Their
# prefill segments are small, so the kernel cuts them into decode tiles with the rows; with the rule's threshold
# at 0 the rows go into prefill tiles with them.
outs = {}
for name, kernel, small_pairs in (("grouped", "grouped", 16), ("decode_tiles", "persistent", 16),
                                  ("prefill_tiles", "persistent", 0)):
    tiling.SMALL_PREFILL_PAIRS = small_pairs
    config = RolloutConfig(
        max_model_len=64, max_batch_size=4, kv_cache_tokens=4 * 64, max_step_tokens=6, expert_kernel=kernel
    )
    engine = RolloutEngine.from_pretrained(sys.argv[1], config=config)
    outs[name] = engine.generate(json.loads(sys.argv[2]), SamplingParams(max_new_tokens=8, temperature=0))
    mixed = engine.last_stats.num_mixed_steps
result = {"mixed_steps": mixed}
for name in ("decode_tiles", "prefill_tiles"):
    pairs = list(zip(outs["grouped"], outs[name]))
    result[name] = {
        "tokens_equal": all(a.token_ids == b.token_ids for a, b in pairs),
        "routes_equal": all(np.array_equal(a.routed_experts, b.routed_experts) for a, b in pairs),
        "logprob_diff": max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in pairs),
    }
print(json.dumps(result))
"""


def test_persistent_expert_kernel_equals_grouped_in_the_engine(qwen_ckpt):
    """rollout.expert_kernel=persistent (the Triton kernel, interpreted on the CPU) gives the grouped path's tokens,
    routes and log-probs (fp32) through mixed prefill + decode steps, whichever way it cuts their prefill."""
    result = interpreter_results("-c", ENGINE_PERSISTENT, str(qwen_ckpt), json.dumps(PROMPTS), timeout=600)
    assert result["mixed_steps"] > 0, result
    for cut in ("decode_tiles", "prefill_tiles"):
        assert result[cut]["tokens_equal"] and result[cut]["routes_equal"], result
        assert result[cut]["logprob_diff"] < 1e-5, result


def test_persistent_expert_kernel_needs_cuda_or_the_interpreter(qwen_ckpt):
    with pytest.raises(ValueError, match=r"rollout\.expert_kernel=persistent needs a CUDA device"):
        RolloutEngine.from_pretrained(qwen_ckpt, config=small_config(expert_kernel="persistent"))


def test_a_launched_steps_outputs_are_refused_once_its_buffers_are_reused(qwen_ckpt):
    """The runner stages and fetches through two host buffer sets taken in turn: a step's outputs stay readable
    until the launch after the next one, and asking later is an error, not another step's numbers."""
    from rollout.runner import StepInputs

    engine = RolloutEngine.from_pretrained(qwen_ckpt, config=small_config())
    row = engine.cache.table.padding_row  # the all-null row: the step writes no sequence's K/V

    def one_token(token: int) -> StepInputs:
        return StepInputs(
            tokens_T4=np.array([[token, 0, row, 0]], dtype=np.int64),
            num_decode=0,
            pieces=[(0, 1)],
            samples_S=np.array([0]),
            seeds_S=np.array([1], dtype=np.uint64),
            top_k_S=np.array([0]),
            temperature_S=np.array([0.0], dtype=np.float32),
            top_p_S=np.array([1.0], dtype=np.float32),
        )

    first, second, third = (engine.runner.launch(one_token(t)) for t in (5, 6, 5))
    with pytest.raises(RuntimeError, match="reused its buffers"):
        first.outputs()
    assert second.outputs().routes_TLK.shape == (1, engine.spec.num_moe_layers, engine.spec.top_k)
    lp = third.outputs().logprobs_S.copy()
    np.testing.assert_array_equal(lp, engine.runner.run(one_token(5)).logprobs_S)
