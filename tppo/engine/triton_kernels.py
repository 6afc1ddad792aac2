"""Where the engine's Triton kernels (rope, swiglu, grouped_wgrad) can run: Triton importable and a CUDA device.

CUDA builds of torch ship Triton; CPU builds (tests, CI) do not, and the engine keeps its eager paths there.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = tl = None

__all__ = ["available", "tl", "triton"]


def available() -> bool:
    """True where the fused kernels can run: Triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()
