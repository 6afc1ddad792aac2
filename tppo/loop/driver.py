"""The T-PPO driver loop (specs/tppo.md): one process that holds no model and runs the dataflow of each step.

    take from the pool -> generate one window (routing recorded) -> score finished -> values -> advantages
    -> ReLibra plan from the replayed routing (in the background, during the next two stages) -> critic update
    (finished only) -> old log-probs -> policy update (routing replay, under the plan) -> weight sync to the
    rollout engine -> put back, metrics, checkpoint on schedule

The critic's update and the policy's are independent within a step (the advantages come from the values before
either); with cluster.overlap_updates they run at the same time, on their own ranks.

Colocated roles time-share the devices (cluster.time_shared): the trainers offload before generation, the
rollout engine sleeps after it and the critic offloads after its update; a role's next call brings it back.

Everything heavy runs in the roles (tppo.cluster.roles); the math and the stages of a step are in tppo.algo.
Departure from the paper: none in the loop; see tppo/algo/stages.py and the spec's "readings" for the choices the
paper leaves open.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rollout.engine import GenerateStats
from rollout.params import SamplingParams
from tppo.algo.batching import padding_fraction, select_microbatches, update_schedule
from tppo.algo.config import AlgoConfig
from tppo.algo.objectives import policy_objective, value_objective
from tppo.algo.pool import Sample, SamplePool
from tppo.algo.stages import (
    PhaseTimer,
    Verifier,
    advantages,
    informative_groups,
    request_seed,
    rollout_metrics,
    score_finished,
    shape_rewards,
    store_values,
    update_metrics,
    update_rng,
    window_values,
)
from tppo.cluster.roles import STREAM_AHEAD, RankBatches, Rollout, Trainer
from tppo.config import ExperimentConfig
from tppo.loop.balance import LoadPlanner, StepPlan, loads_from_ranks


@dataclass
class Roles:
    policy: Trainer
    critic: Trainer
    rollout: Rollout | None = None  # started once the policy has exported its first weights
    planner: LoadPlanner | None = None  # when ReLibra is on
    reference: Trainer | None = None  # the frozen reference policy, when a KL penalty is on


def rl_step(
    step: int,
    cfg: ExperimentConfig,
    pool: SamplePool,
    roles: Roles,
    verifier: Verifier,
    stop_ids: tuple[int, ...],
) -> dict[str, float]:
    """One T-PPO step; returns its metrics."""
    timer, metrics, shared = PhaseTimer(), {}, cfg.cluster.time_shared
    batch = pool.take()
    if shared:
        with timer("offload"):
            offload_trainers(roles)
    with timer("rollout"):
        stats = generate(roles.rollout, batch, cfg, step, stop_ids)
    metrics |= score(batch, verifier, cfg)
    generated = batch
    if cfg.algo.dynamic_sampling:
        batch, generated, refill = refill_informative(
            pool, batch, roles, cfg, step, stop_ids, verifier, timer, stats
        )
        metrics |= refill
    if shared:
        with timer("offload"):
            roles.rollout.sleep()
    if batch:
        metrics |= learn(batch, roles, cfg, step, timer)
    outcome = pool.put_back(generated)
    metrics |= rollout_metrics(generated, outcome.retired, timer.seconds["rollout"]) | timer.metrics()
    metrics |= engine_metrics(stats)
    metrics |= {f"rollout/pool_{k.split('/', 1)[1]}": v for k, v in outcome.metrics().items()}
    return metrics


def learn(
    batch: list[Sample], roles: Roles, cfg: ExperimentConfig, step: int, timer: PhaseTimer
) -> dict[str, float]:
    """Values, advantages, the critic's update and (after the critic's warm-up) the policy's, then weight sync."""
    with timer("values"):
        values = roles.critic.values(batch)
        win_values = window_values(batch, values.rows)
    store_values(batch, win_values, values.rows, cfg.algo)
    adv, metrics = advantages(batch, win_values, cfg.algo, values.after_last_B)
    policy_in = roles.policy.policy_batches(batch, adv)
    updates_policy = step >= cfg.algo.critic_warmup_steps
    planning = start_plan(roles, policy_in) if updates_policy and cfg.algo.routing_replay == "r3" else None
    finish_critic = start_critic_update(roles.critic, [s for s in batch if s.finished], cfg, step, timer)
    overlap = cfg.cluster.overlapped_updates
    if not overlap:
        metrics |= finish_critic()
    if updates_policy:
        metrics |= update_policy(roles, policy_in, planning, cfg, step, timer)
        with timer("weight_sync"):
            sync_weights(roles, cfg)
    if overlap:
        metrics |= finish_critic()
    return metrics


def score(batch: list[Sample], verifier: Verifier, cfg: ExperimentConfig) -> dict[str, float]:
    """The verifier's reward for every finished sample, DAPO's overlong shaping on top."""
    return score_finished(batch, verifier, cfg.data.reward_timeout_s) | shape_rewards(batch, cfg.algo)


def refill_informative(
    pool: SamplePool,
    batch: list[Sample],
    roles: Roles,
    cfg: ExperimentConfig,
    step: int,
    stop_ids: tuple[int, ...],
    verifier: Verifier,
    timer: PhaseTimer,
    stats: list[GenerateStats],
) -> tuple[list[Sample], list[Sample], dict[str, float]]:
    """DAPO's dynamic sampling: the groups whose rewards are all equal leave the batch before any update, and
    further prompts are generated and scored to refill it, at most algo.dynamic_sampling_rounds times. Returns
    the informative samples (at most algo.batch_size) that train, every sample generated (all go back to the
    pool, which drops the uninformative groups) and the refill's metrics; the engines' counters of its calls
    are appended to `stats`."""
    generated, kept, rounds = list(batch), informative_groups(batch), 0
    failures = {"rollout/reward_failures": 0.0, "rollout/reward_timeouts": 0.0}
    while len(kept) < cfg.algo.batch_size and rounds < cfg.algo.dynamic_sampling_rounds:
        extra = pool.take_more(cfg.algo.batch_size - len(kept))
        if not extra:
            break
        with timer("rollout"):
            stats += generate(roles.rollout, extra, cfg, step, stop_ids)
        scored = score(extra, verifier, cfg)
        failures = {k: v + scored.get(k, 0.0) for k, v in failures.items()}
        generated += extra
        kept += informative_groups(extra)
        rounds += 1
    return (
        kept,
        generated,
        {
            "rollout/dynamic_generated": float(len(generated)),
            "rollout/dynamic_kept": float(len(kept)),
            "rollout/dynamic_refill_rounds": float(rounds),
            "rollout/refill_reward_failures": failures["rollout/reward_failures"],
            "rollout/refill_reward_timeouts": failures["rollout/reward_timeouts"],
        },
    )


def generate(
    rollout: Rollout, batch: list[Sample], cfg: ExperimentConfig, step: int, stop_ids: tuple[int, ...]
) -> list[GenerateStats]:
    """One window of every sample of the batch, appended to the sample (with its routing under R3); returns the
    engines' counters of the call."""
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
    outs = rollout.generate([s.context_ids.tolist() for s in batch], params)
    for s, o in zip(batch, outs):
        reason = None if o.finish_reason == "length" else o.finish_reason
        routed = o.routed_experts if cfg.algo.routing_replay == "r3" else None
        s.add_window(o.token_ids, o.logprobs, finish_reason=reason, routed_experts=routed)
    return rollout.last_stats()


def engine_metrics(stats: list[GenerateStats]) -> dict[str, float]:
    """What the rollout engines spent the step on, summed over the engines and the step's calls: seconds of
    their generate calls, of prefill-only steps and of decode steps (mixed_s of them also carried prompt
    chunks), of the steps that captured a CUDA graph (and how many did), how full the decode batches were (rows
    per decode step, and that over the rows an engine decodes at most), preemptions, and the KV cache's peak use
    (blocks, and that over the cache's blocks)."""
    steps = sum(s.num_decode_steps for s in stats)
    rows = sum(s.num_decode_rows for s in stats)
    capacity = sum(s.num_decode_steps * s.max_seqs for s in stats)
    return {
        "rollout/generate_s": float(sum(s.generate_s for s in stats)),
        "rollout/capture_s": float(sum(s.capture_s for s in stats)),
        "rollout/graphs_captured": float(sum(s.num_captures for s in stats)),
        "rollout/prefill_s": float(sum(s.prefill_s for s in stats)),
        "rollout/decode_s": float(sum(s.decode_s for s in stats)),
        "rollout/mixed_s": float(sum(s.mixed_s for s in stats)),
        "rollout/decode_rows_mean": rows / steps if steps else 0.0,
        "rollout/decode_occupancy": rows / capacity if capacity else 0.0,
        "rollout/preemptions": float(sum(s.num_preemptions for s in stats)),
        "rollout/kv_blocks_peak": float(max((s.kv_blocks_peak for s in stats), default=0)),
        "rollout/kv_usage_peak": max(
            (s.kv_blocks_peak / s.kv_blocks for s in stats if s.kv_blocks), default=0.0
        ),
    }


def start_critic_update(
    critic: Trainer, finished: list[Sample], cfg: ExperimentConfig, step: int, timer: PhaseTimer
) -> Callable[[], dict[str, float]]:
    """Start the critic's update on the finished responses (discounted Monte-Carlo targets), algo.mini_batches x
    algo.epochs optimizer steps; returns the wait for its metrics (empty when none finished). The policy's update
    does not read the critic, so with cluster.overlap_updates the driver waits only after the policy's update
    and weight sync: perf/critic_update_s is then the part of the step the critic added (building and sending its
    micro-batches, and the wait)."""
    if not finished:
        return dict
    with timer("critic_update"):
        critic_in = critic.critic_batches(finished, cfg.algo.gamma)
        schedule, objectives = optimizer_steps(critic_in, value_objective, cfg, step, "critic")
        running = critic.update(critic_in, objectives, schedule)

    def finish() -> dict[str, float]:
        with timer("critic_update"):
            metrics = update_metrics("critic", running.result())
        if cfg.cluster.time_shared:
            with timer("offload"):
                critic.offload()
        return metrics

    return finish


def update_policy(
    roles: Roles,
    policy_in: RankBatches,
    planning: Future[StepPlan] | None,
    cfg: ExperimentConfig,
    step: int,
    timer: PhaseTimer,
) -> dict[str, float]:
    """Old (and reference) log-probs of the whole batch, then the policy update (algo.mini_batches x algo.epochs
    optimizer steps) under ReLibra's plan when there is one. With algo.old_logprobs from the update, its one
    optimizer step's forward gives them, and no pass of their own runs."""
    fused = cfg.algo.old_logprobs_from_update
    # R2: the trainer's own pass records the experts the update then replays.
    record = cfg.algo.routing_replay == "r2"
    metrics = {
        "tppo/microbatches": float(len(policy_in[0])),
        "tppo/padding_fraction": padding_fraction(policy_in),
    }
    with timer("policy_update" if fused else "old_logprobs"):
        roles.policy.stage(policy_in)  # the ranks keep the step's micro-batches until the update
        if not fused:
            old = roles.policy.old_logprobs(record_routing=record)
            metrics |= old.metrics
    if record and roles.planner is not None:
        planning = roles.planner.start_loads(loads_from_ranks(old.counts_MLE, roles.planner.layout.ep))
    if roles.reference is not None:
        with timer("ref_logprobs"):
            roles.policy.ref_logprobs(roles.reference.forward(policy_in))
    step_plan = finish_plan(planning, timer)
    plan = step_plan.plan if step_plan is not None else None
    with timer("policy_update"):
        schedule, objectives = optimizer_steps(policy_in, policy_objective, cfg, step, "policy")
        loads = step_plan.loads_MLSE if plan is not None else None
        results = roles.policy.update(None, objectives, schedule, plan, loads, old_from_update=fused).result()
        metrics |= update_metrics("tppo", results)
    if step_plan is not None:
        metrics |= step_plan.metrics
    if results[-1].plan_applied is False:
        roles.planner.refused()
    return metrics


def optimizer_steps(
    batches: RankBatches,
    objective: Callable[[AlgoConfig, RankBatches], Any],
    cfg: ExperimentConfig,
    step: int,
    role: str,
) -> tuple[list[list[int]], list[Any]]:
    """One update's optimizer steps (algo.mini_batches x algo.epochs, shuffled per epoch) and each step's
    objective, built over the micro-batches it trains."""
    rng = update_rng(cfg.run.seed, step, role)
    schedule = update_schedule(len(batches[0]), cfg.algo.mini_batches, cfg.algo.epochs, rng)
    return schedule, [objective(cfg.algo, select_microbatches(batches, s)) for s in schedule]


def offload_trainers(roles: Roles) -> None:
    """Free the devices for the rollout engine: every trainer role moves its state to host memory."""
    for trainer in (roles.policy, roles.critic, roles.reference):
        if trainer is not None:
            trainer.offload()


def start_plan(roles: Roles, policy_in: RankBatches) -> Future[StepPlan] | None:
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
    """Policy weights, bucketed, in HF names and logical expert order, into the rollout engine: each bucket goes
    from the policy's rank 0 to the engines through the object store while the next one is gathered."""
    for bucket in roles.policy.weights(sync_bucket_bytes(cfg)):
        roles.rollout.load_weights(bucket)


def sync_bucket_bytes(cfg: ExperimentConfig) -> int:
    """rollout.weight_sync_bucket_mb, capped so that the buckets the policy gathers ahead (STREAM_AHEAD) and the
    one being loaded fit in cluster.object_store_mb: larger buckets spill to disk (a CPU run of a 300-MB model
    synced in 3.8 s with 256-MB buckets in a 128-MB store, 1.2 s with buckets that fit)."""
    cap_mb = max(1, cfg.cluster.object_store_mb // (STREAM_AHEAD + 1))
    return min(cfg.rollout.weight_sync_bucket_mb, cap_mb) << 20
