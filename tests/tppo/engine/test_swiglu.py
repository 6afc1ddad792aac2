"""The experts' fused gated activation (tppo.engine.swiglu) against the same formula in fp64 autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tppo.engine import swiglu


def _reference(h_N2F: torch.Tensor, p_N: torch.Tensor) -> torch.Tensor:
    g, u = h_N2F.chunk(2, dim=-1)
    return F.silu(g) * u * p_N.unsqueeze(-1)


@pytest.mark.gpu
@pytest.mark.skipif(not swiglu.available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize(
    ("n", "f", "dtype"), [(4096, 768, torch.bfloat16), (37, 1500, torch.float32), (0, 64, torch.bfloat16)]
)
def test_fused_matches_fp64_autograd(n, f, dtype):
    gen = torch.Generator(device="cuda").manual_seed(n + f)
    h = (torch.randn(n, 2 * f, device="cuda", generator=gen) * 3).to(dtype)
    p = torch.rand(n, device="cuda", generator=gen)
    da = torch.randn(n, f, device="cuda", generator=gen).to(dtype)
    h1, p1 = h.clone().requires_grad_(), p.clone().requires_grad_()
    a = swiglu.swiglu_probs(h1, p1)
    a.backward(da)
    h2, p2 = h.double().requires_grad_(), p.double().requires_grad_()
    a_ref = _reference(h2, p2)
    a_ref.backward(da.double())
    assert a.dtype == dtype and a.shape == (n, f)
    # bf16: fp32 math rounded once, so within one bf16 ulp of the exact value; fp32: a few dozen ulps.
    rel = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
    for got, want in ((a, a_ref), (h1.grad, h2.grad)):
        assert torch.all((got.double() - want).abs() <= rel * want.abs() + 1e-6)
    # dp sums F products in fp32: bound the error by the sum of their magnitudes, not by the (cancelling) sum.
    g, u = h2.detach().chunk(2, dim=-1)
    magnitude_N = (da.double() * F.silu(g) * u).abs().sum(dim=-1)
    assert torch.all((p1.grad.double() - p2.grad).abs() <= 1e-5 * magnitude_N + 1e-6)


def test_cpu_path_is_the_eager_formula():
    h = torch.randn(5, 8, requires_grad=True)
    p = torch.rand(5)
    torch.testing.assert_close(swiglu.swiglu_probs(h, p), _reference(h, p))
