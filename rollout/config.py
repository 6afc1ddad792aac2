"""Configuration of the rollout side: the generation engine and the prompt data."""

from __future__ import annotations

from dataclasses import dataclass

from tppo.base.fields import spec


@dataclass
class RolloutConfig:
    """The inference engine that generates windows and records routing."""

    temperature: float = spec(1.0, ge=0)
    top_p: float = spec(1.0, gt=0, le=1)
    top_k: int = spec(0, ge=0, help="0 disables top-k filtering")
    dtype: str = spec("auto", choices=("auto", "float32", "bfloat16"))
    kv_cache_fraction: float = spec(0.5, gt=0, le=1, help="of free device memory")
    kv_cache_tokens: int = spec(0, ge=0, help="fixed KV cache size in tokens; 0 sizes it from memory")
    max_batch_size: int = spec(256, ge=1, help="concurrent sequences in continuous batching")
    max_model_len: int = spec(4096, ge=2, help="longest sequence (prompt + new tokens) a cache slot holds")
    max_prefill_tokens: int = spec(8192, ge=1, help="tokens per prefill forward; longer prompts are chunked")
    cuda_graphs: bool = True
    weight_sync_bucket_mb: int = spec(256, ge=1)


@dataclass
class DataConfig:
    """Prompts with their reference answers: a synthetic task or a dataset (JSONL, Parquet or a hub name)."""

    source: str = spec("synthetic", choices=("synthetic", "dataset"))
    path: str | None = None
    split: str = "train"
    prompt_key: str = "problem"
    answer_key: str = "answer"
    id_key: str = "id"
    template: str = spec("plain", help="a registered prompt template")
    tokenizer: str | None = spec(None, help="HF tokenizer path; None uses the built-in tokenizer")
    reward: str = spec("math", help="a registered reward function")
    reward_timeout_s: float = spec(30.0, gt=0, help="a reward call running longer scores as a failure")
    shuffle: bool = True
    max_prompt_length: int = spec(1024, ge=1)
