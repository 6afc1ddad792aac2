"""The policy objective's KL term against its closed form (k3 = exp(-x) - 1 + x, x = logp - logp_ref)."""

from __future__ import annotations

import pytest
import torch

from tppo.batching import PolicyTargets
from tppo.engine.batch import ForwardOutput, TrainBatch
from tppo.objectives import PolicyObjective


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
