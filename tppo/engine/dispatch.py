"""Token permutation for Megatron's all-to-all dispatcher without host syncs or atomic adds.

Megatron-Core 0.16.1 without transformer-engine permutes tokens with `masked_select` (a device-to-host
sync each call, twice per layer), restores them with a bf16 `scatter_add_` (atomics) whose backward is an
`index_add_` (atomics again), and with several local experts copies its per-expert token counts to the
host and splits / concatenates 64 chunks even when the expert-parallel group has a single rank. Every
sync drains the GPU queue, after which the GPU waits for Python to launch the next kernels.

`RoutePlan` turns a routing map with exactly K experts per token into index tensors (all on the device,
no sync) so that both directions are gathers:

    permute:    x_MH[j]   = x_NH[tok_M[j]]                      (copies sorted by expert, then token)
    backward:   dx_NH[n]  = sum_k dx_MH[pos_NK[n, k]]
    unpermute:  y_NH[n]   = sum_k y_MH[pos_NK[n, k]]
    backward:   dy_MH[j]  = dy_NH[tok_M[j]]

The copy order equals Megatron's (expert-major, tokens ascending within an expert), so the tokens each
expert sees, their gate probabilities and the all-to-all splits are unchanged. The sum over a token's K
copies runs in fp32 inside the reduction instead of K rounded bf16 atomic adds, so bf16 results differ from
Megatron's at rounding level (fp32 results agree to rounding).

`SortedAlltoAllDispatcher` is Megatron's MoEAlltoAllTokenDispatcher with these permutations. With one
expert-parallel and one tensor-parallel rank it also keeps the token counts on the device (the grouped
GEMM takes them there) and skips the no-op chunk sort: no host sync at all. With EP > 1 it keeps
Megatron's single metadata sync (the all-to-all needs its split sizes on the host). Configurations it
does not cover (token dropping, capacity padding, overlapped shared experts, transformer-engine fused
permutation) fall back to Megatron's code.

Legend: N tokens of this rank, E experts (columns of the routing map), K experts per token, M = N K token
copies, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

__all__ = ["RoutePlan", "SortedAlltoAllDispatcher", "gather_copies", "route_plan", "sum_copies"]


@dataclass
class RoutePlan:
    """Where every token copy goes: `tok_M`/`expert_M` per copy (expert-major order), `pos_NK` per token."""

    tok_M: torch.Tensor
    expert_M: torch.Tensor
    pos_NK: torch.Tensor
    tokens_per_expert_E: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.pos_NK.shape[0]


def route_plan(routing_map_NE: torch.Tensor, topk: int) -> RoutePlan:
    """Index tensors of the expert-major permutation of a routing map with exactly `topk` experts per token.

    A row with another number of experts raises (on the GPU through a device-side assertion, which does not
    wait for the device). Sorting keys e N + n gives Megatron's copy order: by expert, then by token.
    """
    if routing_map_NE.dim() != 2 or routing_map_NE.dtype != torch.bool:
        raise ValueError(
            f"routing_map must be a 2-D bool tensor, got {routing_map_NE.dtype} {tuple(routing_map_NE.shape)}"
        )
    n, e = routing_map_NE.shape
    if not 0 < topk <= e:
        raise ValueError(f"topk must be in 1..{e} (experts of the routing map), got {topk}")
    # Each row's routed experts first, ascending (a stable sort of a 0/1 key per row).
    experts_NK = torch.sort(routing_map_NE.to(torch.uint8), dim=1, descending=True, stable=True).indices[
        :, :topk
    ]
    counts_N = routing_map_NE.sum(dim=1)
    torch._assert_async(
        (counts_N == topk).all(), f"the routing map must route every token to exactly {topk} experts"
    )
    device = routing_map_NE.device
    token_N1 = torch.arange(n, device=device).unsqueeze(1)
    order_M = torch.argsort((experts_NK * n + token_N1).reshape(-1))
    pos_M = torch.empty_like(order_M)
    pos_M[order_M] = torch.arange(order_M.numel(), device=device)
    return RoutePlan(
        tok_M=order_M // topk,
        expert_M=experts_NK.reshape(-1)[order_M],
        pos_NK=pos_M.view(n, topk),
        tokens_per_expert_E=routing_map_NE.sum(dim=0),
    )


class _GatherCopies(torch.autograd.Function):
    """x_MH = x_NH[tok_M]; backward sums each token's K copies (a gather, no atomics)."""

    @staticmethod
    def forward(ctx, x_NH, tok_M, pos_NK):
        ctx.save_for_backward(pos_NK)
        return x_NH.index_select(0, tok_M)

    @staticmethod
    def backward(ctx, grad_MH):
        (pos_NK,) = ctx.saved_tensors
        return _sum_rows(grad_MH, pos_NK), None, None


class _SumCopies(torch.autograd.Function):
    """y_NH[n] = sum_k y_MH[pos_NK[n, k]]; backward gathers the token's gradient to each copy."""

    @staticmethod
    def forward(ctx, y_MH, tok_M, pos_NK):
        ctx.save_for_backward(tok_M)
        return _sum_rows(y_MH, pos_NK)

    @staticmethod
    def backward(ctx, grad_NH):
        (tok_M,) = ctx.saved_tensors
        return grad_NH.contiguous().index_select(0, tok_M), None, None


def _sum_rows(y_MH: torch.Tensor, pos_NK: torch.Tensor) -> torch.Tensor:
    n, k = pos_NK.shape
    rows = y_MH.contiguous().index_select(0, pos_NK.reshape(-1)).view(n, k, y_MH.shape[-1])
    if k == 1:
        return rows[:, 0]
    acc = torch.promote_types(y_MH.dtype, torch.float32)  # 16-bit copies add up in fp32
    return rows.sum(dim=1, dtype=acc).to(y_MH.dtype)


def gather_copies(x_NH: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """Token copies in expert-major order, [M, H] (differentiable)."""
    return _GatherCopies.apply(x_NH, plan.tok_M, plan.pos_NK)


def sum_copies(y_MH: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """Per token, the sum of its K copies' rows, [N, H] (differentiable)."""
    return _SumCopies.apply(y_MH, plan.tok_M, plan.pos_NK)


class SortedAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher with gather-only permutations (see the module docstring)."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        self.plan: RoutePlan | None = None
        self._local_only = self.ep_size == 1 and self.tp_size == 1
        self._supported = not (
            self.drop_and_pad
            or config.moe_expert_capacity_factor is not None
            or config.moe_router_padding_for_quantization
            or config.moe_permute_fusion
        )

    def set_shared_experts(self, shared_experts):
        self._supported = False  # overlapped shared experts hook into Megatron's own steps
        super().set_shared_experts(shared_experts)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if not self._supported:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        if probs.dim() != 2 or routing_map.shape != probs.shape:
            raise ValueError(
                f"probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} must both be [tokens, experts]"
            )
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_NH = hidden_states.reshape(-1, self.hidden_shape[-1])
        self.hidden_shape_before_permute = hidden_NH.shape
        self.plan = plan = route_plan(routing_map, self.config.moe_router_topk)
        if self._local_only:
            self.tokens_per_expert = plan.tokens_per_expert_E  # stays on the device
        else:
            self.tokens_per_expert = self.preprocess(routing_map)
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize(
                "before_permutation_1", self.tokens_per_expert
            )
        permuted_MH = gather_copies(hidden_NH, plan)
        num_experts = routing_map.shape[1]
        permuted_probs_M = probs.reshape(-1).index_select(0, plan.tok_M * num_experts + plan.expert_M)
        return permuted_MH, permuted_probs_M

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        if self._supported and self._local_only:
            return permutated_local_input_tokens, permuted_probs
        return super().token_dispatch(permutated_local_input_tokens, permuted_probs)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        if self._supported and self._local_only:
            # One rank: the copies are already sorted by local expert.
            tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
            return global_input_tokens, tokens_per_expert, global_probs
        return super().dispatch_postprocess(global_input_tokens, global_probs)

    def combine_preprocess(self, hidden_states):
        if self._supported and self._local_only:
            return hidden_states
        return super().combine_preprocess(hidden_states)

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        if self._supported and self._local_only:
            return hidden_states
        return super().token_combine(hidden_states, async_finish, allocate_on_comm_stream)

    def combine_postprocess(self, permutated_local_input_tokens):
        if not self._supported:
            return super().combine_postprocess(permutated_local_input_tokens)
        plan, self.plan = self.plan, None
        if plan is None:
            raise RuntimeError("combine without a dispatch: the dispatcher holds no routing plan")
        return sum_copies(permutated_local_input_tokens, plan).view(self.hidden_shape)
