"""The pieces of one T-PPO step that the driver loop strings together: generate a window, score, values,
advantages, the two updates, and the metrics of each. Each function does one stage on typed records.

Legend: B samples of the step, W tokens of the longest current window, T tokens of a whole sequence.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from tppo.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    expected_lengths,
    length_adaptive_lambda,
    overlong_penalty,
    postprocess_advantages,
)
from tppo.algo.config import AlgoConfig
from tppo.algo.losses import mismatch_metrics
from tppo.algo.pool import Sample
from tppo.engine.batch import ForwardOutput, StepResult, TrainBatch

Verifier = Callable[[Sample], float]


@dataclass
class PhaseTimer:
    """Wall time per phase of a step, reported as perf/<phase>_s."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"perf/{k}_s": v for k, v in self.seconds.items()} | {
            "perf/step_s": sum(self.seconds.values())
        }


def request_seed(run_seed: int, step: int, uid: str) -> int:
    """A sampling seed that depends only on the run, the step and the sample, so a resumed run draws the same."""
    digest = hashlib.blake2b(f"{run_seed}/{step}/{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def score_finished(
    batch: Sequence[Sample], verifier: Verifier, timeout_s: float = 30.0, failure_reward: float = -1.0
) -> dict[str, float]:
    """Give every finished sample its reward. A verifier that raises, returns a non-finite value or runs past
    `timeout_s` scores `failure_reward` for that sample and is counted; it never ends the run. A verifier stuck
    past its time is abandoned in its thread (Python cannot kill a thread) and scoring goes on in a new one."""
    failures, timeouts = 0, 0
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        for s in batch:
            if not s.finished:
                continue
            future = pool.submit(verifier, s)
            try:
                reward = float(future.result(timeout=timeout_s))
                if not np.isfinite(reward):
                    raise ValueError(f"non-finite reward {reward}")
            except FutureTimeout:
                reward, timeouts = failure_reward, timeouts + 1
                pool.shutdown(wait=False, cancel_futures=True)
                pool = ThreadPoolExecutor(max_workers=1)
            except Exception:
                reward, failures = failure_reward, failures + 1
            s.reward = reward
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return {"rollout/reward_failures": float(failures), "rollout/reward_timeouts": float(timeouts)}


def shape_rewards(batch: Sequence[Sample], algo: AlgoConfig) -> dict[str, float]:
    """DAPO's overlong shaping (algo.overlong_buffer = L_cache > 0): every sample that finished this step gets
    `overlong_penalty(|y|, L_max, L_cache)` added to its verifier reward, so the advantages, the critic's targets
    and the reward metrics all see the shaped reward; rollout/overlong_penalty_mean is the mean penalty."""
    finished = [s for s in batch if s.finished and s.reward is not None]
    if not algo.overlong_buffer or not finished:
        return {}
    lengths = torch.tensor([s.num_response_tokens for s in finished])
    penalty = overlong_penalty(lengths, algo.max_response_length, algo.overlong_buffer)
    for s, p in zip(finished, penalty.tolist()):
        s.reward = float(s.reward) + p
    return {"rollout/overlong_penalty_mean": float(penalty.mean())}


def informative_groups(samples: Sequence[Sample]) -> list[Sample]:
    """DAPO's dynamic-sampling filter: the samples of the groups whose rewards are not all equal (every sample
    finished and scored), in their order."""
    rewards: dict[int, set[float]] = {}
    for s in samples:
        if not s.finished or s.reward is None:
            raise ValueError(f"sample {s.uid}: dynamic sampling filters finished, scored samples only")
        rewards.setdefault(s.group_id, set()).add(float(s.reward))
    return [s for s in samples if len(rewards[s.group_id]) > 1]


def store_values(
    batch: Sequence[Sample],
    window_values_rows: Sequence[np.ndarray],
    values_rows: Sequence[np.ndarray],
    algo: AlgoConfig,
) -> None:
    """Keep each sample's current-window values (the value-clipping anchor of its critic update). With
    algo.critic_old_values=recompute, the finished samples' anchors become the pre-update critic's values of this
    step over every response token, instead of those stored window by window."""
    for s, v in zip(batch, window_values_rows):
        s.store_values(v)
    if algo.critic_old_values != "recompute":
        return
    for s, v in zip(batch, values_rows):
        if s.finished:
            p = len(s.prompt_ids)
            s.values = np.asarray(v[p : p + s.num_response_tokens], dtype=np.float32).copy()


def _window_tensor(rows: Sequence[np.ndarray], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for b, r in enumerate(rows):
        out[b, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def window_values(batch: Sequence[Sample], values_rows: Sequence[np.ndarray]) -> list[np.ndarray]:
    """V(s_t) of each sample's current-window tokens, cut from the critic's whole-sequence values."""
    out = []
    for s, v in zip(batch, values_rows):
        p = len(s.prompt_ids)
        out.append(np.asarray(v[p + s.window_start : p + s.num_response_tokens], dtype=np.float32))
    return out


def advantages(
    batch: Sequence[Sample],
    values: Sequence[np.ndarray],
    algo: AlgoConfig,
    after_last_B: np.ndarray | None = None,
) -> tuple[list[np.ndarray], dict]:
    """The registered estimator over the current windows, then tail mask, whitening and clamping.

    `values[b]`: V(s_t) of sample b's window tokens; `after_last_B[b]`: the critic's value of the state after its
    last generated token, the bootstrap of a cut window under algo.bootstrap=exact."""
    if algo.bootstrap == "exact" and after_last_B is None:
        raise ValueError("algo.bootstrap=exact needs the value after each window's last token (after_last_B)")
    lengths = [len(s.window_ids) for s in batch]
    width = max(lengths)
    mask = _window_tensor([np.ones(n) for n in lengths], width)
    finished = torch.tensor([s.finished for s in batch], dtype=torch.float32)
    rewards = _window_tensor([_reward_row(s) for s in batch], width)
    lam: float | torch.Tensor = algo.lam
    if algo.lam_adaptive:
        generated = torch.tensor([s.num_response_tokens for s in batch], dtype=torch.float32)
        lam = length_adaptive_lambda(
            expected_lengths(generated, finished, algo.window), algo.lam_alpha, algo.lam
        )
    groups = torch.tensor([s.group_id for s in batch], dtype=torch.long)
    inputs = AdvantageInputs(
        rewards_BT=rewards,
        mask_BT=mask,
        finished_B=finished,
        values_BT=_window_tensor(values, width),
        group_ids_B=groups,
        gamma=algo.gamma,
        lam=lam,
        bootstrap=algo.bootstrap,
        bootstrap_values_B=(
            torch.as_tensor(after_last_B, dtype=torch.float32) if algo.bootstrap == "exact" else None
        ),
    )
    raw = ADVANTAGE_ESTIMATORS.get(algo.estimator)(inputs)
    if raw.dim() == 1:  # outcome estimators (GRPO) give one advantage per sample
        raw = raw[:, None] * mask
    adv = postprocess_advantages(
        raw, mask, finished, num_tail=algo.tail_mask, whiten=algo.whiten, clamp=algo.adv_clamp
    )
    valid = mask.bool()
    lam_t = lam if isinstance(lam, torch.Tensor) else torch.full((len(batch),), float(lam))
    metrics = {
        "tppo/adv_mean": float(raw[valid].mean()),
        "tppo/adv_std": float(raw[valid].std()) if valid.sum() > 1 else 0.0,
        "tppo/adv_abs_max": float(raw[valid].abs().max()),
        "tppo/lambda_mean": float(lam_t.mean()),
    }
    metrics |= _window_kind_means(raw, adv, valid, finished.bool())
    return [adv[b, :n].numpy() for b, n in enumerate(lengths)], metrics


def _window_kind_means(
    raw_BT: torch.Tensor, adv_BT: torch.Tensor, valid_BT: torch.Tensor, finished_B: torch.Tensor
) -> dict[str, float]:
    """Mean advantage over the tokens of cut windows and of finished windows, before (`_raw`) and after the
    post-processing. A cut window's advantage comes from the critic alone: a positive cut mean says continuing
    pays, and whitening scales that signal to unit size however small the raw differences are. A kind absent from
    the batch is not reported."""
    out = {}
    for kind, rows_B in (("cut", ~finished_B), ("finished", finished_B)):
        tokens_BT = valid_BT & rows_B.unsqueeze(1)
        if tokens_BT.any():
            out[f"tppo/adv_{kind}_raw_mean"] = float(raw_BT[tokens_BT].mean())
            out[f"tppo/adv_{kind}_mean"] = float(adv_BT[tokens_BT].mean())
    return out


def _reward_row(s: Sample) -> np.ndarray:
    row = np.zeros(len(s.window_ids), np.float32)
    if s.finished:
        row[-1] = float(s.reward if s.reward is not None else 0.0)
    return row


def store_old_logprobs(
    batches: Sequence[TrainBatch], outs: Sequence[ForwardOutput], take_routing: bool = False
) -> None:
    """One rank's micro-batches: the trainer's pre-update log-probs become the PPO ratio's denominator (and, for
    R2, the experts its router chose are what the update replays)."""
    for b, out in zip(batches, outs, strict=True):
        b.payload.old_logprobs_BT = out.logprobs_BT.detach().float()
        if take_routing:
            b.routed_experts_BTLK = out.routed_experts_BTLK


def store_ref_logprobs(batches: Sequence[TrainBatch], outs: Sequence[ForwardOutput]) -> None:
    """One rank's micro-batches: the reference policy's log-probs of the same tokens (the KL penalty's target)."""
    for b, out in zip(batches, outs, strict=True):
        b.payload.ref_logprobs_BT = out.logprobs_BT.detach().float()


MismatchInputs = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def mismatch_inputs(batches: Sequence[TrainBatch]) -> MismatchInputs:
    """Per micro-batch, flat: the old (trainer) log-probs, the rollout's log-probs and the window mask."""
    return [
        (
            b.payload.old_logprobs_BT.flatten(),
            b.payload.rollout_logprobs_BT.flatten(),
            b.payload.window_mask_BT.flatten(),
        )
        for b in batches
    ]


def rollout_mismatch(parts: Sequence[MismatchInputs]) -> dict[str, float]:
    """How far the trainer's log-probs are from the rollout's on the window tokens of the whole batch (`parts`:
    every rank's `mismatch_inputs`, in rank order), as `mismatch/` metrics."""
    flat = [mb for rank in parts for mb in rank]
    trainer, rollout, mask = (torch.cat([mb[i] for mb in flat])[None] for i in range(3))
    m = mismatch_metrics(trainer, rollout, mask)
    return {k.replace("tppo/mismatch_", "mismatch/"): v for k, v in m.items()}


def update_rng(run_seed: int, step: int, role: str) -> np.random.Generator:
    """The generator that shuffles one role's update at one step: the same after a resume."""
    return np.random.default_rng([run_seed, step, {"policy": 0, "critic": 1}[role]])


def update_metrics(ns: str, results: Sequence[StepResult]) -> dict[str, float]:
    """One update's metrics under `ns/`: its optimizer steps, how many were skipped (non-finite), the loss,
    gradient norm and every metric the steps reported averaged over the steps that reported it (the ReLibra
    executor's ride on the last step only), the last LR."""
    out = {
        f"{ns}/loss": _mean([r.loss for r in results]),
        f"{ns}/grad_norm": _mean([r.grad_norm for r in results]),
        f"{ns}/lr": results[-1].lr,
        f"{ns}/skipped_updates": float(sum(r.skipped for r in results)),
        f"{ns}/optimizer_steps": float(len(results)),
    }
    per_key: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.metrics.items():
            per_key.setdefault(k if "/" in k else f"{ns}/{k}", []).append(v)
    return out | {k: _mean(v) for k, v in per_key.items()}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def rollout_metrics(batch: Sequence[Sample], retired: Sequence[Sample], seconds: float) -> dict[str, float]:
    new_tokens = [len(s.window_ids) for s in batch]
    out = {
        "rollout/tokens": float(sum(new_tokens)),
        "rollout/tokens_per_s": sum(new_tokens) / max(seconds, 1e-9),
        "rollout/cut_fraction": float(np.mean([not s.finished for s in batch])),
        "rollout/finished": float(len(retired)),
    }
    if retired:
        lengths = np.array([s.num_response_tokens for s in retired])
        windows = np.array([s.window_round for s in retired])
        out |= {
            "rollout/reward_mean": float(np.mean([s.reward for s in retired])),
            "rollout/length_mean": float(lengths.mean()),
            "rollout/length_p50": float(np.percentile(lengths, 50)),
            "rollout/length_p90": float(np.percentile(lengths, 90)),
            "rollout/length_max": float(lengths.max()),
            "rollout/windows_mean": float(windows.mean()),
            "rollout/multi_window_fraction": float(np.mean(windows > 1)),
            "rollout/overlong_fraction": float(np.mean([s.finish_reason == "length" for s in retired])),
        }
    return out
