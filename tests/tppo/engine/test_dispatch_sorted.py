"""The gather-only token permutation (tppo.engine.dispatch) against Megatron's own permute/unpermute and loops."""

from __future__ import annotations

import pytest
import torch
from engine_testing import make_hf_checkpoint, nll_loss, run_ranks
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from tppo.engine.dispatch import gather_copies, route_plan, sum_copies

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")


def _routing(n: int, e: int, k: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids_NK = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    routing_NE = torch.zeros(n, e, dtype=torch.bool).scatter_(1, ids_NK, True)
    probs_NE = torch.rand(n, e, generator=g) * routing_NE
    return routing_NE.to(device), probs_NE.to(device)


@pytest.mark.parametrize(("n", "e", "k"), [(1, 4, 4), (13, 8, 2), (64, 16, 3), (5, 6, 1)])
def test_route_plan_is_megatrons_order(n, e, k):
    routing_NE, _ = _routing(n, e, k, seed=n + e + k)
    plan = route_plan(routing_NE, k)
    # Megatron: copies sorted by expert, tokens ascending within an expert.
    want = [(ex, t) for ex in range(e) for t in range(n) if routing_NE[t, ex]]
    assert list(zip(plan.expert_M.tolist(), plan.tok_M.tolist())) == want
    assert plan.tokens_per_expert_E.tolist() == routing_NE.sum(0).tolist()
    for t in range(n):  # pos_NK lists exactly the copies of token t
        assert sorted(plan.pos_NK[t].tolist()) == [j for j, (_, tok) in enumerate(want) if tok == t]


def test_route_plan_rejects_bad_maps():
    routing_NE, _ = _routing(6, 5, 2, seed=1)
    routing_NE[3, :] = False
    with pytest.raises(RuntimeError, match="exactly 2 experts"):
        route_plan(routing_NE, 2)
    with pytest.raises(ValueError, match="2-D bool"):
        route_plan(routing_NE.int(), 2)
    with pytest.raises(ValueError, match=r"topk must be in 1\.\.5"):
        route_plan(routing_NE, 6)


def test_permutation_equals_megatron_forward_and_backward():
    n, e, k, h = 37, 8, 3, 16
    routing_NE, _ = _routing(n, e, k, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(n * k, h, generator=g, dtype=torch.float64)  # stands in for the experts

    def run(ours: bool):
        xi = x.clone().requires_grad_()
        if ours:
            plan = route_plan(routing_NE, k)
            y = sum_copies(gather_copies(xi, plan) * w, plan)
        else:
            permuted, _, idx = permute(xi, routing_NE)
            y = unpermute(permuted * w, idx, restore_shape=xi.shape, routing_map=routing_NE)
        (y * torch.arange(h, dtype=y.dtype)).sum().backward()
        return y.detach(), xi.grad

    y_ours, g_ours = run(True)
    y_ref, g_ref = run(False)
    torch.testing.assert_close(y_ours, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)
    # Closed form: y[t] = x[t] * sum of w over the copies of t.
    plan = route_plan(routing_NE, k)
    w_sum = torch.stack([w[plan.pos_NK[t]].sum(0) for t in range(n)])
    torch.testing.assert_close(y_ours, x * w_sum, rtol=1e-12, atol=1e-12)


def _ep2_worker(rank: int, ckpt: str, batches: list) -> dict:
    """Both dispatchers at EP=2 over gloo (alltoall): same weights, same data, losses and gradients back."""
    from tppo.engine import model as model_mod
    from tppo.engine.config import OptimConfig, ParallelConfig
    from tppo.engine.convert import model_config_from_hf
    from tppo.engine.dispatch import SortedAlltoAllDispatcher
    from tppo.engine.engine import MegatronEngine

    out = {}
    for sorted_permute in (True, False):
        model_mod.USE_SORTED_DISPATCHER = sorted_permute
        engine = MegatronEngine(
            model_config_from_hf(ckpt),
            ParallelConfig(expert_parallel=2),
            OptimConfig(lr=1e-3, grad_clip=0.0),
            dispatcher="alltoall",
        )
        kinds = {isinstance(layer.token_dispatcher, SortedAlltoAllDispatcher) for layer in engine.moe_layers}
        assert kinds == {sorted_permute}
        loss, _ = engine.forward_backward(batches, nll_loss)
        out[sorted_permute] = (loss, {n: g.clone() for n, g in engine.named_grads().items()})
    model_mod.USE_SORTED_DISPATCHER = True
    return out


@pytest.mark.dist
def test_sorted_dispatcher_equals_megatron_at_ep2(tmp_path):
    from tppo.engine.batch import TrainBatch

    ckpt = make_hf_checkpoint(str(tmp_path / "q"), "qwen3_moe", num_layers=2)
    g = torch.Generator().manual_seed(0)
    batches = [TrainBatch(input_ids_BT=torch.randint(0, 96, (2, 11), generator=g)) for _ in range(2)]
    for rank_out in run_ranks(_ep2_worker, 2, ckpt, batches):
        loss_sorted, grads_sorted = rank_out[True]
        loss_ref, grads_ref = rank_out[False]
        assert loss_sorted == pytest.approx(loss_ref, rel=1e-6)
        assert grads_sorted.keys() == grads_ref.keys()
        for name, grad in grads_sorted.items():
            torch.testing.assert_close(grad, grads_ref[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_permutation_has_no_host_sync_and_matches_megatron_bf16():
    n, e, k, h = 4096, 64, 8, 256
    routing_NE, _ = _routing(n, e, k, seed=5, device="cuda")
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n * k, h, device="cuda", dtype=torch.bfloat16)
    xi = x.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = route_plan(routing_NE, k)
        y = sum_copies(gather_copies(xi, plan) * w, plan)
        y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    xr = x.clone().requires_grad_()
    permuted, _, idx = permute(xr, routing_NE)
    y_ref = unpermute(permuted * w, idx, restore_shape=xr.shape, routing_map=routing_NE)
    y_ref.float().sum().backward()
    # Both paths form the same bf16 products; the exact sum of those products (fp64) is the reference. Ours sums a
    # token's K copies in fp32 and rounds once, so it is within one bf16 rounding (2^-8 relative) of the exact sum;
    # Megatron's sums in bf16 and may only be further away.
    products64 = (permuted.detach() * w).double()
    y64 = unpermute(products64, idx, restore_shape=x.shape, routing_map=routing_NE)
    err_ours = (y.double() - y64).abs().max().item()
    err_megatron = (y_ref.double() - y64).abs().max().item()
    assert err_ours <= err_megatron + 1e-6, (err_ours, err_megatron)
    torch.testing.assert_close(y.double(), y64, rtol=2**-8, atol=1e-4)
    # The input gradient is the sum of a token's K copies of w: the same bound against the exact fp64 sum.
    x64 = x.double().requires_grad_()
    permute(x64, routing_NE)[0].mul(w.double()).sum().backward()
    grad_err_ours = (xi.grad.double() - x64.grad).abs().max().item()
    grad_err_megatron = (xr.grad.double() - x64.grad).abs().max().item()
    assert grad_err_ours <= grad_err_megatron + 1e-6, (grad_err_ours, grad_err_megatron)
    torch.testing.assert_close(xi.grad.double(), x64.grad, rtol=2**-8, atol=1e-4)
