"""Atomic checkpoints of a run: a directory per step, written under a temporary name and renamed when whole.

    <run_dir>/checkpoints/step_000040/        one complete checkpoint
        driver.pt                             pool (with every in-flight response), data position, RNG, step
        policy_rank0.pt, critic_rank0.pt ...  each trainer rank's model + optimizer shard
        policy_hf/                            the policy as a Hugging Face checkpoint (eval, serving)
        COMPLETE                              written last, before the rename
    <run_dir>/checkpoints/latest              the name of the newest complete checkpoint (replaced atomically)

A crash at any moment leaves either the previous checkpoint as `latest` or the new one, never a torn one:
ranks write into `step_000040.tmp`, the driver writes its own state and the marker, then renames the
directory and swaps `latest`. Leftover `.tmp` directories of a crashed save are removed on the next save.
The file system must be shared by all ranks (as on any Slurm cluster with a shared home or scratch).
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

COMPLETE = "COMPLETE"
POLICY_HF = "policy_hf"  # the policy exported as a Hugging Face checkpoint
LATEST = "latest"


class Stateful(Protocol):
    """What the driver checkpoints: an object that hands out its state and takes it back, exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RngState:
    """The driver process's random generators (Python's, NumPy's global, torch's CPU) as one `Stateful`."""

    def state_dict(self) -> dict[str, Any]:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])


@dataclass(frozen=True)
class CheckpointDir:
    """Where one step's checkpoint is being written (`tmp`) and where it lands (`final`)."""

    step: int
    tmp: Path
    final: Path

    def shard(self, role: str, rank: int) -> Path:
        return self.tmp / f"{role}_rank{rank}.pt"


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def begin(root: str | Path, step: int) -> CheckpointDir:
    """Create an empty temporary directory for the checkpoint of `step`, dropping leftovers of crashed saves."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / step_name(step)
    tmp = root / f"{step_name(step)}.tmp"
    tmp.mkdir()
    return CheckpointDir(step=step, tmp=tmp, final=final)


def save_file(obj: Any, path: Path) -> None:
    """torch.save then fsync, so the bytes are on disk before the directory is published."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def commit(ckpt: CheckpointDir, keep: int) -> Path:
    """Publish a fully written checkpoint: marker, rename, swap `latest`, then prune old ones (keep >= 1)."""
    (ckpt.tmp / COMPLETE).write_text(str(ckpt.step))
    _fsync_dir(ckpt.tmp)
    if ckpt.final.exists():  # a re-run of the same step after a resume: replace it
        shutil.rmtree(ckpt.final)
    os.rename(ckpt.tmp, ckpt.final)
    root = ckpt.final.parent
    tmp_latest = root / f"{LATEST}.tmp"
    tmp_latest.write_text(ckpt.final.name)
    os.replace(tmp_latest, root / LATEST)
    _fsync_dir(root)
    _prune(root, keep)
    return ckpt.final


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None. Falls back to scanning if `latest` is stale."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.exists():
        candidate = root / pointer.read_text().strip()
        if (candidate / COMPLETE).exists():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE).exists())
    return complete[-1] if complete else None


def step_of(path: Path) -> int:
    return int((path / COMPLETE).read_text())


def load_file(path: Path) -> Any:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    return _owned(torch.load(path, map_location="cpu", weights_only=False))


def _owned(obj: Any) -> Any:
    """Tensors torch.load hands back may live in storages it does not let resize; whatever keeps them (optimizer
    state) could then never be offloaded. Copy those into torch-owned memory."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.untyped_storage().resizable() else obj.clone()
    if isinstance(obj, dict):
        return {k: _owned(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(_owned(v) for v in obj)
    return obj


def _prune(root: Path, keep: int) -> None:
    complete = sorted(p for p in root.glob("step_*") if p.is_dir() and (p / COMPLETE).exists())
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
