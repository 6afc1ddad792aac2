"""Fused rotary position embedding (RoPE) for training on a GPU: one Triton kernel forward, one backward.

Megatron-Core without transformer-engine applies RoPE to queries and keys as ~8 separate kernels each way
(cos, sin, two broadcasting multiplies, a negation, two concatenations, an add), about 10 ms of a 4096-token
micro-batch of a 16-layer model on an H200. Megatron reaches a fused kernel through the module attributes
`rope_utils.fused_apply_rotary_pos_emb` / `fused_apply_rotary_pos_emb_thd` when
`TransformerConfig.apply_rope_fusion` is set; `install()` puts these kernels there.

Rotate-half RoPE with angles f = freqs[pos] ([rot] per position, rot <= head dim; Megatron's freqs hold
the same angles twice, [f, f]), x = [x1, x2, x_pass] (halves of the rotated part, then the rest):

    y1 = x1 cos(f1) - x2 sin(f1)        y2 = x2 cos(f2) + x1 sin(f2)        y_pass = x_pass

computed in fp32, rounded once. The backward is the transposed map:

    dx1 = dy1 cos(f1) + dy2 sin(f2)     dx2 = dy2 cos(f2) - dy1 sin(f1)     dx_pass = dy_pass

Positions: s for [S, B, H, D] inputs; for packed [T, H, D] inputs the offset inside each segment of
cu_seqlens (or t itself when freqs has one row per packed token, as Megatron's exact-offset mode).
Megatron's unfused path rounds cos and sin to the input dtype before multiplying; this one does not, so in
bf16 the two differ at rounding level (fp32 agrees to ~1e-7).
"""

from __future__ import annotations

import torch

from tppo.engine.triton_kernels import available, tl, triton

__all__ = ["available", "fused_rope_bshd", "fused_rope_thd", "install", "packed_positions"]


if triton is not None:

    @triton.jit
    def _rope_kernel(
        x_ptr,
        y_ptr,
        freqs_ptr,
        pos_ptr,
        B,
        H,
        sx_s,
        sx_b,
        sx_h,
        sx_d,
        sy_s,
        sy_b,
        sy_h,
        s_freq,
        HALF: tl.constexpr,
        PASS: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        BLOCK_PASS: tl.constexpr,
        HAS_POS: tl.constexpr,
        BACKWARD: tl.constexpr,
    ):
        row = tl.program_id(0)  # one (s, b) token: all of its heads
        s = row // B
        b = row % B
        pos = tl.load(pos_ptr + s) if HAS_POS else s
        d = tl.arange(0, BLOCK_HALF)
        h = tl.arange(0, BLOCK_H)
        dmask = d < HALF
        f1 = tl.load(freqs_ptr + pos * s_freq + d, mask=dmask, other=0.0).to(tl.float32)
        f2 = tl.load(freqs_ptr + pos * s_freq + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        cos1, sin1 = tl.cos(f1)[None, :], tl.sin(f1)[None, :]
        cos2, sin2 = tl.cos(f2)[None, :], tl.sin(f2)[None, :]
        mask = (h[:, None] < H) & dmask[None, :]
        x_row = x_ptr + s * sx_s + b * sx_b + h[:, None] * sx_h
        y_row = y_ptr + s * sy_s + b * sy_b + h[:, None] * sy_h
        x1 = tl.load(x_row + d[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + (HALF + d[None, :]) * sx_d, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * cos1 + x2 * sin2
            y2 = x2 * cos2 - x1 * sin1
        else:
            y1 = x1 * cos1 - x2 * sin1
            y2 = x2 * cos2 + x1 * sin2
        tl.store(y_row + d[None, :], y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_row + HALF + d[None, :], y2.to(y_ptr.dtype.element_ty), mask=mask)
        if PASS > 0:
            p = tl.arange(0, BLOCK_PASS)
            pmask = (h[:, None] < H) & (p[None, :] < PASS)
            rest = tl.load(x_row + (2 * HALF + p[None, :]) * sx_d, mask=pmask, other=0.0)
            tl.store(y_row + 2 * HALF + p[None, :], rest, mask=pmask)


def _launch(x_SBHD: torch.Tensor, freqs_SR: torch.Tensor, pos_S: torch.Tensor | None, backward: bool):
    s, b, h, d = x_SBHD.shape
    rot = freqs_SR.shape[-1]
    if rot % 2 or rot > d:
        raise ValueError(f"RoPE needs an even rotary dim <= head dim {d}, got {rot}")
    y = torch.empty((s, b, h, d), dtype=x_SBHD.dtype, device=x_SBHD.device)
    if y.numel() == 0:
        return y
    half, rest = rot // 2, d - rot
    _rope_kernel[(s * b,)](
        x_SBHD,
        y,
        freqs_SR,
        pos_S if pos_S is not None else freqs_SR,
        b,
        h,
        *x_SBHD.stride(),
        *y.stride()[:3],
        freqs_SR.stride(0),
        HALF=half,
        PASS=rest,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(rest, 1)),
        HAS_POS=pos_S is not None,
        BACKWARD=backward,
        num_warps=4,
    )
    return y


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SBHD, freqs_SR, pos_S):
        ctx.save_for_backward(freqs_SR, pos_S)
        return _launch(x_SBHD, freqs_SR, pos_S, backward=False)

    @staticmethod
    def backward(ctx, dy_SBHD):
        freqs_SR, pos_S = ctx.saved_tensors
        return _launch(dy_SBHD, freqs_SR, pos_S, backward=True), None, None


def _angles(freqs: torch.Tensor) -> torch.Tensor:
    """Megatron's freqs [S, 1, 1, rot] (or [S, rot]) as a [S, rot] fp32 table with unit stride along rot."""
    f = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    return f if f.dtype == torch.float32 and f.stride(-1) == 1 else f.float().contiguous()


def fused_rope_bshd(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False, interleaved: bool = False
) -> torch.Tensor:
    """RoPE of t [S, B, H, D] at positions 0..S-1 (Megatron's fused_apply_rotary_pos_emb signature)."""
    if interleaved:
        raise ValueError("the fused RoPE implements rotate-half RoPE; interleaved RoPE is not supported")
    if freqs.shape[0] < t.shape[0]:
        raise ValueError(f"RoPE freqs cover {freqs.shape[0]} positions, the input has {t.shape[0]}")
    return _FusedRope.apply(t, _angles(freqs[: t.shape[0]]), None)


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each packed token inside its segment of cu_seqlens, on the device (no host sync)."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    segment = torch.searchsorted(cu[1:], t, right=True)
    return t - cu[segment]


def fused_rope_thd(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0
) -> torch.Tensor:
    """RoPE of packed t [T, H, D] (Megatron's fused_apply_rotary_pos_emb_thd signature)."""
    if cp_size != 1:
        raise ValueError("the fused packed RoPE does not support context parallelism")
    total = t.shape[0]
    # Megatron's exact-offset mode: one freqs row per packed token.
    pos = None if freqs.shape[0] == total else packed_positions(cu_seqlens, total).to(torch.int32)
    out = _FusedRope.apply(t.unsqueeze(1), _angles(freqs), pos)
    return out.squeeze(1)


def install() -> bool:
    """Make Megatron's `apply_rope_fusion` use these kernels. False (nothing installed) where they cannot run."""
    if not available():
        return False
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils.fused_apply_rotary_pos_emb = fused_rope_bshd
    rope_utils.fused_apply_rotary_pos_emb_thd = fused_rope_thd
    return True
