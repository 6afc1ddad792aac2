"""Model builder: a `ModelConfig` (Qwen3-MoE or Mixtral family) -> Megatron-Core GPTModel with MoE layers.

Both families are pre-norm decoders with RMSNorm, rotary position embeddings (rotate-half), GQA and
SwiGLU experts behind a softmax top-k router:
- Qwen3-MoE: RMSNorm on each query and key head before RoPE (QK-norm), explicit head_dim, optional
  normalised top-k probabilities (`norm_topk_prob`), optional leading dense layers (`mlp_only_layers`);
- Mixtral: no QK-norm, softmax over the top-2 logits (normalised top-k).
Softmax-then-top-k-then-renormalise equals top-k-then-softmax over the k logits, which is Megatron's
routing with `moe_router_pre_softmax=False`; without normalisation (`norm_topk_prob=False`) Megatron's
pre-softmax routing gives the plain softmax probabilities of the chosen experts.

The layer spec uses only Megatron-Core modules plus four of ours: `SDPAttention` (core attention on
torch's scaled_dot_product_attention: cuDNN's fused kernel with native GQA on GPU, then flash; any kernel
on CPU; packed sequences run one segment at a time), `RMSNorm` (torch's rms_norm: fp32 statistics like
the Hugging Face models, one fused op, usable with sequence parallelism), `ReplayRouter` (routing replay,
tppo.engine.replay) and `GroupedExperts` (grouped GEMM, tppo.engine.experts). `RoutedMoELayer` is
Megatron's MoELayer with one seam for ReLibra's executor, a `route_hook` called between the router and the
token dispatcher, and with the all-to-all dispatcher replaced by
`tppo.engine.dispatch.SortedAlltoAllDispatcher` (the same routing without host syncs or atomic adds). On
GPUs, RoPE runs as one Triton kernel each way (tppo.engine.rope, through Megatron's `apply_rope_fusion`
slot).

The critic uses the same trunk with `ValueHead` (one scalar per token) in place of the vocabulary
projection.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from tppo.engine import rope as fused_rope
from tppo.engine.config import ModelConfig, ParallelConfig
from tppo.engine.dispatch import SortedAlltoAllDispatcher
from tppo.engine.experts import GroupedExperts
from tppo.engine.replay import ReplayRouter, RoutingReplay

__all__ = [
    "SUPPORTED_ARCHS",
    "BuiltModel",
    "RMSNorm",
    "RoutedMoELayer",
    "SDPAttention",
    "ValueHead",
    "build_model",
    "moe_layer_ids",
    "transformer_config",
]

SUPPORTED_ARCHS = ("qwen3_moe", "mixtral")


class _KnownMoELayerFilter(logging.Filter):
    """Megatron warns about MLP classes it does not know by name; RoutedMoELayer gets its groups via params."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_KnownMoELayerFilter())
EXPERT_IMPLS = ("grouped", "sequential")
# The all-to-all dispatcher permutes with tppo.engine.dispatch (no host syncs, no atomics); False keeps
# Megatron's own permutation (benchmarks compare the two).
USE_SORTED_DISPATCHER = True
# Attention kernels on a GPU in order of preference (the first that takes the inputs runs).
_CUDA_SDPA_ORDER = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class RMSNorm(torch.nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back (as Hugging Face's Qwen3/Mixtral)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused) -> None:
        super().__init__()
        self.eps = eps
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=device))
        # Under sequence parallelism each TP rank normalises different tokens: Megatron sums these grads.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One op (a fused kernel on GPU) in place of six: the layer's host time is its launch overhead. The
        # normalisation runs in fp32 for 16-bit inputs; the weight multiplies the cast result, as Hugging Face.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SDPAttention(MegatronModule):
    """Causal core attention on torch SDPA. Inputs [S, B, heads, D] (or [T, heads, D] packed); out [S, B, heads*D]."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention implements causal attention only, got {attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )

    def _attend(self, q_BHSD: torch.Tensor, k_BGSD: torch.Tensor, v_BGSD: torch.Tensor) -> torch.Tensor:
        groups = q_BHSD.shape[1] // k_BGSD.shape[1]
        if q_BHSD.is_cuda and q_BHSD.dtype in (torch.bfloat16, torch.float16):
            # cuDNN's fused attention takes GQA natively and runs forward + backward ~1.7x faster than
            # flash with repeated K/V on an H200 (bench/megatron_train.py --variants parts).
            with sdpa_kernel(_CUDA_SDPA_ORDER, set_priority=True):
                return self._sdpa(q_BHSD, k_BGSD, v_BGSD, gqa=groups > 1)
        if groups > 1 and q_BHSD.is_cuda:
            # fp32 on a GPU: the memory-efficient kernel, which takes equal head counts only.
            k_BGSD = k_BGSD.repeat_interleave(groups, dim=1)
            v_BGSD = v_BGSD.repeat_interleave(groups, dim=1)
            return self._sdpa(q_BHSD, k_BGSD, v_BGSD, gqa=False)
        return self._sdpa(q_BHSD, k_BGSD, v_BGSD, gqa=groups > 1)

    def _sdpa(self, q_BHSD, k_BGSD, v_BGSD, *, gqa: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_BHSD, k_BGSD, v_BGSD, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None:
            return self._forward_packed(query, key, value, packed_seq_params)
        # [S, B, H, D] -> [B, H, S, D]
        out = self._attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3))
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _forward_packed(self, query, key, value, packed):
        # THD: [T, H, D]; attention stays inside each segment of cu_seqlens.
        bounds = packed.cu_seqlens_q.tolist()
        outs = []
        for start, end in itertools.pairwise(bounds):
            q = query[start:end].transpose(0, 1).unsqueeze(0)
            k = key[start:end].transpose(0, 1).unsqueeze(0)
            v = value[start:end].transpose(0, 1).unsqueeze(0)
            outs.append(self._attend(q, k, v).squeeze(0).transpose(0, 1))
        return torch.cat(outs, dim=0).reshape(query.shape[0], -1)


class RoutedMoELayer(MoELayer):
    """Megatron's MoELayer with `route_hook(layer, probs_NE, routing_map_NE) -> (probs, routing_map)`.

    The hook runs after the router and before the token dispatcher: ReLibra's executor maps logical
    experts to physical slots there. Router statistics (aux losses, expert bias) stay logical.
    """

    route_hook: Callable | None = None

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None) -> None:
        super().__init__(
            config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection
        )
        if USE_SORTED_DISPATCHER and type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            self.token_dispatcher = SortedAlltoAllDispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=pg_collection,
            )
            if self.use_shared_expert and self.shared_expert_overlap:
                self.token_dispatcher.set_shared_experts(self.shared_experts)

    def route(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None):
        probs, routing_map = self.router(hidden_states, padding_mask)
        if self.route_hook is not None:
            probs, routing_map = self.route_hook(self, probs, routing_map)
        return probs, routing_map


class ValueHead(MegatronModule):
    """The critic's head: v = h w^T, one scalar per token, replicated over tensor-parallel ranks."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config=config)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=device)
        )
        if config.perform_initialization:
            config.init_method(self.weight)
        # Each TP rank sees its own tokens under sequence parallelism: Megatron sums these grads.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        values = hidden_states @ self.weight.T
        if self.config.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def _check_model(m: ModelConfig) -> None:
    if m.arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported architecture {m.arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")
    if m.moe_topk > m.num_experts:
        raise ValueError(f"moe_topk={m.moe_topk} exceeds num_experts={m.num_experts}")
    if m.num_attention_heads % m.num_query_groups:
        raise ValueError(
            f"num_attention_heads={m.num_attention_heads} is not a multiple of "
            f"num_query_groups={m.num_query_groups}"
        )
    if m.first_k_dense >= m.num_layers:
        raise ValueError(f"first_k_dense={m.first_k_dense} leaves no MoE layer of num_layers={m.num_layers}")


def moe_layer_ids(m: ModelConfig) -> list[int]:
    """Decoder layer indices (0-based) that are MoE layers."""
    return list(range(m.first_k_dense, m.num_layers))


def transformer_config(
    m: ModelConfig,
    p: ParallelConfig,
    *,
    cuda: bool,
    dtype: torch.dtype,
    perform_initialization: bool = True,
    dispatcher: str | None = None,
) -> TransformerConfig:
    """Megatron's TransformerConfig for model `m` under layout `p`."""
    _check_model(m)
    bf16 = dtype == torch.bfloat16
    recompute = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if p.recompute
        else {}
    )
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.head_dim,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps,
        qk_layernorm=m.arch == "qwen3_moe",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_std,
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_pre_softmax=not m.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss" if m.router_aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=m.router_aux_loss_coef,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher or ("alltoall" if cuda else "allgather"),
        moe_layer_freq=[0] * m.first_k_dense + [1] * (m.num_layers - m.first_k_dense),
        moe_shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size or None,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        tensor_model_parallel_size=p.tensor_parallel,
        pipeline_model_parallel_size=p.pipeline_parallel,
        expert_model_parallel_size=p.expert_parallel,
        expert_tensor_parallel_size=1,
        sequence_parallel=p.sequence_parallel and p.tensor_parallel > 1,
        calculate_per_token_loss=True,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not cuda,
        perform_initialization=perform_initialization,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        # Our Triton RoPE (tppo.engine.rope) in Megatron's fused-RoPE slot, on GPUs only.
        apply_rope_fusion=cuda and fused_rope.install(),
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=cuda,
        **recompute,
    )


def _attention_spec(qk_norm: bool) -> ModuleSpec:
    norm = RMSNorm if qk_norm else IdentityOp
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=norm,
            k_layernorm=norm,
        ),
    )


def _dense_mlp_spec() -> ModuleSpec:
    return ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )


def _moe_spec(m: ModelConfig, experts: str, pg_collection) -> ModuleSpec:
    if experts == "grouped":
        experts_spec = ModuleSpec(module=GroupedExperts)
    elif experts == "sequential":
        experts_spec = ModuleSpec(
            module=SequentialMLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    else:
        raise ValueError(f"unknown experts implementation {experts!r}; expected one of {EXPERT_IMPLS}")
    shared = None
    if m.shared_expert_ffn_hidden_size:
        shared = ModuleSpec(
            module=SharedExpertMLP,
            params={"gate": False},
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    # Megatron's TransformerLayer passes process groups only to modules it knows by class: give ours here.
    return ModuleSpec(
        module=RoutedMoELayer,
        params={"pg_collection": pg_collection},
        submodules=MoESubmodules(experts=experts_spec, shared_experts=shared, router=ReplayRouter),
    )


def _layer_spec(m: ModelConfig, moe: bool, experts: str, pg_collection) -> ModuleSpec:
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=_attention_spec(m.arch == "qwen3_moe"),
            self_attn_bda=_bda_spec(),
            pre_mlp_layernorm=RMSNorm,
            mlp=_moe_spec(m, experts, pg_collection) if moe else _dense_mlp_spec(),
            mlp_bda=_bda_spec(),
        ),
    )


def _bda_spec():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    return get_bias_dropout_add


def block_spec(
    m: ModelConfig, config: TransformerConfig, pp_rank: int, experts: str, pg_collection
) -> TransformerBlockSubmodules:
    """The decoder layers built on pipeline stage `pp_rank`."""
    layer_specs = [_layer_spec(m, i >= m.first_k_dense, experts, pg_collection) for i in range(m.num_layers)]
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset : offset + count], layer_norm=RMSNorm)


@dataclass
class BuiltModel:
    """A GPTModel for this rank's pipeline stage plus what the engine needs to know about it."""

    model: GPTModel
    config: TransformerConfig
    model_cfg: ModelConfig
    layer_offset: int  # global index of this stage's first decoder layer
    num_local_layers: int
    replay: RoutingReplay
    value_head: bool

    @property
    def moe_layers(self) -> list[RoutedMoELayer]:
        return [layer.mlp for layer in self.model.decoder.layers if isinstance(layer.mlp, RoutedMoELayer)]


def build_model(
    m: ModelConfig,
    p: ParallelConfig,
    *,
    pp_rank: int,
    pp_size: int,
    cuda: bool,
    dtype: torch.dtype,
    value_head: bool = False,
    experts: str = "grouped",
    perform_initialization: bool = True,
    dispatcher: str | None = None,
) -> BuiltModel:
    """Build this stage's GPTModel (Megatron's parallel state must be initialised: tppo.engine.parallel)."""
    if m.num_layers % pp_size:
        raise ValueError(f"num_layers={m.num_layers} is not divisible by pipeline_parallel={pp_size}")
    config = transformer_config(
        m, p, cuda=cuda, dtype=dtype, perform_initialization=perform_initialization, dispatcher=dispatcher
    )
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    spec = block_spec(m, config, pp_rank, experts, pg_collection)
    model = GPTModel(
        pg_collection=pg_collection,
        config=config,
        transformer_layer_spec=spec,
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        share_embeddings_and_output_weights=m.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=m.rope_theta,
        rotary_percent=1.0,
    )
    if value_head and model.post_process:
        model.output_layer = ValueHead(config)
    if cuda:
        # Megatron's TopKRouter makes its weight on the CPU and moves it at its first forward: an optimizer state
        # made or loaded before that (torch's AdamW resuming a fresh engine) stayed on the CPU beside it.
        for param in model.parameters():
            if param.device.type == "cpu":
                param.data = param.data.to(torch.cuda.current_device())
    offset = get_transformer_layer_offset(config, pp_rank=pp_rank)
    num_local = len(model.decoder.layers)
    routers, ids = [], []
    moe_ids = moe_layer_ids(m)
    for local, layer in enumerate(model.decoder.layers):
        if isinstance(layer.mlp, RoutedMoELayer):
            routers.append(layer.mlp.router)
            ids.append(moe_ids.index(offset + local))
    return BuiltModel(
        model=model,
        config=config,
        model_cfg=m,
        layer_offset=offset,
        num_local_layers=num_local,
        replay=RoutingReplay(routers, ids),
        value_head=value_head,
    )
