"""The losses against token-by-token references, closed forms and autograd checks (tppo/algo/losses.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tppo.algo.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate,
    clipped_value_loss,
    entropy_bonus,
    entropy_from_logits,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    mismatch_metrics,
    pos_lm_loss,
    ppo_clip_loss,
)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------------------------------------------------------
# References.


def ref_ppo_token(logp, old, adv, eps_low, eps_high, dual_clip, clamp, w):
    log_ratio = min(max(logp - old, -clamp), clamp)
    ratio = math.exp(log_ratio)
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - eps_low), 1 + eps_high))
    if dual_clip > 0 and adv < 0:
        loss = min(loss, -adv * dual_clip)
    return loss * w


def ref_aggregate(per_token, mask, mode, num_tokens=None, num_samples=None):
    if mode == "token_mean":
        total = sum(x for row, m in zip(per_token, mask) for x, v in zip(row, m) if v)
        count = num_tokens if num_tokens is not None else sum(sum(m) for m in mask)
        return total / max(count, 1)
    rows = [[x for x, v in zip(row, m) if v] for row, m in zip(per_token, mask)]
    means = [sum(r) / len(r) for r in rows if r]
    count = num_samples if num_samples is not None else len(means)
    return sum(means) / max(count, 1)


@st.composite
def token_batches(draw, max_rows=4, max_tokens=8):
    """Random [B, T] log-probs, old log-probs, advantages and a mask with holes (not necessarily right-padded)."""
    B = draw(st.integers(1, max_rows))
    T = draw(st.integers(1, max_tokens))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    old = -rng.exponential(size=(B, T))
    logp = old + rng.normal(scale=draw(st.sampled_from([0.05, 0.5, 3.0])), size=(B, T))
    adv = rng.normal(scale=2.0, size=(B, T))
    mask = rng.random((B, T)) < draw(st.floats(0.2, 1.0))
    rollout = old + rng.normal(scale=0.5, size=(B, T))
    return logp, old, adv, mask, rollout


# ---------------------------------------------------------------------------------------------------------------
# Policy loss.


@SETTINGS
@given(
    token_batches(),
    st.sampled_from(["token_mean", "sample_mean"]),
    st.sampled_from([0.0, 3.0]),
    st.sampled_from([0.0, 2.0]),
    st.floats(0.05, 0.3),
    st.floats(0.05, 0.4),
)
def test_ppo_clip_matches_loop(batch, agg, dual_clip, tis_cap, eps_low, eps_high):
    logp, old, adv, mask, rollout = batch
    B, T = logp.shape
    result = ppo_clip_loss(
        torch.tensor(logp),
        torch.tensor(old),
        torch.tensor(adv),
        torch.tensor(mask),
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        log_ratio_clamp=2.0,
        rollout_logprobs=torch.tensor(rollout),
        tis_cap=tis_cap,
        agg=agg,
    )
    per_token = [
        [
            ref_ppo_token(
                logp[b, t],
                old[b, t],
                adv[b, t],
                eps_low,
                eps_high,
                dual_clip,
                2.0,
                min(math.exp(old[b, t] - rollout[b, t]), tis_cap) if tis_cap else 1.0,
            )
            for t in range(T)
        ]
        for b in range(B)
    ]
    want = ref_aggregate(per_token, mask.tolist(), agg)
    assert math.isclose(result.loss.item(), want, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(result.metrics["tppo/pg_loss"], want, rel_tol=1e-9, abs_tol=1e-12)
    clipped = [
        -adv[b, t] * min(max(math.exp(min(max(logp[b, t] - old[b, t], -2), 2)), 1 - eps_low), 1 + eps_high)
        > -adv[b, t] * math.exp(min(max(logp[b, t] - old[b, t], -2), 2))
        for b in range(B)
        for t in range(T)
        if mask[b, t]
    ]
    want_fraction = sum(clipped) / len(clipped) if clipped else 0.0
    assert math.isclose(result.metrics["tppo/clip_fraction"], want_fraction, abs_tol=1e-12)
    assert all(isinstance(v, float) for v in result.metrics.values())


@SETTINGS
@given(token_batches(max_rows=6), st.integers(1, 5), st.sampled_from(["token_mean", "sample_mean"]))
def test_mini_batches_sum_to_the_batch_loss(batch, num_splits, agg):
    """With the batch-level denominator, the mini-batch losses (and gradients) add up to the whole batch's."""
    logp, old, adv, mask, _ = batch
    B = logp.shape[0]
    mask_t = torch.tensor(mask)
    num_tokens = int(mask_t.sum())
    num_samples = int((mask_t.sum(1) > 0).sum())

    def run(rows):
        logp_t = torch.tensor(logp[rows], requires_grad=True)
        loss = ppo_clip_loss(
            logp_t,
            torch.tensor(old[rows]),
            torch.tensor(adv[rows]),
            mask_t[rows],
            agg=agg,
            num_tokens=num_tokens,
            num_samples=num_samples,
        ).loss
        loss.backward()
        return float(loss.detach()), logp_t.grad

    whole, whole_grad = run(list(range(B)))
    parts = np.array_split(np.arange(B), min(num_splits, B))
    results = [run(list(p)) for p in parts]
    assert math.isclose(sum(r[0] for r in results), whole, rel_tol=1e-9, abs_tol=1e-12)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), whole_grad, rtol=1e-9, atol=1e-12)


def _grad(logp, old, adv, **kwargs):
    logp_t = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    result = ppo_clip_loss(
        logp_t,
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.ones(1, len(logp[0])),
        **kwargs,
    )
    result.loss.backward()
    return result, logp_t.grad[0].tolist()


def test_clip_higher_gradients():
    """Gradient -A r / n inside the trust region; 0 where the clipped (constant) term wins."""
    log = math.log
    # ratio 1.1 (inside), 1.5 with A > 0 (above 1 + eps_high = 1.28: clipped), 1.25 with A > 0 (inside the
    # asymmetric region 1.2 < r < 1.28), 0.7 with A < 0 (below 1 - eps_low: clipped), 0.7 with A > 0 (unclipped)
    ratios = [1.1, 1.5, 1.25, 0.7, 0.7]
    adv = [[1.0, 2.0, 1.0, -1.0, 1.0]]
    result, grad = _grad([[log(r) for r in ratios]], [[0.0] * 5], adv, dual_clip=0.0)
    n = 5
    want = [-1.0 * 1.1 / n, 0.0, -1.0 * 1.25 / n, 0.0, -1.0 * 0.7 / n]
    assert np.allclose(grad, want, atol=1e-12)
    assert math.isclose(result.metrics["tppo/clip_fraction"], 2 / 5)
    assert math.isclose(result.metrics["tppo/clip_fraction_high"], 1 / 5)
    assert math.isclose(result.metrics["tppo/clip_fraction_low"], 1 / 5)


def test_dual_clip_bounds_negative_advantages():
    """A < 0 and r > c: the loss is -A c with zero gradient; 1 + eps_high < r < c: the unclipped -A r."""
    log = math.log
    ratios = [20.0, 5.0]
    result, grad = _grad([[log(r) for r in ratios]], [[0.0, 0.0]], [[-2.0, -2.0]], dual_clip=10.0)
    assert math.isclose(result.loss.item(), (2.0 * 10.0 + 2.0 * 5.0) / 2, rel_tol=1e-12)
    assert np.allclose(grad, [0.0, 2.0 * 5.0 / 2], atol=1e-12)
    assert math.isclose(result.metrics["tppo/dual_clip_fraction"], 0.5)
    # without dual clip the first token's loss is unbounded in r
    off, _ = _grad([[log(r) for r in ratios]], [[0.0, 0.0]], [[-2.0, -2.0]], dual_clip=0.0)
    assert math.isclose(off.loss.item(), (2.0 * 20.0 + 2.0 * 5.0) / 2, rel_tol=1e-12)


def test_log_ratio_clamp_keeps_the_loss_finite():
    result, grad = _grad(
        [[500.0, -500.0]], [[0.0, 0.0]], [[1.0, 1.0]], dual_clip=0.0, eps_high=1e9, eps_low=0.0
    )
    assert math.isfinite(result.loss.item())
    # token 0: r = e^20 (clamped); token 1: r = e^-20, and with eps_low = 0 the unclipped -r is the larger term
    assert math.isclose(result.loss.item(), -(math.exp(20.0) + math.exp(-20.0)) / 2, rel_tol=1e-9)
    assert grad == [0.0, 0.0]  # the clamp is flat there


def test_tis_weights_are_truncated_constants():
    logp = [[math.log(1.1), math.log(1.1)]]
    old = [[0.0, 0.0]]
    rollout = torch.tensor([[-2.0, 0.1]], dtype=torch.float64)  # weights e^2 -> capped at 2, e^-0.1
    logp_t = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    result = ppo_clip_loss(
        logp_t,
        torch.tensor(old, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        torch.ones(1, 2),
        rollout_logprobs=rollout,
        tis_cap=2.0,
    )
    result.loss.backward()
    weights = [2.0, math.exp(-0.1)]
    assert math.isclose(result.loss.item(), sum(-1.1 * w for w in weights) / 2, rel_tol=1e-12)
    assert np.allclose(logp_t.grad[0].tolist(), [-1.1 * w / 2 for w in weights], atol=1e-12)
    assert math.isclose(result.metrics["tppo/tis_clip_fraction"], 0.5)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        ppo_clip_loss(logp_t, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), tis_cap=2.0)


def test_approx_kl_and_ratio_metrics():
    logp = torch.tensor([[0.1, -0.2, 5.0]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    metrics = ppo_clip_loss(logp, old, torch.ones(1, 3), mask).metrics
    want_kl = sum(math.exp(x) - 1 - x for x in (0.1, -0.2)) / 2
    assert math.isclose(metrics["tppo/approx_kl"], want_kl, rel_tol=1e-5)
    assert math.isclose(metrics["tppo/ratio_max"], math.exp(0.1), rel_tol=1e-6)
    assert math.isclose(metrics["tppo/ratio_min"], math.exp(-0.2), rel_tol=1e-6)  # the masked 5.0 is not seen


# ---------------------------------------------------------------------------------------------------------------
# Value loss.


@SETTINGS
@given(
    token_batches(), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.sampled_from(["sample_mean", "token_mean"])
)
def test_value_loss_matches_loop(batch, low, high, agg):
    values, old, returns, mask, _ = batch
    B, T = values.shape
    result = clipped_value_loss(
        torch.tensor(values),
        torch.tensor(old),
        torch.tensor(returns),
        torch.tensor(mask),
        clip_low=low,
        clip_high=high,
        agg=agg,
    )
    per_token = [
        [
            0.5
            * max(
                (values[b, t] - returns[b, t]) ** 2,
                (min(max(values[b, t], old[b, t] - low), old[b, t] + high) - returns[b, t]) ** 2,
            )
            for t in range(T)
        ]
        for b in range(B)
    ]
    want = ref_aggregate(per_token, mask.tolist(), agg)
    assert math.isclose(result.loss.item(), want, rel_tol=1e-9, abs_tol=1e-12)


def test_value_clipping_is_asymmetric_with_the_right_gradients():
    values = torch.tensor([[1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    returns = torch.tensor([[2.0, 0.0]], dtype=torch.float64)
    result = clipped_value_loss(values, old, returns, torch.ones(1, 2), clip_low=0.5, clip_high=0.6)
    # token 0: V clipped to 0.6, (0.6-2)^2 = 1.96 > (1-2)^2 = 1: the constant clipped term, gradient 0
    # token 1: V clipped to -0.5, (-0.5)^2 = 0.25 < 1: the unclipped term, gradient (V - G) / 2 tokens
    assert math.isclose(result.loss.item(), (0.5 * 1.96 + 0.5 * 1.0) / 2, rel_tol=1e-12)
    result.loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, -1.0 / 2])
    assert result.metrics["critic/vf_clip_fraction"] == 0.5


def test_value_loss_is_per_sample_then_mean_over_samples():
    values = torch.zeros(2, 4)
    returns = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    result = clipped_value_loss(values, values, returns, mask, clip_low=None, clip_high=None)
    assert math.isclose(result.loss.item(), (0.5 * 1.0 + 0.5 * 4.0) / 2)
    # a mini-batch of one sample with the batch's sample count
    half = clipped_value_loss(
        values[:1], values[:1], returns[:1], mask[:1], clip_low=None, clip_high=None, num_samples=2
    )
    assert math.isclose(float(half.loss), 0.5 / 2)


def test_explained_variance():
    returns = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    perfect = clipped_value_loss(returns.clone(), returns, returns, torch.ones(1, 4)).metrics
    assert perfect["critic/explained_variance"] == 1.0
    blind = clipped_value_loss(torch.zeros(1, 4), torch.zeros(1, 4), returns, torch.ones(1, 4)).metrics
    assert blind["critic/explained_variance"] == 0.0
    flat = clipped_value_loss(
        torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    ).metrics
    assert math.isnan(flat["critic/explained_variance"])


# ---------------------------------------------------------------------------------------------------------------
# Positive LM loss, KL, entropy.


def test_pos_lm_loss_is_nll_of_positive_rows():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0], [-7.0, -8.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    positive = torch.tensor([True, False, True])
    result = pos_lm_loss(logp, mask, positive)
    assert math.isclose(result.loss.item(), (1 + 2 + 7 + 8 + 9) / 5, rel_tol=1e-6)
    assert result.metrics["tppo/pos_lm_num_tokens"] == 5.0
    result.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.2, -0.2, 0], [0, 0, 0], [-0.2, -0.2, -0.2]]))
    none = pos_lm_loss(logp, mask, torch.zeros(3, dtype=torch.bool))
    assert none.loss.item() == 0.0 and none.loss.requires_grad


def test_kl_estimators_closed_form():
    logp = torch.tensor([[0.3, -1.0]])
    ref = torch.tensor([[0.1, -0.5]])
    x = logp - ref
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), x)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(-x) - 1 + x)
    assert bool((kl_penalty(torch.randn(4, 5), torch.randn(4, 5), "k3") >= 0).all())
    assert float(kl_penalty(logp, logp, "k3").abs().max()) == 0.0


def test_kl_estimators_are_unbiased_on_policy_samples():
    """E_{a ~ pi}[k] = KL(pi || pi_ref) for k1 and k3 (Monte Carlo over a categorical distribution)."""
    gen = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(6, generator=gen), 0).double()
    ref = torch.softmax(torch.randn(6, generator=gen), 0).double()
    exact = float((pi * (pi.log() - ref.log())).sum())
    actions = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    logp, ref_logp = pi.log()[actions].view(1, -1), ref.log()[actions].view(1, -1)
    for name in ("k1", "k3"):
        estimate = float(kl_loss(logp, ref_logp, torch.ones_like(logp), estimator=name).loss)
        assert abs(estimate - exact) < 0.01, (name, estimate, exact)


def test_entropy_matches_torch_distributions():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    want = torch.distributions.Categorical(logits=logits).entropy().float()
    torch.testing.assert_close(entropy_from_logits(logits), want)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    bonus = entropy_bonus(want, mask)
    assert math.isclose(float(bonus.loss), float(want[mask.bool()].sum()) / 3, rel_tol=1e-6)
    assert math.isclose(bonus.metrics["tppo/entropy"], float(bonus.loss), rel_tol=1e-6)


def test_logprobs_from_logits():
    logits = torch.randn(2, 3, 5)
    ids = torch.randint(0, 5, (2, 3))
    want = torch.distributions.Categorical(logits=logits).log_prob(ids)
    torch.testing.assert_close(logprobs_from_logits(logits, ids), want)


def test_mismatch_metrics():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0]])
    metrics = mismatch_metrics(trainer, rollout, torch.tensor([[1, 1, 0]]))
    assert math.isclose(metrics["tppo/mismatch_abs_diff"], 0.25)
    assert math.isclose(metrics["tppo/mismatch_abs_diff_max"], 0.5)
    assert math.isclose(metrics["tppo/mismatch_k3"], (math.exp(0.5) - 1 - 0.5) / 2, rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Aggregation, registries, bad input.


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0]])
    assert float(aggregate(loss, mask, "token_mean")) == pytest.approx(12 / 3)
    assert float(aggregate(loss, mask, "token_mean", num_tokens=10)) == pytest.approx(12 / 10)
    assert float(aggregate(loss, mask, "sample_mean")) == pytest.approx((2 + 8) / 2)
    assert float(aggregate(loss, mask, "sample_mean", num_samples=4)) == pytest.approx((2 + 8) / 4)
    assert float(aggregate(loss, torch.zeros(3, 3), "token_mean")) == 0.0
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate(loss, mask, "token_mean", num_tokens=2)
    with pytest.raises(ValueError, match="num_samples"):
        aggregate(loss, mask, "sample_mean", num_samples=1)
    with pytest.raises(ValueError, match="mode"):
        aggregate(loss, mask, "seq_sum")


def test_registries():
    assert set(KL_ESTIMATORS.names()) == {"k1", "k3"}
    assert set(LOSS_AGGREGATIONS.names()) == {"token_mean", "sample_mean"}


def test_bad_input_names_the_argument():
    ok = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        ppo_clip_loss(ok, torch.zeros(2, 4), ok, torch.ones(2, 3))
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(ok, ok, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        ppo_clip_loss(ok, ok, ok, torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(ok, ok, ok, torch.ones(2, 3), dual_clip=0.5)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_clip_loss(ok, ok, ok, torch.ones(2, 3), eps_low=1.0)
    with pytest.raises(ValueError, match="returns"):
        clipped_value_loss(ok, ok, torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="clip_low"):
        clipped_value_loss(ok, ok, ok, torch.ones(2, 3), clip_low=None)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(ok, ok, "k9")
    with pytest.raises(ValueError, match="positive"):
        pos_lm_loss(ok, torch.ones(2, 3), torch.ones(3))
