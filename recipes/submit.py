"""Submit a recipe to Slurm, after checking the experiment against the allocation it asks for.

    python -m recipes.submit experiment=qwen3_30b_a3b_tppo              # nodes and GPUs from its cluster config
    python -m recipes.submit --nodes 2 experiment=qwen3_30b_a3b_tppo cluster.policy_ranks=16
    python -m recipes.submit --recipe check --cpus-per-node 1 experiment=default
    python -m recipes.submit --dry-run experiment=...                    # print the sbatch command only

The job runs launch/slurm_ray.sbatch: a Ray cluster over the allocation, then `python -m recipes.<recipe>` on its
head with cluster.ray_address=auto and cluster.num_nodes / cluster.gpus_per_node set from the allocation (unless
the overrides set them). Before anything is queued, the experiment is composed as the job will see it and the
submission is refused, with the reason, when
- the experiment needs GPUs (run.device=cuda or a cluster config with GPUs) and the job would have none;
- an override of cluster.num_nodes / cluster.gpus_per_node contradicts the allocation;
- the experiment's parallelism cannot use the node count: policy ranks that do not spread evenly over the
  nodes, more nodes than the ranks fill, or any rule of ExperimentConfig.validate on the job's cluster.

`SlurmSweepCheck` applies the same rules to every point of a Hydra sweep on Slurm
(configs/hydra/launcher/slurm.yaml) before the launcher submits it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from recipes._hydra import CONFIG_DIR, compose, fail, register_schema, to_experiment, unknown_override_key
from tppo.config import ConfigError, ExperimentConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
SBATCH_SCRIPT = REPO_ROOT / "launch" / "slurm_ray.sbatch"
# The keys launch/slurm_ray.sbatch sets from the allocation when the overrides do not.
DERIVED_KEYS = ("cluster.ray_address", "cluster.num_nodes", "cluster.gpus_per_node")


class SubmitError(ValueError):
    """The job cannot run as asked; the message says why and what to change."""


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What the Slurm job gets: nodes, and GPUs on each."""

    num_nodes: int
    gpus_per_node: int


@dataclasses.dataclass(frozen=True)
class SlurmJob:
    """A checked submission: the config the job will run with and the sbatch command that queues it."""

    recipe: str
    overrides: tuple[str, ...]
    allocation: Allocation
    cfg: ExperimentConfig
    log_root: Path
    sbatch_argv: tuple[str, ...]
    env: dict[str, str]


def override_value(overrides: Sequence[str], key: str) -> str | None:
    """The value the last override of `key` sets (`key=v`, `+key=v`, `++key=v`), or None."""
    value = None
    for override in overrides:
        name, sep, rhs = override.lstrip("+").partition("=")
        if sep and name == key:
            value = rhs
    return value


def allocation_overrides(overrides: Sequence[str], allocation: Allocation) -> list[str]:
    """The overrides launch/slurm_ray.sbatch adds for the allocation (kept in step with its has_key lines)."""
    derived = {
        "cluster.ray_address": "auto",
        "cluster.num_nodes": str(allocation.num_nodes),
        "cluster.gpus_per_node": str(allocation.gpus_per_node),
    }
    return [f"{k}={v}" for k, v in derived.items() if override_value(overrides, k) is None]


def needs_gpus(cfg: ExperimentConfig) -> str | None:
    """Why the experiment needs GPUs, or None when it runs on CPUs."""
    if cfg.run.device == "cuda":
        return "run.device=cuda"
    if cfg.cluster.gpus_per_node > 0:
        return f"its cluster config has cluster.gpus_per_node={cfg.cluster.gpus_per_node}"
    return None


def nodes_used(cfg: ExperimentConfig) -> int:
    """How many nodes the experiment's ranks fill: ceil(GPUs used / GPUs per node), or policy ranks on CPU.

    GPUs used are the policy ranks when roles share GPUs (colocated), and policy + critic + rollout processes
    (engines, and their expert workers in the disaggregated layout) when each role has its own (separate).
    """
    cl = cfg.cluster
    if cl.gpus_per_node == 0:
        return cl.policy_ranks
    used = cl.policy_ranks
    if cl.placement == "separate":
        used += cl.critic_ranks + cl.rollout_ranks
    return math.ceil(used / cl.gpus_per_node)


def check_gpus(requested: ExperimentConfig, allocation: Allocation) -> None:
    """Refuse a job without GPUs for an experiment that needs them (`requested`: the experiment as asked)."""
    if allocation.gpus_per_node == 0 and (why := needs_gpus(requested)):
        raise SubmitError(
            f"experiment '{requested.run.name}' needs GPUs ({why}) but the job asks for none: "
            f"give it GPUs (--gpus-per-node / hydra.launcher.gpus_per_node)"
        )


def check_nodes(job: ExperimentConfig, allocation: Allocation) -> None:
    """Refuse a node count the job's config contradicts or its parallelism cannot use (`job`: as the job runs it)."""
    for key, value, wanted, what in (
        ("cluster.num_nodes", job.cluster.num_nodes, allocation.num_nodes, "nodes"),
        ("cluster.gpus_per_node", job.cluster.gpus_per_node, allocation.gpus_per_node, "GPUs per node"),
    ):
        if value != wanted:
            raise SubmitError(f"{key}={value} but the job asks for {wanted} {what}: make them agree")
    ranks, nodes = job.cluster.policy_ranks, allocation.num_nodes
    if ranks % nodes:
        raise SubmitError(
            f"cluster.policy_ranks={ranks} cannot be spread evenly over {nodes} nodes: "
            f"use a node count that divides {ranks}"
        )
    if nodes > (used := nodes_used(job)):
        raise SubmitError(
            f"the experiment's ranks fill {used} node(s) (cluster.policy_ranks={ranks}, "
            f"{allocation.gpus_per_node} GPUs per node, placement={job.cluster.placement}); "
            f"{nodes} nodes would leave {nodes - used} idle: ask for {used} or raise cluster.policy_ranks"
        )


def compose_point(config_name: str, overrides: Sequence[str]) -> ExperimentConfig:
    """Compose and validate one configuration, also from inside a running Hydra app (a sweep callback).

    `recipes._hydra.compose` initialises Hydra's global state, which a running app already holds; inside one,
    the config loader is used directly, with the same checks and conversion.
    """
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return compose(config_name, overrides)
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write
    from omegaconf.errors import OmegaConfBaseException

    for override in overrides:
        if problem := unknown_override_key(override):
            raise ConfigError(problem)
    register_schema()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONFIG_DIR))
    try:
        cfg = loader.load_configuration(config_name, list(overrides), run_mode=RunMode.RUN, from_shell=False)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0]) from err
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]  # as hydra.compose does; the task config never holds it
    return to_experiment(cfg)


def _compose_or_refuse(config_name: str, overrides: Sequence[str], context: str) -> ExperimentConfig:
    try:
        return compose_point(config_name, overrides)
    except ConfigError as err:
        raise SubmitError(f"{context}: {err}") from err
    except Exception as err:  # Hydra's own composition errors: unknown experiment, bad group choice
        raise SubmitError(f"the overrides do not compose: {str(err).splitlines()[0]}") from err


def plan_job(
    overrides: Sequence[str],
    *,
    recipe: str = "train",
    config_name: str = "train",
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    cpus_per_node: int | None = None,
    partition: str | None = None,
    time: str | None = None,
    account: str | None = None,
    log_root: str | Path | None = None,
    sbatch_args: Sequence[str] = (),
) -> SlurmJob:
    """Check a submission and build its sbatch command (nothing is queued). Raises SubmitError."""
    if (
        not re.fullmatch(r"[a-z_][a-z0-9_]*", recipe)
        or not (REPO_ROOT / "recipes" / f"{recipe}.py").is_file()
    ):
        raise SubmitError(f"recipe={recipe!r}: expected the name of a module in recipes/ (e.g. train)")
    for key, value in (("nodes", nodes), ("cpus_per_node", cpus_per_node)):
        if value is not None and value < 1:
            raise SubmitError(f"{key}={value}: expected a count >= 1")
    if gpus_per_node is not None and gpus_per_node < 0:
        raise SubmitError(f"gpus_per_node={gpus_per_node}: expected a count >= 0")
    requested = _compose_or_refuse(config_name, overrides, "invalid configuration")
    allocation = Allocation(
        nodes if nodes is not None else requested.cluster.num_nodes,
        gpus_per_node if gpus_per_node is not None else requested.cluster.gpus_per_node,
    )
    check_gpus(requested, allocation)
    job_overrides = [*overrides, *allocation_overrides(overrides, allocation)]
    job = _compose_or_refuse(config_name, job_overrides, _on(allocation))
    check_nodes(job, allocation)

    root = Path(log_root) if log_root is not None else _run_root(job) / "slurm"
    cpus = cpus_per_node if cpus_per_node is not None else job.cluster.cpus_per_node
    argv = [
        "sbatch",
        "--parsable",
        f"--job-name={job.run.name}",
        f"--nodes={allocation.num_nodes}",
        "--ntasks-per-node=1",
        f"--output={root}/slurm-%j.out",
        f"--cpus-per-task={cpus}" if cpus else "--exclusive",
    ]
    if allocation.gpus_per_node:
        argv.append(f"--gres=gpu:{allocation.gpus_per_node}")
    argv += [f"--{k}={v}" for k, v in (("partition", partition), ("time", time), ("account", account)) if v]
    argv += [*sbatch_args, str(SBATCH_SCRIPT), recipe, *overrides]
    env = {
        "RELIBRA_REPO": str(REPO_ROOT),
        "RELIBRA_LOG_ROOT": str(root),
        "RELIBRA_PYTHON": sys.executable,
        "RAY_OBJECT_STORE_MB": str(job.cluster.object_store_mb),
    }
    return SlurmJob(recipe, tuple(overrides), allocation, job, root, tuple(argv), env)


def _on(allocation: Allocation) -> str:
    return f"the experiment cannot run on {allocation.num_nodes} node(s) x {allocation.gpus_per_node} GPUs"


def _run_root(cfg: ExperimentConfig) -> Path:
    """run.output_dir as the job sees it: the recipe runs in the repository root."""
    out = Path(cfg.run.output_dir)
    return out if out.is_absolute() else REPO_ROOT / out


def submit(job: SlurmJob) -> str:
    """Queue the job; return its Slurm id."""
    if shutil.which(job.sbatch_argv[0]) is None:
        raise SubmitError(
            "sbatch is not on PATH: run this on a Slurm login node (or start one: launch/local_slurm.sh)"
        )
    job.log_root.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(job.sbatch_argv, capture_output=True, text=True, env={**os.environ, **job.env})
    if done.returncode != 0:
        raise SubmitError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def describe(job: SlurmJob, job_id: str) -> str:
    """Where the submitted job's logs and outputs will be."""
    run = _run_root(job.cfg) / job.cfg.run.name
    return "\n".join(
        [
            f"submitted job {job_id}: recipes.{job.recipe} on {job.allocation.num_nodes} node(s) x "
            f"{job.allocation.gpus_per_node} GPUs",
            f"  slurm output   {job.log_root}/slurm-{job_id}.out",
            f"  job directory  {job.log_root}/{job_id}/  (driver.log, ray-head.log, ray-logs/)",
            f"  run directory  {run}/  (metrics.jsonl, summary.json, checkpoints, wandb/)",
            f"  follow         tail -f {job.log_root}/{job_id}/driver.log",
            f"  cancel         scancel {job_id}",
        ]
    )


def sweep_points(task_overrides: Sequence[str]) -> list[list[str]]:
    """The override lists of every job of a basic Hydra sweep (`a=1,2 b=x` -> [[a=1, b=x], [a=2, b=x]])."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    return BasicSweeper.split_arguments(parsed, None)[0]


def check_sweep(config_name: str, task_overrides: Sequence[str], allocation: Allocation) -> int:
    """Apply the submission rules to every sweep point and return their number.

    Sweep jobs get nothing derived from the allocation, so their Ray address must be `auto`; and concurrent
    jobs must not share a run directory (each would resume from and overwrite the other's checkpoints).
    """
    points = sweep_points(task_overrides)
    runs: dict[tuple[str, str], str] = {}
    for overrides in points:
        where = " ".join(overrides) or "(no overrides)"
        try:
            cfg = _compose_or_refuse(config_name, overrides, "invalid configuration")
            run = (cfg.run.output_dir, cfg.run.name)
            if run in runs:
                raise SubmitError(
                    f"it shares run.name={cfg.run.name} (one run directory) with [{runs[run]}]: give every point "
                    f"its own, e.g. 'run.name={cfg.run.name}_${{algo.lam}}' for a sweep over algo.lam"
                )
            runs[run] = where
            check_gpus(cfg, allocation)
            if cfg.cluster.ray_address != "auto":
                raise SubmitError(
                    f"cluster.ray_address={cfg.cluster.ray_address!r}: a Slurm sweep job joins the Ray cluster its "
                    "job starts; add cluster.ray_address=auto"
                )
            check_nodes(cfg, allocation)
        except SubmitError as err:
            raise SubmitError(f"sweep point [{where}]: {err}") from err
    return len(points)


def _launcher_allocation(launcher: Any) -> Allocation:
    gpus = launcher.get("gpus_per_node")
    if gpus is None and (gres := launcher.get("gres")):
        match = re.search(r"gpu(?::[^:,]+)?:(\d+)", str(gres))
        gpus = int(match.group(1)) if match else None
    return Allocation(int(launcher.nodes), int(gpus or 0))


try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # pragma: no cover - hydra is a dependency of recipes/
    _Callback = object  # type: ignore[assignment,misc]


class SlurmSweepCheck(_Callback):  # type: ignore[misc,valid-type]
    """Hydra callback of the Slurm launcher: checks every sweep point before anything is submitted.

    It also tells the jobs where the checkout is (RELIBRA_REPO: their setup lines source launch/ray_cluster.sh
    from it) and the Ray object store size of the experiment; Slurm passes the environment to the jobs.
    """

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        # Hydra turns a callback's exception into a warning and carries on; only an exit stops the sweep.
        try:
            allocation = _launcher_allocation(config.hydra.launcher)
            task = list(config.hydra.overrides.task)
            count = check_sweep(config.hydra.job.config_name or "train", task, allocation)
        except SubmitError as err:
            fail(f"cannot submit: {err}")
        except Exception as err:
            fail(f"cannot check the sweep before submitting it: {type(err).__name__}: {err}")
        os.environ["RELIBRA_REPO"] = str(REPO_ROOT)
        # The jobs' Ray bring-up must use this interpreter (the one with ray), not whatever python3 is on PATH.
        os.environ.setdefault("RAY_CLUSTER_PYTHON", sys.executable)
        os.environ.setdefault("RAY_OBJECT_STORE_MB", str(config.cluster.object_store_mb))
        print(
            f"slurm sweep: {count} job(s) checked for {allocation.num_nodes} node(s) x "
            f"{allocation.gpus_per_node} GPUs; each brings up its own Ray cluster",
            flush=True,
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.submit",
        description="Check an experiment against a Slurm allocation and submit launch/slurm_ray.sbatch.",
        epilog="Everything after the options is Hydra overrides, e.g. experiment=default run.num_steps=2.",
    )
    p.add_argument("--recipe", default="train", help="module of recipes/ to run (default: train)")
    p.add_argument("--config-name", default="train", help="the recipe's primary config (default: train)")
    p.add_argument("--nodes", type=int, help="default: the experiment's cluster.num_nodes")
    p.add_argument("--gpus-per-node", type=int, help="default: the experiment's cluster.gpus_per_node")
    p.add_argument("--cpus-per-node", type=int, help="default: cluster.cpus_per_node, else whole nodes")
    p.add_argument("--partition")
    p.add_argument("--time", help="Slurm time limit, e.g. 2-00:00:00")
    p.add_argument("--account")
    p.add_argument("--log-dir", help="default: <run.output_dir>/slurm")
    p.add_argument("--sbatch-arg", action="append", default=[], help="extra sbatch argument (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch command; queue nothing")
    p.add_argument("overrides", nargs="*")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        job = plan_job(
            args.overrides,
            recipe=args.recipe,
            config_name=args.config_name,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            cpus_per_node=args.cpus_per_node,
            partition=args.partition,
            time=args.time,
            account=args.account,
            log_root=args.log_dir,
            sbatch_args=args.sbatch_arg,
        )
        if args.dry_run:
            env = " ".join(f"{k}={v}" for k, v in job.env.items())
            print(f"{env} {' '.join(job.sbatch_argv)}")
            return 0
        print(describe(job, submit(job)))
    except SubmitError as err:
        sys.stderr.write(f"error: cannot submit: {err}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
