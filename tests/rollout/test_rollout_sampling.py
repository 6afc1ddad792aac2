"""The sampler against brute force: top-k/top-p masks, sampled frequencies vs the (filtered) distribution,
log-probs under the temperature-scaled full distribution, greedy rows, and the counter-based uniforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import SamplingParams
from rollout.sampling import counter_uniform, counter_uniform_torch, inverse_cdf, sample, top_k_top_p_mask


def _reference_keep(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    order = np.argsort(-row)
    k = top_k if top_k > 0 else len(row)
    kept_vals = row[order[:k]]
    probs = np.exp(kept_vals - kept_vals.max())
    probs /= probs.sum()
    keep = np.zeros(len(row), dtype=bool)
    mass = 0.0
    for rank, tok in enumerate(order[:k]):
        if rank == 0 or mass < top_p:
            keep[tok] = True
        mass += probs[rank]
    return keep


def test_top_k_top_p_mask_matches_brute_force():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 30)) * 2
    top_k = rng.integers(0, 8, size=40)
    top_p = rng.uniform(0.05, 1.0, size=40)
    top_p[:5] = 1.0
    mask = top_k_top_p_mask(torch.tensor(logits), torch.tensor(top_k), torch.tensor(top_p)).numpy()
    for i in range(40):
        np.testing.assert_array_equal(mask[i], _reference_keep(logits[i], int(top_k[i]), float(top_p[i])))


def _draw(logits: np.ndarray, n: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 7):
    logits_BV = torch.tensor(np.tile(logits, (n, 1)), dtype=torch.float32)
    uniform = counter_uniform(np.full(n, seed, dtype=np.uint64), np.arange(n))
    return sample(
        logits_BV,
        torch.full((n,), temperature),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        torch.tensor(uniform),
        filtered=top_k > 0 or top_p < 1,
    )


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.8)])
def test_sampled_frequencies_follow_the_filtered_distribution(top_k, top_p):
    logits = np.array([2.0, 1.5, 0.3, 0.0, -0.5, -3.0])
    temperature, n = 0.8, 40_000
    tokens, logprobs = _draw(logits, n, temperature, top_k, top_p)
    scaled = logits / temperature
    full = np.exp(scaled - scaled.max())
    full /= full.sum()
    keep = _reference_keep(scaled, top_k, top_p)
    filtered = np.where(keep, full, 0.0)
    filtered /= filtered.sum()
    freq = np.bincount(tokens.numpy(), minlength=len(logits)) / n
    np.testing.assert_allclose(freq, filtered, atol=0.01)
    assert freq[~keep].sum() == 0
    # Log-probs are those of the full temperature-scaled distribution, not the truncated one.
    np.testing.assert_allclose(logprobs.numpy(), np.log(full)[tokens.numpy()], atol=1e-5)


@pytest.mark.parametrize("vocab", [96, 512, 1187, 2 * 1187])
def test_two_level_inverse_cdf_matches_a_full_cumulative_sum(vocab):
    rng = np.random.default_rng(vocab)
    weights = rng.exponential(size=(64, vocab)) * (rng.uniform(size=(64, vocab)) < 0.3)
    weights[:, -1] = 0.0  # a masked last token must never be drawn, even for u -> 1
    u = rng.uniform(size=64)
    u[:3] = [0.0, 1 - 2**-53, 0.5]
    got = inverse_cdf(torch.tensor(weights), torch.tensor(u)).numpy()
    cdf = np.cumsum(weights, axis=1)
    expected = np.array([np.searchsorted(c, x * c[-1], side="right") for c, x in zip(cdf, u)])
    expected = np.minimum(expected, vocab - 1)
    assert (weights[np.arange(64), got] > 0).all()
    np.testing.assert_array_equal(got[3:], expected[3:])
    assert got[0] == np.flatnonzero(weights[0])[0]


def test_greedy_rows_take_argmax_with_untempered_logprob():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    tokens, logprobs = sample(
        logits,
        torch.tensor([0.0, 0.0]),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2),
        torch.tensor([0.99, 0.01], dtype=torch.float64),
        filtered=False,
    )
    assert tokens.tolist() == [1, 0]
    np.testing.assert_allclose(
        logprobs.numpy(), torch.log_softmax(logits, -1)[[0, 1], [1, 0]].numpy(), atol=1e-6
    )


def test_counter_uniforms_are_reproducible_and_uniform():
    seeds = np.full(100_000, 3, dtype=np.uint64)
    u = counter_uniform(seeds, np.arange(100_000))
    np.testing.assert_array_equal(u, counter_uniform(seeds, np.arange(100_000)))
    assert (u >= 0).all() and (u < 1).all()
    hist = np.histogram(u, bins=20, range=(0, 1))[0] / len(u)
    np.testing.assert_allclose(hist, 0.05, atol=0.004)
    other = counter_uniform(np.full(100_000, 4, dtype=np.uint64), np.arange(100_000))
    assert abs(np.corrcoef(u, other)[0, 1]) < 0.02


def test_torch_counter_uniforms_equal_numpy_bit_for_bit():
    rng = np.random.default_rng(1)
    seeds = rng.integers(0, 2**64 - 1, size=50_000, dtype=np.uint64, endpoint=True)
    seeds[:4] = [0, 1, 2**63, 2**64 - 1]
    counters = rng.integers(0, 2**62, size=50_000)
    counters[:4] = [0, 1, 2**62, 7]
    expected = counter_uniform(seeds, counters)
    got = counter_uniform_torch(torch.from_numpy(seeds.view(np.int64)), torch.from_numpy(counters))
    assert got.dtype == torch.float64
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
