"""Grouped-GEMM experts equal Megatron's SequentialMLP (one MLP per expert in a loop), forward and backward."""

from __future__ import annotations

import pytest
import torch
from engine_testing import make_hf_checkpoint

from tppo.engine import experts as experts_mod
from tppo.engine.batch import LossOutput, TrainBatch
from tppo.engine.config import ModelConfig, OptimConfig, ParallelConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")


def _modules(num_experts: int = 4, ffn: int = 12):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from tppo.engine.model import transformer_config
    from tppo.engine.parallel import init_parallel

    p = ParallelConfig()
    init_parallel(p)
    m = ModelConfig(hidden_size=24, moe_ffn_hidden_size=ffn, num_experts=num_experts, moe_topk=2)
    cfg = transformer_config(m, p, cuda=False, dtype=torch.float32)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    grouped = experts_mod.GroupedExperts(num_experts, cfg, pg_collection=pgc)
    seq = SequentialMLP(
        num_experts,
        cfg,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        pg_collection=pgc,
    )
    with torch.no_grad():
        for e, mlp in enumerate(seq.local_experts):
            mlp.linear_fc1.weight.copy_(grouped.weight1[e])
            mlp.linear_fc2.weight.copy_(grouped.weight2[e])
    return grouped, seq


def _inputs(counts: list[int], hidden: int = 24):
    n = sum(counts)
    x = torch.randn(n, hidden, requires_grad=True)
    probs = torch.rand(n, requires_grad=True)
    return x, torch.tensor(counts), probs


def _run(module, x, counts, probs, grad_out):
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    out, bias = module(x, counts, probs)
    assert bias is None
    out.backward(grad_out)
    return out.detach(), x.grad, probs.grad


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7, 1], [4, 4, 4, 4]])
def test_grouped_equals_sequential_forward_backward(counts):
    grouped, seq = _modules()
    x, tpe, probs = _inputs(counts)
    grad_out = torch.randn(sum(counts), 24)
    out_g, dx_g, dp_g = _run(grouped, x, tpe, probs, grad_out)
    out_s, dx_s, dp_s = _run(seq, x, tpe, probs, grad_out)
    torch.testing.assert_close(out_g, out_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dp_g, dp_s, rtol=1e-5, atol=1e-6)
    for e, mlp in enumerate(seq.local_experts):
        torch.testing.assert_close(grouped.weight1.grad[e], mlp.linear_fc1.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grouped.weight2.grad[e], mlp.linear_fc2.weight.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(grouped.last_tokens_per_expert, tpe)


def test_looped_fallback_equals_grouped_gemm(monkeypatch):
    grouped, _ = _modules()
    x, tpe, probs = _inputs([2, 5, 0, 3])
    grad_out = torch.randn(10, 24)
    out_g, dx_g, _ = _run(grouped, x, tpe, probs, grad_out)
    w1_grad = grouped.weight1.grad.clone()
    grouped.weight1.grad = grouped.weight2.grad = None
    monkeypatch.setattr(experts_mod, "_grouped_mm_supported", lambda t, *dims: False)
    out_l, dx_l, _ = _run(grouped, x, tpe, probs, grad_out)
    torch.testing.assert_close(out_l, out_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_l, dx_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped.weight1.grad, w1_grad, rtol=1e-5, atol=1e-6)


def test_unaligned_shapes_fall_back_and_match_sequential():
    grouped, seq = _modules(ffn=10)  # 10 fp32 values = 40-byte rows: not a grouped-GEMM layout
    x, tpe, probs = _inputs([3, 1, 0, 2])
    grad_out = torch.randn(6, 24)
    out_g, dx_g, _ = _run(grouped, x, tpe, probs, grad_out)
    out_s, dx_s, _ = _run(seq, x, tpe, probs, grad_out)
    torch.testing.assert_close(out_g, out_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_s, rtol=1e-5, atol=1e-6)


def test_no_token_gives_zero_gradients():
    grouped, _ = _modules()
    x, tpe, probs = _inputs([0, 0, 0, 0])
    out, _ = grouped(x, tpe, probs)
    assert out.shape == (0, 24)
    out.sum().backward()
    assert torch.count_nonzero(grouped.weight1.grad) == 0


def test_count_mismatch_is_refused():
    grouped, _ = _modules()
    x, _, probs = _inputs([1, 1, 1, 1])
    with pytest.raises(ValueError, match="tokens for 3 experts"):
        grouped(x, torch.tensor([1, 1, 2]), probs)


def test_weight_provider_seam_is_used():
    grouped, _ = _modules()
    x, tpe, probs = _inputs([1, 2, 0, 1])
    w1, w2 = grouped.weight1.detach() * 2, grouped.weight2.detach()
    grouped.weight_provider = lambda module: (w1, w2)
    out, _ = grouped(x, tpe, probs)
    ref = experts_mod.grouped_swiglu(x, tpe, probs, w1, w2)
    torch.testing.assert_close(out, ref)


def test_model_with_grouped_experts_equals_sequential(tmp_path):
    """The same HF weights in both expert implementations give the same log-probs, loss and gradients."""
    from tppo.engine.convert import model_config_from_hf
    from tppo.engine.engine import MegatronEngine

    ckpt = make_hf_checkpoint(str(tmp_path / "q"), "qwen3_moe", first_k_dense=1, num_layers=3)
    m = model_config_from_hf(ckpt)
    engines = [
        MegatronEngine(m, ParallelConfig(), OptimConfig(), experts=kind) for kind in ("grouped", "sequential")
    ]
    torch.manual_seed(1)
    batch = TrainBatch(input_ids_BT=torch.randint(0, m.vocab_size, (2, 9)))

    def loss_fn(out, b):
        return LossOutput(loss_sum=-(out.logprobs_BT.sum() + 0.1 * out.entropy_BT.sum()), denominator=18)

    results = []
    for eng in engines:
        out = eng.forward([batch], with_entropy=True)[0]
        loss, _ = eng.forward_backward([batch], loss_fn)
        results.append((out, loss, eng.named_grads()))
    (o_g, l_g, g_g), (o_s, l_s, g_s) = results
    torch.testing.assert_close(o_g.logprobs_BT, o_s.logprobs_BT, rtol=1e-5, atol=1e-5)
    assert abs(l_g - l_s) < 1e-5
    for name, grad in g_g.items():
        if ".experts.weight" in name:
            prefix = name.split("experts.")[0] + "experts.local_experts"
            for e in range(m.num_experts):
                fc = "linear_fc1" if name.endswith("weight1") else "linear_fc2"
                torch.testing.assert_close(grad[e], g_s[f"{prefix}.{e}.{fc}.weight"], rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(grad, g_s[name], rtol=1e-4, atol=1e-6)
