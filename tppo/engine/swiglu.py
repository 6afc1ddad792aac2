"""The experts' gated activation scaled by the gate probability, one Triton kernel each way (GPU).

Between the two grouped GEMMs of the experts, eager PyTorch runs ~6 kernels forward (silu, two products
over strided halves, a cast) and ~10 backward, several of them unvectorised because the halves are
strided views: ~8 ms of a 4096-token micro-batch of a 16-layer, 64-expert model on an H200, for a few
hundred MB of traffic. With h = [g, u] (the [N, 2F] output of the first GEMM) and p the gate probability:

    a   = silu(g) * u * p                                     (fp32 math, one rounding to h's dtype)
    du  = da * silu(g) * p
    dg  = da * u * p * s * (1 + g (1 - s)),   s = sigmoid(g)
    dp  = sum_f da * silu(g) * u                              (fp32, per row)

`swiglu_probs(h_N2F, probs_N)` runs these on a GPU with Triton and falls back to the same formula in
eager PyTorch elsewhere (the CPU path keeps the eager rounding of the original code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tppo.engine.triton_kernels import available, tl, triton

__all__ = ["available", "swiglu_probs", "swiglu_probs_eager"]

_BLOCK_F = 1024


def swiglu_probs_eager(h_N2F: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
    """silu(g) * u * p in eager PyTorch, cast to h's dtype."""
    gate_NF, up_NF = h_N2F.chunk(2, dim=-1)
    return (F.silu(gate_NF) * up_NF * probs_N.unsqueeze(-1)).to(h_N2F.dtype)


if triton is not None:

    @triton.jit
    def _fwd_kernel(h_ptr, p_ptr, a_ptr, size_f, stride_h, stride_a, BLOCK_F: tl.constexpr):
        row = tl.program_id(0)
        p = tl.load(p_ptr + row).to(tl.float32)
        for f0 in range(0, size_f, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            live = f < size_f
            g = tl.load(h_ptr + row * stride_h + f, mask=live, other=0.0).to(tl.float32)
            u = tl.load(h_ptr + row * stride_h + size_f + f, mask=live, other=0.0).to(tl.float32)
            a = g * tl.sigmoid(g) * u * p
            tl.store(a_ptr + row * stride_a + f, a.to(a_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _bwd_kernel(h_ptr, p_ptr, da_ptr, dh_ptr, dp_ptr, size_f, stride_h, stride_da, BLOCK_F: tl.constexpr):
        row = tl.program_id(0)
        p = tl.load(p_ptr + row).to(tl.float32)
        dp = tl.zeros((BLOCK_F,), dtype=tl.float32)
        for f0 in range(0, size_f, BLOCK_F):
            f = f0 + tl.arange(0, BLOCK_F)
            live = f < size_f
            g = tl.load(h_ptr + row * stride_h + f, mask=live, other=0.0).to(tl.float32)
            u = tl.load(h_ptr + row * stride_h + size_f + f, mask=live, other=0.0).to(tl.float32)
            da = tl.load(da_ptr + row * stride_da + f, mask=live, other=0.0).to(tl.float32)
            s = tl.sigmoid(g)
            silu = g * s
            dp += da * silu * u
            du = da * silu * p
            dg = da * u * p * s * (1.0 + g * (1.0 - s))
            tl.store(dh_ptr + row * stride_h + f, dg.to(dh_ptr.dtype.element_ty), mask=live)
            tl.store(dh_ptr + row * stride_h + size_f + f, du.to(dh_ptr.dtype.element_ty), mask=live)
        tl.store(dp_ptr + row, tl.sum(dp, axis=0).to(dp_ptr.dtype.element_ty))


class _SwigluProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_N2F, probs_N):
        n, f = h_N2F.shape[0], h_N2F.shape[1] // 2
        a_NF = torch.empty(n, f, dtype=h_N2F.dtype, device=h_N2F.device)
        if n:
            _fwd_kernel[(n,)](h_N2F, probs_N, a_NF, f, h_N2F.stride(0), a_NF.stride(0), BLOCK_F=_BLOCK_F)
        ctx.save_for_backward(h_N2F, probs_N)
        return a_NF

    @staticmethod
    def backward(ctx, da_NF):
        h_N2F, probs_N = ctx.saved_tensors
        da_NF = da_NF.contiguous()
        n, f = da_NF.shape
        dh_N2F = torch.empty_like(h_N2F)
        dp_N = torch.empty_like(probs_N)
        if n:
            _bwd_kernel[(n,)](
                h_N2F, probs_N, da_NF, dh_N2F, dp_N, f, h_N2F.stride(0), da_NF.stride(0), BLOCK_F=_BLOCK_F
            )
        return dh_N2F, dp_N


def swiglu_probs(h_N2F: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
    """silu(g) * u * p for h = [g, u] ([N, 2F]) and p ([N]): the Triton kernels on a GPU, eager elsewhere."""
    if h_N2F.is_cuda and triton is not None:
        return _SwigluProbs.apply(h_N2F.contiguous(), probs_N.contiguous())
    return swiglu_probs_eager(h_N2F, probs_N)
