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

from tppo.engine.batch import ForwardOutput, TrainBatch

__all__ = ["aligned_logprobs", "aligned_values", "token_logprobs_entropy"]


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


def _aligned(x_BT1: torch.Tensor, starts_BT: torch.Tensor) -> torch.Tensor:
    """out[:, t] = x[:, t - 1] (fp32): a token's score comes from the output at the token before it; 0 at
    `starts_BT` (sequence starts have no prefix to score, padding scores nothing)."""
    b, t = starts_BT.shape
    out_BT = torch.zeros(b, t, dtype=torch.float32, device=x_BT1.device)
    out_BT[:, 1:] = x_BT1.reshape(b, t - 1).float()
    return out_BT.masked_fill(starts_BT, 0.0)


def aligned_values(batch: TrainBatch, v_BT: torch.Tensor, end_values_S: torch.Tensor) -> ForwardOutput:
    """A critic's outputs aligned with the tokens: values_BT[:, t] = V(s_t), read at the token before t."""
    starts_BT = batch.sequence_starts_BT() | ~batch.valid_BT()
    return ForwardOutput(values_BT=_aligned(v_BT[:, :-1], starts_BT), end_values_S=end_values_S)


def aligned_logprobs(
    batch: TrainBatch,
    logits_BTV: torch.Tensor,
    *,
    with_entropy: bool,
    tp_group=None,
    vocab_start: int = 0,
) -> ForwardOutput:
    """Each token's log-prob (and the entropy of its distribution) given the tokens before it, aligned with the
    token: logprobs_BT[:, t] from the logits at t - 1 (`token_logprobs_entropy` at the batch's temperature)."""
    starts_BT = batch.sequence_starts_BT() | ~batch.valid_BT()
    lp_N, ent_N = token_logprobs_entropy(
        logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]),
        batch.input_ids_BT.long()[:, 1:].reshape(-1),
        tp_group=tp_group,
        vocab_start=vocab_start,
        with_entropy=with_entropy,
        temperature=batch.temperature,
    )
    entropy_BT = None if ent_N is None else _aligned(ent_N, starts_BT)
    return ForwardOutput(logprobs_BT=_aligned(lp_N, starts_BT), entropy_BT=entropy_BT)
