"""Expert weight gradients accumulated into the fp32 main grads (tppo.engine.grouped_wgrad): the kernel
against an fp32 per-expert reference, and an engine with the fusion against one without."""

from __future__ import annotations

import pytest
import torch

from tppo.engine import grouped_wgrad

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")


@pytest.mark.gpu
@pytest.mark.skipif(not grouped_wgrad.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize(
    ("counts", "o", "k"),
    [
        ([512, 0, 37, 1, 300], 1536, 2048),  # the benchmark's W1 shape, an empty expert, ragged counts
        ([64, 129, 0], 200, 72),  # sizes that are not multiples of the tiles
        ([0, 0], 64, 64),  # no token at all
    ],
)
def test_kernel_adds_each_experts_gradient(counts, o, k):
    g = torch.Generator(device="cuda").manual_seed(sum(counts) + o)
    n = sum(counts)
    dy = torch.randn(n, o, device="cuda", generator=g).bfloat16()
    x = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    start = torch.randn(len(counts), o, k, device="cuda", generator=g)
    main = start.clone()
    grouped_wgrad.grouped_wgrad_accumulate(dy, x, offs, main)
    begin = 0
    for e, c in enumerate(counts):
        rows = slice(begin, begin + c)
        want = start[e] + dy[rows].double().T @ x[rows].double()
        scale = max(float(want.abs().max()), 1.0)
        assert float((main[e].double() - want).abs().max()) <= 1e-5 * scale, f"expert {e}"
        if c == 0:
            assert torch.equal(main[e], start[e])
        begin += c


def test_kernel_refuses_bad_shapes():
    """The checks come before any kernel: they run on the CPU too."""
    main = torch.zeros(2, 8, 16)
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    offs = torch.tensor([2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="shapes do not fit"):
        grouped_wgrad.grouped_wgrad_accumulate(torch.zeros(4, 9), x, offs, main)
    with pytest.raises(ValueError, match="contiguous fp32"):
        grouped_wgrad.grouped_wgrad_accumulate(x[:, :8], x, offs, main.bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not grouped_wgrad.available(), reason="needs CUDA and Triton")
def test_engine_with_fusion_matches_engine_without():
    """Same model, same micro-batches: the dense gradients are bit-identical (the fusion touches only the
    expert weight gradients) and the expert ones agree to bf16 rounding (the unfused path rounds each
    micro-batch's expert gradient to bf16 before adding it up; the fused one does not)."""
    from tppo.engine.batch import LossOutput, TrainBatch
    from tppo.engine.config import ModelConfig, OptimConfig, ParallelConfig
    from tppo.engine.engine import MegatronEngine
    from tppo.engine.experts import GroupedExperts

    cfg = ModelConfig(
        arch="qwen3_moe",
        vocab_size=256,
        hidden_size=128,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=32,
        ffn_hidden_size=256,
        moe_ffn_hidden_size=64,
        num_experts=8,
        moe_topk=2,
        dtype="bfloat16",
        init_std=0.05,
    )
    gen = torch.Generator().manual_seed(0)
    batches = [TrainBatch(input_ids_BT=torch.randint(0, 256, (2, 96), generator=gen)) for _ in range(3)]

    def nll(out, batch):
        lp = out.logprobs_BT[:, 1:]
        return LossOutput(loss_sum=-lp.sum(), denominator=lp.numel())

    grads = {}
    for fused in (True, False):
        torch.manual_seed(1)
        engine = MegatronEngine(cfg, ParallelConfig(), OptimConfig(lr=1e-4))
        experts = [m for m in engine.module.modules() if isinstance(m, GroupedExperts)]
        assert experts and all(m.fuse_wgrad_accumulation for m in experts)
        for m in experts:
            m.fuse_wgrad_accumulation = fused
        engine.forward_backward(batches, nll)
        grads[fused] = {n: g.clone() for n, g in engine.named_grads().items()}
        del engine
    expert_names = [n for n in grads[True] if "experts" in n]
    assert expert_names
    for name, g in grads[True].items():
        ref = grads[False][name]
        if name in expert_names:
            assert g.abs().sum() > 0, name
            err = float((g - ref).abs().max()) / float(ref.abs().max())
            assert err < 1e-2, f"{name}: {err:.3g}"
        else:
            assert torch.equal(g, ref), name
