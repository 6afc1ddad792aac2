"""Offload and onload of tensors by their storage, so every view (parameters inside Megatron's contiguous
buffers, optimizer shards) stays valid while the memory is released.

`offload(tensors, drop=...)` copies each distinct storage to host memory (pinned on CUDA) and resizes the
device storage to zero bytes; storages listed in `drop` (gradient buffers) are released without a copy.
`onload()` re-allocates every storage at its old size, copies the saved bytes back and zero-fills the
dropped ones. Tensors that share a storage are handled once. On CPU the same calls run (they release and
restore the same way), which is what the tests exercise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StorageOffloader"]


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: dropped (zero-filled on onload)


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StorageOffloader:
    """Releases and restores the storages behind a set of tensors."""

    def __init__(self) -> None:
        self._saved: list[_Saved] = []

    @property
    def active(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: list[torch.Tensor], drop: list[torch.Tensor] = ()) -> int:
        """Release the storages of `tensors` (saved) and `drop` (not saved); return the bytes released."""
        if self._saved:
            raise RuntimeError("already offloaded: call onload() first")
        seen: set[int] = set()
        dropped = {t.untyped_storage().data_ptr() for t in drop if t.untyped_storage().nbytes()}
        released = 0
        for t in list(drop) + list(tensors):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            if not storage.resizable():
                raise ValueError(
                    f"cannot offload a tensor of shape {tuple(t.shape)} ({t.dtype}): its storage is not resizable "
                    "(memory owned by numpy or a memory map); copy it into a torch-owned tensor first"
                )
            host = None
            if key not in dropped:
                src = _bytes_view(storage)
                host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=src.is_cuda)
                host.copy_(src, non_blocking=src.is_cuda)
            self._saved.append(_Saved(storage=storage, nbytes=storage.nbytes(), host=host))
        if any(s.host is not None and s.host.is_pinned() for s in self._saved):
            torch.cuda.synchronize()
        for s in self._saved:
            released += s.nbytes
            s.storage.resize_(0)
        return released

    def onload(self) -> None:
        """Restore every released storage (saved bytes back; dropped ones zero-filled)."""
        for s in self._saved:
            s.storage.resize_(s.nbytes)
            view = _bytes_view(s.storage)
            if s.host is None:
                view.zero_()
            else:
                view.copy_(s.host, non_blocking=True)
        if self._saved and self._saved[0].storage.device.type == "cuda":
            torch.cuda.synchronize()
        self._saved = []
