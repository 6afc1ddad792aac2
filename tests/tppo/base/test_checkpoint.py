"""Atomic checkpoints: a save interrupted at any point leaves the last complete checkpoint as `latest`."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tppo.base import checkpoint


def _save(root, step, payload, keep=2):
    ckpt = checkpoint.begin(root, step)
    checkpoint.save_file(payload, ckpt.tmp / "driver.pt")
    return checkpoint.commit(ckpt, keep)


def test_commit_publishes_and_latest_finds_it(tmp_path):
    path = _save(tmp_path, 3, {"x": 1})
    assert checkpoint.latest(tmp_path) == path
    assert (path / checkpoint.COMPLETE).read_text() == "3"
    assert checkpoint.load_file(path / "driver.pt") == {"x": 1}


def test_interrupted_save_keeps_previous_and_is_cleaned_up(tmp_path):
    good = _save(tmp_path, 1, {"x": 1})
    crashed = checkpoint.begin(tmp_path, 2)  # ranks wrote, the driver died before commit
    checkpoint.save_file({"x": "partial"}, crashed.tmp / "driver.pt")
    assert checkpoint.latest(tmp_path) == good
    _save(tmp_path, 3, {"x": 3})
    assert not crashed.tmp.exists(), "leftovers of a crashed save are removed by the next save"


def test_stale_pointer_falls_back_to_the_newest_complete(tmp_path):
    _save(tmp_path, 1, {"x": 1})
    second = _save(tmp_path, 2, {"x": 2})
    (tmp_path / checkpoint.LATEST).write_text("step_000099")  # points at nothing
    assert checkpoint.latest(tmp_path) == second


def test_a_torn_newest_checkpoint_is_passed_over_with_the_reason(tmp_path):
    good = _save(tmp_path, 1, {"x": 1})
    torn = _save(tmp_path, 2, {"x": list(range(1000))})
    data = (torn / "driver.pt").read_bytes()
    (torn / "driver.pt").write_bytes(data[: len(data) // 2])  # a copy cut short, a full disk
    skipped = []
    assert checkpoint.latest(tmp_path, on_skip=lambda c, why: skipped.append((c.name, why))) == good
    assert skipped == [("step_000002", f"driver.pt has {len(data) // 2} bytes, {len(data)} were written")]
    (good / "driver.pt").unlink()
    assert checkpoint.problem(good) == "driver.pt is missing" and checkpoint.latest(tmp_path) is None


def test_pruning_keeps_the_newest(tmp_path):
    for step in range(5):
        _save(tmp_path, step, {"x": step}, keep=2)
    kept = sorted(p.name for p in tmp_path.glob("step_*"))
    assert kept == ["step_000003", "step_000004"]


def test_missing_shard_is_a_clear_error(tmp_path):
    path = _save(tmp_path, 1, {"x": 1})
    import pytest

    with pytest.raises(FileNotFoundError, match=r"policy_rank0\.pt is missing"):
        checkpoint.load_file(path / "policy_rank0.pt")


class _RunsCode:
    """A crafted pickle: unpickling it calls os.system (what a replaced driver.pt could do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "driver.pt"
    torch.save({"step": 3, "pool": _RunsCode(marker)}, path)
    with pytest.raises(
        checkpoint.CheckpointError, match=r"driver\.pt is refused: .* could run code \(.*posix\.system"
    ):
        checkpoint.load_file(path)
    assert not marker.exists()


def test_driver_state_round_trips_through_the_safe_loader(tmp_path):
    """What the driver saves: numbers, strings, NumPy arrays of every dtype it uses, the three RNG states."""
    rng = checkpoint.RngState()
    state = {
        "step": 7,
        "pool": {
            "ids": np.arange(5, dtype=np.int32),
            "lp": np.linspace(0, 1, 4, dtype=np.float32),
            "tag": "g1.0",
        },
        "routes": np.zeros((3, 2, 2), np.uint8),
        "loads": np.ones((2, 4), np.int64),
        "flags": np.array([True, False]),
        "none": None,
        "rng": rng.state_dict(),
    }
    checkpoint.save_file(state, tmp_path / "driver.pt")
    back = checkpoint.load_file(tmp_path / "driver.pt")
    assert back["step"] == 7 and back["none"] is None and back["pool"]["tag"] == "g1.0"
    for key in ("routes", "loads", "flags"):
        np.testing.assert_array_equal(back[key], state[key])
        assert back[key].dtype == state[key].dtype
    np.testing.assert_array_equal(back["pool"]["ids"], state["pool"]["ids"])
    drawn = (random.random(), float(np.random.random()), float(torch.rand(1)))
    rng.load_state_dict(back["rng"])  # the generators continue from the saved point
    assert (random.random(), float(np.random.random()), float(torch.rand(1))) == drawn
