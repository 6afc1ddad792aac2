"""Per-token log-probs and entropy against torch's log_softmax of the tempered logits (one rank, no TP)."""

from __future__ import annotations

import pytest
import torch

from tppo.engine.logprobs import token_logprobs_entropy


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.6])
def test_logprobs_and_entropy_are_those_of_the_tempered_distribution(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=g) * 4
    targets = torch.randint(0, 50, (12,), generator=g)
    lp, ent = token_logprobs_entropy(logits, targets, temperature=temperature)
    ref = torch.log_softmax(logits.double() / temperature, dim=-1)
    torch.testing.assert_close(lp.double(), ref.gather(-1, targets[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1), rtol=1e-5, atol=1e-5)


def test_a_non_positive_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature=0"):
        token_logprobs_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), temperature=0.0)
