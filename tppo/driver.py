"""The T-PPO driver loop (specs/tppo.md): one process that holds no model and runs the dataflow of each step.

    take from the pool -> generate one window (routing recorded) -> score finished -> values -> advantages
    -> ReLibra plan from the replayed routing (in the background, during the next two stages) -> critic update
    (finished only) -> old log-probs -> policy update (routing replay, under the plan) -> weight sync to the
    rollout engine -> put back, metrics, checkpoint on schedule

Colocated roles time-share the devices (cluster.time_shared): the trainers offload before generation, the
rollout engine sleeps after it and the critic offloads after its update; a role's next call brings it back.

Everything heavy runs in the roles (tppo.roles); the math is in tppo.advantages / tppo.losses; the stages of a
step are small functions in tppo.step. Departure from the paper: none in the loop; see tppo/step.py and the
spec's "readings" for the choices the paper leaves open.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.params import SamplingParams
from tppo.balance import LoadPlanner, StepPlan
from tppo.config import ExperimentConfig
from tppo.pool import Sample, SamplePool
from tppo.roles import RankGroup, Trainer, generate_split, policy_objective, value_objective
from tppo.step import (
    PhaseTimer,
    Verifier,
    advantages,
    fill_old_logprobs,
    fill_ref_logprobs,
    recompute_old_values,
    request_seed,
    rollout_metrics,
    score_finished,
    shape_rewards,
    window_values,
)


@dataclass
class Roles:
    policy: Trainer
    critic: Trainer
    rollout: RankGroup  # the rollout engines (generate splits the requests, load_weights goes to all)
    planner: LoadPlanner | None = None  # when ReLibra is on
    reference: Trainer | None = None  # the frozen reference policy, when a KL penalty is on


def generate(
    roles: Roles, batch: list[Sample], cfg: ExperimentConfig, step: int, stop_ids: tuple[int, ...]
) -> None:
    r = cfg.rollout
    params = [
        SamplingParams(
            max_new_tokens=s.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=request_seed(cfg.run.seed, step, s.uid),
            stop_token_ids=stop_ids,
        )
        for s in batch
    ]
    outs = generate_split(roles.rollout, [s.context_ids.tolist() for s in batch], params)
    for s, o in zip(batch, outs):
        reason = None if o.finish_reason == "length" else o.finish_reason
        routed = o.routed_experts if cfg.algo.routing_replay == "r3" else None
        s.add_window(o.token_ids, o.logprobs, finish_reason=reason, routed_experts=routed)


def rl_step(
    step: int,
    cfg: ExperimentConfig,
    pool: SamplePool,
    roles: Roles,
    verifier: Verifier,
    stop_ids: tuple[int, ...],
) -> dict[str, float]:
    """One T-PPO step; returns its metrics."""
    timer, metrics = PhaseTimer(), {}
    batch = pool.take()
    if cfg.cluster.time_shared:
        with timer("offload"):
            offload_trainers(roles)
    with timer("rollout"):
        generate(roles, batch, cfg, step, stop_ids)
    if cfg.cluster.time_shared:
        with timer("offload"):
            roles.rollout.call("sleep")
    metrics |= score_finished(batch, verifier, cfg.data.reward_timeout_s)
    metrics |= shape_rewards(batch, cfg.algo)
    with timer("values"):
        critic_in = roles.critic.critic_batches(batch)
        values = _rows(
            roles.critic.forward(critic_in), roles.critic.placement(len(batch)), "values_BT", len(batch)
        )
        win_values = window_values(batch, values)
    for s, v in zip(batch, win_values):
        s.store_values(v)
    if cfg.algo.critic_old_values == "recompute":
        recompute_old_values(batch, values)
    adv, adv_metrics = advantages(batch, win_values, cfg.algo)
    metrics |= adv_metrics
    policy_in = roles.policy.policy_batches(batch, adv)
    updates_policy = step >= cfg.algo.critic_warmup_steps
    planning = start_plan(roles, policy_in) if updates_policy and cfg.algo.routing_replay == "r3" else None
    finished = [s for s in batch if s.finished]
    if finished:
        with timer("critic_update"):
            critic_in = roles.critic.critic_batches(finished)
            result = roles.critic.train(critic_in, value_objective(cfg, critic_in))
            metrics |= _step_metrics("critic", result)
        if cfg.cluster.time_shared:
            with timer("offload"):
                roles.critic.ranks.call("offload")
    if updates_policy:
        with timer("old_logprobs"):
            # R2: the trainer's own pass records the experts the update then replays.
            record = cfg.algo.routing_replay == "r2"
            outs = roles.policy.forward(policy_in, record_routing=record)
            metrics |= fill_old_logprobs(policy_in, outs, record)
        if record:
            planning = start_plan(roles, policy_in)
        if roles.reference is not None:
            with timer("ref_logprobs"):
                fill_ref_logprobs(policy_in, roles.reference.forward(policy_in))
        step_plan = finish_plan(planning, timer)
        with timer("policy_update"):
            result = roles.policy.train(policy_in, policy_objective(cfg, policy_in), step_plan)
            metrics |= _step_metrics("tppo", result)
        if step_plan is not None:
            metrics |= step_plan.metrics
            if result.metrics.get("relibra/exec_refused"):
                roles.planner.refused()
        with timer("weight_sync"):
            sync_weights(roles, cfg)
    outcome = pool.put_back(batch)
    metrics |= rollout_metrics(batch, outcome.retired, timer.seconds["rollout"]) | timer.metrics()
    metrics |= {f"rollout/pool_{k.split('/', 1)[1]}": v for k, v in outcome.metrics().items()}
    return metrics


def offload_trainers(roles: Roles) -> None:
    """Free the devices for the rollout engine: every trainer role moves its state to host memory."""
    for trainer in (roles.policy, roles.critic, roles.reference):
        if trainer is not None:
            trainer.ranks.call("offload")


def start_plan(roles: Roles, policy_in: list[list[Any]]) -> Future[StepPlan] | None:
    """Start ReLibra's plan for the policy update from the routing it will replay (None when ReLibra is off); it
    runs in the background while the critic updates and the old (and reference) log-probs are computed."""
    return None if roles.planner is None else roles.planner.start(policy_in)


def finish_plan(planning: Future[StepPlan] | None, timer: PhaseTimer) -> StepPlan | None:
    """The plan, once ready; perf/plan_wait_s is how long the step waited for it (relibra/planner_s: how long
    planning took)."""
    if planning is None:
        return None
    with timer("plan_wait"):
        return planning.result()


def sync_weights(roles: Roles, cfg: ExperimentConfig) -> None:
    """Policy weights, bucketed, in HF names and logical expert order, into the rollout engine."""
    for bucket in roles.policy.weights(cfg.rollout.weight_sync_bucket_mb << 20):
        roles.rollout.call("load_weights", None, bucket)


def _rows(outs: list[list[Any]], placement, attr: str, num: int) -> list[np.ndarray]:
    """Per-sample rows of a per-token output, back in the samples' order (fillers dropped)."""
    rows: list[np.ndarray | None] = [None] * num
    for rank_rows, rank_outs in zip(placement.rows, outs):
        for mb_rows, out in zip(rank_rows, rank_outs):
            tensor = getattr(out, attr)
            for j, i in enumerate(mb_rows):
                rows[i] = tensor[j].float().numpy()
    return [r for r in rows if r is not None]


def _step_metrics(ns: str, result) -> dict[str, float]:
    out = {
        f"{ns}/loss": result.loss,
        f"{ns}/grad_norm": result.grad_norm,
        f"{ns}/lr": result.lr,
        f"{ns}/skipped_updates": float(result.skipped),
    }
    return out | {k if "/" in k else f"{ns}/{k}": v for k, v in result.metrics.items()}
