"""The fused Triton RoPE (tppo.engine.rope) against Megatron's unfused RoPE, and the GPU attention path of
`SDPAttention` (cuDNN with native GQA) against fp32 math attention."""

from __future__ import annotations

import contextlib

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import (
    _apply_rotary_pos_emb_bshd,
    _apply_rotary_pos_emb_thd,
)

from tppo.engine import rope

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _freqs(positions: int, rot: int, theta: float = 1e6) -> torch.Tensor:
    """Megatron's RotaryEmbedding layout: [S, 1, 1, rot], the angles twice ([f, f])."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]


def test_packed_positions_restart_in_every_segment():
    cu = torch.tensor([0, 3, 3, 7, 8])
    assert rope.packed_positions(cu, 8).tolist() == [0, 1, 2, 0, 1, 2, 3, 0]


def test_installs_only_where_the_kernels_can_run():
    assert rope.install() == (rope.triton is not None and torch.cuda.is_available())


def _unfused_grad(fn, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim", "rot"), [(32, 128, 128), (4, 128, 128), (3, 80, 64)])
def test_fused_rope_bshd_matches_megatron(dtype, heads, dim, rot):
    torch.manual_seed(0)
    s, b = 257, 2
    # A strided view, as Megatron's query after splitting the fused QKV projection.
    qkv = torch.randn(s, b, heads, 3 * dim, device="cuda", dtype=dtype)
    x = qkv[..., dim : 2 * dim]
    freqs = _freqs(s, rot).cuda()
    dy = torch.randn(s, b, heads, dim, device="cuda", dtype=dtype)
    y_ref, dx_ref = _unfused_grad(lambda t: _apply_rotary_pos_emb_bshd(t, freqs), x.float(), dy.float())
    y, dx = _unfused_grad(lambda t: rope.fused_rope_bshd(t, freqs), x, dy)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(y.float(), y_ref, **tol)
    torch.testing.assert_close(dx.float(), dx_ref, **tol)
    if rot < dim:  # the part past the rotary dims passes through untouched
        assert torch.equal(y[..., rot:], x[..., rot:])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("exact_offsets", [False, True])
def test_fused_rope_thd_matches_megatron(exact_offsets):
    torch.manual_seed(1)
    cu = torch.tensor([0, 5, 6, 70, 133], dtype=torch.int32, device="cuda")
    total, heads, dim = 133, 4, 64
    x = torch.randn(total, heads, dim, device="cuda")
    dy = torch.randn(total, heads, dim, device="cuda")
    freqs = _freqs(total if exact_offsets else 64, dim).cuda()
    group = _SingleRank()
    y_ref, dx_ref = _unfused_grad(lambda t: _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group), x, dy)
    y, dx = _unfused_grad(lambda t: rope.fused_rope_thd(t, cu, freqs), x, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)


class _SingleRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def test_fused_rope_refuses_what_it_does_not_implement():
    """The checks come before any kernel: they run on the CPU too."""
    x = torch.randn(8, 1, 2, 16)
    with pytest.raises(ValueError, match="interleaved"):
        rope.fused_rope_bshd(x, _freqs(8, 16), interleaved=True)
    with pytest.raises(ValueError, match="cover 4 positions"):
        rope.fused_rope_bshd(x, _freqs(4, 16))
    with pytest.raises(ValueError, match="even rotary dim"):
        rope.fused_rope_bshd(x, _freqs(8, 32))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_attention_matches_fp32_math(packed):
    """bf16 GQA attention as the model runs it on a GPU (cuDNN first) against fp32 math attention."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tppo.engine.model import SDPAttention

    torch.manual_seed(2)
    attn = object.__new__(SDPAttention)  # the kernels only need the softmax scale
    torch.nn.Module.__init__(attn)
    attn.softmax_scale = 128**-0.5
    s, hq, g, d = 1000, 32, 4, 128

    def inputs(dtype):
        shape = (s, hq, d) if packed else (s, 1, hq, d)
        kv = (s, g, d) if packed else (s, 1, g, d)
        gen = torch.Generator(device="cuda").manual_seed(3)
        return [torch.randn(sh, device="cuda", generator=gen).to(dtype) for sh in (shape, kv, kv)]

    cu = torch.tensor([0, 37, 600, s], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu) if packed else None

    def run(dtype, ctx):
        q, k, v = (t.requires_grad_() for t in inputs(dtype))
        with ctx:
            out = attn(q, k, v, None, packed_seq_params=params)
        dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))
        out.backward(dout.to(dtype))
        return [out.float()] + [t.grad.float() for t in (q, k, v)]

    got = run(torch.bfloat16, contextlib.nullcontext())
    want = run(torch.float32, sdpa_kernel([SDPBackend.MATH]))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a - b).abs().max() / b.abs().max()
        assert err < 2e-2, f"{name}: max error {err:.3g} of the largest value"
