"""Expert weight gradients accumulated straight into Megatron's fp32 main grads (one Triton kernel).

Without this, every micro-batch's backward writes each expert weight's gradient in bf16 and Megatron's DDP
hook then adds it into the fp32 `main_grad` buffer: 2 + 10 bytes of traffic per expert parameter per
micro-batch, ~15% of a training step of a 64-expert model at sequence 4096 on an H200. Here the
weight-gradient GEMM of each expert adds its fp32 accumulator to `main_grad` in the epilogue (8 bytes per
parameter, overlapped with the GEMM) and the bf16 gradient never exists. It is Megatron's
`gradient_accumulation_fusion` for the grouped experts.

For tokens sorted by expert (offs_E: cumulative row counts), with y = x W[e]^T:

    main_grad[e] += dy[rows of e]^T @ x[rows of e]          ([O, K] per expert, fp32 accumulation)

`grouped_linear_fused_wgrad(x_NK, w_EOK, offs_E)` is y = x W[e]^T whose backward returns dx and adds dW to
`w_EOK.main_grad` instead of returning it. It returns no weight gradient, so DDP's per-parameter hook does
not run for that weight; that is only safe without overlapped gradient reduction (the engine's setting),
which is why the engine switches it on explicitly (`GroupedExperts.fuse_wgrad_accumulation`).
"""

from __future__ import annotations

import torch

from tppo.engine.triton_kernels import available, tl, triton

__all__ = ["available", "grouped_linear_fused_wgrad", "grouped_wgrad_accumulate"]

# (BLOCK_O, BLOCK_K, BLOCK_N, warps, stages): the fastest of ten on an H200 at Qwen3-30B-A3B-like expert
# shapes (bench/megatron_train.py --variants parts times a few of them).
_CONFIG = (64, 128, 64, 4, 4)


if triton is not None:

    @triton.jit
    def _wgrad_kernel(
        g_ptr,
        x_ptr,
        w_ptr,
        offs_ptr,
        size_o,
        size_k,
        stride_g,
        stride_x,
        stride_we,
        stride_wo,
        BLOCK_O: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        tile = tl.program_id(0)
        e = tl.program_id(1)
        tiles_k = tl.cdiv(size_k, BLOCK_K)
        ro = (tile // tiles_k) * BLOCK_O + tl.arange(0, BLOCK_O)
        rk = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offs_ptr + e)
        # An expert without tokens adds nothing: leave its main grad untouched (no read, no write).
        if end > start:
            w_tile = w_ptr + e * stride_we + ro[:, None] * stride_wo + rk[None, :]
            inside = (ro[:, None] < size_o) & (rk[None, :] < size_k)
            # Issued before the GEMM loop so that the read overlaps it.
            prev = tl.load(w_tile, mask=inside, other=0.0)
            rn = tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32)
            for n0 in range(start, end, BLOCK_N):
                rows = n0 + rn
                live = rows < end
                g = tl.load(
                    g_ptr + rows[:, None] * stride_g + ro[None, :],
                    mask=live[:, None] & (ro[None, :] < size_o),
                    other=0.0,
                )
                x = tl.load(
                    x_ptr + rows[:, None] * stride_x + rk[None, :],
                    mask=live[:, None] & (rk[None, :] < size_k),
                    other=0.0,
                )
                acc = tl.dot(tl.trans(g), x, acc)
            tl.store(w_tile, acc + prev, mask=inside)


def grouped_wgrad_accumulate(
    dy_NO: torch.Tensor, x_NK: torch.Tensor, offs_E: torch.Tensor, main_grad_EOK: torch.Tensor
) -> None:
    """main_grad[e] += dy[rows of e]^T @ x[rows of e] in place (rows of e: offs[e-1]..offs[e])."""
    e, o, k = main_grad_EOK.shape
    if main_grad_EOK.dtype != torch.float32 or not main_grad_EOK.is_contiguous():
        raise ValueError("the main grad must be a contiguous fp32 tensor [E, O, K]")
    if dy_NO.shape[1] != o or x_NK.shape[1] != k or dy_NO.shape[0] != x_NK.shape[0] or offs_E.numel() != e:
        raise ValueError(
            f"shapes do not fit: dy {tuple(dy_NO.shape)}, x {tuple(x_NK.shape)}, offs {tuple(offs_E.shape)}, "
            f"main grad {tuple(main_grad_EOK.shape)}"
        )
    dy_NO, x_NK = dy_NO.contiguous(), x_NK.contiguous()
    bo, bk, bn, warps, stages = _CONFIG
    grid = (triton.cdiv(o, bo) * triton.cdiv(k, bk), e)
    _wgrad_kernel[grid](
        dy_NO,
        x_NK,
        main_grad_EOK,
        offs_E.to(torch.int32),
        o,
        k,
        dy_NO.stride(0),
        x_NK.stride(0),
        main_grad_EOK.stride(0),
        main_grad_EOK.stride(1),
        BLOCK_O=bo,
        BLOCK_K=bk,
        BLOCK_N=bn,
        num_warps=warps,
        num_stages=stages,
    )


class _GroupedLinearFusedWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NK, w_EOK, offs_E, linear):
        ctx.save_for_backward(x_NK, w_EOK, offs_E)
        return linear(x_NK, w_EOK, offs_E)

    @staticmethod
    def backward(ctx, dy_NO):
        x_NK, w_EOK, offs_E = ctx.saved_tensors
        dy_NO = dy_NO.contiguous()
        dx_NK = torch._grouped_mm(dy_NO, w_EOK, offs=offs_E) if ctx.needs_input_grad[0] else None
        grouped_wgrad_accumulate(dy_NO, x_NK, offs_E, w_EOK.main_grad)
        return dx_NK, None, None, None


def grouped_linear_fused_wgrad(x_NK: torch.Tensor, w_EOK: torch.Tensor, offs_E: torch.Tensor, linear):
    """`linear(x, w, offs)` (y = x W[e]^T) whose weight gradient goes into w.main_grad (see the module doc)."""
    if not hasattr(w_EOK, "main_grad"):
        raise ValueError("the fused weight gradient needs a parameter with a main_grad (Megatron's DDP)")
    return _GroupedLinearFusedWgrad.apply(x_NK, w_EOK, offs_E, linear)
