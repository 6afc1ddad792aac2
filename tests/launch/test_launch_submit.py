"""Submission-time checks of Slurm jobs and sweeps, and the bash helpers of launch/ray_cluster.sh (no Slurm needed).

A refused submission must say why and queue nothing: the CLI exits 2 before creating its log directory (which
sbatch would need), and a refused Hydra sweep exits 2 before the launcher writes its .submitit folder.
"""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes.submit import (
    Allocation,
    SubmitError,
    allocation_overrides,
    check_sweep,
    nodes_used,
    override_value,
    plan_job,
    sweep_points,
)
from tppo.cluster.config import ClusterConfig
from tppo.config import ExperimentConfig

REPO = Path(__file__).resolve().parents[2]
RAY_CLUSTER_SH = REPO / "launch" / "ray_cluster.sh"


def test_override_value_takes_the_last_setting_and_plus_forms():
    overrides = ["cluster.num_nodes=2", "experiment=default", "++cluster.num_nodes=4"]
    assert override_value(overrides, "cluster.num_nodes") == "4"
    assert override_value(["+cluster.gpus_per_node=8"], "cluster.gpus_per_node") == "8"
    assert override_value(["cluster.num_nodes_x=1", "cluster.num_nodes"], "cluster.num_nodes") is None


def test_allocation_overrides_leave_user_keys_alone():
    derived = allocation_overrides(["cluster.num_nodes=2"], Allocation(2, 8))
    assert derived == ["cluster.ray_address=auto", "cluster.gpus_per_node=8"]


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_nodes_used_is_the_fewest_nodes_that_hold_the_ranks(placement):
    for gpus in range(0, 9):
        for policy in range(1, 17):
            cluster = ClusterConfig(
                gpus_per_node=gpus,
                policy_ranks=policy,
                critic_ranks=3,
                rollout_workers=2,
                placement=placement,
            )
            cfg = dataclasses.replace(ExperimentConfig(), cluster=cluster)
            if gpus == 0:
                expected = policy  # one CPU rank per node at most is what "spread over nodes" can use
            else:
                used = policy + (5 if placement == "separate" else 0)
                expected = next(n for n in range(1, 100) if n * gpus >= used)
            assert nodes_used(cfg) == expected


def test_plan_of_the_default_experiment(tmp_path):
    job = plan_job(["experiment=default"], recipe="check", cpus_per_node=1, log_root=tmp_path)
    argv = list(job.sbatch_argv)
    assert argv[0] == "sbatch" and "--nodes=1" in argv and "--cpus-per-task=1" in argv
    assert not any(a.startswith("--gres") for a in argv) and "--exclusive" not in argv
    assert f"--output={tmp_path}/slurm-%j.out" in argv
    assert argv[-3:] == [str(REPO / "launch" / "slurm_ray.sbatch"), "check", "experiment=default"]
    assert (job.cfg.cluster.ray_address, job.cfg.cluster.num_nodes, job.cfg.cluster.gpus_per_node) == (
        "auto",
        1,
        0,
    )
    assert job.env["RAY_OBJECT_STORE_MB"] == str(job.cfg.cluster.object_store_mb)
    assert job.env["RELIBRA_REPO"] == str(REPO)
    assert not tmp_path.joinpath("x").exists()


def test_plan_of_a_gpu_experiment_takes_its_cluster_shape():
    job = plan_job(["experiment=qwen3_30b_a3b_tppo"], partition="gpu", time="1-00:00:00")
    argv = list(job.sbatch_argv)
    assert {"--nodes=4", "--gres=gpu:8", "--exclusive", "--partition=gpu", "--time=1-00:00:00"} <= set(argv)
    assert job.allocation == Allocation(4, 8)


@pytest.mark.parametrize(
    ("kwargs", "overrides", "message"),
    [
        ({"gpus_per_node": 0}, ["experiment=qwen3_30b_a3b_tppo"], "needs GPUs (run.device=cuda)"),
        (
            {"gpus_per_node": 0},
            ["experiment=default", "cluster.gpus_per_node=2"],
            "needs GPUs (its cluster config has cluster.gpus_per_node=2)",
        ),
        ({"nodes": 8}, ["experiment=qwen3_30b_a3b_tppo"], "8 nodes would leave 4 idle: ask for 4"),
        ({"nodes": 3}, ["experiment=qwen3_30b_a3b_tppo"], "cluster.policy_ranks=32 exceeds the 24 GPUs"),
        ({"nodes": 3}, ["experiment=default"], "cluster.policy_ranks=2 cannot be spread evenly over 3 nodes"),
        (
            {"nodes": 2},
            ["experiment=default", "cluster.num_nodes=1"],
            "cluster.num_nodes=1 but the job asks for 2 nodes",
        ),
        ({"recipe": "no_such_recipe"}, ["experiment=default"], "recipe='no_such_recipe'"),
        ({}, ["experiment=default", "algo.lamm=1"], "did you mean algo.lam?"),
        ({"nodes": 0}, ["experiment=default"], "nodes=0: expected a count >= 1"),
    ],
)
def test_bad_submissions_are_refused_with_the_reason(kwargs, overrides, message):
    with pytest.raises(SubmitError, match=re.escape(message)):
        plan_job(overrides, **kwargs)


def _python(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_cli_refuses_a_job_without_gpus_before_anything_is_queued(tmp_path):
    logs = tmp_path / "slurm"
    done = _python(
        "-m",
        "recipes.submit",
        "--gpus-per-node",
        "0",
        "--log-dir",
        str(logs),
        "experiment=qwen3_30b_a3b_tppo",
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: cannot submit: experiment 'qwen3_30b_a3b_tppo' needs GPUs")
    assert not logs.exists()  # submit() creates it just before calling sbatch


def test_cli_dry_run_prints_the_sbatch_command(tmp_path):
    done = _python("-m", "recipes.submit", "--dry-run", "--nodes", "2", "experiment=qwen3_30b_a3b_tppo",
                   "cluster.policy_ranks=16", "parallel.expert_parallel=8")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "sbatch --parsable --job-name=qwen3_30b_a3b_tppo --nodes=2" in done.stdout
    assert "--gres=gpu:8" in done.stdout and "RAY_OBJECT_STORE_MB=16384" in done.stdout


def test_sweep_points_expand_like_hydras_basic_sweeper():
    assert sweep_points(["a=1,2", "b=x", "c=3,4"]) == [
        ["a=1", "b=x", "c=3"],
        ["a=1", "b=x", "c=4"],
        ["a=2", "b=x", "c=3"],
        ["a=2", "b=x", "c=4"],
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["experiment=default", "run.seed=1,2"],
            "sweep point [experiment=default run.seed=1]: cluster.ray_address=None",
        ),
        (
            [
                "experiment=qwen3_30b_a3b_tppo",
                "cluster.ray_address=auto",
                "hydra.launcher.gpus_per_node=0",
                "run.seed=1,2",
            ],
            "needs GPUs (run.device=cuda) but the job asks for none",
        ),
    ],
)
def test_hydra_slurm_sweep_is_refused_before_submission(tmp_path, overrides, message):
    sweep = tmp_path / "sweep"
    done = _python(
        "-m", "recipes.check", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep}", *overrides
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: cannot submit: " in done.stderr and message in done.stderr
    assert not (sweep / ".submitit").exists()


def _bash(script: str, **env: str) -> str:
    done = subprocess.run(
        ["bash", "-c", f"source {RAY_CLUSTER_SH}; {script}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "RAY_CLUSTER_PYTHON": sys.executable, **env},
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("72(x2),36", "72 72 36"), ("8", "8"), ("4,2(x3)", "4 2 2 2")],
)
def test_cpus_per_node_expands_slurms_compressed_form(spec, expected):
    assert _bash("_rc_cpus_per_node", SLURM_JOB_CPUS_PER_NODE=spec) == expected


def test_gpus_here_counts_visible_devices():
    assert _bash("_rc_gpus_here", CUDA_VISIBLE_DEVICES="0,1,3") == "3"
    assert _bash("_rc_gpus_here", SLURM_GPUS_ON_NODE="4") == "4"
    assert _bash("_rc_gpus_here") == "0"


def test_probe_gives_the_interfaces_address_and_free_ports():
    ip, *ports = _bash("_rc_probe 3", RAY_CLUSTER_IFACE="lo").split()
    assert ip == "127.0.0.1" and len(set(ports)) == 3
    for port in ports:  # free now: binding each must work
        with socket.socket() as s:
            s.bind(("", int(port)))
    with pytest.raises(subprocess.CalledProcessError) as err:
        _bash("_rc_probe 1", RAY_CLUSTER_IFACE="no_such_iface0")
    assert "RAY_CLUSTER_IFACE=no_such_iface0" in err.value.stderr


def test_kill_leftovers_takes_only_this_jobs_ray_processes():
    sleeper = "import time; time.sleep(60)"
    mine = subprocess.Popen([sys.executable, "-c", sleeper, "--temp-dir=/tmp/ray-4242", "x"])
    child = subprocess.Popen([sys.executable, "-c", sleeper, "/tmp/ray-4242/session_latest/sockets/raylet"])
    other = subprocess.Popen([sys.executable, "-c", sleeper, "/tmp/ray-42420/session_latest/sockets/raylet"])
    try:
        time.sleep(0.5)
        out = _bash("_rc_kill_leftovers", SLURM_JOB_ID="4242")
        assert "killing 2 leftover Ray processes" in out
        assert mine.wait(10) == -9 and child.wait(10) == -9
        assert other.poll() is None
    finally:
        for proc in (mine, child, other):
            proc.kill()
            proc.wait()


def test_sweep_points_need_their_own_run_directories():
    base = ["cluster.ray_address=auto", "algo.lam=0.9,0.95"]
    with pytest.raises(SubmitError, match=re.escape("shares run.name=default (one run directory)")):
        check_sweep("train", base, Allocation(1, 0))
    assert check_sweep("train", [*base, "run.name=lam_${algo.lam}"], Allocation(1, 0)) == 2
