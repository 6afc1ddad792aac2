"""The training engine on CPU: the optimizer really moves the weights (Megatron's main_grad handed over),
clipping, LR schedules, the non-finite skip, packed = padded, the critic, offload and checkpoints."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from engine_testing import make_hf_checkpoint

from tppo.algo.batching import place, place_by_tokens, policy_batch, split_for_ranks
from tppo.algo.config import AlgoConfig
from tppo.algo.objectives import policy_objective
from tppo.algo.pool import Sample
from tppo.engine.batch import LossOutput, TrainBatch
from tppo.engine.config import ModelConfig, OptimConfig, ParallelConfig
from tppo.engine.convert import model_config_from_hf
from tppo.engine.engine import MegatronEngine, lr_at

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("train") / "m"), "mixtral")


def _engine(ckpt, **optim) -> MegatronEngine:
    cfg = dict(lr=1e-2, grad_clip=0.0)
    cfg.update(optim)
    return MegatronEngine(model_config_from_hf(ckpt), ParallelConfig(), OptimConfig(**cfg))


def _batch(seed: int, b: int = 2, t: int = 9) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    return TrainBatch(input_ids_BT=torch.randint(0, 96, (b, t), generator=g))


def _nll(out, batch):
    lp = out.logprobs_BT
    return LossOutput(loss_sum=-lp.sum(), denominator=lp.numel(), metrics={"mean_lp": float(lp.mean())})


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def test_optimizer_step_moves_weights_like_adamw_on_main_grad(ckpt):
    engine = _engine(ckpt, weight_decay=0.1)
    before = _params(engine)
    engine.forward_backward([_batch(0)], _nll)
    grads = {n: g.clone() for n, g in engine.named_grads().items()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    result = engine.optimizer_step()
    after = _params(engine)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert sorted(moved) == sorted(before)  # every weight moved
    # Independent reference: torch's AdamW on copies of the weights with the reduced gradients.
    ref = {n: t.clone().requires_grad_() for n, t in before.items()}
    decay = [ref[n] for n in ref if ref[n].dim() > 1]
    no_decay = [ref[n] for n in ref if ref[n].dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
    )
    for n, t in ref.items():
        t.grad = grads[n]
    opt.step()
    # Bit-exact on CPU (the same torch AdamW); on a GPU Megatron runs a fused Adam kernel: rounding only.
    tol = dict(rtol=0, atol=0) if not torch.cuda.is_available() else dict(rtol=1e-5, atol=1e-7)
    for n in before:
        torch.testing.assert_close(after[n], ref[n].detach(), **tol)
    assert not result.skipped and result.lr == 1e-2
    assert math.isclose(
        result.grad_norm, math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())), rel_tol=1e-5
    )


def test_training_lowers_the_loss(ckpt):
    engine = _engine(ckpt)
    batches = [_batch(1), _batch(2)]
    losses = [engine.train_step(batches, _nll).loss for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5
    assert engine.step_count == 6


def test_gradient_clipping_scales_the_update(ckpt):
    clipped, plain = _engine(ckpt, grad_clip=0.05, lr=1e-3), _engine(ckpt, lr=1e-3)
    r_c = clipped.train_step([_batch(3)], _nll)
    r_p = plain.train_step([_batch(3)], _nll)
    assert r_c.grad_norm > 0.05 and math.isclose(r_c.grad_norm, r_p.grad_norm, rel_tol=1e-6)
    # Adam is scale-invariant per coordinate except for eps: a clipped first step moves (almost) the same,
    # so check the clipped gradient went in through the second moment instead.
    scale = 0.05 / (r_c.grad_norm + 1e-6)
    # The same first parameter in both (torch's AdamW on CPU, the one inside Megatron's optimizer on a GPU).
    state_c = next(iter(clipped._torch_optimizers()[0].state.values()))
    state_p = next(iter(plain._torch_optimizers()[0].state.values()))
    torch.testing.assert_close(state_c["exp_avg"], state_p["exp_avg"] * scale, rtol=1e-5, atol=1e-12)


def test_lr_schedules_closed_form():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=4, schedule="cosine")
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 14) == 1.0
    assert math.isclose(lr_at(9, cfg, 14), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(lr_at(14, cfg, 14), 0.1) and math.isclose(lr_at(99, cfg, 14), 0.1)
    with pytest.raises(ValueError, match="needs total_steps"):
        lr_at(5, cfg, None)
    const = OptimConfig(lr=2.0, warmup_steps=2)
    assert [lr_at(s, const) for s in range(4)] == [1.0, 2.0, 2.0, 2.0]


def test_engine_applies_the_schedule(ckpt):
    engine = MegatronEngine(
        model_config_from_hf(ckpt),
        ParallelConfig(),
        OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine"),
        total_steps=4,
    )
    lrs = [engine.train_step([_batch(4)], _nll).lr for _ in range(4)]
    assert lrs == [lr_at(s, engine.optim_cfg, 4) for s in range(4)]


def test_non_finite_gradient_skips_the_update(ckpt):
    engine = _engine(ckpt)
    before = _params(engine)

    def nan_loss(out, batch):
        return LossOutput(loss_sum=out.logprobs_BT.sum() * float("nan"), denominator=1)

    result = engine.train_step([_batch(5)], nan_loss)
    assert result.skipped and engine.step_count == 0
    assert all(torch.equal(before[n], t) for n, t in _params(engine).items())
    assert not engine.train_step([_batch(5)], _nll).skipped


def test_loss_is_normalised_over_microbatches(ckpt):
    engine = _engine(ckpt)
    b1, b2 = _batch(6, b=1, t=5), _batch(7, b=3, t=8)
    outs = engine.forward([b1, b2])
    expected = -(outs[0].logprobs_BT.sum() + outs[1].logprobs_BT.sum()) / (5 + 24)
    loss, metrics = engine.forward_backward([b1, b2], _nll)
    assert math.isclose(loss, float(expected), rel_tol=1e-6)
    assert set(metrics) == {"mean_lp"}


def test_loss_callable_contract(ckpt):
    engine = _engine(ckpt)
    with pytest.raises(TypeError, match="must return a LossOutput"):
        engine.forward_backward([_batch(8)], lambda out, b: out.logprobs_BT.sum())
    with pytest.raises(ValueError, match="whole number"):
        engine.forward_backward([_batch(8)], lambda out, b: LossOutput(out.logprobs_BT.sum(), 2.5))


def test_packed_equals_padded(ckpt):
    engine = _engine(ckpt)
    seqs = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (4, 7, 5)]
    padded = torch.zeros(3, 7, dtype=torch.long)
    mask = torch.zeros(3, 7)
    for i, s in enumerate(seqs):
        padded[i, : len(s)], mask[i, : len(s)] = s, 1
    packed = torch.cat([*seqs, torch.zeros(2, dtype=torch.long)]).unsqueeze(0)
    b_pad = TrainBatch(input_ids_BT=padded, attention_mask_BT=mask, loss_mask_BT=mask)
    b_pk = TrainBatch(
        input_ids_BT=packed,
        cu_seqlens=torch.tensor([0, 4, 11, 16]),
        loss_mask_BT=torch.cat([torch.ones(16), torch.zeros(2)]).unsqueeze(0),
    )
    o_pad, o_pk = engine.forward([b_pad, b_pk], with_entropy=True)
    flat = torch.cat([o_pad.logprobs_BT[i, : len(s)] for i, s in enumerate(seqs)])
    torch.testing.assert_close(o_pk.logprobs_BT[0, :16], flat, rtol=1e-5, atol=1e-6)
    flat_h = torch.cat([o_pad.entropy_BT[i, : len(s)] for i, s in enumerate(seqs)])
    torch.testing.assert_close(o_pk.entropy_BT[0, :16], flat_h, rtol=1e-5, atol=1e-6)
    assert torch.all(o_pad.logprobs_BT[mask == 0] == 0) and torch.all(o_pk.logprobs_BT[0, 16:] == 0)

    def masked_nll(out, batch):
        return LossOutput(loss_sum=-(out.logprobs_BT * batch.loss_mask_BT).sum(), denominator=16)

    engine.forward_backward([b_pad], masked_nll)
    g_pad = {k: v.clone() for k, v in engine.named_grads().items()}
    engine.forward_backward([b_pk], masked_nll)
    for k, v in engine.named_grads().items():
        torch.testing.assert_close(v, g_pad[k], rtol=1e-4, atol=1e-6)


def test_critic_values_train(ckpt):
    m = model_config_from_hf(ckpt)
    critic = MegatronEngine(m, ParallelConfig(), OptimConfig(lr=1e-2, grad_clip=0.0), role="critic")
    batch = _batch(9)
    target = torch.linspace(-1, 1, 9).expand(2, 9)

    def mse(out, b):
        assert out.logprobs_BT is None and out.values_BT.shape == (2, 9)
        err = out.values_BT - target.to(out.values_BT.device)
        return LossOutput(loss_sum=(err[:, 1:] ** 2).sum(), denominator=16)

    values = critic.forward([batch])[0].values_BT
    assert values.shape == (2, 9) and torch.all(values[:, 0] == 0)
    losses = [critic.train_step([batch], mse).loss for _ in range(8)]
    assert losses[-1] < 0.5 * losses[0]
    assert "output_layer.weight" in dict(critic.module.named_parameters())
    assert critic.module.output_layer.weight.shape == (1, m.hidden_size)


def test_critic_end_values_are_the_values_of_the_state_after_the_last_token(ckpt):
    """Causal model: the value of the state after a sequence's last token is what a one-token-longer sequence
    reads as V(s_t) of its appended token. Padded rows of different lengths and a packed row agree."""
    critic = MegatronEngine(model_config_from_hf(ckpt), ParallelConfig(), OptimConfig(), role="critic")
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in (9, 6)]

    def padded(rows: list[torch.Tensor]) -> TrainBatch:
        width = max(len(r) for r in rows)
        ids, mask = (
            torch.zeros(len(rows), width, dtype=torch.long),
            torch.zeros(len(rows), width, dtype=torch.long),
        )
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        return TrainBatch(input_ids_BT=ids, attention_mask_BT=mask)

    ends = critic.forward([padded(seqs)])[0].end_values_S
    longer = critic.forward([padded([torch.cat([s, torch.tensor([5])]) for s in seqs])])[0].values_BT
    torch.testing.assert_close(ends, torch.stack([longer[0, 9], longer[1, 6]]), rtol=1e-4, atol=1e-5)
    packed = TrainBatch(input_ids_BT=torch.cat(seqs)[None], cu_seqlens=torch.tensor([0, 9, 15]))
    torch.testing.assert_close(critic.forward([packed])[0].end_values_S, ends, rtol=1e-4, atol=1e-5)


def test_offload_releases_and_onload_restores(ckpt):
    a, b = _engine(ckpt), _engine(ckpt)
    for e in (a, b):
        e.train_step([_batch(10)], _nll)
    before = _params(a)
    a.offload()
    assert a.offloaded
    assert all(p.untyped_storage().nbytes() == 0 for p in a.module.parameters())
    # torch's AdamW, or the one inside Megatron's optimizer on a GPU
    state = next(iter(a._torch_optimizers()[0].state.values()))
    assert state["exp_avg"].untyped_storage().nbytes() == 0
    a.onload()
    assert not a.offloaded
    assert all(torch.equal(before[n], t) for n, t in _params(a).items())
    ra, rb = a.train_step([_batch(11)], _nll), b.train_step([_batch(11)], _nll)
    assert ra.loss == rb.loss
    assert all(torch.equal(t, _params(b)[n]) for n, t in _params(a).items())


def test_state_dict_round_trip_resumes_exactly(ckpt):
    a = _engine(ckpt)
    a.train_step([_batch(12)], _nll)
    sd = a.state_dict()
    a.train_step([_batch(13)], _nll)
    b = _engine(ckpt)
    b.load_state_dict(sd)
    assert b.step_count == 1
    b.train_step([_batch(13)], _nll)
    assert all(torch.equal(t, _params(a)[n]) for n, t in _params(b).items())
    with pytest.raises(ValueError, match="layout"):
        b.load_state_dict({**sd, "layout": (1, 1, 2, 1)})
    with pytest.raises(ValueError, match="not an engine checkpoint"):
        b.load_state_dict({"model": {}})


def test_state_dict_before_the_first_step_restores_a_fresh_optimizer(ckpt):
    """The policy is saved before its first step while the critic warms up; Megatron's optimizer (on a GPU)
    has no Adam state then. Loading that checkpoint into an engine that has trained must bring back its weights
    and an optimizer without moments: the next step equals the original engine's."""
    a, b = _engine(ckpt), _engine(ckpt)
    sd = a.state_dict()
    b.train_step([_batch(20)], _nll)
    b.load_state_dict(sd)
    assert b.step_count == 0
    a.train_step([_batch(21)], _nll)
    b.train_step([_batch(21)], _nll)
    assert all(torch.equal(t, _params(a)[n]) for n, t in _params(b).items())
    again = b.state_dict()
    b.train_step([_batch(22)], _nll)
    c = _engine(ckpt)
    c.load_state_dict(again)
    c.train_step([_batch(22)], _nll)
    assert all(torch.equal(t, _params(b)[n]) for n, t in _params(c).items())


def test_micro_batches_cut_by_tokens_train_like_fixed_ones(ckpt):
    """The policy's step on long-tailed samples does not depend on how they are cut into micro-batches: two rows
    each in sample order, or rows of similar lengths within 24 padded tokens, give the same loss and gradient
    norm (fp32, up to summation order) and the same first step of the weights."""
    rng = np.random.default_rng(0)
    samples = []
    for i, n in enumerate((2, 11, 3, 1, 7, 4, 2, 9)):
        s = Sample(
            uid=str(i), group_id=0, prompt_uid="p", prompt_ids=rng.integers(1, 96, 3), max_response_length=16
        )
        s.max_new_tokens = n
        s.add_window(rng.integers(1, 96, n), rng.normal(-2.0, 0.5, n))
        samples.append(s)
    advantages = [rng.normal(size=len(s.response_ids)) for s in samples]
    lengths = [3 + len(s.response_ids) for s in samples]
    placements = {"fixed": place(len(samples), 1, 2), "tokens": place_by_tokens(lengths, 1, 8, 24)}
    assert placements["tokens"].rows == (((1,), (7, 4), (5, 2, 0), (6, 3)),)
    results, weights = {}, {}
    for name, placement in placements.items():
        rank = split_for_ranks(samples, placement)[0]
        batches = [
            [policy_batch(ss, ff, [advantages[int(x.uid)] for x in ss], routing=False) for ss, ff in rank]
        ]
        engine = _engine(ckpt)
        results[name] = engine.train_step(batches[0], policy_objective(AlgoConfig(), batches))
        weights[name] = _params(engine)
    assert results["tokens"].loss == pytest.approx(results["fixed"].loss, rel=1e-5, abs=1e-7)
    assert results["tokens"].grad_norm == pytest.approx(results["fixed"].grad_norm, rel=1e-5)
    # Adam's first step is ~lr x sign(g): a gradient that is ~0 may move either way; a tenth of the LR bounds it
    for n, w in weights["fixed"].items():
        torch.testing.assert_close(weights["tokens"][n], w, rtol=0, atol=1e-3)


def test_forward_only_engine_holds_no_training_state_and_matches_the_policy(ckpt):
    """The reference policy's engine: the policy's weights and log-probs, but no gradient buffer and no optimizer
    state (a trainable engine keeps fp32 main grads and Adam moments: 16 bytes per parameter more)."""
    policy = _engine(ckpt)
    policy.train_step([_batch(14)], _nll)
    frozen = MegatronEngine(
        model_config_from_hf(ckpt), ParallelConfig(), OptimConfig(lr=1e-2), optimizer="none"
    )
    assert frozen.optimizer is None and frozen.ddp is None
    assert not any(p.requires_grad or hasattr(p, "main_grad") for p in frozen.module.parameters())
    shard = policy.state_dict()
    frozen.load_state_dict({**shard, "optimizer": None})
    assert frozen.step_count == policy.step_count
    batches = [_batch(15), _batch(16, b=3, t=5)]
    # Bit-identical on CPU; on a GPU the policy's parameters live in DDP's buffer (other GEMM kernels may run).
    for got, want in zip(frozen.forward(batches), policy.forward(batches)):
        torch.testing.assert_close(got.logprobs_BT, want.logprobs_BT, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="forward-only"):
        frozen.train_step(batches, _nll)
    assert frozen.state_dict()["optimizer"] is None
    frozen.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in frozen.module.parameters())
    frozen.onload()
    again = frozen.forward(batches)[0].logprobs_BT
    torch.testing.assert_close(again, policy.forward(batches)[0].logprobs_BT, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no optimizer state"):
        _engine(ckpt).load_state_dict({**shard, "optimizer": None})


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            TrainBatch(
                input_ids_BT=torch.zeros(2, 4, dtype=torch.long),
                attention_mask_BT=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
            ),
            "right padding",
        ),
        (
            TrainBatch(
                input_ids_BT=torch.zeros(2, 4, dtype=torch.long),
                position_ids_BT=torch.tensor([[1, 2, 3, 4]] * 2),
            ),
            "position_ids_BT must count",
        ),
        (
            TrainBatch(input_ids_BT=torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4])),
            "B=1",
        ),
        (
            TrainBatch(input_ids_BT=torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 3])),
            "strictly increasing",
        ),
        (
            TrainBatch(input_ids_BT=torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 5])),
            "T=4",
        ),
        (TrainBatch(input_ids_BT=torch.zeros(2, 4), loss_mask_BT=None), "integer tensor"),
        (
            TrainBatch(input_ids_BT=torch.zeros(2, 4, dtype=torch.long), loss_mask_BT=torch.ones(2, 3)),
            "loss_mask_BT has shape",
        ),
    ],
)
def test_malformed_batches_are_refused(ckpt, batch, message):
    engine = _engine(ckpt)
    with pytest.raises(ValueError, match=message):
        engine.forward([batch])


def test_packed_positions_are_accepted():
    batch = TrainBatch(
        input_ids_BT=torch.zeros(1, 6, dtype=torch.long),
        cu_seqlens=torch.tensor([0, 2, 6]),
        position_ids_BT=torch.tensor([[0, 1, 0, 1, 2, 3]]),
    )
    batch.validate()


def test_bad_construction_arguments(ckpt):
    m = model_config_from_hf(ckpt)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="bfloat16 needs CUDA"):
            MegatronEngine(replace(m, dtype="bfloat16"), ParallelConfig(), OptimConfig())
    with pytest.raises(ValueError, match="role must be"):
        MegatronEngine(m, ParallelConfig(), OptimConfig(), role="reference")
    with pytest.raises(ValueError, match=r"expert_parallel=2 must divide the data x tensor ranks \(1\)"):
        MegatronEngine(ModelConfig(), ParallelConfig(expert_parallel=2), OptimConfig())


def test_unshare_adam_steps_fixes_megatron_resume_bug():
    """Megatron 0.16.1's DistributedOptimizer.load_state_dict puts one step tensor in every state; torch's
    Adam then adds 1 per parameter. Reproduce that state on a torch Adam and check the repair."""
    from tppo.engine.engine import unshare_adam_steps

    def make():
        params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
        return params, torch.optim.Adam(params, lr=0.1)

    params, opt = make()
    shared = torch.tensor(1.0)
    state = {i: {"step": shared, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)} for i in range(4)}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    assert unshare_adam_steps(opt) == 3
    assert unshare_adam_steps(opt) == 0
    for p in params:
        p.grad = torch.ones(3)
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [2.0] * 4


def test_alltoall_dispatcher_equals_allgather(ckpt):
    """The GPU default (alltoall) and the CPU default (allgather) token dispatchers compute the same."""
    m = model_config_from_hf(ckpt)
    a2a = MegatronEngine(m, ParallelConfig(), OptimConfig(lr=1e-2), dispatcher="alltoall")
    ag = MegatronEngine(m, ParallelConfig(), OptimConfig(lr=1e-2), dispatcher="allgather")
    batches = [_batch(20), _batch(21)]
    rec = a2a.forward(batches[:1], record_routing=True)[0]
    replayed = TrainBatch(input_ids_BT=batches[0].input_ids_BT, routed_experts_BTLK=rec.routed_experts_BTLK)
    assert torch.equal(a2a.forward([replayed])[0].logprobs_BT, rec.logprobs_BT)
    assert torch.equal(ag.forward(batches[:1])[0].logprobs_BT, rec.logprobs_BT)
    la, _ = a2a.forward_backward(batches, _nll)
    lg, _ = ag.forward_backward(batches, _nll)
    assert la == lg
    grads = ag.named_grads()
    assert all(torch.equal(v, grads[k]) for k, v in a2a.named_grads().items())


def test_megatron_optimizer_needs_cuda(ckpt):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    with pytest.raises(ValueError, match="optimizer='megatron' needs CUDA"):
        MegatronEngine(model_config_from_hf(ckpt), ParallelConfig(), OptimConfig(), optimizer="megatron")
