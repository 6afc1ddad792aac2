"""Atomic checkpoints: a save interrupted at any point leaves the last complete checkpoint as `latest`."""

from __future__ import annotations

from tppo.base import checkpoint


def _save(root, step, payload, keep=2):
    ckpt = checkpoint.begin(root, step)
    checkpoint.save_file(payload, ckpt.tmp / "driver.pt")
    return checkpoint.commit(ckpt, keep)


def test_commit_publishes_and_latest_finds_it(tmp_path):
    path = _save(tmp_path, 3, {"x": 1})
    assert checkpoint.latest(tmp_path) == path
    assert checkpoint.step_of(path) == 3
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
