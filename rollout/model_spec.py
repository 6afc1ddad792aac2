"""The architecture the rollout engine runs, read from a Hugging Face `config.json` (Qwen3-MoE or Mixtral).

Parsed by hand (no transformers import) so the engine starts on machines whose transformers differs from ours.
Supported: `Qwen3MoeForCausalLM` (q/k RMSNorm, optional dense layers through `mlp_only_layers` and
`decoder_sparse_step`, `norm_topk_prob`) and `MixtralForCausalLM` (top-k weights always renormalised). Not
supported, with a clear error: sliding-window attention, RoPE scaling other than the default, activations other
than SiLU, shared experts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}


@dataclass(frozen=True)
class MoeModelSpec:
    """Shapes and options of one MoE decoder; `moe_layers[i]` says whether layer i routes to experts."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_ffn_size: int
    dense_ffn_size: int
    moe_layers: tuple[bool, ...]
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None = None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of K and V one token occupies in the cache, over all layers."""
        return 2 * self.num_layers * self.kv_size * element_size

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> MoeModelSpec:
        archs = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            arch = {"qwen3_moe": "qwen3_moe", "mixtral": "mixtral"}.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"config: architectures={archs!r} model_type={cfg.get('model_type')!r} is not supported; "
                f"expected one of {sorted(ARCHITECTURES)}"
            )
        _check_supported(cfg)
        num_layers = int(cfg["num_hidden_layers"])
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if num_experts <= 0:
            raise ValueError(f"config: num_experts={num_experts} is not supported; expected a MoE model")
        if arch == "qwen3_moe":
            moe_ffn, dense_ffn = int(cfg["moe_intermediate_size"]), int(cfg.get("intermediate_size") or 0)
            only = set(cfg.get("mlp_only_layers") or [])
            step = int(cfg.get("decoder_sparse_step") or 1)
            moe_layers = tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers))
            norm_topk = bool(cfg.get("norm_topk_prob", False))
        else:
            moe_ffn, dense_ffn = int(cfg["intermediate_size"]), 0
            moe_layers = (True,) * num_layers
            norm_topk = True
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            num_experts=num_experts,
            top_k=int(cfg["num_experts_per_tok"]),
            moe_ffn_size=moe_ffn,
            dense_ffn_size=dense_ffn,
            moe_layers=moe_layers,
            norm_topk_prob=norm_topk,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            qk_norm=arch == "qwen3_moe",
            attention_bias=bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            eos_token_ids=_as_ids(cfg.get("eos_token_id")),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> MoeModelSpec:
        """Read `config.json` (and `generation_config.json` for the EOS ids, when present) from a checkpoint folder."""
        root = Path(path)
        cfg_file = root / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"path={str(path)!r}: no config.json; expected a Hugging Face checkpoint folder"
            )
        cfg = json.loads(cfg_file.read_text())
        gen_file = root / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            if gen_eos is not None:
                cfg = {**cfg, "eos_token_id": gen_eos}
        return cls.from_hf_config(cfg)


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _check_supported(cfg: dict[str, Any]) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config: hidden_act={cfg.get('hidden_act')!r} is not supported; expected 'silu'")
    sliding = cfg.get("sliding_window")
    if sliding is not None and cfg.get("use_sliding_window", True):
        raise ValueError(f"config: sliding_window={sliding} is not supported; expected null")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config: rope_type={rope_type!r} is not supported; expected 'default'")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError("config: shared experts are not supported by the rollout engine")
