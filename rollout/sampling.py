"""Sampling parameters and the sampler: temperature, top-k, top-p, greedy, with per-request reproducible randomness.

Randomness is counter based: the uniform number that picks token t of a request is a hash of (request seed,
position t in the sequence), independent of which other requests share the batch, of the batch row and of
whether the request was resumed from a prefix (a T-PPO window continues the same random stream). The token is
drawn by inverse CDF: the first token whose cumulative probability exceeds u (float64 sums, in two levels:
vocabulary blocks, then inside the chosen block). The hash
exists twice with identical bits: in numpy (`counter_uniform`, the reference) and in torch int64 arithmetic
(`counter_uniform_torch`, which runs on the device inside the captured decode graph: no host work per step).

Log-probs (the RL convention, what the trainer recomputes with logits / temperature): log softmax(logits / T)
of the sampled token under the FULL temperature-scaled distribution, not the top-k/top-p truncated one. Greedy
requests (temperature 0) report log softmax(logits) (T = 1). Top-k is applied before top-p, as in transformers;
top-p keeps the smallest prefix of the sorted (top-k renormalised) distribution whose mass reaches top_p; tokens
tied with the last kept logit are kept too.

Legend: B rows, V vocab.
"""

from __future__ import annotations

import numpy as np
import torch

from rollout.params import SamplingParams

__all__ = ["SamplingParams", "counter_uniform", "counter_uniform_torch", "sample", "top_k_top_p_mask"]


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (Steele et al.), a bijective mixer of 64-bit integers."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def counter_uniform(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """u in [0, 1) from (seed, counter) pairs: two rounds of splitmix64, top 53 bits as a float64."""
    key = _splitmix64(seeds.astype(np.uint64))
    bits = _splitmix64(key ^ counters.astype(np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) / float(2**53)


def _as_int64(c: int) -> int:
    """The signed int64 with the same bits as the uint64 constant c."""
    return c - (1 << 64) if c >= 1 << 63 else c


_SPLITMIX = tuple(_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> on int64 is arithmetic: clear the sign-extended bits)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """_splitmix64 on int64 tensors holding uint64 bits (two's-complement add and multiply wrap like uint64)."""
    x = x + _SPLITMIX[0]
    x = (x ^ _shr(x, 30)) * _SPLITMIX[1]
    x = (x ^ _shr(x, 27)) * _SPLITMIX[2]
    return x ^ _shr(x, 31)


def counter_uniform_torch(seeds_B: torch.Tensor, counters_B: torch.Tensor) -> torch.Tensor:
    """counter_uniform bit for bit, as float64 on the tensors' device; seeds_B are int64 holding the uint64 seed
    bits (`np.uint64` seeds viewed as int64), counters_B int64 >= 0."""
    key_B = _splitmix64_torch(seeds_B)
    bits_B = _splitmix64_torch(key_B ^ counters_B)
    return _shr(bits_B, 11).to(torch.float64) / float(2**53)


def top_k_top_p_mask(scaled_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V]: tokens kept by top-k (0 = all) and then top-p over the renormalised top-k distribution."""
    vocab = scaled_BV.shape[-1]
    sorted_BV, _ = torch.sort(scaled_BV, dim=-1, descending=True)
    rank_V = torch.arange(vocab, device=scaled_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B, vocab)
    in_k_BV = rank_V[None, :] < k_B[:, None]
    probs_BV = torch.softmax(sorted_BV.masked_fill(~in_k_BV, float("-inf")), dim=-1)
    mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
    keep_BV = in_k_BV & (mass_before_BV < top_p_B[:, None])
    keep_BV[:, 0] = True
    threshold_B = torch.where(keep_BV, sorted_BV, torch.full_like(sorted_BV, float("inf"))).amin(dim=-1)
    return scaled_BV >= threshold_B[:, None]


def _block_size(vocab: int) -> int:
    return next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if vocab % b == 0)


def inverse_cdf(weights_BV: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """The first token t with sum_{v <= t} w_v > u * sum_v w_v, for non-negative unnormalised weights w, in two
    levels (float64 sums of vocabulary blocks, then a cumulative sum inside the chosen block only) instead of a
    float64 cumulative sum over the whole vocabulary. Targets are clipped below the totals, so the token drawn
    always has a positive weight (a token masked to 0 by top-k/top-p can never come out of rounding)."""
    num_rows, vocab = weights_BV.shape
    block = _block_size(vocab)
    blocks_BJC = weights_BV.view(num_rows, vocab // block, block)
    cum_BJ = blocks_BJC.sum(-1, dtype=torch.float64).cumsum(-1)
    total_B = cum_BJ[:, -1]
    target_B = torch.minimum(
        uniform_B.double() * total_B, torch.nextafter(total_B, torch.zeros_like(total_B))
    )
    j_B = torch.searchsorted(cum_BJ, target_B[:, None], right=True).squeeze(1).clamp_(max=vocab // block - 1)
    before_B = torch.where(j_B > 0, cum_BJ.gather(1, (j_B - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    index_B1C = j_B[:, None, None].expand(num_rows, 1, block)
    inner_BC = blocks_BJC.gather(1, index_B1C).squeeze(1).double().cumsum(-1)
    inner_total_B = inner_BC[:, -1]
    inner_target_B = torch.minimum(
        (target_B - before_B).clamp(min=0), torch.nextafter(inner_total_B, torch.zeros_like(inner_total_B))
    )
    i_B = torch.searchsorted(inner_BC, inner_target_B[:, None], right=True).squeeze(1).clamp_(max=block - 1)
    return j_B * block + i_B


def sample(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    uniform_B: torch.Tensor,
    filtered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] and their log-probs [B] (see the module docstring); `filtered` False skips the top-k/p sort.
    log p(t) = z_t - logsumexp(z), z = logits / T (T = 1 for greedy rows), computed in fp32; the draw is an
    inverse CDF over exp(z - max z) (kept tokens only when filtered). Five passes over [B, V] when unfiltered."""
    greedy_B = temperature_B <= 0
    scaled_BV = torch.div(logits_BV, torch.where(greedy_B, 1.0, temperature_B).float()[:, None])
    if scaled_BV.dtype != torch.float32:
        scaled_BV = scaled_BV.float()
    max_B, argmax_B = scaled_BV.max(dim=-1)
    exp_BV = (scaled_BV - max_B[:, None]).exp_()
    lse_B = max_B + torch.log(exp_BV.sum(-1))
    if filtered:
        exp_BV = exp_BV.masked_fill_(~top_k_top_p_mask(scaled_BV, top_k_B, top_p_B), 0.0)
    drawn_B = inverse_cdf(exp_BV, uniform_B)
    tokens_B = torch.where(greedy_B, argmax_B, drawn_B)
    return tokens_B, scaled_BV.gather(1, tokens_B[:, None]).squeeze(1) - lse_B
