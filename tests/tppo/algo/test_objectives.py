"""The policy objective against closed forms: its KL term (k3 = exp(-x) - 1 + x, k1 = x, x = logp - logp_ref) and
its token- or sample-mean aggregation over the micro-batches of a step."""

from __future__ import annotations

import pytest
import torch

from tppo.algo.batching import PolicyTargets
from tppo.algo.objectives import PolicyObjective
from tppo.engine.batch import ForwardOutput, TrainBatch


def _batch(logprobs_BT, ref_BT, mask_BT):
    zeros = torch.zeros_like(logprobs_BT)
    targets = PolicyTargets(
        window_mask_BT=mask_BT,
        advantages_BT=zeros,  # no policy gradient: the loss is the KL term alone
        old_logprobs_BT=logprobs_BT.clone(),
        rollout_logprobs_BT=logprobs_BT.clone(),
        response_mask_BT=mask_BT,
        positive_B=torch.zeros(logprobs_BT.shape[0]),
        ref_logprobs_BT=ref_BT,
    )
    return TrainBatch(input_ids_BT=torch.zeros_like(logprobs_BT, dtype=torch.long), payload=targets)


def test_kl_term_is_the_k3_token_mean_over_the_window():
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=g) * 3
    ref = -torch.rand(3, 5, generator=g) * 3
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    n = int(mask.sum())
    objective = PolicyObjective(num_window_tokens=n, num_positive_tokens=0, kl_coef=0.1)
    out = objective(ForwardOutput(logprobs_BT=logprobs), _batch(logprobs, ref, mask))
    x = (logprobs - ref)[mask.bool()]
    k3 = torch.exp(-x) - 1 + x
    assert float(out.loss_sum / out.denominator) == pytest.approx(0.1 * float(k3.mean()), rel=1e-5)
    assert out.metrics["tppo/kl"] == pytest.approx(float(k3.mean()), rel=1e-5)


def test_kl_without_reference_logprobs_is_an_error():
    logprobs = torch.zeros(1, 2)
    batch = _batch(logprobs, None, torch.ones(1, 2))
    with pytest.raises(ValueError, match="no reference log-probs"):
        PolicyObjective(num_window_tokens=2, num_positive_tokens=0, kl_coef=0.1)(
            ForwardOutput(logprobs_BT=logprobs), batch
        )


def test_kl_term_follows_the_configured_estimator():
    g = torch.Generator().manual_seed(1)
    logprobs, ref = -torch.rand(2, 4, generator=g) * 3, -torch.rand(2, 4, generator=g) * 3
    mask = torch.ones(2, 4)
    objective = PolicyObjective(num_window_tokens=8, num_positive_tokens=0, kl_coef=1.0, kl_estimator="k1")
    out = objective(ForwardOutput(logprobs_BT=logprobs), _batch(logprobs, ref, mask))
    assert float(out.loss_sum / out.denominator) == pytest.approx(float((logprobs - ref).mean()), rel=1e-5)


@pytest.mark.parametrize("loss_agg", ["token_mean", "sample_mean"])
def test_policy_gradient_aggregation_over_micro_batches_matches_the_whole_batch(loss_agg):
    """At ratio 1 the clipped loss of a token is -A: the step's loss, summed over micro-batches as the engine does
    (sum loss_sum / sum denominator), is the token mean or the per-sample mean of -A over the whole batch."""
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(5, 6, generator=g)
    mask = (torch.rand(5, 6, generator=g) > 0.4).float()
    mask[4] = 0.0  # a row without window tokens (a filler) counts in neither mean
    mask[0, 0] = 1.0
    logprobs = -torch.rand(5, 6, generator=g)
    rows = mask.sum(dim=1) > 0
    objective = PolicyObjective(
        num_window_tokens=int(mask.sum()),
        num_positive_tokens=0,
        num_window_samples=int(rows.sum()),
        loss_agg=loss_agg,
    )
    total, denominator = 0.0, 0
    for part in (slice(0, 2), slice(2, 5)):  # two micro-batches
        batch = _batch(logprobs[part], logprobs[part], mask[part])
        batch.payload.advantages_BT = adv[part]
        out = objective(ForwardOutput(logprobs_BT=logprobs[part]), batch)
        total, denominator = total + float(out.loss_sum), denominator + out.denominator
    per_token = -adv * mask
    if loss_agg == "token_mean":
        want = float(per_token.sum() / mask.sum())
    else:
        want = float((per_token.sum(dim=1)[rows] / mask.sum(dim=1)[rows]).mean())
    assert total / denominator == pytest.approx(want, rel=1e-5)


def test_entropy_is_reported_without_a_bonus_and_the_loss_ignores_it():
    logprobs, mask = -torch.rand(2, 4), torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 0]])
    entropy = torch.arange(8.0).view(2, 4)
    batch = _batch(logprobs, None, mask)
    plain = PolicyObjective(num_window_tokens=5, num_positive_tokens=0)
    with_entropy = plain(ForwardOutput(logprobs_BT=logprobs, entropy_BT=entropy), batch)
    without = plain(ForwardOutput(logprobs_BT=logprobs), batch)
    assert with_entropy.metrics["tppo/entropy"] == pytest.approx((0 + 1 + 4 + 5 + 6) / 5)
    assert float(with_entropy.loss_sum) == float(without.loss_sum) and "tppo/entropy" not in without.metrics
    bonus = PolicyObjective(num_window_tokens=5, num_positive_tokens=0, entropy_coef=0.5)
    out = bonus(ForwardOutput(logprobs_BT=logprobs, entropy_BT=entropy), batch)
    assert float(out.loss_sum - with_entropy.loss_sum) == pytest.approx(-0.5 * 16 / 5 * 5)


def test_old_logprobs_from_the_forward_give_the_policy_gradient_at_the_old_policy():
    """With old_from_forward the old log-probs are the forward's own, detached, whatever the batch carries: the
    ratio is 1, nothing clips, and the gradient is that of -A logp averaged over the window (closed form)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 6, generator=g)
    mask = (torch.rand(3, 6, generator=g) > 0.3).float()
    adv = torch.randn(3, 6, generator=g) * 3  # large enough that any ratio away from 1 would clip
    n = int(mask.sum())
    batch = _batch(torch.full((3, 6), -9.0), None, mask)  # stale old log-probs: must not be read
    batch.payload.advantages_BT = adv
    objective = PolicyObjective(
        num_window_tokens=n, num_positive_tokens=0, pos_lm_coef=0.0, old_from_forward=True
    )
    logprobs = torch.nn.functional.logsigmoid(logits.clone().requires_grad_())
    out = objective(ForwardOutput(logprobs_BT=logprobs), batch)
    (grad,) = torch.autograd.grad(out.loss_sum / n, logprobs)
    torch.testing.assert_close(grad, -adv * mask / n)
    assert out.metrics["tppo/ratio_max"] == 1.0 and out.metrics["tppo/clip_fraction"] == 0.0
