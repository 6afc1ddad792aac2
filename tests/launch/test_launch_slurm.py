"""Jobs on a real single-node Slurm (launch/local_slurm.sh): the sbatch path, scancel, and a Hydra sweep.

Each job brings up a real Ray cluster with launch/ray_cluster.sh, runs the recipe on its head and tears the
cluster down. The checks read what Slurm, Ray and the recipe left behind: the job's final state and exit code
from slurmctld, Ray's own count of joined nodes in the job log, Ray's session logs copied into the job
directory, the recipe's output, and the process table (no Ray process of the job may survive it).
Skips only where Slurm cannot be installed (no root, no apt-get, apt-get failing).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
HOST = socket.gethostname().split(".")[0]


@dataclass(frozen=True)
class Recipe:
    """What the jobs run: `python -m recipes.<name> <args>` with `cpus` CPUs per job, each job within `job_s`."""

    name: str
    args: tuple[str, ...]
    cpus: int
    job_s: int


# What the jobs run. The sbatch job and each sweep job train (a short default recipe: EP=2 policy and critic,
# rollout, ReLibra) on the Ray cluster the job brings up; the training actors ask Ray for 0.01 CPU each, so one
# Slurm CPU is enough to schedule them. The job that is cancelled only needs a recipe that runs on the cluster:
# recipes.check composes, validates and prints the job's config.
TRAIN = Recipe(
    "train",
    (
        "experiment=default",
        "run.num_steps=2",
        "run.save_every=0",
        "algo.warm_start_steps=2",
        "algo.critic_warmup_steps=0",
        "algo.batch_size=8",
        "logging=disabled",
    ),
    cpus=1,
    job_s=900,
)
RECIPE = Recipe("check", ("experiment=default",), cpus=1, job_s=300)

pytestmark = [pytest.mark.slow, pytest.mark.dist]


@pytest.fixture(scope="session")
def slurm() -> None:
    """A running single-node Slurm, installed and started by launch/local_slurm.sh if needed."""
    done = subprocess.run(
        ["bash", str(REPO / "launch" / "local_slurm.sh")], capture_output=True, text=True, timeout=600
    )
    if done.returncode == 3:
        pytest.skip(f"Slurm cannot be installed on this machine: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, f"launch/local_slurm.sh failed:\n{done.stdout}\n{done.stderr}"


def job_states(job_id: str) -> dict[str, tuple[str, str]]:
    """JobState and ExitCode of a job (of every task `<array>_<i>` of an array job), as slurmctld reports them."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30
    ).stdout
    states = {}
    for line in out.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if "JobId" in fields:
            task = fields.get("ArrayTaskId")
            key = f"{fields.get('ArrayJobId')}_{task}" if task and task.isdigit() else fields["JobId"]
            states[key] = (fields.get("JobState", ""), fields.get("ExitCode", ""))
    return states


def wait_for_job(job_id: str, timeout: float) -> dict[str, tuple[str, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = job_states(job_id)
        if states and all(state in FINAL for state, _ in states.values()):
            return states
        time.sleep(1)
    subprocess.run(["scancel", job_id], check=False)
    pytest.fail(f"job {job_id} did not end within {timeout:.0f} s: {job_states(job_id)}")


def ray_processes_of(job_id: str) -> list[str]:
    """Command lines of live processes that belong to the job's Ray session (/tmp/ray-<job id>)."""
    markers = (f"/tmp/ray-{job_id}/", f"--temp-dir=/tmp/ray-{job_id} ")
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace") + " "
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if any(m in cmdline for m in markers) and state != "Z":
            found.append(f"{proc.name}: {cmdline[:160]}")
    return found


def printed_config(text: str) -> dict:
    """The JSON config recipes.check prints (the first top-level {...} block of the log)."""
    lines = text.splitlines()
    start = lines.index("{")
    end = lines.index("}", start)
    return json.loads("\n".join(lines[start : end + 1]))


def run_name_in(log: str, recipe: Recipe = RECIPE) -> str:
    """The run the recipe says it ran: from its printed config (check) or its run directory line (train)."""
    if recipe.name == "check":
        return printed_config(log)["run"]["name"]
    match = re.search(r"^run directory: (.+)$", log, re.MULTILINE)
    assert match, log
    return Path(match.group(1)).name


def check_recipe_outputs(log: str, output_dir: Path, run_name: str, recipe: Recipe = RECIPE) -> None:
    """What the recipe must have produced inside the job (its log, and its run directory for train)."""
    if recipe.name == "check":
        cfg = printed_config(log)
        assert cfg["cluster"]["ray_address"] == "auto", cfg["cluster"]
        assert (cfg["cluster"]["num_nodes"], cfg["cluster"]["gpus_per_node"]) == (1, 0)
        assert (cfg["run"]["name"], cfg["run"]["output_dir"]) == (run_name, str(output_dir))
    else:
        run_dir = output_dir / run_name
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary, "empty summary.json"
        steps = {json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
        num_steps = int(next(a.split("=")[1] for a in recipe.args if a.startswith("run.num_steps=")))
        assert sorted(steps) == list(range(num_steps)), steps  # steps count from 0
        assert f"run directory: {run_dir}" in log


def submit(tmp: Path, run_name: str, recipe: Recipe = RECIPE) -> tuple[str, Path, Path]:
    """Queue `recipe` through `python -m recipes.submit`; return the job id, log root and output dir."""
    logs, outputs = tmp / "slurm", tmp / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "recipes.submit", "--recipe", recipe.name, "--cpus-per-node", str(recipe.cpus),
         "--time", str(recipe.job_s // 60 + 5), "--log-dir", str(logs), *recipe.args, f"run.output_dir={outputs}", f"run.name={run_name}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"^submitted job (\d+)", done.stdout, re.MULTILINE)
    assert match, done.stdout
    assert f"job directory  {logs}/{match.group(1)}/" in done.stdout
    return match.group(1), logs, outputs


def test_sbatch_job_runs_the_recipe_on_its_ray_cluster(slurm, tmp_path):
    job_id, logs, outputs = submit(tmp_path, "slurm_sbatch", TRAIN)
    states = wait_for_job(job_id, timeout=TRAIN.job_s)
    job_dir = logs / job_id
    launcher_log = (logs / f"slurm-{job_id}.out").read_text()
    driver_log = (job_dir / "driver.log").read_text() if (job_dir / "driver.log").exists() else ""
    assert states[job_id] == ("COMPLETED", "0:0"), f"{states}\n{launcher_log}\n{driver_log}"

    assert (job_dir / "slurm.out").resolve() == (logs / f"slurm-{job_id}.out").resolve()
    assert re.search(r"^1 of 1 nodes joined \(\d+ CPUs, 0 GPUs\)", launcher_log, re.MULTILINE), launcher_log
    assert "recipes.train " in launcher_log and "the recipe exited with status 0" in launcher_log
    assert "stopping the Ray cluster" in launcher_log and "leftover" not in launcher_log
    assert "Ray runtime started" in (job_dir / "ray-head.log").read_text()
    # the job's own token: required by its cluster, readable by its user only while it ran, gone afterwards
    assert f"Ray token authentication on (token in {job_dir}/ray_auth_token)" in launcher_log
    assert not (job_dir / "ray_auth_token").exists()
    assert (job_dir / "ray-logs" / HOST / "raylet.out").is_file()
    check_recipe_outputs(driver_log, outputs, "slurm_sbatch", TRAIN)
    assert not Path(f"/tmp/ray-{job_id}").exists()
    assert ray_processes_of(job_id) == []


def test_scancel_tears_the_ray_cluster_down(slurm, tmp_path):
    job_id, logs, _ = submit(tmp_path, "slurm_cancel")
    launcher = logs / f"slurm-{job_id}.out"
    ready = Path(f"/tmp/ray-{job_id}/ray_current_cluster")  # the head is up (this is its node)
    deadline = time.monotonic() + 240
    while not ready.exists():
        assert time.monotonic() < deadline, f"the head never came up: {job_states(job_id)}"
        state = job_states(job_id).get(job_id, ("",))[0]
        assert state not in FINAL, launcher.read_text() if launcher.exists() else state
        time.sleep(0.2)
    running = ray_processes_of(job_id)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    assert running, "the job's Ray processes were not found while it ran"
    states = wait_for_job(job_id, timeout=120)
    assert states[job_id][0] == "CANCELLED", f"{states}\n{launcher.read_text()}"

    deadline = time.monotonic() + 30
    while (left := ray_processes_of(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], "Ray processes outlived the cancelled job:\n" + "\n".join(left)
    assert "stopping the Ray cluster" in launcher.read_text()
    assert not ready.parent.exists(), f"{ready.parent} was left behind"


def test_hydra_sweep_runs_each_point_as_a_slurm_job_with_its_own_ray_cluster(slurm, tmp_path):
    sweep, outputs = tmp_path / "sweep", tmp_path / "runs"
    cmd = [sys.executable, "-m", f"recipes.{TRAIN.name}", "-m", "hydra/launcher=slurm",
           f"hydra.sweep.dir={sweep}", f"hydra.launcher.cpus_per_task={TRAIN.cpus}", f"hydra.launcher.timeout_min={TRAIN.job_s // 60 + 5}",
           "cluster.ray_address=auto", *TRAIN.args, f"run.output_dir={outputs}", "run.name=sweep_a,sweep_b"]  # fmt: skip
    hydra = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, array_id = time.monotonic() + TRAIN.job_s + 60, None
    try:
        while hydra.poll() is None:
            assert time.monotonic() < deadline, "the sweep did not finish in time"
            time.sleep(1)
            if array_id is None:
                ids = [p.name for p in (sweep / ".submitit").glob("*") if p.name.isdigit()]
                array_id = ids[0] if ids else None
                continue
            # Without accounting (sacct) the launcher cannot see a job that failed before Python started.
            states = job_states(array_id)
            failed = {k: v for k, v in states.items() if v[0] in FINAL and v[0] != "COMPLETED"}
            if failed:
                pytest.fail(f"sweep jobs failed: {failed}\n{_sweep_logs(sweep)}")
    finally:
        if hydra.poll() is None:
            hydra.send_signal(signal.SIGINT)
            hydra.wait(30)
            if array_id:
                subprocess.run(["scancel", array_id], check=False)
    output = hydra.stdout.read() if hydra.stdout else ""
    assert hydra.returncode == 0, output
    assert "slurm sweep: 2 job(s) checked for 1 node(s) x 0 GPUs" in output

    states = wait_for_job(array_id, timeout=120)
    assert sorted(states) == [f"{array_id}_0", f"{array_id}_1"], states
    assert all(v == ("COMPLETED", "0:0") for v in states.values()), states
    names = set()
    job_ids = re.findall(r"^JobId=(\d+)", subprocess.run(["scontrol", "show", "job", "-o", array_id],
                         capture_output=True, text=True, timeout=30).stdout, re.MULTILINE)  # fmt: skip
    assert len(job_ids) == 2
    for task in states:
        folder = sweep / ".submitit" / task
        log = (folder / f"{task}_0_log.out").read_text()
        assert re.search(r"^1 of 1 nodes joined", log, re.MULTILINE), log
        assert "stopping the Ray cluster" in log
        assert "Ray runtime started" in (folder / "ray" / "ray-head.log").read_text()
        assert (folder / "ray" / "ray-logs" / HOST / "raylet.out").is_file()
        names.add(run_name_in(log, TRAIN))
        check_recipe_outputs(log, outputs, run_name_in(log, TRAIN), TRAIN)
    assert names == {"sweep_a", "sweep_b"}
    for job_id in job_ids:
        assert ray_processes_of(job_id) == [] and not Path(f"/tmp/ray-{job_id}").exists()


def _sweep_logs(sweep: Path) -> str:
    parts = []
    for log in sorted(sweep.glob(".submitit/*/*_log.*")):
        parts.append(f"--- {log}\n{log.read_text()[-3000:]}")
    return "\n".join(parts) or "(no logs)"


def test_local_slurm_is_idempotent(slurm):
    first = subprocess.run(
        ["bash", str(REPO / "launch" / "local_slurm.sh")], capture_output=True, text=True, timeout=120
    )
    assert first.returncode == 0, first.stderr
    assert "starting" not in first.stdout and "installing" not in first.stdout, first.stdout
    status = subprocess.run(
        ["bash", str(REPO / "launch" / "local_slurm.sh"), "--status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and status.stdout.strip() in {"idle", "mixed", "allocated", "completing"}
