"""Logical -> physical routing of one MoE layer's tokens, between Megatron's router and its token dispatcher.

The router's output stays logical (aux losses, expert bias, metrics): `probs_NE` (gate probabilities, zero
where a token is not routed) and `routing_map_NE`. The dispatcher then sees P physical slots:

    phys(n, e) = inst[e, i(n, e)],  i(n, e) = #{i : cum[e, i] <= rank(n, e)}
    rank(n, e) = #{n' < n : routing_map[n', e]}         (the pair's position among e's pairs, token order)
    probs_NP[n, phys(n, e)] = probs_NE[n, e],  routing_map_NP[n, phys(n, e)] = True

with the tables of `relibra.executor.tables.reroute_tables`. probs_NP is a scatter of probs_NE, so the gate
probability of every pair keeps its gradient (back to the router's logits) unchanged.

Without replicas the map is a permutation of the columns (`permute_routing`).

Legend: N tokens seen by the router, E logical experts, P physical slots, I instances per expert (padded).
"""

from __future__ import annotations

import torch

__all__ = ["permute_routing", "reroute_routing"]


def reroute_routing(
    probs_NE: torch.Tensor,
    routing_map_NE: torch.Tensor,
    inst_EI: torch.Tensor,
    cum_EI: torch.Tensor,
    num_phys: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs_NP, routing_map_NP) following the quotas (see the module docstring for the formula)."""
    n, e = routing_map_NE.shape
    if inst_EI.shape != cum_EI.shape or inst_EI.shape[0] != e:
        raise ValueError(
            f"inst_EI {tuple(inst_EI.shape)} and cum_EI {tuple(cum_EI.shape)} must both be [E={e}, I]"
        )
    routed = routing_map_NE.bool()
    # The running count over tokens as a scan along the contiguous dim: CUDA's scan over the outer dim of [N, E]
    # takes ~0.7 ms at N = 4096 (measured on the H200), the transposed one a few microseconds.
    rank_NE = (torch.cumsum(routed.t().contiguous(), dim=1, dtype=torch.int32) - 1).t()
    # I is a few instances: i(n, e) = #{i : cum[e, i] <= rank(n, e)} is one broadcast compare [N, E, I].
    idx_NE = (cum_EI.unsqueeze(0) <= rank_NE.unsqueeze(-1)).sum(-1)
    flat_NE = torch.arange(e, device=inst_EI.device) * inst_EI.shape[1] + idx_NE
    phys_NE = torch.take(inst_EI, flat_NE)
    # Unrouted pairs go to a spare column that is dropped: no two routed pairs of a token share a slot.
    phys_NE = torch.where(routed, phys_NE, num_phys)
    src = torch.where(routed, probs_NE, torch.zeros((), dtype=probs_NE.dtype, device=probs_NE.device))
    probs_NP = probs_NE.new_zeros(n, num_phys + 1).scatter_add(1, phys_NE, src)
    map_NP = torch.zeros(n, num_phys + 1, dtype=torch.bool, device=routed.device).scatter_(1, phys_NE, routed)
    return probs_NP[:, :num_phys], map_NP[:, :num_phys]


def permute_routing(
    probs_NE: torch.Tensor, routing_map_NE: torch.Tensor, log_of_phys_P: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Home slots only: physical column p is logical column log_of_phys_P[p] (a permutation, P == E)."""
    return probs_NE.index_select(1, log_of_phys_P), routing_map_NE.index_select(1, log_of_phys_P)
