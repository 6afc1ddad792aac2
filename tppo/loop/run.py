"""A whole training run: roles up, warm start or resume, the step loop with checkpoints, the summary.

The run directory `<run.output_dir>/<run.name>` is stable for a name, so re-running the same command finds the
last complete checkpoint and resumes from it: trainer shards, the pool with every in-flight response, the data
position, RNG states and the step. The rollout engine's weights are derived from the policy's, so they are
re-exported rather than saved. A checkpoint keeps the settings its files are laid out by (`resume_settings`:
the model's shape, the trainer ranks, the pool's batch layout); a re-run with other values is refused before
anything starts, naming them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tppo.algo.batching import logprob_temperature, policy_batch, split_for_ranks
from tppo.algo.objectives import supervised_objective
from tppo.algo.pool import Sample, SamplePool
from tppo.base import checkpoint
from tppo.base.checkpoint import Stateful
from tppo.base.metrics import MetricsLogger, progress
from tppo.cluster.placement import Reservation, reserve
from tppo.cluster.roles import RoleError, Rollout, Trainer, start_rollout, start_trainers
from tppo.cluster.session import ray_session
from tppo.config import ExperimentConfig
from tppo.engine.config import ParallelConfig
from tppo.eval.periodic import LoopEval, due, prepare_loop_eval, run_loop_eval
from tppo.loop.balance import LoadPlanner, executor_spec, relibra_applies
from tppo.loop.driver import Roles, offload_trainers, rl_step
from tppo.loop.report import History, summarize, write_plots
from tppo.loop.tasks import Task, build_task

_log = logging.getLogger(__name__)


def run_dir(cfg: ExperimentConfig) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def critic_parallel(cfg: ExperimentConfig) -> ParallelConfig:
    """The critic splits experts over its own ranks the same way the policy does when it can."""
    ep = cfg.cluster.critic_ranks if cfg.model.num_experts % cfg.cluster.critic_ranks == 0 else 1
    return dataclasses.replace(cfg.parallel, tensor_parallel=1, pipeline_parallel=1, expert_parallel=ep)


def rollout_engines(cfg: ExperimentConfig, hf_dir: Path, placement: Reservation | None = None) -> Rollout:
    """The rollout engines (cluster.rollout_workers; with their expert workers in the disaggregated layout),
    each in its own process, built from the HF directory the policy exported."""
    device = "cuda" if cfg.cluster.gpus_per_node else "cpu"
    cl = cfg.cluster
    expert_workers = cl.expert_workers if cl.rollout_layout == "disaggregated" else 0
    return start_rollout(
        hf_dir, device, cfg.rollout.dtype, cfg.rollout, cl.rollout_workers, True, placement, expert_workers
    )


def warm_start(cfg: ExperimentConfig, task: Task, policy: Trainer) -> list[float]:
    """Supervised steps on the task's demonstrations (a recipe stage before RL); returns the NLL per step."""
    if not cfg.algo.warm_start_steps or task.demonstrate is None:
        return []
    rng = np.random.default_rng(cfg.run.seed + 7)
    losses = []
    began = time.perf_counter()
    for _ in progress(range(cfg.algo.warm_start_steps), desc="warm start", enabled=cfg.logging.progress):
        prompts = [task.dataset[int(i)] for i in rng.integers(0, len(task.dataset), cfg.algo.batch_size)]
        samples = [_demo_sample(p, task.demonstrate(p, rng), i) for i, p in enumerate(prompts)]
        split = split_for_ranks(samples, policy.placement(samples))
        batches = [[_sft_batch(ss, ff) for ss, ff in rank] for rank in split]
        losses.append(policy.train(batches, supervised_objective(batches)).loss)
    _log.info("warm start: %d supervised steps in %.1f s", len(losses), time.perf_counter() - began)
    return losses


def _demo_sample(prompt, response: list[int], i: int) -> Sample:
    s = Sample(
        uid=f"demo-{i}",
        group_id=i,
        prompt_uid=prompt.uid,
        prompt_ids=np.asarray(prompt.prompt_ids),
        max_response_length=len(response),
    )
    s.response_ids = np.asarray(response, np.int32)
    s.rollout_logprobs = np.zeros(len(response), np.float32)
    return s


def _sft_batch(samples, filler):
    batch = policy_batch(samples, filler, [np.zeros(s.num_response_tokens) for s in samples], routing=False)
    batch.loss_mask_BT = batch.payload.response_mask_BT
    return batch


@dataclass
class DriverState:
    """What the driver checkpoints besides the ranks' shards: the pool (with every in-flight response and the
    data position), the report's history, the RNG states and, with ReLibra, the planner's placement."""

    pool: SamplePool
    history: History
    planner: LoadPlanner | None
    rng: checkpoint.RngState = field(default_factory=checkpoint.RngState)

    def parts(self) -> dict[str, Stateful]:
        parts: dict[str, Stateful] = {"pool": self.pool, "history": self.history, "rng": self.rng}
        if self.planner is not None:
            parts["planner"] = self.planner
        return parts


def export_policy(policy: Trainer, task: Task, folder: Path) -> None:
    """The policy as a Hugging Face folder (logical expert order) with the tokenizer the run trains with: what
    evaluation (`python -m recipes.eval checkpoint=<run dir>`) and serving load."""
    policy.export_hf(folder)
    if task.save_tokenizer is not None:
        task.save_tokenizer(folder)


def _save(cfg: ExperimentConfig, roles: Roles, step: int, state: DriverState, task: Task) -> None:
    ckpt = checkpoint.begin(run_dir(cfg) / "checkpoints", step)
    for role, trainer in (("policy", roles.policy), ("critic", roles.critic)):
        trainer.save([ckpt.shard(role, r) for r in range(trainer.ranks.size)])
    export_policy(roles.policy, task, ckpt.tmp / checkpoint.POLICY_HF)
    saved = {"step": step, "settings": resume_settings(cfg)}
    saved |= {name: part.state_dict() for name, part in state.parts().items()}
    checkpoint.save_file(saved, ckpt.tmp / "driver.pt")
    checkpoint.commit(ckpt, cfg.run.keep_checkpoints)


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, and the driver state read from it."""

    ckpt: Path
    saved: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.saved["step"])


def find_resume_point(cfg: ExperimentConfig) -> ResumePoint | None:
    """The newest usable checkpoint of the run (None: none), found before anything starts. A newer checkpoint
    that is torn (a file missing or short) or whose driver state cannot be loaded is skipped with a one-line
    warning saying why; CheckpointError when every checkpoint was skipped, or when the one found was written
    with other settings (`resume_settings`)."""
    skipped: list[str] = []

    def skip(ckpt: Path, why: str) -> None:
        _log.warning("skipping checkpoint %s: %s", ckpt, why)
        skipped.append(ckpt.name)

    for ckpt in checkpoint.whole(run_dir(cfg) / "checkpoints", on_skip=skip):
        try:
            saved = checkpoint.load_file(ckpt / "driver.pt")
        except (checkpoint.CheckpointError, pickle.UnpicklingError, EOFError, RuntimeError) as err:
            skip(ckpt, f"driver.pt cannot be loaded ({str(err).splitlines()[0]})")
            continue
        if "settings" in saved:  # none in checkpoints written before they were kept
            _check_settings(cfg, ckpt, saved["settings"])
        return ResumePoint(ckpt, saved)
    if skipped:  # starting afresh would overwrite the run's metrics and prune its checkpoints
        raise checkpoint.CheckpointError(
            f"no usable checkpoint in {run_dir(cfg) / 'checkpoints'} (skipped {', '.join(skipped)}, see above): move "
            "the run directory away or pick a new run.name"
        )
    return None


def _resume(point: ResumePoint, roles: Roles, state: DriverState) -> int:
    """Load every shard and the driver's state from the resume point; its step."""
    for role, trainer in (("policy", roles.policy), ("critic", roles.critic)):
        trainer.load([point.ckpt / f"{role}_rank{r}.pt" for r in range(trainer.ranks.size)])
    for name, part in state.parts().items():
        # A run whose planner was off when it saved continues with a fresh one.
        if name in point.saved:
            part.load_state_dict(point.saved[name])
    _log.warning("resuming from %s (step %d)", point.ckpt, point.step)
    return point.step


# What a checkpoint's shards and pool are laid out by: a run resumes only with the same values.
_MODEL_SHAPE = (
    "arch",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "ffn_hidden_size",
    "moe_ffn_hidden_size",
    "num_experts",
    "moe_topk",
    "shared_expert_ffn_hidden_size",
    "first_k_dense",
    "tie_word_embeddings",
)


def resume_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """The settings a resumed run must share with its checkpoint, by config key: the model's shape, how the
    trainer ranks split it (the shards), and the pool's layout (batch and group size, window, L_max)."""
    model = dataclasses.asdict(cfg.model)
    a, c, p = cfg.algo, cfg.cluster, cfg.parallel
    return {f"model.{k}": model[k] for k in _MODEL_SHAPE} | {
        "algo.batch_size": a.batch_size,
        "algo.group_size": a.group_size,
        "algo.window": a.window,
        "algo.max_response_length": a.max_response_length,
        "algo.dynamic_sampling": a.dynamic_sampling,
        "cluster.policy_ranks": c.policy_ranks,
        "cluster.critic_ranks": c.critic_ranks,
        "parallel.tensor_parallel": p.tensor_parallel,
        "parallel.pipeline_parallel": p.pipeline_parallel,
        "parallel.expert_parallel": p.expert_parallel,
    }


def _check_settings(cfg: ExperimentConfig, ckpt: Path, saved: dict[str, Any]) -> None:
    """CheckpointError naming every setting that differs from the one `ckpt` was written with."""
    now = resume_settings(cfg)
    changed = [f"{k}={saved[k]!r} now {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if changed:
        raise checkpoint.CheckpointError(
            f"{ckpt} was written with other settings ({', '.join(changed)}); to start afresh, pick a new "
            f"run.name or move {run_dir(cfg)} away"
        )


def train(cfg: ExperimentConfig) -> dict[str, Any]:
    """Run (or resume) the experiment; returns the summary written to summary.json."""
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    task = build_task(cfg)
    loop_eval = prepare_loop_eval(
        cfg.eval, cfg.run.eval_every, cfg.max_model_len, task.tokenizer, task.stop_token_ids
    )
    point = find_resume_point(cfg)
    out = run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    reference_ranks = cfg.cluster.policy_ranks if cfg.algo.kl_coef else 0
    with ray_session(cfg.cluster), reserve(cfg.cluster, reference_ranks) as placement:
        # The trainers' start and the warm start log their seconds: on a GPU they can take minutes.
        began = time.perf_counter()
        roles = _start_roles(cfg, placement)
        _log.info("trainers started in %.1f s", time.perf_counter() - began)
        pool = SamplePool.from_config(cfg.algo, task.dataset, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        state = DriverState(pool, History(), roles.planner)
        resumed = None if point is None else _resume(point, roles, state)
        start = 0 if resumed is None else resumed + 1
        if resumed is None:
            state.history.warm_start_nll = warm_start(cfg, task, roles.policy)
        if roles.reference is not None:
            _freeze_reference(cfg, roles, fresh=resumed is None)
        # The rollout engine starts from the policy's current weights (warm-started or resumed).
        export_policy(roles.policy, task, out / "rollout_init")
        if cfg.cluster.time_shared:  # the engine sizes its KV cache from the free memory it finds
            offload_trainers(roles)
        began = time.perf_counter()
        roles.rollout = rollout_engines(cfg, out / "rollout_init", placement)
        _log.info("rollout engines started in %.1f s", time.perf_counter() - began)
        with MetricsLogger(
            out,
            cfg.logging,
            cfg.run.name,
            dataclasses.asdict(cfg),
            resume_step=resumed,
        ) as logger:
            try:
                _loop(cfg, roles, state, task, logger, start, loop_eval)
            except RoleError as err:
                last = checkpoint.latest(out / "checkpoints")
                where = f"the last complete checkpoint is {last}" if last else "no checkpoint was written yet"
                raise RoleError(f"{err}\n{where}; re-run the same command to resume") from err
            summary = summarize(state.history)
            expert_load = roles.planner.expert_load_LE if roles.planner is not None else None
            write_plots(out, state.history, expert_load)
            logger.summary(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _loop(
    cfg: ExperimentConfig,
    roles: Roles,
    state: DriverState,
    task: Task,
    logger: MetricsLogger,
    start: int,
    loop_eval: LoopEval | None = None,
) -> None:
    steps = range(start, cfg.run.num_steps)
    for step in progress(
        steps, total=cfg.run.num_steps, initial=start, desc="T-PPO", enabled=cfg.logging.progress
    ):
        metrics = rl_step(step, cfg, state.pool, roles, task.verifier, task.stop_token_ids)
        state.history.remember(metrics)
        if loop_eval is not None and due(cfg.run.eval_every, step):
            t0 = time.perf_counter()
            metrics |= run_loop_eval(loop_eval, roles.rollout, run_dir(cfg), step)
            metrics["perf/eval_s"] = time.perf_counter() - t0
        logger.log(metrics, step=step)
        if (cfg.run.save_every and (step + 1) % cfg.run.save_every == 0) or step + 1 == cfg.run.num_steps:
            _save(cfg, roles, step, state, task)


def _start_roles(cfg: ExperimentConfig, placement: Reservation) -> Roles:
    c, mbs, routing = cfg.cluster, cfg.parallel.micro_batch_size, cfg.algo.routing_replay == "r3"
    tokens = cfg.parallel.micro_batch_tokens

    def trainers(role: str, parallel: ParallelConfig, num_ranks: int, **kwargs: Any) -> Any:
        optim = cfg.algo.critic_optim if role == "critic" else cfg.algo.actor_optim
        seed = cfg.run.seed + (1 if role == "critic" else 0)
        return start_trainers(
            role,
            cfg.model,
            parallel,
            optim,
            num_ranks,
            seed=seed,
            total_steps=cfg.run.num_steps,
            placement=placement,
            backend=getattr(cfg.backend, role),
            **kwargs,
        )

    temperature = logprob_temperature(cfg.rollout.temperature)
    policy = Trainer(
        trainers("policy", cfg.parallel, c.policy_ranks, executor=executor_spec(cfg)),
        mbs,
        routing,
        temperature,
        micro_batch_tokens=tokens,
    )
    critic = Trainer(
        trainers("critic", critic_parallel(cfg), c.critic_ranks), mbs, False, micro_batch_tokens=tokens
    )
    planner = LoadPlanner(cfg.relibra, cfg.model, policy.router_layout()) if relibra_applies(cfg) else None
    reference = None
    if cfg.algo.kl_coef:
        reference = Trainer(
            trainers("reference", cfg.parallel, c.policy_ranks),
            mbs,
            routing,
            temperature,
            micro_batch_tokens=tokens,
        )
    return Roles(policy=policy, critic=critic, planner=planner, reference=reference)


def _freeze_reference(cfg: ExperimentConfig, roles: Roles, fresh: bool) -> None:
    """The reference policy is the policy as RL starts (after the warm start). Its weights are written once into
    the run directory, so a resumed run loads the same reference rather than the resumed policy: the policy's
    own shards when both run on Megatron, else its Hugging Face export (what either backend loads)."""
    folder = run_dir(cfg) / "reference"
    b = cfg.backend
    if b.policy.engine != "megatron" or b.reference.engine != "megatron":
        _freeze_reference_hf(cfg, roles, folder / "hf", fresh)
        return
    shards = [folder / f"rank{r}.pt" for r in range(roles.policy.ranks.size)]
    if fresh:
        folder.mkdir(parents=True, exist_ok=True)
        roles.policy.save(shards, with_optimizer=False)
    elif not all(s.exists() for s in shards):
        raise FileNotFoundError(
            f"algo.kl_coef={cfg.algo.kl_coef} but the reference policy of this run is missing from {folder}"
        )
    roles.reference.load(shards)


def _freeze_reference_hf(cfg: ExperimentConfig, roles: Roles, folder: Path, fresh: bool) -> None:
    if fresh:
        roles.policy.export_hf(folder)
    elif not (folder / "config.json").exists():
        raise FileNotFoundError(
            f"algo.kl_coef={cfg.algo.kl_coef} but the reference policy of this run is missing from {folder}"
        )
    roles.reference.load_hf(folder)
