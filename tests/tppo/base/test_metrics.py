"""The metrics logger: namespaced keys, JSONL always, resume keeps what came before the checkpoint."""

from __future__ import annotations

import math

import pytest

from tppo.base.metrics import LoggingConfig, MetricsLogger, check_key, read_metrics, wandb_mode


def test_keys_must_be_namespaced():
    check_key("rollout/tokens_per_s")
    for bad in ("loss", "foo/bar", "tppo/", "/x"):
        with pytest.raises(ValueError, match="namespace"):
            check_key(bad)


def test_wandb_mode_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode("auto", {}) == "offline"
    assert wandb_mode("auto", {"WANDB_API_KEY": "x"}) == "online"
    assert wandb_mode("online", {"WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode("disabled", {}) == "disabled"


def test_jsonl_records_and_resume_truncation(tmp_path):
    cfg = LoggingConfig(wandb="disabled")
    with MetricsLogger(tmp_path, cfg, "t") as log:
        for step in range(1, 6):
            log.log({"tppo/loss": float(step), "perf/step_s": math.nan}, step=step)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["perf/step_s"] is None  # non-finite values become null, never invalid JSON
    with MetricsLogger(tmp_path, cfg, "t", resume_step=3) as log:
        log.log({"tppo/loss": 40.0}, step=4)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["tppo/loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_resume_tolerates_a_line_torn_by_a_kill(tmp_path):
    cfg = LoggingConfig(wandb="disabled")
    with MetricsLogger(tmp_path, cfg, "t") as log:
        for step in range(3):
            log.log({"tppo/loss": float(step)}, step=step)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "tppo/lo')  # killed mid-write
    with MetricsLogger(tmp_path, cfg, "t", resume_step=1) as log:
        log.log({"tppo/loss": 20.0}, step=2)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["tppo/loss"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 20.0)]


def test_fresh_run_starts_a_new_file(tmp_path):
    cfg = LoggingConfig(wandb="disabled")
    with MetricsLogger(tmp_path, cfg, "t") as log:
        log.log({"tppo/loss": 1.0}, step=1)
    with MetricsLogger(tmp_path, cfg, "t") as log:
        log.log({"tppo/loss": 2.0}, step=1)
    assert [r["tppo/loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2.0]


def test_unknown_namespace_is_rejected_before_writing(tmp_path):
    with MetricsLogger(tmp_path, LoggingConfig(wandb="disabled"), "t") as log, pytest.raises(ValueError):
        log.log({"loss": 1.0}, step=1)
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_wandb_offline_run_writes_its_files(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(tmp_path, LoggingConfig(wandb="offline"), "t", config={"a": 1}) as log:
        log.log({"eval/acc": 0.5}, step=1)
    run_id = (tmp_path / "wandb_id.txt").read_text()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}")), "wandb wrote no offline run"
