"""The losses of T-PPO and its relatives, as pure functions of per-token tensors (specs/tppo.md, "Losses").

- `ppo_clip_loss`: PPO clip with clip-higher (eps_low, eps_high), dual clip c for negative advantages, the
  log-ratio clamped before exp, optional truncated importance sampling (TIS) against the rollout's log-probs.
- `clipped_value_loss`: the critic's loss with asymmetric value clipping (VAPO/T-PPO).
- `pos_lm_loss`: VAPO's positive-example LM loss (NLL of the tokens of finished responses with R > 0).
- `kl_penalty` / `kl_loss` (estimators k1, k3 of KL(pi || pi_ref)), `entropy_from_logits` / `entropy_bonus`.
- `mismatch_metrics`: how far the trainer's log-probs are from the rollout engine's.

Every loss takes a 0/1 `mask` of the tokens it trains on (it need not be right-padded: in a full-sequence
layout the current window sits after the prompt and the earlier windows) and an aggregation mode
(`LOSS_AGGREGATIONS`):
- "token_mean": sum over valid tokens / `num_tokens`, the number of valid tokens of the WHOLE training batch, so
  that the losses of its mini-batches add up to the loss of the batch (T-PPO, DAPO, VAPO);
- "sample_mean": per-row token mean, summed over rows / `num_samples`, the number of samples of the whole batch
  (GRPO; the critic's per-sample mean).
Without an explicit denominator the call's own count is used.

Each loss returns a `LossResult`: the scalar loss (with its graph) and a dict of plain floats under namespaced keys
(`tppo/...` for the policy, `critic/...` for the value); metrics are means over this call's valid tokens.

Readings of ours: `tppo/approx_kl` is the k3 estimate of KL(pi_old || pi) over the valid tokens; the TIS weight
min(exp(old - rollout), cap) is a constant (no gradient), as in the port; dual clip is disabled by c = 0.

Legend of tensor suffixes: B rows, T tokens (window or full sequence), V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from tppo.base.registry import Registry

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LossResult",
    "aggregate",
    "clipped_value_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "mismatch_metrics",
    "pos_lm_loss",
    "ppo_clip_loss",
]


class LossResult(NamedTuple):
    """A scalar loss (differentiable) and its metrics as plain floats under namespaced keys."""

    loss: Tensor
    metrics: dict[str, float]


# ----------------------------------------------------------------------------------------------------------------
# Checks.


def _check_float(name: str, x: object, shape: tuple[int, ...] | None) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    return x


def _check_mask(mask: object) -> Tensor:
    """A [B, T] 0/1 (or bool) mask, returned as bool."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape [B, T], got {list(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("mask: expected only 0/1 (or bool) entries")
    return mask != 0


def _check_number(name: str, value: Any, *, low: float, strict: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        raise ValueError(f"{name}: expected a finite number {'>' if strict else '>='} {low}, got {value!r}")
    return float(value)


def _masked_mean(x_BT: Tensor, valid_BT: Tensor) -> float:
    count = int(valid_BT.sum())
    if count == 0:
        return 0.0
    return float(torch.where(valid_BT, x_BT.detach(), 0.0).sum()) / count


def _masked_max(x_BT: Tensor, valid_BT: Tensor) -> float:
    if not bool(valid_BT.any()):
        return 0.0
    return float(x_BT.detach()[valid_BT].max())


# ----------------------------------------------------------------------------------------------------------------
# Aggregation.


Aggregation = Callable[..., Tensor]
LOSS_AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


def _denominator(name: str, given: float | int | Tensor | None, local: int) -> float:
    """The batch-level denominator: `given` (>= this call's own count) or the local count; at least 1."""
    if given is None:
        return float(max(local, 1))
    value = float(given.item()) if isinstance(given, Tensor) else given
    _check_number(name, value, low=0)
    if value < local:
        raise ValueError(
            f"{name}: {value:g} is smaller than this call's own count {local}; pass the count of the "
            "whole training batch"
        )
    return max(float(value), 1.0)


@LOSS_AGGREGATIONS.register("token_mean")
def token_mean(
    loss_BT: Tensor,
    valid_BT: Tensor,
    *,
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> Tensor:
    """Global token mean: sum_{b,t} mask[b,t] loss[b,t] / num_tokens (valid tokens of the whole batch)."""
    denominator = _denominator("num_tokens", num_tokens, int(valid_BT.sum()))
    return torch.where(valid_BT, loss_BT, 0.0).sum() / denominator


@LOSS_AGGREGATIONS.register("sample_mean")
def sample_mean(
    loss_BT: Tensor,
    valid_BT: Tensor,
    *,
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> Tensor:
    """Sample mean: sum_b [ sum_t mask[b,t] loss[b,t] / max(1, l_b) ] / num_samples (samples of the whole batch).

    By default num_samples counts the rows with at least one valid token; a fully masked row adds 0.
    """
    lengths_B = valid_BT.sum(dim=1)
    denominator = _denominator("num_samples", num_samples, int((lengths_B > 0).sum()))
    per_row_B = torch.where(valid_BT, loss_BT, 0.0).sum(dim=1) / lengths_B.clamp(min=1)
    return per_row_B.sum() / denominator


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar with a registered mode ("token_mean" or "sample_mean")."""
    valid_BT = _check_mask(mask)
    loss_BT = _check_float("loss", loss, tuple(valid_BT.shape))
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"mode: expected one of {LOSS_AGGREGATIONS.names()}, got {mode!r}")
    return LOSS_AGGREGATIONS.get(mode)(loss_BT, valid_BT, num_tokens=num_tokens, num_samples=num_samples)


# ----------------------------------------------------------------------------------------------------------------
# Policy.


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float = 10.0,
    log_ratio_clamp: float = 20.0,
    rollout_logprobs: Tensor | None = None,
    tis_cap: float = 0.0,
    agg: str = "token_mean",
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> LossResult:
    """PPO clip with clip-higher, dual clip, log-ratio clamp and optional truncated importance sampling.

        log r = clamp(logp - logp_old, -log_ratio_clamp, log_ratio_clamp),   r = exp(log r)
        L_clip = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        L = min(L_clip, -A c)  where A < 0 (dual clip, c > 1; c = 0 disables),  L = L_clip elsewhere
        L *= w,  w = min(exp(logp_old - logp_rollout), tis_cap)  (TIS, a constant; tis_cap = 0 disables)
        loss = aggregate(L, mask, agg)

    Args:
        logprobs: [B, T] log pi(a_t | s_t) of the current policy (with gradient).
        old_logprobs: [B, T] log-probs of the policy that generated the window (recomputed by the trainer).
        advantages: [B, T]; mask: [B, T] 0/1 tokens trained on.
        rollout_logprobs: [B, T] the rollout engine's log-probs, needed when tis_cap > 0.
        num_tokens / num_samples: the whole training batch's denominators (see `aggregate`).

    Metrics: tppo/pg_loss, tppo/clip_fraction (tokens whose clipped term is the larger one), tppo/clip_fraction_low,
    tppo/clip_fraction_high, tppo/dual_clip_fraction, tppo/approx_kl (k3 of KL(old || new)), tppo/ratio_mean,
    tppo/ratio_max, and with TIS tppo/tis_weight_mean, tppo/tis_clip_fraction.
    """
    valid_BT = _check_mask(mask)
    shape = tuple(valid_BT.shape)
    logprobs_BT = _check_float("logprobs", logprobs, shape)
    old_BT = _check_float("old_logprobs", old_logprobs, shape).detach()
    advantages_BT = _check_float("advantages", advantages, shape).detach()
    eps_low = _check_number("eps_low", eps_low, low=0)
    eps_high = _check_number("eps_high", eps_high, low=0)
    if eps_low >= 1:
        raise ValueError(f"eps_low: expected a number in [0, 1), got {eps_low!r}")
    dual_clip = _check_number("dual_clip", dual_clip, low=0)
    if 0 < dual_clip <= 1:
        raise ValueError(f"dual_clip: expected 0 (off) or a number > 1, got {dual_clip!r}")
    clamp = _check_number("log_ratio_clamp", log_ratio_clamp, low=0, strict=True)
    tis_cap = _check_number("tis_cap", tis_cap, low=0)

    log_ratio_BT = torch.clamp(logprobs_BT - old_BT, -clamp, clamp)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * torch.clamp(ratio_BT, 1.0 - eps_low, 1.0 + eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    negative_BT = advantages_BT < 0
    dual_BT = torch.zeros_like(valid_BT)
    if dual_clip > 0:
        floor_BT = -advantages_BT * dual_clip
        dual_BT = negative_BT & (floor_BT < loss_BT)
        loss_BT = torch.where(negative_BT, torch.minimum(loss_BT, floor_BT), loss_BT)
    metrics: dict[str, float] = {}
    if tis_cap > 0:
        loss_BT, metrics = _apply_tis(loss_BT, old_BT, rollout_logprobs, valid_BT, tis_cap)
    loss = aggregate(loss_BT, valid_BT, agg, num_tokens=num_tokens, num_samples=num_samples)

    ratio_d_BT = ratio_BT.detach()
    metrics.update(
        {
            "tppo/pg_loss": float(loss.detach()),
            "tppo/clip_fraction": _masked_mean((clipped_BT > unclipped_BT).float(), valid_BT),
            "tppo/clip_fraction_low": _masked_mean(
                (negative_BT & (ratio_d_BT < 1.0 - eps_low)).float(), valid_BT
            ),
            "tppo/clip_fraction_high": _masked_mean(
                ((advantages_BT > 0) & (ratio_d_BT > 1.0 + eps_high)).float(), valid_BT
            ),
            "tppo/dual_clip_fraction": _masked_mean(dual_BT.float(), valid_BT),
            "tppo/approx_kl": _masked_mean(ratio_d_BT - 1.0 - log_ratio_BT.detach(), valid_BT),
            "tppo/ratio_mean": _masked_mean(ratio_d_BT, valid_BT),
            "tppo/ratio_min": -_masked_max(-ratio_d_BT, valid_BT),
            "tppo/ratio_max": _masked_max(ratio_d_BT, valid_BT),
        }
    )
    return LossResult(loss, metrics)


def _apply_tis(
    loss_BT: Tensor, old_BT: Tensor, rollout_logprobs: Tensor | None, valid_BT: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """Scale each token's loss by the truncated importance weight min(exp(old - rollout), cap)."""
    if rollout_logprobs is None:
        raise ValueError("rollout_logprobs: required when tis_cap > 0")
    rollout_BT = _check_float("rollout_logprobs", rollout_logprobs, tuple(valid_BT.shape)).detach()
    raw_BT = torch.exp(torch.clamp(old_BT - rollout_BT, max=math.log(cap) + 1.0))
    weight_BT = torch.clamp(raw_BT, max=cap)
    metrics = {
        "tppo/tis_weight_mean": _masked_mean(weight_BT, valid_BT),
        "tppo/tis_clip_fraction": _masked_mean((raw_BT > cap).float(), valid_BT),
    }
    return loss_BT * weight_BT, metrics


def mismatch_metrics(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """Training/inference mismatch of the same tokens' log-probs (trainer vs rollout engine).

    tppo/mismatch_abs_diff      = mean |logp_trainer - logp_rollout|
    tppo/mismatch_abs_diff_max  = max  |logp_trainer - logp_rollout|
    tppo/mismatch_k3            = mean (rho - 1 - log rho),  rho = exp(logp_trainer - logp_rollout)
                                  (k3 estimate of KL(rollout || trainer) on the rollout's samples)
    """
    valid_BT = _check_mask(mask)
    shape = tuple(valid_BT.shape)
    trainer_BT = _check_float("trainer_logprobs", trainer_logprobs, shape).detach()
    rollout_BT = _check_float("rollout_logprobs", rollout_logprobs, shape).detach()
    log_rho_BT = torch.clamp(trainer_BT - rollout_BT, -20.0, 20.0)
    return {
        "tppo/mismatch_abs_diff": _masked_mean(log_rho_BT.abs(), valid_BT),
        "tppo/mismatch_abs_diff_max": _masked_max(log_rho_BT.abs(), valid_BT),
        "tppo/mismatch_k3": _masked_mean(torch.exp(log_rho_BT) - 1.0 - log_rho_BT, valid_BT),
    }


# ----------------------------------------------------------------------------------------------------------------
# Critic.


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_low: float | None = 0.5,
    clip_high: float | None = 0.6,
    agg: str = "sample_mean",
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> LossResult:
    """Value loss with asymmetric value clipping, per-sample token mean then mean over samples by default.

        L = 0.5 * max((V - G)^2, (clip(V, V_old - clip_low, V_old + clip_high) - G)^2)
        loss = aggregate(L, mask, agg)       (clip_low = clip_high = None: L = 0.5 (V - G)^2)

    Args:
        values: [B, T] the critic's values V (with gradient); old_values: [B, T] V_old (stored at generation time
            or recomputed); returns: [B, T] targets G (Monte-Carlo returns); mask: [B, T] 0/1 tokens trained on.

    Metrics: critic/vf_loss, critic/vf_clip_fraction (tokens whose clipped term is the larger one),
    critic/values_mean, critic/returns_mean, critic/explained_variance (1 - Var(G - V) / Var(G); NaN if Var(G) = 0).
    """
    valid_BT = _check_mask(mask)
    shape = tuple(valid_BT.shape)
    values_BT = _check_float("values", values, shape)
    old_BT = _check_float("old_values", old_values, shape).detach()
    returns_BT = _check_float("returns", returns, shape).detach()
    if (clip_low is None) != (clip_high is None):
        raise ValueError("clip_low, clip_high: give both (clipping) or neither (no clipping)")
    error_BT = (values_BT - returns_BT) ** 2
    clip_fraction = 0.0
    if clip_low is not None and clip_high is not None:
        low = _check_number("clip_low", clip_low, low=0)
        high = _check_number("clip_high", clip_high, low=0)
        clipped_V_BT = torch.clamp(values_BT, old_BT - low, old_BT + high)
        clipped_error_BT = (clipped_V_BT - returns_BT) ** 2
        clip_fraction = _masked_mean((clipped_error_BT > error_BT).float(), valid_BT)
        error_BT = torch.maximum(error_BT, clipped_error_BT)
    loss = aggregate(0.5 * error_BT, valid_BT, agg, num_tokens=num_tokens, num_samples=num_samples)
    metrics = {
        "critic/vf_loss": float(loss.detach()),
        "critic/vf_clip_fraction": clip_fraction,
        "critic/values_mean": _masked_mean(values_BT, valid_BT),
        "critic/returns_mean": _masked_mean(returns_BT, valid_BT),
        "critic/explained_variance": _explained_variance(values_BT.detach(), returns_BT, valid_BT),
    }
    return LossResult(loss, metrics)


def _explained_variance(values_BT: Tensor, returns_BT: Tensor, valid_BT: Tensor) -> float:
    """1 - Var(G - V) / Var(G) over the valid tokens (population variances); NaN when Var(G) = 0."""
    if not bool(valid_BT.any()):
        return float("nan")
    returns_N = returns_BT[valid_BT].double()
    residual_N = returns_N - values_BT[valid_BT].double()
    var_returns = float(returns_N.var(unbiased=False))
    if var_returns == 0.0:
        return float("nan")
    return 1.0 - float(residual_N.var(unbiased=False)) / var_returns


# ----------------------------------------------------------------------------------------------------------------
# Auxiliary losses: positive-example LM, KL to a reference, entropy.


def pos_lm_loss(
    logprobs: Tensor,
    mask: Tensor,
    positive: Tensor,
    *,
    agg: str = "token_mean",
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> LossResult:
    """VAPO's positive-example LM loss: NLL of the tokens of positive (finished, R > 0) responses.

        L[b, t] = -logp[b, t]   on tokens with mask[b, t] and positive[b]
        loss = aggregate(L, mask * positive, agg)     (num_tokens: positive tokens of the whole batch)

    Returns 0 (with a graph) when no token is positive. Metrics: tppo/pos_lm_loss, tppo/pos_lm_num_tokens.
    """
    valid_BT = _check_mask(mask)
    logprobs_BT = _check_float("logprobs", logprobs, tuple(valid_BT.shape))
    if not isinstance(positive, Tensor) or positive.shape != (valid_BT.shape[0],):
        raise ValueError(f"positive: expected a tensor of shape [{valid_BT.shape[0]}]")
    positive_B = positive.bool() if positive.dtype != torch.bool else positive
    selected_BT = valid_BT & positive_B.unsqueeze(1)
    loss = aggregate(-logprobs_BT, selected_BT, agg, num_tokens=num_tokens, num_samples=num_samples)
    metrics = {"tppo/pos_lm_loss": float(loss.detach()), "tppo/pos_lm_num_tokens": float(selected_BT.sum())}
    return LossResult(loss, metrics)


KLEstimator = Callable[[Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = x = log(pi / pi_ref) (unbiased for KL(pi || pi_ref) on pi's samples; can be negative per token)."""
    return log_ratio


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = pi_ref / pi - 1 - log(pi_ref / pi) = exp(-x) - 1 + x with x = log(pi / pi_ref) (unbiased, >= 0)."""
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", log_ratio_clamp: float = 20.0
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi, [B, T].

    x = clamp(logp - logp_ref, -log_ratio_clamp, log_ratio_clamp);   k1 = x;   k3 = exp(-x) - 1 + x
    """
    logprobs_T = _check_float("logprobs", logprobs, None)
    ref_T = _check_float("ref_logprobs", ref_logprobs, tuple(logprobs_T.shape)).detach()
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator: expected one of {KL_ESTIMATORS.names()}, got {estimator!r}")
    clamp = _check_number("log_ratio_clamp", log_ratio_clamp, low=0, strict=True)
    log_ratio_T = torch.clamp(logprobs_T - ref_T, -clamp, clamp)
    return KL_ESTIMATORS.get(estimator)(log_ratio_T)


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    estimator: str = "k3",
    agg: str = "token_mean",
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> LossResult:
    """KL penalty to a reference policy: aggregate(kl_penalty(logp, logp_ref, estimator), mask, agg).

    The caller adds kl_coef * loss. Metric: tppo/kl (token mean over this call's valid tokens).
    """
    valid_BT = _check_mask(mask)
    _check_float("logprobs", logprobs, tuple(valid_BT.shape))
    kl_BT = kl_penalty(logprobs, ref_logprobs, estimator)
    loss = aggregate(kl_BT, valid_BT, agg, num_tokens=num_tokens, num_samples=num_samples)
    return LossResult(loss, {"tppo/kl": _masked_mean(kl_BT, valid_BT)})


def logprobs_from_logits(logits: Tensor, token_ids: Tensor) -> Tensor:
    """log softmax(logits)[token]: [B, T, V] logits and [B, T] ids -> [B, T] log-probs."""
    logits_BTV = _check_float("logits", logits, None)
    if logits_BTV.dim() != 3 or not isinstance(token_ids, Tensor) or token_ids.shape != logits_BTV.shape[:2]:
        raise ValueError(f"token_ids: expected shape {list(logits_BTV.shape[:2])} matching logits [B, T, V]")
    log_probs_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return log_probs_BTV.gather(-1, token_ids.long().unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax of each position's logits, [B, T, V] -> [B, T].

    H = logsumexp(z) - sum_v softmax(z)_v z_v
    """
    logits_BTV = _check_float("logits", logits, None).float()
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs_BTV * logits_BTV).sum(dim=-1)


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    *,
    agg: str = "token_mean",
    num_tokens: float | int | Tensor | None = None,
    num_samples: float | int | Tensor | None = None,
) -> LossResult:
    """The mean entropy to maximise: aggregate(H, mask, agg). The caller SUBTRACTS entropy_coef * loss.

    Metric: tppo/entropy (token mean over this call's valid tokens).
    """
    valid_BT = _check_mask(mask)
    entropy_BT = _check_float("entropy", entropy, tuple(valid_BT.shape))
    bonus = aggregate(entropy_BT, valid_BT, agg, num_tokens=num_tokens, num_samples=num_samples)
    return LossResult(bonus, {"tppo/entropy": _masked_mean(entropy_BT, valid_BT)})
