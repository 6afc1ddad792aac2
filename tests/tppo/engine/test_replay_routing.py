"""Routing replay: record -> replay reproduces the model exactly, replayed experts are provably the ones
computed (and the router keeps its gradient), recompute replays the right micro-batch, and bad replay data
fails loudly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_testing import make_hf_checkpoint

from tppo.engine.batch import LossOutput, TrainBatch
from tppo.engine.config import OptimConfig, ParallelConfig
from tppo.engine.convert import model_config_from_hf
from tppo.engine.engine import MegatronEngine
from tppo.engine.replay import RouterReplayAction, StrictRouterReplay

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(
        str(tmp_path_factory.mktemp("replay") / "q"), "qwen3_moe", first_k_dense=1, num_layers=3
    )


@pytest.fixture(scope="module")
def engine(ckpt):
    return MegatronEngine(model_config_from_hf(ckpt), ParallelConfig(), OptimConfig())


def _batch(seed: int, b: int = 2, t: int = 10, vocab: int = 96) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    return TrainBatch(input_ids_BT=torch.randint(0, vocab, (b, t), generator=g))


def _nll(out, batch):
    lp = out.logprobs_BT
    return LossOutput(loss_sum=-lp.sum(), denominator=lp.numel())


def _router_logits(engine, batch):
    """Per MoE layer, the router logits [B, T, E] of a natural forward (captured by hooks)."""
    captured = []
    hooks = [
        layer.router.register_forward_hook(lambda mod, args, out: captured.append(mod.gating(args[0])))
        for layer in engine.moe_layers
    ]
    engine.forward([batch])
    for h in hooks:
        h.remove()
    return [c.view(batch.shape[1], batch.shape[0], -1).transpose(0, 1) for c in captured]


def _anti_routing(engine, batch):
    """The K experts each token's router likes LEAST, per MoE layer: [B, T, L, K] (never the natural choice)."""
    k = engine.model_cfg.moe_topk
    return torch.stack(
        [lg.topk(k, dim=-1, largest=False).indices for lg in _router_logits(engine, batch)], dim=2
    )


def test_record_then_replay_is_identical(engine):
    batch = _batch(0)
    rec = engine.forward([batch], with_entropy=True, record_routing=True)[0]
    assert rec.routed_experts_BTLK.shape == (2, 10, 2, 2)
    replayed = TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=rec.routed_experts_BTLK)
    again = engine.forward([replayed], with_entropy=True)[0]
    assert torch.equal(again.logprobs_BT, rec.logprobs_BT)
    assert torch.equal(again.entropy_BT, rec.entropy_BT)
    loss_nat, _ = engine.forward_backward([batch], _nll)
    g_nat = {k: v.clone() for k, v in engine.named_grads().items()}
    loss_rep, _ = engine.forward_backward([replayed], _nll)
    assert loss_rep == loss_nat
    assert all(torch.equal(g_nat[k], v) for k, v in engine.named_grads().items())


def test_record_then_replay_packed(engine):
    ids = _batch(5, b=1, t=14).input_ids_BT
    cu = torch.tensor([0, 6, 11])  # two sequences and 3 padding tokens
    rec = engine.forward([TrainBatch(input_ids_BT=ids, cu_seqlens=cu)], record_routing=True)[0]
    again = engine.forward(
        [TrainBatch(input_ids_BT=ids, cu_seqlens=cu, routed_experts_BTLK=rec.routed_experts_BTLK)]
    )
    assert torch.equal(again[0].logprobs_BT, rec.logprobs_BT)


def _moe_reference(layer, x_NH, ids_NK):
    """The MoE output computed by hand from the layer's own weights with the given experts."""
    logits = x_NH.float() @ layer.router.weight.float().T
    probs = torch.softmax(logits.gather(1, ids_NK), dim=-1)
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    out = torch.zeros_like(x_NH)
    f = w2.shape[-1]
    for j in range(ids_NK.shape[1]):
        h = torch.einsum("nh,nfh->nf", x_NH, w1[ids_NK[:, j]])
        a = F.silu(h[:, :f]) * h[:, f:]
        out += probs[:, j : j + 1] * torch.einsum("nf,nhf->nh", a, w2[ids_NK[:, j]])
    return out


def test_replayed_experts_are_the_ones_computed(engine):
    batch = _batch(1)
    anti = _anti_routing(engine, batch)
    natural = engine.forward([batch], record_routing=True)[0]
    assert not torch.equal(anti.sort(-1).values, natural.routed_experts_BTLK.long().sort(-1).values)
    seen = []
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: seen.append((i, args[0].detach().clone(), out[0].detach().clone()))
        )
        for i, layer in enumerate(engine.moe_layers)
    ]
    replayed = engine.forward([TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=anti)])[0]
    for h in hooks:
        h.remove()
    assert not torch.allclose(replayed.logprobs_BT, natural.logprobs_BT)
    num_experts = engine.model_cfg.num_experts
    for i, x_SBH, y_SBH in seen:
        layer = engine.moe_layers[i]
        # Megatron orders tokens sequence-first; the output is cloned in the hook because Megatron adds the
        # residual in place during inference.
        ids_NK = anti[:, :, i].transpose(0, 1).reshape(-1, 2)
        counts = torch.bincount(ids_NK.reshape(-1), minlength=num_experts)
        assert torch.equal(layer.experts.last_tokens_per_expert.long(), counts)
        ref = _moe_reference(layer, x_SBH.reshape(-1, x_SBH.shape[-1]), ids_NK)
        torch.testing.assert_close(y_SBH.reshape(ref.shape), ref, rtol=1e-5, atol=1e-5)


def test_router_keeps_its_gradient_under_replay(engine):
    """Directional derivative of the loss w.r.t. a router weight matches the replayed backward."""
    batch = _batch(2)
    replayed = TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=_anti_routing(engine, batch))
    engine.forward_backward([replayed], _nll)
    router = engine.moe_layers[1].router.weight
    grad = engine.named_grads()["decoder.layers.2.mlp.router.weight"].clone()
    assert grad.abs().sum() > 0
    direction = torch.randn_like(router)
    h = 1e-3

    def loss_at(shift):
        with torch.no_grad():
            router.add_(shift * direction)
            lp = engine.forward([replayed])[0].logprobs_BT
            router.sub_(shift * direction)
        return float(-lp.double().sum() / lp.numel())

    numeric = (loss_at(h) - loss_at(-h)) / (2 * h)
    analytic = float((grad * direction).sum())
    assert abs(numeric - analytic) <= 2e-3 * max(1.0, abs(analytic))


def test_recompute_replays_each_microbatch(ckpt, engine):
    """With activation recompute the backward re-runs every router; it must replay that micro-batch's ids."""
    m = model_config_from_hf(ckpt)
    recompute = MegatronEngine(m, ParallelConfig(recompute=True), OptimConfig())
    batches = [_batch(s) for s in (10, 11, 12)]
    replayed = [
        TrainBatch(input_ids_BT=b.input_ids_BT, routed_experts_BTLK=_anti_routing(engine, b)) for b in batches
    ]
    calls = []
    hooks = [layer.router.register_forward_hook(lambda *a: calls.append(1)) for layer in recompute.moe_layers]
    loss_ref, _ = engine.forward_backward(replayed, _nll)
    g_ref = {k: v.clone() for k, v in engine.named_grads().items()}
    loss_rc, _ = recompute.forward_backward(replayed, _nll)
    for h in hooks:
        h.remove()
    assert len(calls) == 2 * len(batches) * len(recompute.moe_layers)  # forward + recompute per micro-batch
    assert abs(loss_rc - loss_ref) < 1e-6
    for k, v in recompute.named_grads().items():
        torch.testing.assert_close(v, g_ref[k], rtol=1e-5, atol=1e-7)
    recompute.forward_backward(batches, _nll)  # natural routing: a different gradient
    assert not torch.allclose(
        recompute.named_grads()["decoder.layers.2.mlp.router.weight"],
        g_ref["decoder.layers.2.mlp.router.weight"],
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r[:, :, :1], "has 1 MoE layers; the model has 2"),
        (lambda r: r[:, :7], r"covers \(B=2, T=7\) tokens; the batch has \(B=2, T=10\)"),
        (lambda r: torch.cat([r, r[..., :1]], dim=-1), "has k=3 experts per token; the model routes top-2"),
        (lambda r: r + 4, r"expert ids in \[4, 7\]; the model has experts 0..3"),
        (lambda r: r[..., :1].expand_as(r).clone(), "repeats an expert within one token's top-k"),
        (lambda r: r.float(), "must hold integer expert ids"),
        (lambda r: r[0], r"must be \[B, T, L, K\]"),
    ],
)
def test_bad_replay_data_is_refused(engine, change, message):
    batch = _batch(3)
    routed = engine.forward([batch], record_routing=True)[0].routed_experts_BTLK
    bad = TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=change(routed))
    with pytest.raises(ValueError, match=message):
        engine.forward([bad])
    with pytest.raises(ValueError, match=message):
        engine.train_step([bad], _nll)


def test_missing_replay_is_never_silent(engine):
    batch = _batch(4)
    with pytest.raises(
        ValueError, match="routing replay is required but the batch has no routed_experts_BTLK"
    ):
        engine.train_step([batch], _nll, require_replay=True)
    with pytest.raises(ValueError, match="cannot both record routing and replay"):
        routed = engine.forward([batch], record_routing=True)[0].routed_experts_BTLK
        engine.forward(
            [TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=routed)], record_routing=True
        )


def test_router_level_replay_checks():
    rep = StrictRouterReplay("layer 7", num_experts=4, topk=2)
    scores = torch.randn(5, 4)
    rep.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(ValueError, match="layer 7 has no replay data"):
        rep.get_replay_topk(scores, 2)
    rep.set_target_indices(torch.tensor([[0, 1]] * 4))
    with pytest.raises(
        ValueError, match=r"replay data of layer 7 has shape \(4, 2\); expected \(tokens=5, k=2\)"
    ):
        rep.get_replay_topk(scores, 2)
    rep.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    rep.replay_backward_list = []
    with pytest.raises(ValueError, match="recompute of layer 7 found no replay data"):
        rep.get_replay_topk(scores, 2)
