"""Expert MLPs of a MoE layer on `torch._grouped_mm` (CPU and GPU), as a Megatron-Core experts module.

Megatron's token dispatcher hands the experts module the tokens of its local experts, sorted by expert,
with the number of tokens per expert and each token's gate probability. `GroupedExperts` computes every
local expert's SwiGLU MLP in two grouped GEMMs:

    h_N2F = x_NH @ W1[e(n)]^T          (W1 = [gate; up] rows, shape [E, 2F, H])
    a_NF  = silu(h_gate) * h_up * p_N  (the gate probability scales the intermediate, as Megatron's MLP)
    y_NH  = a_NF @ W2[e(n)]^T          (W2 shape [E, H, F])

On a GPU the middle line is one Triton kernel each way (tppo.engine.swiglu), and with
`fuse_wgrad_accumulation` (set by the engine) the weight gradients are added to Megatron's fp32 main grads
inside their GEMM (tppo.engine.grouped_wgrad) instead of being returned in bf16.

Legend: N dispatched tokens (sorted by local expert), H hidden size, F expert FFN size, E local experts
(slots), P physical slots seen by the dispatcher.

Seams for ReLibra's executor (issue 7): `logical_expert_ids` says which logical expert each local slot
holds (export, checkpoints and loading follow it, so weights always leave in logical order), and
`weight_provider`, when set, returns the (W1, W2) tensors to compute with, e.g. home slots concatenated
with replica slots; the dispatcher then has to be built for that many slots.

Megatron's SequentialMLP (one MLP per expert in a loop) is kept only as the reference in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from tppo.engine.grouped_wgrad import grouped_linear_fused_wgrad
from tppo.engine.swiglu import swiglu_probs

__all__ = ["GroupedExperts", "grouped_swiglu"]


_COLUMN_MAJOR_OK = {"cpu": True, "cuda": True}


def _grouped_linear(x_NK: torch.Tensor, w_EOK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """y[n] = x[n] @ w[e(n)]^T for tokens sorted by expert; offs_E are the cumulative token counts."""
    w_EKO = w_EOK.transpose(1, 2)  # column-major view: the layout nn.Linear's GEMM uses
    kind = x_NK.device.type
    if _COLUMN_MAJOR_OK.get(kind, True):
        try:
            return torch._grouped_mm(x_NK, w_EKO, offs=offs_E)
        except RuntimeError as exc:
            if "stride" not in str(exc) and "layout" not in str(exc) and "major" not in str(exc):
                raise
            # A build whose kernel takes row-major weights only: pay one weight copy per call.
            _COLUMN_MAJOR_OK[kind] = False
    return torch._grouped_mm(x_NK, w_EKO.contiguous(), offs=offs_E)


def _looped_linear(x_NK: torch.Tensor, w_EOK: torch.Tensor, counts: list[int]) -> torch.Tensor:
    parts = [chunk @ w_EOK[e].T for e, chunk in enumerate(torch.split(x_NK, counts))]
    return torch.cat(parts) if parts else x_NK.new_zeros(0, w_EOK.shape[1])


def _grouped_mm_supported(x: torch.Tensor, *dims: int) -> bool:
    # CUDA's grouped GEMM is bf16-only (the CPU kernel takes any floating type); both need every row
    # stride to be a multiple of 16 bytes.
    aligned = all(d * x.element_size() % 16 == 0 for d in dims)
    return aligned and (x.device.type == "cpu" or x.dtype == torch.bfloat16)


def grouped_swiglu(
    x_NH: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    probs_N: torch.Tensor,
    w1_E2FH: torch.Tensor,
    w2_EHF: torch.Tensor,
    *,
    fuse_wgrad: bool = False,
) -> torch.Tensor:
    """SwiGLU experts over expert-sorted tokens: y = (silu(x W_gate^T) * (x W_up^T) * p) W_down^T per expert.

    With `fuse_wgrad` the weights' gradients are added to their `main_grad` inside the weight-gradient GEMM
    (tppo.engine.grouped_wgrad) and never returned; it applies on the grouped-GEMM path only.
    """
    if x_NH.shape[0] == 0:
        # No token reached these experts (grouped_mm's backward rejects empty inputs): keep every input in
        # the graph, the routing probabilities too, so that their gradients are zeros rather than missing. A
        # missing gradient would skip the backward of the dispatcher's gather on this rank alone, and the
        # expert-parallel peers would hang in that collective.
        keep = x_NH.sum() + probs_N.sum() + w1_E2FH.sum() + w2_EHF.sum()
        return x_NH.new_zeros(0, w2_EHF.shape[1]) + 0.0 * keep
    grouped = _grouped_mm_supported(x_NH, x_NH.shape[1], w1_E2FH.shape[1], w2_EHF.shape[2])
    if grouped:
        offs_E = torch.cumsum(tokens_per_expert_E.to(device=x_NH.device), 0).to(torch.int32)
        if fuse_wgrad:
            linear = partial(grouped_linear_fused_wgrad, linear=_grouped_linear)
        else:
            linear = _grouped_linear
        h_N2F = linear(x_NH, w1_E2FH, offs_E)
    else:
        counts = tokens_per_expert_E.tolist()
        h_N2F = _looped_linear(x_NH, w1_E2FH, counts)
    a_NF = swiglu_probs(h_N2F, probs_N)
    if grouped:
        return linear(a_NF, w2_EHF, offs_E)
    return _looped_linear(a_NF, w2_EHF, counts)


class GroupedExperts(MegatronModule):
    """The local experts of one MoE layer as two stacked weights, computed with grouped GEMMs."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection=None) -> None:
        super().__init__(config=config)
        if config.add_bias_linear:
            raise ValueError("GroupedExperts has no biases: set add_bias_linear=False")
        if not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("GroupedExperts implements SwiGLU experts (gated_linear_unit with silu) only")
        self.num_local_experts = num_local_experts
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        device = torch.device("cpu") if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, 2 * ffn, hidden, dtype=config.params_dtype, device=device)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden, ffn, dtype=config.params_dtype, device=device)
        )
        for param in (self.weight1, self.weight2):
            # Megatron's DDP keeps expert parameters apart (reduced over expert-data-parallel ranks).
            param.allreduce = False
        ep_rank = pg_collection.ep.rank() if pg_collection is not None else 0
        self.logical_expert_ids: list[int] = [
            ep_rank * num_local_experts + i for i in range(num_local_experts)
        ]
        self.weight_provider: Callable[[GroupedExperts], tuple[torch.Tensor, torch.Tensor]] | None = None
        # Set by the engine where gradients are reduced after the last micro-batch (not by per-parameter
        # hooks) and the kernel can run: see tppo.engine.grouped_wgrad.
        self.fuse_wgrad_accumulation = False
        self.last_tokens_per_expert: torch.Tensor | None = None
        if config.perform_initialization:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for e in range(self.num_local_experts):
                self.config.init_method(self.weight1[e])
                self.config.output_layer_init_method(self.weight2[e])

    def compute_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W1 [slots, 2F, H], W2 [slots, H, F]) used by forward: own parameters unless a provider is set."""
        if self.weight_provider is not None:
            return self.weight_provider(self)
        return self.weight1, self.weight2

    def forward(
        self,
        permuted_hidden_NH: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        permuted_probs_N: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        w1, w2 = self.compute_weights()
        if tokens_per_expert_E.numel() != w1.shape[0]:
            raise ValueError(
                f"the dispatcher sent tokens for {tokens_per_expert_E.numel()} experts; "
                f"this module computes {w1.shape[0]} slots"
            )
        self.last_tokens_per_expert = tokens_per_expert_E.detach()  # no copy: a device sync per layer
        # Weights from a provider (home + replica slots) are not the parameters: their gradient flows back
        # through the provider, so only the parameters themselves take the fused path.
        fuse = self.fuse_wgrad_accumulation and w1 is self.weight1 and w2 is self.weight2
        y_NH = grouped_swiglu(
            permuted_hidden_NH, tokens_per_expert_E, permuted_probs_N, w1, w2, fuse_wgrad=fuse
        )
        return y_NH, None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the ordinary backward pass (no delayed wgrad)."""
