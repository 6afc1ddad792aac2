"""The engine's configuration: the MoE architecture, how ranks split it, and one model's optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field

from tppo.base.fields import spec


@dataclass
class ModelConfig:
    """Architecture of the MoE policy (and of the critic's trunk). `hf_path` loads weights instead of random init."""

    arch: str = spec("qwen3_moe", choices=("qwen3_moe", "mixtral"))
    hf_path: str | None = None
    vocab_size: int = spec(64, ge=2)
    hidden_size: int = spec(64, ge=1)
    num_layers: int = spec(2, ge=1)
    num_attention_heads: int = spec(4, ge=1)
    num_query_groups: int = spec(2, ge=1, help="key/value heads (GQA)")
    head_dim: int = spec(16, ge=1)
    ffn_hidden_size: int = spec(128, ge=1, help="FFN size of dense (non-MoE) layers")
    moe_ffn_hidden_size: int = spec(32, ge=1)
    num_experts: int = spec(8, ge=1)
    moe_topk: int = spec(2, ge=1)
    norm_topk_prob: bool = True
    shared_expert_ffn_hidden_size: int = spec(0, ge=0, help="0: no shared expert")
    first_k_dense: int = spec(0, ge=0, help="leading dense layers before the MoE layers")
    rms_norm_eps: float = spec(1e-6, gt=0)
    rope_theta: float = spec(10000.0, gt=0)
    max_position_embeddings: int = spec(2048, ge=1)
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = spec(0.0, ge=0)
    init_std: float = spec(0.02, gt=0)
    dtype: str = spec("float32", choices=("float32", "bfloat16"))


@dataclass
class ParallelConfig:
    """How trainer ranks split the model. World size = data x tensor x pipeline ranks; EP divides data x tensor."""

    tensor_parallel: int = spec(1, ge=1)
    pipeline_parallel: int = spec(1, ge=1)
    expert_parallel: int = spec(1, ge=1)
    sequence_parallel: bool = False
    recompute: bool = spec(False, help="activation recompute of whole layers")
    micro_batch_size: int = spec(
        4, ge=1, help="sequences per micro-batch (the most, with micro_batch_tokens)"
    )
    micro_batch_tokens: int = spec(
        0,
        ge=0,
        help="> 0: micro-batches of sequences of similar length, each at most this many padded tokens (rows x "
        "longest row); 0: micro_batch_size sequences each in sample order",
    )


@dataclass
class OptimConfig:
    """One model's optimizer: AdamW with warmup then constant/cosine LR, gradient clipping."""

    lr: float = spec(1e-6, gt=0)
    min_lr: float = spec(0.0, ge=0)
    weight_decay: float = spec(0.0, ge=0)
    beta1: float = spec(0.9, ge=0, lt=1)
    beta2: float = spec(0.999, ge=0, lt=1)
    eps: float = spec(1e-8, gt=0)
    grad_clip: float = spec(1.0, ge=0, help="0 disables clipping")
    warmup_steps: int = spec(0, ge=0)
    schedule: str = spec("constant", choices=("constant", "cosine"))


@dataclass
class BackendConfig:
    """Which training engine runs one role: Megatron-Core (the default; TP/PP/EP, ReLibra, routing replay) or
    DeepSpeed ZeRO over transformers' own model (data parallel only: any Hugging Face architecture, a critic of
    another shape, a reference in host memory)."""

    engine: str = spec("megatron", choices=("megatron", "deepspeed"))
    zero_stage: int = spec(
        2, choices=(2, 3), help="deepspeed: 2 shards optimizer state and gradients, 3 also weights"
    )
    offload_optimizer: bool = spec(False, help="deepspeed: optimizer state in host memory")
    offload_param: bool = spec(False, help="deepspeed, zero_stage=3: parameters in host memory")


@dataclass
class BackendsConfig:
    """The training engine of each trainer role."""

    policy: BackendConfig = field(default_factory=BackendConfig)
    critic: BackendConfig = field(default_factory=BackendConfig)
    reference: BackendConfig = field(default_factory=BackendConfig)
