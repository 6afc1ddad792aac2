"""Run Megatron-Core 0.16.1 on a machine without CUDA: an explicit, minimal set of patches.

Megatron-Core assumes a CUDA device in a handful of places that the CPU tests and CI reach. Each patch
below is listed in `PATCHES` with the reason it exists; `enable_cpu_compat()` applies them only when
CUDA is absent (it refuses otherwise), is idempotent, and reports what it applied. Nothing here changes
the mathematics: it only lets device bookkeeping (current device, streams, events, the CUDA RNG state
saved by activation recompute) degrade to the CPU.

One fix is not about the CPU: megatron-core 0.16.1 without transformer-engine misses a symbol on every
device (`fix_missing_te_symbols`, applied by `tppo.engine.parallel.init_parallel` on GPU too).

Parts of running on CPU that are not patches live where they belong: the core attention on torch SDPA
(`tppo.engine.model`), the allgather token dispatcher on CPU (`tppo.engine.model`), and a torch AdamW in
place of Megatron's CUDA-only optimizer (`tppo.engine.engine`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "PATCHES",
    "compat_active",
    "enable_cpu_compat",
    "fix_missing_te_symbols",
    "maybe_enable_cpu_compat",
]


class _NoStream:
    """Stands in for torch.cuda.Stream: CPU work is synchronous, so waiting and recording are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


class _NoEvent:
    """Stands in for torch.cuda.Event."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


_CURRENT_STREAM = _NoStream()


def _patch_current_device() -> None:
    # Megatron allocates buffers with device=torch.cuda.current_device(); on CPU they belong on the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")


def _patch_streams_events() -> None:
    # The token dispatchers, DDP and shared experts create side streams and events for overlap.
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoEvent
    torch.cuda.current_stream = lambda device=None: _CURRENT_STREAM
    torch.cuda.default_stream = lambda device=None: _CURRENT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.is_current_stream_capturing = lambda: False


def fix_missing_te_symbols() -> bool:
    """Define moe_utils.te_general_gemm = None when transformer-engine is absent (CPU or GPU).

    0.16.1 reads that name in the router's gating linear but only defines it when transformer-engine
    imports; without TE the router raises NameError on any device. Not a CPU patch: `init_parallel`
    applies it on every machine. Returns whether the name had to be defined.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def _patch_te_general_gemm() -> None:
    fix_missing_te_symbols()


def _patch_cuda_rng_state() -> None:
    # Activation recompute (tensor_parallel.checkpoint) saves and restores the CUDA RNG state and the
    # model-parallel RNG tracker's states. On CPU there is no CUDA generator: the CPU generator (which
    # the checkpoint function saves separately) is the only one in use, so these become no-ops.
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.zeros(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.zeros(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda new_state, device="cuda": None
    tracker_cls = mp_random.CudaRNGStatesTracker
    tracker_cls.get_states = lambda self: {}
    tracker_cls.set_states = lambda self, states: None
    tracker_cls.add = lambda self, name, seed: self.seeds_.add(seed)
    tracker_cls.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()


def _on_cpu(device):
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _CpuTorch:
    """The torch module as seen by a Megatron module that writes device="cuda" literally: its tensor
    factories read that literal as the CPU; everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def tensor(*args, device=None, **kwargs):
        return torch.tensor(*args, device=_on_cpu(device), **kwargs)

    @staticmethod
    def empty(*args, device=None, **kwargs):
        return torch.empty(*args, device=_on_cpu(device), **kwargs)


def _patch_cuda_literals() -> None:
    # The forward/backward schedules allocate their token counter with device="cuda" (a literal, not
    # current_device()); that module sees a torch whose tensor factories map "cuda" to the CPU.
    # (Megatron's optimizer modules do the same and also check param.type() == "torch.cuda.*": they
    # are not patched; the CPU engine uses torch's AdamW instead.)
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuTorch()


def _patch_alltoall_splits() -> None:
    # The all-to-all dispatcher moves its split sizes to the host as numpy arrays, but only from a CUDA
    # tensor; on the CPU they stay tensors, which all_to_all_single refuses. Convert them the same way.
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    apply: Callable[[], None]


PATCHES: tuple[Patch, ...] = (
    Patch("current_device", "torch.cuda.current_device() -> the CPU device", _patch_current_device),
    Patch("streams_events", "CUDA streams/events used for overlap become no-ops", _patch_streams_events),
    Patch(
        "te_general_gemm",
        "define moe_utils.te_general_gemm = None (0.16.1 bug without TE)",
        _patch_te_general_gemm,
    ),
    Patch("cuda_rng_state", "recompute's CUDA RNG state save/restore become no-ops", _patch_cuda_rng_state),
    Patch(
        "cuda_literals", 'device="cuda" literals of the pipeline schedules -> the CPU', _patch_cuda_literals
    ),
    Patch(
        "alltoall_splits",
        "the all-to-all dispatcher's split sizes become host arrays on the CPU too (EP > 1 over gloo)",
        _patch_alltoall_splits,
    ),
)

_applied: list[str] = []


def compat_active() -> bool:
    """True once the CPU patches are applied in this process."""
    return bool(_applied)


def enable_cpu_compat() -> list[str]:
    """Apply every patch of `PATCHES` once; return their names. Refuses when CUDA is available."""
    if torch.cuda.is_available():
        raise RuntimeError("the CPU compatibility layer must not be enabled when CUDA is available")
    if not _applied:
        for patch in PATCHES:
            patch.apply()
            _applied.append(patch.name)
    return list(_applied)


def maybe_enable_cpu_compat() -> bool:
    """Enable the CPU patches iff CUDA is absent; return whether they are active."""
    if torch.cuda.is_available():
        return False
    enable_cpu_compat()
    return True
