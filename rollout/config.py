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
    max_batch_size: int = spec(256, ge=1, help="sequences decoded at once at most")
    max_model_len: int = spec(
        0, ge=0, help="longest sequence (prompt + new tokens); 0 takes the model's max_position_embeddings"
    )
    kv_block_size: int = spec(
        16,
        ge=0,
        help="positions per KV cache block (a multiple of 16); 0: one max_model_len slot per sequence",
    )
    max_step_tokens: int = spec(
        2048, ge=1, help="tokens per engine step: one per decoding sequence, prompt chunks fill the rest"
    )
    expert_kernel: str = spec(
        "auto",
        choices=("auto", "grouped", "padded", "persistent"),
        help="expert MLP path: persistent: the tile-scheduled Triton kernel (rollout.kernels, decode tiles first; "
        "CUDA or TRITON_INTERPRET=1); grouped GEMMs; padded bmm for decode batches; auto: persistent on CUDA, "
        "grouped on the CPU",
    )
    max_decode_slowdown: float = spec(
        0.0,
        ge=0,
        help="size each mixed step's prefill so decoding rows slow by at most this fraction (a tile cost model "
        "fitted from the engine's own steps, rollout.step_cost); 0: prefill fills max_step_tokens",
    )
    micro_batches: int = spec(
        0,
        ge=0,
        le=4,
        help="disaggregated layout: micro-batches per step shuttling between attention and expert workers "
        "(ping-pong); 0 = auto (3)",
    )
    cuda_graphs: bool = True
    overlap_steps: bool = spec(
        False,
        help="schedule and launch each engine step while the device runs the one before (the host's work per step "
        "hides behind the device's; the same steps and bits as waiting); off: every step is waited for before "
        "the next is scheduled",
    )
    cuda_graph_max_tokens: int = spec(4096, ge=1, help="steps of at most this many tokens run as CUDA graphs")
    trace_steps: bool = spec(False, help="record every step in last_stats.steps (benchmarks)")
    weight_sync_bucket_mb: int = spec(
        256,
        ge=1,
        help="weight sync unit: the policy streams its weights to the engines in buckets of this size (capped "
        "at a third of cluster.object_store_mb, so the buckets in flight never spill)",
    )


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
    countdown_max: int = spec(
        60,
        gt=4,
        help="source=synthetic: starts of the countdown are below this; its numbers are token ids, so it needs "
        "model.vocab_size >= countdown_max + 4 and algo.max_response_length >= countdown_max",
    )
