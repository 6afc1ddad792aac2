"""The DeepSpeed ZeRO engine against the Megatron engine (EP 1, fp32, CPU) on tiny Qwen3-MoE and Mixtral checkpoints:
one T-PPO step (loss, gradient norm, updated weights by HF name) with and without routing replay, forward-only
log-probs (also against transformers itself), the critic's values, ZeRO-3 on 2 ranks = 1 rank, save -> load ->
the same next step, and strict replay errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deepspeed_workers import objective, policy_batch, with_old_logprobs, zero_worker
from engine_testing import make_hf_checkpoint, run_ranks

from tppo.engine.batch import TrainBatch
from tppo.engine.config import BackendConfig, OptimConfig, ParallelConfig
from tppo.engine.convert import model_config_from_hf
from tppo.engine.deepspeed_engine import DeepSpeedEngine
from tppo.engine.engine import MegatronEngine
from tppo.engine.hf_replay import HFRoutingReplay, replayed_weights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

OPTIM = OptimConfig(lr=1e-3, grad_clip=0.5, weight_decay=0.1)
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def ckpt(request, tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("ds") / request.param), request.param)


def _batches() -> list[TrainBatch]:
    return [policy_batch(1, lengths=(9, 6)), policy_batch(2, rows=3, tokens=7, lengths=(7, 7, 4))]


def _hf_weights(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu() for bucket in engine.iter_hf_weights(1 << 16) for n, t in bucket}


def _other_routes(recorded_BTLK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Top-k ids that differ from the live router's for every token: its choice shifted by one expert."""
    return ((recorded_BTLK.long() + 1) % num_experts).contiguous()


def _step(engine, batches, *, replay: bool):
    loss_fn = objective(batches)
    return engine.train_step(batches, loss_fn, require_replay=replay, keep_logprobs=True)


@pytest.mark.parametrize("replay", [False, True], ids=["live", "replay"])
def test_one_tppo_step_matches_megatron(ckpt, replay):
    m = model_config_from_hf(ckpt)
    meg = MegatronEngine(m, ParallelConfig(), OPTIM)
    ds = DeepSpeedEngine(m, OPTIM, zero=BackendConfig("deepspeed", 2))
    batches = _batches()
    before = meg.forward(batches)
    with_old_logprobs(batches, before)
    if replay:
        live = ds.forward(batches, record_routing=True)
        for b, o in zip(batches, live):
            b.routed_experts_BTLK = _other_routes(o.routed_experts_BTLK, m.num_experts)
        # Replay matters: the shifted routes change the log-probs.
        replayed = ds.forward(batches, require_replay=True)
        assert not torch.allclose(replayed[0].logprobs_BT, live[0].logprobs_BT, atol=1e-3)
    r_meg, r_ds = _step(meg, batches, replay=replay), _step(ds, batches, replay=replay)
    assert not r_meg.skipped and not r_ds.skipped
    assert r_meg.grad_norm > OPTIM.grad_clip  # clipping is on in both
    assert math.isclose(r_ds.loss, r_meg.loss, rel_tol=0, abs_tol=1e-5)
    assert math.isclose(r_ds.grad_norm, r_meg.grad_norm, rel_tol=1e-5, abs_tol=1e-5)
    assert r_ds.metrics.keys() == r_meg.metrics.keys() and r_ds.lr == r_meg.lr
    # Both keep the training forward's log-probs: the old ones of a one-step update (algo.old_logprobs=update).
    for kept_ds, kept_meg, out in zip(r_ds.outputs, r_meg.outputs, before, strict=True):
        torch.testing.assert_close(kept_ds.logprobs_BT.cpu(), kept_meg.logprobs_BT.cpu(), rtol=0, atol=1e-5)
        if not replay:  # with replay the step ran other experts than the forward before it
            torch.testing.assert_close(kept_meg.logprobs_BT.cpu(), out.logprobs_BT, rtol=1e-5, atol=2e-6)
    w_meg, w_ds = _hf_weights(meg), _hf_weights(ds)
    assert sorted(w_ds) == sorted(w_meg)
    for name in w_meg:
        torch.testing.assert_close(w_ds[name], w_meg[name], rtol=0, atol=1e-5, msg=name)


def test_forward_logprobs_match_megatron_and_transformers(ckpt):
    from transformers import AutoModelForCausalLM

    m = model_config_from_hf(ckpt)
    meg = MegatronEngine(m, ParallelConfig(), OptimConfig(), optimizer="none")
    ds = DeepSpeedEngine(m, OptimConfig(), optimizer="none")
    batches = _batches()
    batches[1].temperature = 0.7
    o_meg = meg.forward(batches, with_entropy=True, record_routing=True)
    o_ds = ds.forward(batches, with_entropy=True, record_routing=True)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for b, a, r in zip(batches, o_ds, o_meg):
        valid = b.valid_BT()
        torch.testing.assert_close(a.logprobs_BT, r.logprobs_BT, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.entropy_BT, r.entropy_BT, rtol=0, atol=1e-5)
        # Both routers pick the same experts for every real token (as sets: top-k order aside).
        ids_ds, ids_meg = (
            x.long().sort(-1).values[valid] for x in (a.routed_experts_BTLK, r.routed_experts_BTLK)
        )
        assert torch.equal(ids_ds, ids_meg)
        with torch.no_grad():
            logits = hf(input_ids=b.input_ids_BT, attention_mask=b.attention_mask_BT.long()).logits
        own = torch.log_softmax(logits[:, :-1].float() / b.temperature, -1)
        own = own.gather(-1, b.input_ids_BT[:, 1:, None])[..., 0] * valid[:, 1:]
        torch.testing.assert_close(a.logprobs_BT[:, 1:], own, rtol=0, atol=1e-5)


def test_cpu_start_does_not_wait_on_a_stale_extension_lock(tmp_path):
    """DeepSpeed's CPU start would JIT-load its shared-memory all-reduce op under a lock in the torch extensions
    cache, and a process killed while holding it leaves a lock on which every later start waits forever. In a
    fresh process whose extensions cache holds such a stale lock, the engine's start finishes and leaves that
    op out."""
    stale = tmp_path / f"py{sys.version_info.major}{sys.version_info.minor}_cpu" / "deepspeed_shm_comm"
    stale.mkdir(parents=True)
    (stale / "lock").touch()
    code = (
        "from tppo.engine.deepspeed_engine import _start_distributed\n"
        "import deepspeed.comm.comm as c\n"
        "_start_distributed(False)\n"
        "print('shm op:', c.cdb.shm_comm_op)\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shm op: None" in done.stdout
    assert (stale / "lock").exists()  # untouched: nothing waited on it or took it


def test_critic_values_match_megatron(ckpt):
    m = model_config_from_hf(ckpt)
    meg = MegatronEngine(m, ParallelConfig(), OptimConfig(), role="critic", optimizer="none")
    ds = DeepSpeedEngine(m, OptimConfig(), role="critic", optimizer="none")
    assert ds.module.value_head.weight.shape == meg.module.output_layer.weight.shape
    assert 0.5 * m.init_std < float(ds.module.value_head.weight.std()) < 2 * m.init_std
    with torch.no_grad():  # the heads are drawn from different generators: compare the bodies under one head
        ds.module.value_head.weight.copy_(meg.module.output_layer.weight)
    batches = _batches()
    for a, r in zip(ds.forward(batches), meg.forward(batches)):
        assert a.logprobs_BT is None
        torch.testing.assert_close(a.values_BT, r.values_BT, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.end_values_S, r.end_values_S, rtol=0, atol=1e-5)


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_two_ranks_equals_one_rank(ckpt, stage):
    m = model_config_from_hf(ckpt)
    batches = [policy_batch(3, lengths=(9, 5)), policy_batch(4, lengths=(8, 9))]
    ref = DeepSpeedEngine(
        m, OptimConfig(lr=1e-3, grad_clip=0.5), zero=BackendConfig("deepspeed", 3), optimizer="none"
    )
    with_old_logprobs(batches, ref.forward(batches))
    loss_fn = objective(batches)
    one = zero_worker(0, stage, ckpt, [batches], loss_fn)
    two = run_ranks(zero_worker, 2, stage, ckpt, [[batches[0]], [batches[1]]], loss_fn)
    for rank in two:
        assert math.isclose(rank["loss"], one["loss"], abs_tol=1e-6)
        assert math.isclose(rank["grad_norm"], one["grad_norm"], rel_tol=1e-5)
        assert sorted(rank["weights"]) == sorted(one["weights"])
        for name, t in one["weights"].items():
            # Adam's first step is lr g / (|g| + eps): a coordinate with |g| near eps turns rounding of the
            # two-rank sum into ~1e-5 of the update (seen: one lm_head entry of 3072 at 6e-6).
            torch.testing.assert_close(rank["weights"][name], t, rtol=0, atol=1e-5, msg=name)


def test_save_load_gives_the_same_next_step(ckpt, tmp_path):
    m = model_config_from_hf(ckpt)
    first, second = _batches(), [policy_batch(5), policy_batch(6, lengths=(9, 4))]
    a = DeepSpeedEngine(m, OPTIM)
    with_old_logprobs(first + second, a.forward(first + second))
    _step(a, first, replay=False)
    a.save(str(tmp_path / "ckpt"))
    b = DeepSpeedEngine(m, OPTIM, seed=1)
    b.load(str(tmp_path / "ckpt"))
    assert b.step_count == a.step_count == 1
    a.offload()  # a CPU run keeps its states where they are; the next call brings back what moved
    assert a.offloaded
    r_a, r_b = _step(a, second, replay=False), _step(b, second, replay=False)
    assert not a.offloaded
    assert (r_a.loss, r_a.grad_norm, r_a.lr) == (r_b.loss, r_b.grad_norm, r_b.lr)
    w_a, w_b = _hf_weights(a), _hf_weights(b)
    assert all(torch.equal(w_a[n], w_b[n]) for n in w_a)


def test_missing_or_misshaped_routing_raises(ckpt):
    m = model_config_from_hf(ckpt)
    ds = DeepSpeedEngine(m, OptimConfig(), optimizer="none")
    batch = policy_batch(7)
    with pytest.raises(ValueError, match="routing replay is required"):
        ds.forward([batch], require_replay=True)
    routed = ds.forward([batch], record_routing=True)[0].routed_experts_BTLK
    bad_layers = TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=routed[:, :, :1])
    with pytest.raises(ValueError, match="MoE layers"):
        ds.forward([bad_layers])
    bad_k = TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=routed[..., :1])
    with pytest.raises(ValueError, match="k=1"):
        ds.forward([bad_k])
    # The hooks themselves: replay on with no ids for a layer, or ids for another token count.
    replay = ds.replay
    with pytest.raises(ValueError, match="no replay data"), replay.replaying([None] * replay.num_layers):
        ds.ds(input_ids=batch.input_ids_BT)
    short = [torch.zeros(3, replay.topk, dtype=torch.long)] * replay.num_layers
    with pytest.raises(ValueError, match=r"expected \(tokens=18, k=2\)"), replay.replaying(short):
        ds.ds(input_ids=batch.input_ids_BT)
    # ... and nothing stays armed afterwards: a plain forward routes live again.
    assert ds.forward([batch])[0].logprobs_BT.shape == batch.shape


def test_replayed_weights_equal_the_routers_own_at_its_own_choice():
    logits = torch.randn(5, 6, dtype=torch.float64)
    top = torch.softmax(logits, -1).topk(2, -1)
    for normalize in (True, False):
        expect = top.values / top.values.sum(-1, keepdim=True) if normalize else top.values
        got = replayed_weights(logits, top.indices, normalize=normalize, dtype=torch.float64)
        torch.testing.assert_close(got, expect)
    with pytest.raises(ValueError, match="no router module"):
        HFRoutingReplay(torch.nn.Linear(2, 2))


def test_reference_on_zero3_with_offload_loads_the_policys_export(ckpt, tmp_path):
    """A trained Megatron policy exported to HF and loaded into a forward-only ZeRO-3 engine with parameters in
    host memory (the reference of a KL penalty) gives the policy's own log-probs."""
    m = model_config_from_hf(ckpt)
    policy = MegatronEngine(m, ParallelConfig(), OPTIM)
    batches = _batches()
    with_old_logprobs(batches, policy.forward(batches))
    _step(policy, batches, replay=False)  # the export differs from the checkpoint the reference starts from
    policy.export_hf(str(tmp_path / "policy"))
    zero = BackendConfig("deepspeed", zero_stage=3, offload_param=True)
    reference = DeepSpeedEngine(m, OPTIM, zero=zero, optimizer="none")
    reference.load_hf(str(tmp_path / "policy"))
    for a, r in zip(reference.forward(batches), policy.forward(batches)):
        torch.testing.assert_close(a.logprobs_BT, r.logprobs_BT, rtol=0, atol=1e-5)
    # Between calls no parameter is materialised (ZeRO-3 leaves an empty placeholder): none stays resident on the
    # device, not even the small ones DeepSpeed keeps by default (norms; 33 of 91 tensors on an H100).
    held = [n for n, p in reference.module.named_parameters() if p.data.numel() > 0]
    assert not held, held
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        reference.load_hf(str(tmp_path / "empty"))
    from safetensors.torch import load_file, save_file

    # a checkpoint without layer 1 (its index still lists the shard, which no longer holds those tensors)
    for shard in map(str, (tmp_path / "policy").glob("*.safetensors")):
        save_file({n: t for n, t in load_file(shard).items() if "layers.1." not in n}, shard)
    with pytest.raises(ValueError, match="lacks"):
        reference.load_hf(str(tmp_path / "policy"))
