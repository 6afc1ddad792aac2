"""The CPU compatibility layer: applied only without CUDA, each patch does what it says, training works."""

from __future__ import annotations

import pytest
import torch

from tppo.engine import compat

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is for machines without CUDA")


def test_refuses_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="must not be enabled when CUDA is available"):
        compat.enable_cpu_compat()
    assert compat.maybe_enable_cpu_compat() is False


@no_cuda
def test_patches_are_documented_and_applied_once():
    names = compat.enable_cpu_compat()
    assert names == [p.name for p in compat.PATCHES]
    assert all(p.why for p in compat.PATCHES)
    assert compat.enable_cpu_compat() == names  # idempotent
    assert compat.compat_active()
    assert compat.maybe_enable_cpu_compat() is True


@no_cuda
def test_device_bookkeeping_maps_to_cpu():
    compat.enable_cpu_compat()
    assert torch.cuda.current_device() == torch.device("cpu")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x = torch.ones(3, device=torch.cuda.current_device())
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    torch.cuda.synchronize()
    assert x.device.type == "cpu"
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"


@no_cuda
def test_megatron_recompute_checkpoint_runs_on_cpu():
    """tensor_parallel.checkpoint saves/restores CUDA RNG state; with the layer it runs and matches."""
    compat.enable_cpu_compat()
    from megatron.core import tensor_parallel

    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    out = tensor_parallel.checkpoint(lambda a: torch.tanh(a @ w), False, x)
    out.sum().backward()
    ref_w = w.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    torch.tanh(ref_x @ ref_w).sum().backward()
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)


def test_missing_te_symbol_is_defined_on_any_device(monkeypatch):
    """Not a CPU patch: without transformer-engine the router needs te_general_gemm = None everywhere."""
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    assert compat.fix_missing_te_symbols() is True
    assert moe_utils.te_general_gemm is None
    assert compat.fix_missing_te_symbols() is False
