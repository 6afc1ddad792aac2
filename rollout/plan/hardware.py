"""GPU and model presets of the deployment planner, and the byte counts every layout needs.

GPU numbers are datasheet values (dense bf16 tensor FLOP/s, HBM bandwidth, memory) except the A100's bandwidth,
which is MegaScale-Infer's rounded 2 TB/s (section 2.3) so that the preset reproduces its F / B = 156; the
datasheet says 2.039 TB/s. The roofline built on them is an upper bound: DESIGN.md measured 790 of the H200's
989 TFLOP/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollout.model_spec import MoeModelSpec

GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: peak dense bf16 FLOP/s, HBM bandwidth (bytes/s), memory (bytes), NVLink (bytes/s)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: float
    nvlink_bandwidth: float


GPU_PRESETS: dict[str, GpuSpec] = {
    "a100": GpuSpec("A100-80GB", 312e12, 2.0e12, 80 * GB, 300 * GB),
    "h100": GpuSpec("H100-80GB-SXM", 989e12, 3.35e12, 80 * GB, 450 * GB),
    "h800": GpuSpec("H800-80GB-SXM", 989e12, 3.35e12, 80 * GB, 200 * GB),
    "h200": GpuSpec("H200-141GB-SXM", 989e12, 4.8e12, 141 * GB, 450 * GB),
}


@dataclass(frozen=True)
class ModelShape:
    """The widths the performance model needs. Every layer counts as a MoE layer (true of both presets).

    `weight_bytes` is the element size of the weights (2 for bf16, 1 for fp8); the KV cache is `kv_bytes` per
    element; activations on the wire are `act_bytes`."""

    name: str
    hidden_size: int
    num_experts: int
    top_k: int
    moe_ffn: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: int = 2
    kv_bytes: int = 2
    act_bytes: int = 2
    tie_word_embeddings: bool = False

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v and o projections plus the router: h (q + 2 kv) + q h + h E."""
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden_size
        return h * (q + 2 * kv) + q * h + h * self.num_experts

    @property
    def expert_params(self) -> int:
        """One expert of one layer: gate, up and down, 3 h f."""
        return 3 * self.hidden_size * self.moe_ffn

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def dense_bytes(self) -> float:
        """Everything but the experts (attention, router, embedding, LM head): an attention worker's weights."""
        return (self.num_layers * self.attention_params_per_layer + self.embedding_params) * self.weight_bytes

    def expert_bytes(self, num_experts: int) -> float:
        """`num_experts` experts in every layer."""
        return num_experts * self.num_layers * self.expert_params * self.weight_bytes

    @property
    def total_bytes(self) -> float:
        return self.dense_bytes + self.expert_bytes(self.num_experts)

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one cached token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes

    def kv_shards(self, tp: int) -> int:
        """GPUs a TP group splits the KV cache over: KV heads are replicated once tp exceeds their number."""
        return max(1, min(tp, self.num_kv_heads))


def _hf(arch: str, **kw: Any) -> dict[str, Any]:
    return {"architectures": [arch], "hidden_act": "silu", **kw}


# Hugging Face config.json excerpts: the presets go through the same parser as a checkpoint folder.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _hf(
        "Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_id=151645,
    ),
    "mixtral-8x22b": _hf(
        "MixtralForCausalLM",
        vocab_size=32768,
        hidden_size=6144,
        num_hidden_layers=56,
        num_attention_heads=48,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=16384,
    ),
    # ExpertPlex's evaluation model (section 7); the widths are those of MiniMax-M2's published config.json
    # (an assumption: the paper's M2.7 is taken to share them), weights in fp8 as the paper serves them.
    "minimax-m2": _hf(
        "MixtralForCausalLM",
        vocab_size=200064,
        hidden_size=3072,
        num_hidden_layers=62,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        num_local_experts=256,
        num_experts_per_tok=8,
        intermediate_size=1536,
    ),
}
PRESET_WEIGHT_BYTES = {"minimax-m2": 1}


def shape_from_spec(name: str, spec: MoeModelSpec, weight_bytes: int = 2) -> ModelShape:
    return ModelShape(
        name=name,
        hidden_size=spec.hidden_size,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
        moe_ffn=spec.moe_ffn_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=spec.vocab_size,
        weight_bytes=weight_bytes,
        tie_word_embeddings=spec.tie_word_embeddings,
    )


def model_preset(name: str) -> ModelShape:
    if name not in MODEL_PRESETS:
        raise ValueError(
            f"--model {name!r}: unknown preset; expected one of {sorted(MODEL_PRESETS)} or a folder"
        )
    spec = MoeModelSpec.from_hf_config(MODEL_PRESETS[name])
    return shape_from_spec(name, spec, PRESET_WEIGHT_BYTES.get(name, 2))


def gpu_preset(name: str) -> GpuSpec:
    if name not in GPU_PRESETS:
        raise ValueError(f"--gpu {name!r}: unknown preset; expected one of {sorted(GPU_PRESETS)}")
    return GPU_PRESETS[name]


def divisors(n: int, limit: int | None = None) -> list[int]:
    """Divisors of n, at most `limit`."""
    top = n if limit is None else min(n, limit)
    return [d for d in range(1, top + 1) if n % d == 0]


def powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]
