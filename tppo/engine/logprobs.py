"""Per-token log-probabilities and entropies from (vocabulary-parallel) logits.

The distribution is softmax(logits / T) at the sampling temperature T (the rollout engine reports the log-probs
of its samples under the same full tempered distribution; T = 1 for greedy requests). With z = logits / T, the
vocabulary split over tensor-parallel ranks (rank r holds z[:, v0:v1]), m = max_v z_v (no gradient),
S = sum_v exp(z_v - m) and lse = m + log S:

    log p(y) = z_y - lse
    H        = lse - sum_v p_v z_v,        p_v = exp(z_v - lse)

Sums over v run over all ranks through Megatron's differentiable all-reduce (identity backward: every TP
rank computes the same loss). Computed in fp32 whatever the logits' dtype.

Legend: N tokens, V vocabulary entries held by this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["token_logprobs_entropy"]


def _sum_over_tp(x: torch.Tensor, group) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def token_logprobs_entropy(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    tp_group=None,
    vocab_start: int = 0,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target), entropy) per token of softmax(logits / temperature), from this rank's slice
    [vocab_start, vocab_start + V) of the logits."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}: expected > 0 (greedy sampling reports T = 1)")
    z_NV = logits_NV.float() if temperature == 1.0 else logits_NV.float() / temperature
    tp = tp_group is not None and dist.get_world_size(tp_group) > 1
    with torch.no_grad():
        m_N = z_NV.max(dim=-1).values
        if tp:
            dist.all_reduce(m_N, op=dist.ReduceOp.MAX, group=tp_group)
    shifted_NV = z_NV - m_N.unsqueeze(-1)
    exp_NV = shifted_NV.exp()
    lse_N = _sum_over_tp(exp_NV.sum(-1), tp_group if tp else None).log()
    local_N = targets_N - vocab_start
    inside_N = (local_N >= 0) & (local_N < z_NV.shape[-1])
    picked_N = shifted_NV.gather(-1, local_N.clamp(0, z_NV.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_N = _sum_over_tp(picked_N * inside_N, tp_group if tp else None)
    logprobs_N = target_N - lse_N
    if not with_entropy:
        return logprobs_N, None
    # sum_v p_v z_v with p_v = exp(shifted_v) / S, z shifted by m (entropy is shift-invariant).
    weighted_N = _sum_over_tp((exp_NV * shifted_NV).sum(-1), tp_group if tp else None)
    entropy_N = lse_N - weighted_N / lse_N.exp()
    return logprobs_N, entropy_N
