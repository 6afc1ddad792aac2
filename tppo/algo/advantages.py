"""Advantage estimators of T-PPO (EGAE) and its relatives, and the post-processing of policy advantages.

Every estimator is a pure function of tensors with its formula in the docstring (specs/tppo.md):

- `egae`: Extended GAE over the tokens of the CURRENT window. Finished rows get ordinary GAE (terminal value 0);
  rows cut at the window's end bootstrap with the last known value V(s_l) := V(s_{l-1}) (the paper's
  `repeat_last`) or with a value the caller supplies (`exact`, our option).
- `gae`: plain GAE, every row finished. `mc_returns`: discounted returns (the critic's targets, lambda = 1).
- `length_adaptive_lambda` (VAPO) and `expected_lengths` (the port's guess of an unfinished response's length).
- `grpo_advantages`: group-normalised outcome rewards.
- post-processing: `apply_tail_mask`, `whiten_advantages`, `clamp_advantages`, and `postprocess_advantages`
  that chains them in the port's order; `overlong_penalty` is DAPO's length shaping of rewards.

The estimators selectable by config (`AlgoConfig.estimator`) are registered in `ADVANTAGE_ESTIMATORS` as adapters
that take one typed `AdvantageInputs` record.

Departures and readings of ours: discounted sums are computed with a log-depth doubling scan (vectorised over
rows and tokens) instead of a token-by-token reverse loop; rewards at padded positions are ignored; a fully
padded row gets zero advantages; GRPO uses the unbiased group standard deviation and gives a group of one a zero
advantage (there is no baseline to compare with).

Legend of tensor suffixes: B rows (responses), T tokens of the window (or of the response for `mc_returns`),
N samples (GRPO: one scalar reward each).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tppo.base.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "BOOTSTRAP_MODES",
    "AdvantageInputs",
    "apply_tail_mask",
    "clamp_advantages",
    "egae",
    "expected_lengths",
    "gae",
    "grpo_advantages",
    "length_adaptive_lambda",
    "mc_returns",
    "overlong_penalty",
    "postprocess_advantages",
    "tail_keep_mask",
    "whiten_advantages",
]

BOOTSTRAP_MODES = ("repeat_last", "exact")


# ----------------------------------------------------------------------------------------------------------------
# Input checks (shared by every function here): each names the argument and what was expected.


def _check_tensor(name: str, x: object) -> Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (or numpy array), got {type(x).__name__}")
    return x


def _check_float(
    name: str,
    x: object,
    shape: tuple[int, ...] | None = None,
    finite: bool = True,
    like: str = "the shape of mask",
) -> Tensor:
    t = _check_tensor(name, x)
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)} ({like}), got {list(t.shape)}")
    if finite and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: contains NaN or inf")
    return t


def _check_binary(name: str, x: object, ndim: int) -> Tensor:
    """A 0/1 (or bool) tensor of `ndim` dimensions, returned as bool."""
    t = _check_tensor(name, x)
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {list(t.shape)}")
    if t.dtype != torch.bool:
        if t.is_complex() or bool(((t != 0) & (t != 1)).any()):
            raise ValueError(f"{name}: expected only 0/1 (or bool) entries")
        t = t != 0
    return t


def _check_right_padded(name: str, mask: object) -> Tensor:
    """A [B, T] 0/1 mask whose rows are a run of ones then zeros; returned as bool."""
    valid_BT = _check_binary(name, mask, 2)
    gaps_BT = valid_BT[:, 1:] & ~valid_BT[:, :-1]
    if bool(gaps_BT.any()):
        row = int(gaps_BT.any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"{name}: must be right-padded (each row ones then zeros); row {row} has a valid token "
            "after a padded one"
        )
    return valid_BT


def _check_unit(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name}: expected a number in [0, 1], got {value!r}")
    return float(value)


def _check_lam(lam: float | Tensor, num_rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """lambda as a [B, 1] tensor from a float or a [B] tensor, each in [0, 1]."""
    if isinstance(lam, Tensor):
        lam_B = _check_float("lam", lam, (num_rows,), like="one entry per row")
        if bool(((lam_B < 0) | (lam_B > 1)).any()):
            raise ValueError("lam: every entry must lie in [0, 1]")
        return lam_B.to(dtype=dtype, device=device).unsqueeze(1)
    return torch.full((num_rows, 1), _check_unit("lam", lam), dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# The scan behind every discounted sum.


def _reverse_discounted_cumsum(x_BT: Tensor, discount_B1: Tensor) -> Tensor:
    """y_t = sum_{k >= t} c^(k - t) x_k per row, with c = discount_B1 (broadcast over T).

    A doubling scan: after the pass with offset s, y_t holds the sum over [t, t + 2s); each pass is one vectorised
    update, so the whole sum takes ceil(log2 T) passes. c^s is squared from pass to pass (it may underflow to 0,
    which is exactly the vanishing tail).
    """
    y_BT = x_BT.clone()
    power_B1 = discount_B1
    num_tokens = x_BT.shape[1]
    offset = 1
    while offset < num_tokens:
        # the product is a new tensor, so the in-place add never reads what it has already overwritten
        y_BT[:, :-offset] += power_B1 * y_BT[:, offset:]
        power_B1 = power_B1 * power_B1
        offset *= 2
    return y_BT


# ----------------------------------------------------------------------------------------------------------------
# Estimators.


def egae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    finished: Tensor,
    gamma: float = 1.0,
    lam: float | Tensor = 0.95,
    bootstrap: str = "repeat_last",
    bootstrap_values: Tensor | None = None,
) -> Tensor:
    """Extended GAE (T-PPO) over the tokens of the current window; returns advantages [B, T], 0 where padded.

    With l_b = sum_t mask[b, t] valid tokens in row b (t = 0..l_b-1) and c_b = gamma * lam_b:

        V_next[b, t] = values[b, t+1]                      for t < l_b - 1
        V_next[b, l_b-1] = 0                                if finished[b]          (terminal)
                         = values[b, l_b-1]                  if bootstrap == "repeat_last"  (paper)
                         = bootstrap_values[b]               if bootstrap == "exact"
        delta[b, t] = rewards[b, t] + gamma * V_next[b, t] - values[b, t]
        A[b, t] = sum_{k=t}^{l_b-1} c_b^(k-t) delta[b, k]

    For an unfinished row with gamma = 1 and repeat_last, delta at the cut is 0 and
    A_t = sum_{k=t}^{l-2} lam^(k-t) (V_{k+1} - V_k): no reward enters a cut window.

    Args:
        rewards: [B, T] reward after token t (outcome reward: only on the last valid token of a finished row;
            entries at padded positions are ignored).
        values: [B, T] V(s_t), the critic's value of the state before token t of this window.
        mask: [B, T] valid tokens, right-padded (0/1 or bool).
        finished: [B] the response ended inside this window (EOS or its last allowed window).
        gamma: discount in [0, 1].
        lam: GAE lambda, a float or a [B] tensor (length-adaptive lambda per row), in [0, 1].
        bootstrap: "repeat_last" or "exact" (value after the last token of an unfinished row).
        bootstrap_values: [B], needed for "exact"; ignored for finished rows.
    """
    valid_BT = _check_right_padded("mask", mask)
    shape = tuple(valid_BT.shape)
    values_BT = _check_float("values", values, shape)
    rewards_BT = _check_float("rewards", rewards, shape)
    num_rows = shape[0]
    finished_B = _check_binary("finished", finished, 1)
    if finished_B.shape[0] != num_rows:
        raise ValueError(f"finished: expected shape [{num_rows}], got {list(finished_B.shape)}")
    gamma = _check_unit("gamma", gamma)
    lam_B1 = _check_lam(lam, num_rows, values_BT.dtype, values_BT.device)
    tail_B = _tail_values(values_BT, valid_BT, finished_B, bootstrap, bootstrap_values)
    if shape[1] == 0:
        return values_BT.new_zeros(shape)
    lengths_B = valid_BT.sum(dim=1)
    positions_T = torch.arange(shape[1], device=values_BT.device)
    is_last_BT = positions_T.unsqueeze(0) == (lengths_B - 1).unsqueeze(1)
    shifted_BT = torch.cat([values_BT[:, 1:], values_BT.new_zeros(num_rows, 1)], dim=1)
    next_values_BT = torch.where(is_last_BT, tail_B.unsqueeze(1), shifted_BT)
    zero = values_BT.new_zeros(())
    delta_BT = torch.where(valid_BT, rewards_BT + gamma * next_values_BT - values_BT, zero)
    advantages_BT = _reverse_discounted_cumsum(delta_BT, gamma * lam_B1)
    return torch.where(valid_BT, advantages_BT, zero)


def _tail_values(
    values_BT: Tensor, valid_BT: Tensor, finished_B: Tensor, bootstrap: str, bootstrap_values: Tensor | None
) -> Tensor:
    """The value after each row's last valid token: 0 when finished, else per `bootstrap`."""
    num_rows = values_BT.shape[0]
    if bootstrap == "repeat_last" and values_BT.shape[1] == 0:
        cut_B = values_BT.new_zeros(num_rows)
    elif bootstrap == "repeat_last":
        last_B = (valid_BT.sum(dim=1) - 1).clamp(min=0)
        cut_B = values_BT.gather(1, last_B.unsqueeze(1)).squeeze(1)
    elif bootstrap == "exact":
        if bootstrap_values is None:
            raise ValueError('bootstrap_values: required when bootstrap="exact"')
        cut_B = _check_float("bootstrap_values", bootstrap_values, (num_rows,), like="one entry per row")
        cut_B = cut_B.to(values_BT.dtype)
    else:
        raise ValueError(f"bootstrap: expected one of {BOOTSTRAP_MODES}, got {bootstrap!r}")
    return torch.where(finished_B.to(values_BT.device), values_BT.new_zeros(()), cut_B)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float | Tensor = 0.95
) -> Tensor:
    """Plain GAE: `egae` with every row finished (terminal value 0 after the last valid token).

    delta_t = r_t + gamma V_{t+1} - V_t  (V_l = 0),   A_t = sum_{k=t}^{l-1} (gamma lam)^(k-t) delta_k
    """
    valid_BT = _check_right_padded("mask", mask)
    finished_B = torch.ones(valid_BT.shape[0], dtype=torch.bool, device=valid_BT.device)
    return egae(rewards, values, valid_BT, finished_B, gamma=gamma, lam=lam)


def mc_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Monte-Carlo returns (the critic's targets: GAE with lambda = 1 of a finished response), [B, T].

        G_t = sum_{k=t}^{l-1} gamma^(k-t) r_k   (0 at padded positions)

    With gamma = 1 and an outcome reward R on the last token, every valid token's target is R.
    """
    valid_BT = _check_right_padded("mask", mask)
    rewards_BT = _check_float("rewards", rewards, tuple(valid_BT.shape))
    gamma = _check_unit("gamma", gamma)
    zero = rewards_BT.new_zeros(())
    discount_B1 = torch.full((valid_BT.shape[0], 1), gamma, dtype=rewards_BT.dtype, device=rewards_BT.device)
    returns_BT = _reverse_discounted_cumsum(torch.where(valid_BT, rewards_BT, zero), discount_B1)
    return torch.where(valid_BT, returns_BT, zero)


def length_adaptive_lambda(lengths: Tensor, alpha: float = 0.05, floor: float = 0.95) -> Tensor:
    """VAPO's length-adaptive lambda per response: lambda = max(floor, 1 - 1 / (alpha * L)).

    `lengths` [B] (integer or float, >= 0); L = 0 gives `floor`. Returns a float32 (or the input's float dtype)
    tensor [B].
    """
    lengths_B = _check_tensor("lengths", lengths)
    if lengths_B.dim() != 1:
        raise ValueError(f"lengths: expected a 1-D tensor [B], got shape {list(lengths_B.shape)}")
    lengths_B = lengths_B if lengths_B.is_floating_point() else lengths_B.to(torch.float32)
    if not bool(torch.isfinite(lengths_B).all()) or bool((lengths_B < 0).any()):
        raise ValueError("lengths: expected finite values >= 0")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"alpha: expected a number > 0, got {alpha!r}")
    floor = _check_unit("floor", floor)
    # L = 0 gives 1 - inf = -inf, which the floor replaces.
    return torch.clamp(1.0 - 1.0 / (alpha * lengths_B), min=floor)


def expected_lengths(num_generated: Tensor, finished: Tensor, window: int) -> Tensor:
    """The response length the policy's lambda uses (the port's guess): L = generated, + W/2 if unfinished.

    L_b = num_generated[b] + (0 if finished[b] else window / 2)
    """
    generated_B = _check_tensor("num_generated", num_generated)
    if generated_B.dim() != 1:
        raise ValueError(f"num_generated: expected a 1-D tensor [B], got shape {list(generated_B.shape)}")
    finished_B = _check_binary("finished", finished, 1)
    if finished_B.shape != generated_B.shape:
        raise ValueError(f"finished: expected shape {list(generated_B.shape)}, got {list(finished_B.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window: expected an integer >= 1, got {window!r}")
    extra_B = torch.where(finished_B, 0.0, window / 2.0)
    return generated_B.to(torch.float32) + extra_B


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """GRPO: each sample's outcome reward relative to its group, [N] (the same for all its tokens).

        A_i = (R_i - mean_{j in g(i)} R_j) / (std_{j in g(i)} R_j + eps)     (unbiased std)
        A_i = R_i - mean_{j in g(i)} R_j                                      if not normalize_std (Dr. GRPO)

    A group of one has no baseline: its advantage is 0. `group_ids` [N] are any integers.
    """
    rewards_N = _check_float("rewards", rewards)
    if rewards_N.dim() != 1:
        raise ValueError(f"rewards: expected a 1-D tensor [N], got shape {list(rewards_N.shape)}")
    group_ids_N = _check_tensor("group_ids", group_ids)
    if (
        group_ids_N.shape != rewards_N.shape
        or group_ids_N.is_floating_point()
        or group_ids_N.dtype == torch.bool
    ):
        raise ValueError(
            f"group_ids: expected an integer tensor of shape {list(rewards_N.shape)}, "
            f"got {group_ids_N.dtype} {list(group_ids_N.shape)}"
        )
    if not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps!r}")
    _, member_N = torch.unique(group_ids_N, return_inverse=True)
    num_groups = int(member_N.max()) + 1 if member_N.numel() else 0
    counts_G = torch.zeros(num_groups, dtype=rewards_N.dtype, device=rewards_N.device)
    counts_G.index_add_(0, member_N, torch.ones_like(rewards_N))
    sums_G = torch.zeros_like(counts_G).index_add_(0, member_N, rewards_N)
    centred_N = rewards_N - (sums_G / counts_G)[member_N]
    if not normalize_std:
        return centred_N
    squares_G = torch.zeros_like(counts_G).index_add_(0, member_N, centred_N * centred_N)
    std_G = torch.sqrt(squares_G / (counts_G - 1).clamp(min=1))
    return centred_N / (std_G[member_N] + eps)


def overlong_penalty(lengths: Tensor, max_length: int, buffer: int) -> Tensor:
    """DAPO's overlong reward shaping (added to the outcome reward), [N] float32.

        0                                   if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        -1                                  if L > L_max
    with L_max = max_length and L_cache = buffer.
    """
    lengths_N = _check_tensor("lengths", lengths)
    if lengths_N.dim() != 1:
        raise ValueError(f"lengths: expected a 1-D tensor [N], got shape {list(lengths_N.shape)}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length: expected an integer >= 1, got {max_length!r}")
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer < max_length:
        raise ValueError(f"buffer: expected an integer in (0, max_length={max_length}), got {buffer!r}")
    lengths_N = lengths_N.to(torch.float32)
    start = max_length - buffer
    ramp_N = (start - lengths_N) / buffer
    shaped_N = torch.where(lengths_N <= start, torch.zeros_like(lengths_N), ramp_N)
    return torch.where(lengths_N > max_length, torch.full_like(lengths_N, -1.0), shaped_N)


# ----------------------------------------------------------------------------------------------------------------
# Post-processing of policy advantages.


def _check_advantages_and_mask(advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    valid_BT = _check_binary("mask", mask, 2)
    advantages_BT = _check_float("advantages", advantages, tuple(valid_BT.shape))
    return advantages_BT, valid_BT


def tail_keep_mask(mask: Tensor, finished: Tensor, num_tail: int) -> Tensor:
    """The valid tokens that keep their advantage: mask without the last `num_tail` valid tokens of unfinished rows.

    keep[b, t] = mask[b, t] and (finished[b] or t < l_b - num_tail)      (mask right-padded)
    """
    valid_BT = _check_right_padded("mask", mask)
    finished_B = _check_binary("finished", finished, 1)
    if finished_B.shape[0] != valid_BT.shape[0]:
        raise ValueError(f"finished: expected shape [{valid_BT.shape[0]}], got {list(finished_B.shape)}")
    if isinstance(num_tail, bool) or not isinstance(num_tail, int) or num_tail < 0:
        raise ValueError(f"num_tail: expected an integer >= 0, got {num_tail!r}")
    lengths_B1 = valid_BT.sum(dim=1, keepdim=True)
    positions_1T = torch.arange(valid_BT.shape[1], device=valid_BT.device).unsqueeze(0)
    before_tail_BT = positions_1T < lengths_B1 - num_tail
    return valid_BT & (before_tail_BT | finished_B.unsqueeze(1))


def apply_tail_mask(advantages: Tensor, mask: Tensor, finished: Tensor, num_tail: int) -> Tensor:
    """Zero the advantage of the last `num_tail` valid tokens of every unfinished row (the port's tail mask).

    A'[b, t] = A[b, t] * keep[b, t]    with keep from `tail_keep_mask`
    """
    keep_BT = tail_keep_mask(mask, finished, num_tail)
    advantages_BT = _check_float("advantages", advantages, tuple(keep_BT.shape))
    return torch.where(keep_BT, advantages_BT, advantages_BT.new_zeros(()))


def whiten_advantages(advantages: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """Whiten over the valid tokens of the batch; padded positions become 0.

    mu = mean_{valid} A,  var = sum_{valid} (A - mu)^2 / (n - 1)   (n valid tokens; var = 0 if n < 2)
    A' = (A - mu) / sqrt(var + eps)        (or (A - mu) / sqrt(var + eps) + mu without `shift_mean`)
    """
    advantages_BT, valid_BT = _check_advantages_and_mask(advantages, mask)
    if not eps > 0:
        raise ValueError(f"eps: expected a number > 0, got {eps!r}")
    zero = advantages_BT.new_zeros(())
    count = valid_BT.sum()
    values_BT = torch.where(valid_BT, advantages_BT, zero)
    mean = values_BT.sum() / count.clamp(min=1)
    centred_BT = torch.where(valid_BT, advantages_BT - mean, zero)
    var = (centred_BT * centred_BT).sum() / (count - 1).clamp(min=1)
    whitened_BT = centred_BT * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened_BT = whitened_BT + mean
    return torch.where(valid_BT, whitened_BT, zero)


def clamp_advantages(advantages: Tensor, bound: float) -> Tensor:
    """Clamp every advantage to [-bound, bound] (bound > 0): A' = min(max(A, -bound), bound)."""
    advantages_BT = _check_float("advantages", advantages)
    if isinstance(bound, bool) or not isinstance(bound, int | float) or not bound > 0:
        raise ValueError(f"bound: expected a number > 0, got {bound!r}")
    return advantages_BT.clamp(min=-float(bound), max=float(bound))


def postprocess_advantages(
    advantages: Tensor,
    mask: Tensor,
    finished: Tensor,
    *,
    num_tail: int = 0,
    whiten: bool = True,
    clamp: float = 10.0,
) -> Tensor:
    """The port's post-processing of policy advantages: tail mask, whitening, clamp.

        keep = tail_keep_mask(mask, finished, num_tail)
        A' = clamp(whiten(A over keep), [-clamp, clamp]) on keep, 0 elsewhere

    Whitening runs over the kept tokens only, so masked tail tokens stay exactly 0. `clamp` = 0 disables clamping.
    """
    if isinstance(clamp, bool) or not isinstance(clamp, int | float) or not clamp >= 0:
        raise ValueError(f"clamp: expected a number >= 0 (0 disables), got {clamp!r}")
    keep_BT = tail_keep_mask(mask, finished, num_tail)
    advantages_BT = _check_float("advantages", advantages, tuple(keep_BT.shape))
    if whiten:
        advantages_BT = whiten_advantages(advantages_BT, keep_BT)
    if clamp > 0:
        advantages_BT = clamp_advantages(advantages_BT, clamp)
    return torch.where(keep_BT, advantages_BT, advantages_BT.new_zeros(()))


# ----------------------------------------------------------------------------------------------------------------
# The registry: one record in, advantages [B, T] out.


@dataclass
class AdvantageInputs:
    """What an estimator may read, for the rows of one training batch (current-window tensors [B, T]).

    `values_BT` is needed by the critic-based estimators; `group_ids_B` by GRPO; `bootstrap_values_B` by
    `bootstrap="exact"`. `lam` is a float or a [B] tensor (see `length_adaptive_lambda`).
    """

    rewards_BT: Tensor
    mask_BT: Tensor
    finished_B: Tensor
    values_BT: Tensor | None = None
    group_ids_B: Tensor | None = None
    gamma: float = 1.0
    lam: float | Tensor = 0.95
    bootstrap: str = "repeat_last"
    bootstrap_values_B: Tensor | None = None


AdvantageEstimator = Callable[[AdvantageInputs], Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _need_values(inputs: AdvantageInputs, estimator: str) -> Tensor:
    if inputs.values_BT is None:
        raise ValueError(f"values_BT: the {estimator} estimator needs the critic's values")
    return inputs.values_BT


@ADVANTAGE_ESTIMATORS.register("egae")
def egae_estimator(inputs: AdvantageInputs) -> Tensor:
    """T-PPO's EGAE over the current window (see `egae`)."""
    return egae(
        inputs.rewards_BT,
        _need_values(inputs, "egae"),
        inputs.mask_BT,
        inputs.finished_B,
        gamma=inputs.gamma,
        lam=inputs.lam,
        bootstrap=inputs.bootstrap,
        bootstrap_values=inputs.bootstrap_values_B,
    )


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_estimator(inputs: AdvantageInputs) -> Tensor:
    """Plain GAE (see `gae`); every row must be finished (no window cuts)."""
    finished_B = _check_binary("finished_B", inputs.finished_B, 1)
    if not bool(finished_B.all()):
        raise ValueError(
            "finished_B: the gae estimator needs every row finished (window >= max response length)"
        )
    return gae(
        inputs.rewards_BT, _need_values(inputs, "gae"), inputs.mask_BT, gamma=inputs.gamma, lam=inputs.lam
    )


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_estimator(inputs: AdvantageInputs) -> Tensor:
    """GRPO: the group-normalised outcome reward (R_b = sum_t rewards[b, t]) on every valid token of row b."""
    valid_BT = _check_right_padded("mask_BT", inputs.mask_BT)
    rewards_BT = _check_float(
        "rewards_BT", inputs.rewards_BT, tuple(valid_BT.shape), like="the shape of mask_BT"
    )
    finished_B = _check_binary("finished_B", inputs.finished_B, 1)
    if not bool(finished_B.all()):
        raise ValueError(
            "finished_B: the grpo estimator needs every row finished (window >= max response length)"
        )
    if inputs.group_ids_B is None:
        raise ValueError("group_ids_B: the grpo estimator needs the group id of every row")
    outcome_B = torch.where(valid_BT, rewards_BT, rewards_BT.new_zeros(())).sum(dim=1)
    advantages_B = grpo_advantages(outcome_B, inputs.group_ids_B)
    return torch.where(valid_BT, advantages_B.unsqueeze(1), rewards_BT.new_zeros(()))
