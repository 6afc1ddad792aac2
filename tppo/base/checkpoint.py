"""Atomic checkpoints of a run: a directory per step, written under a temporary name and renamed when whole.

    <run_dir>/checkpoints/step_000040/        one complete checkpoint
        driver.pt                             pool (with every in-flight response), data position, RNG, step
        policy_rank0.pt, critic_rank0.pt ...  each trainer rank's model + optimizer shard
        policy_hf/                            the policy as a Hugging Face checkpoint (eval, serving)
        MANIFEST.json                         the size of every file above
        COMPLETE                              written last, before the rename
    <run_dir>/checkpoints/latest              the name of the newest complete checkpoint (replaced atomically)

A crash at any moment leaves either the previous checkpoint as `latest` or the new one, never a torn one:
ranks write into `step_000040.tmp`, the driver writes its own state and the marker, then renames the
directory and swaps `latest`. Leftover `.tmp` directories of a crashed save are removed on the next save.
The file system must be shared by all ranks (as on any Slurm cluster with a shared home or scratch).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"  # every file's size, written before COMPLETE
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
    """Publish a fully written checkpoint: manifest, marker, rename, swap `latest`, then prune old ones."""
    sizes = {
        str(f.relative_to(ckpt.tmp)): f.stat().st_size for f in sorted(ckpt.tmp.rglob("*")) if f.is_file()
    }
    (ckpt.tmp / MANIFEST).write_text(json.dumps(sizes, indent=0))
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


def complete(root: str | Path) -> list[Path]:
    """The complete checkpoints under `root`, newest first."""
    found = [p for p in Path(root).glob("step_*") if p.is_dir() and (p / COMPLETE).exists()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def problem(ckpt: Path) -> str | None:
    """Why the checkpoint `ckpt` cannot be used (a file of its manifest missing or of another size: a torn copy,
    a full disk), or None."""
    if not (ckpt / COMPLETE).exists():
        return "it is incomplete (no COMPLETE marker)"
    manifest = ckpt / MANIFEST
    if not manifest.exists():
        return None  # written before manifests were kept: the marker is all there is to check
    try:
        sizes = json.loads(manifest.read_text())
    except ValueError:
        return f"its {MANIFEST} is unreadable"
    for name, size in sizes.items():
        f = ckpt / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} has {f.stat().st_size} bytes, {size} were written"
    return None


def whole(root: str | Path, on_skip: Callable[[Path, str], None] | None = None) -> Iterator[Path]:
    """The complete checkpoints under `root` whose files are whole (`problem`), newest first; each one passed
    over is reported to `on_skip` with the reason."""
    for ckpt in complete(root):
        why = problem(ckpt)
        if why is None:
            yield ckpt
        elif on_skip is not None:
            on_skip(ckpt, why)


def latest(root: str | Path, on_skip: Callable[[Path, str], None] | None = None) -> Path | None:
    """The newest complete checkpoint under `root` whose files are whole, or None (see `whole`)."""
    return next(whole(root, on_skip), None)


class CheckpointError(ValueError):
    """A checkpoint file that is not checkpoint data: loading it could run code, so it is refused."""


def _numpy_types() -> list[Any]:
    """What NumPy arrays unpickle through: its array reconstructor, ndarray, dtype, the dtype classes and bytes
    (an array's raw data)."""
    core = getattr(np, "_core", None) or np.core
    dtypes = [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, *dtypes, bytes]


# Checkpoints hold tensors, numbers, strings, containers and NumPy arrays: nothing that runs code when loaded.
SAFE_TYPES = _numpy_types()


def load_file(path: Path) -> Any:
    """A file `save_file` wrote, loaded without running any code it might carry: torch's weights-only unpickler
    with NumPy arrays allowed. Anything else (a class, a function to call) raises CheckpointError."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    try:
        with torch.serialization.safe_globals(SAFE_TYPES):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = next(
            (line.strip() for line in str(err).splitlines() if "GLOBAL" in line or "got <" in line), ""
        )
        raise CheckpointError(
            f"{path} is refused: it holds more than tensors, numbers, strings and arrays, and loading it could run "
            f"code ({found or 'an object the weights-only loader does not build'})"
        ) from None
    return _owned(obj)


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
