"""The default recipe end to end (a few steps), resume after kill -9, and a dead actor's clear message."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from recipe_testlib import ROOT, recipe_env, run, train_cmd

# Timing keys differ between any two runs; everything else must match step for step.
VOLATILE = (
    "time",
    "perf/",
    "rollout/tokens_per_s",
    "rollout/generate_s",
    "rollout/prefill_s",
    "rollout/decode_s",
    "rollout/mixed_s",
    "rollout/capture_s",
    "relibra/planner_s",
    "relibra/exec_apply_s",
    "relibra/exec_expert_fwd_ms",
)


def _old_logprobs_passes(run_dir: Path) -> int:
    """Steps of a run that timed an old-log-prob pass of its own."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sum("perf/old_logprobs_s" in r for r in rows)


def _comparable(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        rows.append({k: v for k, v in r.items() if not k.startswith(VOLATILE)})
    return rows


def _close(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, float) and isinstance(y, float):
            if not (math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-7) or (math.isnan(x) and math.isnan(y))):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.slow
@pytest.mark.dist
def test_default_recipe_runs_and_resumes_after_kill(tmp_path, default_run):
    summary = json.loads((default_run / "summary.json").read_text())
    for key in (
        "reward_first",
        "reward_last",
        "truncated_fraction",
        "tokens_per_s",
        "skew_static",
        "skew_planned",
        "skew_executed",
    ):
        assert key in summary
    assert summary["steps"] == 5 and summary["tokens_per_s"] > 0
    assert (default_run / "checkpoints" / "latest").read_text() == "step_000004"
    ref_rows = _comparable(default_run / "metrics.jsonl")
    assert [r["step"] for r in ref_rows] == [0, 1, 2, 3, 4]

    # Kill -9 once the first checkpoint (after step 1) is complete, then re-run the very same command. This
    # run also time-shares the devices (offload on, as colocated GPU runs do) and computes the old log-probs in
    # a pass of their own, where the default run takes them from its one-step updates: the numbers must not
    # change.
    cmd = train_cmd(tmp_path, "killed", "cluster.offload=on", "algo.old_logprobs=pass")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=recipe_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    marker = tmp_path / "killed" / "checkpoints" / "step_000001" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    still_running = proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert marker.exists(), "the run never wrote its first checkpoint"
    # The kill landed mid-run: the run had not finished, nor logged or saved its last step.
    assert still_running, "the run finished before the kill: nothing would be resumed"
    logged = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) < 5 and not (tmp_path / "killed" / "checkpoints" / "step_000004").exists()
    resumed = run(cmd)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr
    rows = _comparable(tmp_path / "killed" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert _old_logprobs_passes(tmp_path / "killed") > 0 and _old_logprobs_passes(default_run) == 0
    for a, b in zip(rows, ref_rows):
        assert _close(a, b), f"step {a['step']} differs after resume:\n{a}\n{b}"


@pytest.mark.slow
@pytest.mark.dist
def test_a_torn_newest_checkpoint_resumes_from_the_one_before(tmp_path, default_run):
    """A shard of the newest checkpoint cut short (a copy that broke off, a full disk): the re-run says which
    checkpoint it skips and why, resumes from the one before and finishes the run."""
    shutil.copytree(default_run, tmp_path / "torn")  # a finished run, as if the user had named it so
    cmd = train_cmd(tmp_path, "torn")
    shard = tmp_path / "torn" / "checkpoints" / "step_000004" / "policy_rank1.pt"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 3])
    again = run(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert (
        f"skipping checkpoint {shard.parent}: policy_rank1.pt has {size // 3} bytes, {size} were written"
        in said
    )
    assert f"resuming from {shard.parent.parent / 'step_000003'} (step 3)" in said
    rows = _comparable(tmp_path / "torn" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert _close(rows[4], _comparable(default_run / "metrics.jsonl")[4])  # step 4 again, the same numbers
    # Every checkpoint unusable: refused with one line, the run's files left as they are.
    for ckpt in (tmp_path / "torn" / "checkpoints").glob("step_*"):
        (ckpt / "driver.pt").write_bytes(b"not a checkpoint")
    refused = run(cmd)
    assert refused.returncode != 0 and "error: cannot resume: no usable checkpoint in" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert len((tmp_path / "torn" / "metrics.jsonl").read_text().splitlines()) == 5


@pytest.mark.slow
@pytest.mark.dist
def test_kl_penalty_runs_a_frozen_reference_policy(tmp_path):
    """With algo.kl_coef a reference role holds the policy as RL starts: the first update sees KL = 0 (same weights,
    same replayed routing), the second a positive KL; the reference is written once into the run directory."""
    done = run(
        train_cmd(tmp_path, "kl", "algo.kl_coef=0.05", "algo.critic_warmup_steps=0", "run.num_steps=3")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["tppo/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["tppo/kl"] > 1e-6 and rows[2]["tppo/kl"] > 1e-6
    assert sorted(p.name for p in (tmp_path / "kl" / "reference").iterdir()) == ["rank0.pt", "rank1.pt"]
    from tppo.base.checkpoint import load_file

    shard = load_file(tmp_path / "kl" / "reference" / "rank0.pt")
    assert shard["optimizer"] is None and shard["model"]  # a forward-only copy: weights, no optimizer state


@pytest.mark.slow
@pytest.mark.dist
def test_a_reference_on_deepspeed_zero3_offload_starts_as_the_megatron_policy(tmp_path):
    """The reference on DeepSpeed ZeRO-3 with parameters in host memory loads the policy's Hugging Face export as
    RL starts: the first update sees KL = 0 against the Megatron policy, the next ones a positive KL."""
    reference = [
        "backend.reference.engine=deepspeed",
        "backend.reference.zero_stage=3",
        "backend.reference.offload_param=true",
    ]
    args = ("algo.kl_coef=0.05", "algo.critic_warmup_steps=0", "run.num_steps=3", *reference)
    done = run(train_cmd(tmp_path, "klds", *args))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "klds" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["tppo/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["tppo/kl"] > 1e-6 and rows[2]["tppo/kl"] > 1e-6
    assert (tmp_path / "klds" / "reference" / "hf" / "config.json").is_file()


@pytest.fixture(scope="module")
def t07_exact(tmp_path_factory) -> list[dict]:
    """One run for three independent settings (rollout.temperature=0.7, algo.bootstrap=exact, micro-batches cut
    by tokens): its metric rows."""
    root = tmp_path_factory.mktemp("t07")
    args = (
        "rollout.temperature=0.7",
        "algo.bootstrap=exact",
        "algo.critic_warmup_steps=0",
        "parallel.micro_batch_tokens=96",
        "parallel.micro_batch_size=16",
    )
    done = run(train_cmd(root, "t07_exact", *args, "run.num_steps=3"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (root / "t07_exact" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    return rows


@pytest.mark.slow
@pytest.mark.dist
def test_the_trainer_scores_tokens_at_the_rollouts_sampling_temperature(t07_exact):
    """At rollout.temperature=0.7 the trainer's old log-probs equal the rollout engine's (both of softmax(z / T)):
    fp32 on CPU, the mismatch is rounding only."""
    for row in t07_exact:
        assert row["mismatch/abs_diff"] <= 1e-4, row["mismatch/abs_diff"]
        assert row["mismatch/abs_diff_max"] <= 1e-3


@pytest.mark.slow
@pytest.mark.dist
def test_exact_bootstrap_trains_end_to_end(t07_exact):
    """algo.bootstrap=exact bootstraps cut windows with the critic's value after their last token."""
    assert all(math.isfinite(r["tppo/adv_abs_max"]) and r["tppo/adv_abs_max"] > 0 for r in t07_exact)
    # some windows were cut: the bootstrap was used
    assert all(r["rollout/cut_fraction"] > 0 for r in t07_exact)


@pytest.mark.slow
@pytest.mark.dist
def test_mini_batches_and_epochs_take_several_clipped_steps(tmp_path):
    """algo.mini_batches=2 x algo.epochs=2: four optimizer steps per update; after the first the policy has moved
    from the old one, so the ratio leaves 1 and PPO's clip acts (one step per update never clips)."""
    done = run(
        train_cmd(
            tmp_path,
            "mb",
            "algo.mini_batches=2",
            "algo.epochs=2",
            "algo.critic_warmup_steps=0",
            "algo.actor_optim.lr=1e-2",
            "parallel.micro_batch_size=2",
            "run.num_steps=2",
        )
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "mb" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tppo/optimizer_steps"] == 4 for r in rows)
    # The critic trains on finished responses only: a step whose 8 responses were all cut skips it.
    critic = [r["critic/optimizer_steps"] for r in rows if "critic/optimizer_steps" in r]
    assert critic and all(n >= 1 for n in critic)
    assert all(r["tppo/ratio_max"] > 1.0 for r in rows) and any(r["tppo/clip_fraction"] > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.dist
def test_bad_override_fails_before_anything_starts(tmp_path):
    result = run(train_cmd(tmp_path, "bad", "algo.window=0"), timeout=120)
    assert result.returncode == 2
    assert "algo.window=0 is not allowed" in result.stderr and "Traceback" not in result.stderr
