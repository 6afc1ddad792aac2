"""Expert parallelism over gloo: two processes with EP=2 (and data parallel 2) give the same logits, loss,
gradients, updated weights, routing and exported checkpoint as one process with EP=1 on the same data."""

from __future__ import annotations

import os

import pytest
import torch
from engine_testing import (
    ep_parity_worker,
    hf_gradients,
    layout_worker,
    make_hf_checkpoint,
    nll_loss,
    run_ranks,
)
from safetensors import safe_open

from tppo.engine.batch import TrainBatch
from tppo.engine.config import OptimConfig, ParallelConfig
from tppo.engine.convert import HFReader, model_config_from_hf
from tppo.engine.engine import MegatronEngine

pytestmark = [
    pytest.mark.dist,
    pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning"),
]


def _tensors(path):
    reader = HFReader(path)
    out = {}
    for name, fname in reader.weight_map.items():
        with safe_open(os.path.join(path, fname), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_ep2_equals_ep1(tmp_path):
    ckpt = make_hf_checkpoint(str(tmp_path / "q"), "qwen3_moe", first_k_dense=1, num_layers=3)
    m = model_config_from_hf(ckpt)
    g = torch.Generator().manual_seed(0)
    # Different lengths per rank: the engine pads to a common shape for the allgather dispatcher.
    batches = [TrainBatch(input_ids_BT=torch.randint(0, m.vocab_size, (2, t), generator=g)) for t in (9, 7)]
    replay_ids = [
        torch.stack(
            [torch.randperm(m.num_experts, generator=g)[: m.moe_topk] for _ in range(2 * t * 2)]
        ).view(2, t, 2, m.moe_topk)
        for t in (9, 7)
    ]
    logit_ids = [torch.randint(0, m.vocab_size, (2, 8), generator=g) for _ in range(2)]
    ranks = run_ranks(ep_parity_worker, 2, ckpt, batches, replay_ids, logit_ids, str(tmp_path / "ep2_export"))

    ref = MegatronEngine(m, ParallelConfig(), OptimConfig(lr=1e-3, grad_clip=0.0))
    ref.ddp.eval()
    for r, out in enumerate(ranks):
        with torch.no_grad():
            logits = ref.module(logit_ids[r], None, None)
        torch.testing.assert_close(out["logits"], logits, rtol=1e-5, atol=1e-5)
        rec = ref.forward([batches[r]], with_entropy=True, record_routing=True)[0]
        torch.testing.assert_close(out["logprobs"], rec.logprobs_BT, rtol=1e-5, atol=1e-5)
        assert torch.equal(out["routed"], rec.routed_experts_BTLK)
        assert torch.equal(out["replayed_logprobs"], out["logprobs"])  # replay at EP=2 reproduces exactly
        assert torch.equal(out["replayed_entropy"], out["entropy"])
    assert ranks[0]["expert_ids"] == [[0, 1], [0, 1]] and ranks[1]["expert_ids"] == [[2, 3], [2, 3]]
    assert ranks[0]["experts_read"] == [0, 1] and ranks[1]["experts_read"] == [
        2,
        3,
    ]  # each reads its own only

    # Each rank's experts computed exactly the replayed (token, expert) pairs of BOTH ranks, plus the
    # 2 rows x 2 tokens rank 1 was padded with (a [2, 9] grid whose padding token n, row-major, is replayed
    # to experts (n K + k) mod E: tokens 7, 8, 16, 17).
    k, e = m.moe_topk, m.num_experts
    padding = torch.tensor([(n * k + j) % e for n in (7, 8, 16, 17) for j in range(k)])
    for layer in range(2):
        ids = torch.cat([replay_ids[r][:, :, layer].reshape(-1) for r in range(2)] + [padding])
        expected = torch.bincount(ids, minlength=m.num_experts)
        got = torch.cat([ranks[0]["counts"][layer], ranks[1]["counts"][layer]])
        assert torch.equal(got.long(), expected)

    loss, _ = ref.forward_backward(batches, nll_loss)
    assert abs(ranks[0]["loss"] - loss) < 1e-6 and abs(ranks[1]["loss"] - loss) < 1e-6
    ref_grads = {n: g.clone() for n, g in ref.named_grads().items()}
    ref.optimizer_step()
    ref_params = {n: p.detach() for n, p in ref.module.named_parameters()}
    for r, out in enumerate(ranks):
        for name, grad in out["grads"].items():
            want, have = ref_grads[name], out["params"][name]
            sl = slice(2 * r, 2 * r + 2) if ".experts." in name else slice(None)
            torch.testing.assert_close(grad, want[sl], rtol=1e-5, atol=1e-6)
            # Adam's first step is ~lr * sign(g): gradients near eps amplify 1e-7 differences; 1% of lr.
            torch.testing.assert_close(have, ref_params[name][sl], rtol=1e-5, atol=1e-5)

    src, exported = _tensors(ckpt), _tensors(str(tmp_path / "ep2_export"))
    assert sorted(src) == sorted(exported)
    # The export ran after one optimizer step: compare with the EP=1 engine's own export of the same step.
    ref.export_hf(str(tmp_path / "ep1_export"))
    ep1 = _tensors(str(tmp_path / "ep1_export"))
    for name in src:
        torch.testing.assert_close(exported[name], ep1[name], rtol=1e-5, atol=1e-5)


def test_ep2_round_trip_cli_is_bit_identical(tmp_path):
    from tppo.engine.convert import convert_checkpoint

    ckpt = make_hf_checkpoint(str(tmp_path / "m"), "mixtral", seed=4)
    convert_checkpoint(ckpt, str(tmp_path / "out"), ep=2)
    before, after = _tensors(ckpt), _tensors(str(tmp_path / "out"))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.parametrize(
    ("tp", "pp", "ep"),
    [pytest.param(2, 1, 2, id="tp2-sp-ep2"), pytest.param(1, 2, 1, id="pp2", marks=pytest.mark.slow)],
)
def test_tensor_and_pipeline_parallel_equal_single_process(tmp_path, tp, pp, ep):
    """TP=2 with sequence parallelism (and EP=2 over the same ranks), or PP=2 (1F1B over gloo p2p): the same
    log-probs (of the forward pass and, kept on every rank, of the training forward), entropies, recorded routing,
    loss and gradients (in HF layout) as one process, and an export bit-identical to the source checkpoint."""
    ckpt = make_hf_checkpoint(str(tmp_path / "q"), "qwen3_moe", first_k_dense=1, num_layers=4)
    m = model_config_from_hf(ckpt)
    g = torch.Generator().manual_seed(1)
    replicas = [
        [TrainBatch(input_ids_BT=torch.randint(0, m.vocab_size, (2, 9), generator=g)) for _ in range(2)]
    ]
    ranks = run_ranks(layout_worker, 2, ckpt, replicas, tp, pp, ep, str(tmp_path / "export"))
    ref = MegatronEngine(m, ParallelConfig(), OptimConfig(lr=1e-3))
    outs = ref.forward(replicas[0], with_entropy=True, record_routing=True)
    loss, _ = ref.forward_backward(replicas[0], nll_loss)
    ref_grads = hf_gradients(ref)
    covered = set()
    for r in ranks:
        for i, out in enumerate(outs):
            torch.testing.assert_close(r["logprobs"][i], out.logprobs_BT, rtol=1e-5, atol=2e-6)
            # every stage holds the training forward's log-probs (the old ones of a one-step update)
            torch.testing.assert_close(r["kept"][i], out.logprobs_BT, rtol=1e-5, atol=2e-6)
            torch.testing.assert_close(r["entropy"][i], out.entropy_BT, rtol=1e-5, atol=2e-6)
            assert torch.equal(r["routed"][i], out.routed_experts_BTLK)
        assert abs(r["loss"] - loss) < 1e-6
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6)
            covered.add(name)
    assert covered == set(ref_grads)
    src, exported = _tensors(ckpt), _tensors(str(tmp_path / "export"))
    assert sorted(src) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in src.items())
