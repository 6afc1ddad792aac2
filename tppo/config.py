"""Typed configuration of a run: one dataclass per component, validated in one place.

Hydra composes YAML over these dataclasses (recipes/ registers them in its ConfigStore) and the entry point
converts the result to an `ExperimentConfig` once; nothing below recipes/ sees omegaconf. Field-level rules
(ranges, choices) are declared next to each field with `spec(...)`; rules that join several fields live in
`ExperimentConfig.validate`, so every check of a run's configuration is found in this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relibra.config import RelibraConfig
from rollout.config import DataConfig, RolloutConfig
from tppo.fields import ConfigError, check_fields, spec

__all__ = ["ConfigError", "ExperimentConfig"]


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
    micro_batch_size: int = spec(4, ge=1, help="sequences per micro-batch")


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
class AlgoConfig:
    """T-PPO with EGAE (specs/tppo.md) and the related estimators; defaults are the spec's."""

    estimator: str = spec("egae", choices=("egae", "gae", "grpo"))
    window: int = spec(8192, ge=1, help="W: new tokens per response per step")
    max_response_length: int = spec(24576, ge=1, help="L_max")
    group_size: int = spec(16, ge=1, help="G: responses per prompt")
    batch_size: int = spec(512, ge=1, help="items generated per step (continuations first)")
    gamma: float = spec(1.0, ge=0, le=1)
    lam: float = spec(0.95, ge=0, le=1, help="fixed policy lambda, or the floor of the adaptive one")
    lam_adaptive: bool = True
    lam_alpha: float = spec(0.05, gt=0)
    bootstrap: str = spec("repeat_last", choices=("repeat_last", "exact"))
    tail_mask: int = spec(0, ge=0)
    whiten: bool = True
    adv_clamp: float = spec(10.0, ge=0, help="0 disables clamping")
    policy_loss: str = spec("ppo_clip", choices=("ppo_clip",))
    loss_agg: str = spec("token_mean", choices=("token_mean", "sample_mean"))
    eps_low: float = spec(0.2, ge=0, lt=1)
    eps_high: float = spec(0.28, ge=0)
    dual_clip: float = spec(10.0, ge=0, help="c of dual clip; 0 disables")
    log_ratio_clamp: float = spec(20.0, gt=0)
    tis_cap: float = spec(0.0, ge=0, help="truncated importance sampling cap; 0 disables")
    pos_lm_coef: float = spec(0.1, ge=0)
    value_clip_low: float = spec(0.5, ge=0)
    value_clip_high: float = spec(0.6, ge=0)
    kl_coef: float = spec(0.0, ge=0)
    kl_estimator: str = spec("k3", choices=("k1", "k3"))
    entropy_coef: float = spec(0.0, ge=0)
    critic_warmup_steps: int = spec(10, ge=0)
    critic_old_values: str = spec("stored", choices=("stored", "recompute"))
    dynamic_sampling: bool = False
    overlong_buffer: int = spec(0, ge=0, help="DAPO L_cache; 0 disables overlong shaping")
    routing_replay: str = spec("r3", choices=("r3", "r2", "off"))
    warm_start_steps: int = spec(
        0, ge=0, help="supervised warm start of the policy on the task's demonstrations"
    )
    mini_batches: int = spec(1, ge=1, help="PPO mini-batches per step (only 1 is supported)")
    epochs: int = spec(1, ge=1, help="PPO epochs per step (only 1 is supported)")
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-6))


@dataclass
class ClusterConfig:
    """Where the roles run. Plumbing only; `ray_address` None starts a local Ray instance."""

    num_nodes: int = spec(1, ge=1)
    gpus_per_node: int = spec(0, ge=0, help="0: CPU-only (gloo)")
    cpus_per_node: int | None = None
    ray_address: str | None = None
    object_store_mb: int = spec(128, ge=64)
    placement: str = spec("colocated", choices=("colocated", "separate"))
    policy_ranks: int = spec(1, ge=1, help="trainer processes of the policy")
    critic_ranks: int = spec(1, ge=1)
    rollout_workers: int = spec(1, ge=1)
    offload: str = spec(
        "auto",
        choices=("auto", "on", "off"),
        help="time-share devices between roles (trainers offload while the rollout engine generates, the engine "
        "sleeps while they train); auto: on for colocated GPU runs",
    )

    @property
    def time_shared(self) -> bool:
        if self.offload == "auto":
            return bool(self.gpus_per_node) and self.placement == "colocated"
        return self.offload == "on"


@dataclass
class LoggingConfig:
    """Where metrics go. JSONL always; wandb `auto` = online with an API key, else offline."""

    wandb: str = spec("auto", choices=("auto", "online", "offline", "disabled"))
    project: str = "relibra-tppo"
    entity: str | None = None
    log_every: int = spec(1, ge=1)
    progress: bool = True


@dataclass
class RunConfig:
    """The run itself: its name (the run directory is stable for a name), length, seed, checkpoint schedule."""

    name: str = "default"
    output_dir: str = "runs"
    num_steps: int = spec(100, ge=0)
    seed: int = spec(0, ge=0)
    save_every: int = spec(0, ge=0, help="checkpoint every N steps; 0 only at the end")
    keep_checkpoints: int = spec(2, ge=1)
    eval_every: int = spec(0, ge=0)
    device: str = spec("auto", choices=("auto", "cpu", "cuda"))


SCORED_REWARDS = ("math", "exact")


@dataclass
class EvalConfig:
    """One sampled evaluation: what to load, how to sample, where results go (configs/eval.yaml composes it).

    `evaluate` reads only n, temperature, top_p, top_k, max_new_tokens, ks, seed, batch_size, name and
    data.reward / data.reward_timeout_s; the rest is for `run_eval`."""

    checkpoint: str | None = spec(
        None, help="HF folder, training checkpoint dir (step_NNNNNN) or run directory"
    )
    tokenizer: str | None = spec(
        None, help="tokenizer spec (see rollout.tokenizer.load_tokenizer); None: the checkpoint folder's own"
    )
    data: DataConfig = field(
        default_factory=lambda: DataConfig(source="dataset", template="math_chat", shuffle=False)
    )
    name: str | None = spec(None, help="label in metric keys and paths; None: the dataset file or hub name")
    limit: int = spec(0, ge=0, help="evaluate only the first N problems; 0: all")
    n: int = spec(32, ge=1, help="samples per problem")
    temperature: float = spec(0.6, ge=0)
    top_p: float = spec(0.95, gt=0, le=1)
    top_k: int = spec(0, ge=0, help="0 disables top-k")
    max_new_tokens: int = spec(32768, ge=1)
    ks: list[int] | None = None  # pass@k values; None: 1, 2, 4, ... up to n
    seed: int = spec(0, ge=0)
    batch_size: int = spec(256, ge=1, help="engine slots and requests per generate call (whole problems)")
    device: str = spec("auto", choices=("auto", "cpu", "cuda"))
    dtype: str = spec("auto", choices=("auto", "float32", "bfloat16"))
    kv_cache_fraction: float = spec(0.85, gt=0, le=1, help="of free device memory")
    kv_cache_tokens: int = spec(0, ge=0, help="fixed KV cache size in tokens; 0 sizes it from memory")
    cuda_graphs: bool = True
    verify_workers: int = spec(4, ge=1, help="math-verify worker processes")
    output_dir: str = "runs/eval"
    run_name: str | None = spec(None, help="results go to output_dir/run_name; None: <checkpoint>-<name>")
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> EvalConfig:
        """Check field ranges and the rules that join fields; raise ConfigError naming the keys."""
        check_fields(self)
        for k in self.pass_ks:
            if not 1 <= k <= self.n:
                raise ConfigError(f"ks contains {k}; every k must satisfy 1 <= k <= n={self.n}")
        if self.data.reward not in SCORED_REWARDS:
            raise ConfigError(
                f"data.reward={self.data.reward!r} is not a correctness reward; expected one of {SCORED_REWARDS}"
            )
        if self.tokenizer and self.data.tokenizer and self.tokenizer != self.data.tokenizer:
            raise ConfigError(
                f"tokenizer={self.tokenizer!r} and data.tokenizer={self.data.tokenizer!r} disagree; set one"
            )
        return self

    @property
    def pass_ks(self) -> list[int]:
        from tppo.eval_metrics import default_ks

        return sorted(set(self.ks)) if self.ks else default_ks(self.n)

    @property
    def tokenizer_spec(self) -> str | None:
        return self.tokenizer or self.data.tokenizer


@dataclass
class ExperimentConfig:
    """Everything a recipe needs, as composed by Hydra from configs/."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    relibra: RelibraConfig = field(default_factory=RelibraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # Every run.eval_every steps the loop evaluates the policy with the rollout engine it holds; of `eval`
    # it reads the data and sampling fields (n, temperature, top_p, top_k, max_new_tokens, ks, seed, limit).
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> ExperimentConfig:
        """Check field ranges, then the rules that join fields; raise ConfigError naming the keys."""
        check_fields(self)
        for rule in _CROSS_FIELD_RULES:
            problem = rule(self)
            if problem:
                raise ConfigError(problem)
        return self


def _model_rules(c: ExperimentConfig) -> str | None:
    m = c.model
    if m.moe_topk > m.num_experts:
        return f"model.moe_topk={m.moe_topk} exceeds model.num_experts={m.num_experts}"
    if m.num_attention_heads % m.num_query_groups:
        return (
            f"model.num_attention_heads={m.num_attention_heads} must be a multiple of "
            f"model.num_query_groups={m.num_query_groups}"
        )
    if m.first_k_dense >= m.num_layers:
        return f"model.first_k_dense={m.first_k_dense} leaves no MoE layer of model.num_layers={m.num_layers}"
    return None


def _parallel_rules(c: ExperimentConfig) -> str | None:
    p, m = c.parallel, c.model
    world = c.cluster.policy_ranks
    if world % (p.tensor_parallel * p.pipeline_parallel):
        return (
            f"cluster.policy_ranks={world} is not divisible by parallel.tensor_parallel x "
            f"parallel.pipeline_parallel = {p.tensor_parallel * p.pipeline_parallel}"
        )
    data_x_tensor = world // p.pipeline_parallel
    if data_x_tensor % p.expert_parallel:
        return (
            f"parallel.expert_parallel={p.expert_parallel} must divide the data x tensor ranks "
            f"({data_x_tensor} of cluster.policy_ranks={world})"
        )
    if m.num_experts % p.expert_parallel:
        return f"model.num_experts={m.num_experts} is not divisible by parallel.expert_parallel={p.expert_parallel}"
    if m.num_attention_heads % p.tensor_parallel or m.num_query_groups % p.tensor_parallel:
        return (
            f"parallel.tensor_parallel={p.tensor_parallel} must divide the attention heads and query groups"
        )
    moe_layers = m.num_layers - m.first_k_dense
    if p.pipeline_parallel > m.num_layers:
        return f"parallel.pipeline_parallel={p.pipeline_parallel} exceeds model.num_layers={m.num_layers}"
    if moe_layers < 1:
        return "model has no MoE layer"
    return None


def _algo_rules(c: ExperimentConfig) -> str | None:
    a = c.algo
    if a.batch_size % a.group_size:
        return f"algo.batch_size={a.batch_size} must be a multiple of algo.group_size={a.group_size}"
    if a.estimator in ("gae", "grpo") and a.window < a.max_response_length:
        return (
            f"algo.estimator={a.estimator} needs whole responses: set algo.window >= "
            f"algo.max_response_length={a.max_response_length} (windows need egae)"
        )
    if a.estimator == "grpo" and a.group_size < 2:
        return "algo.estimator=grpo needs algo.group_size >= 2"
    if a.max_response_length > c.model.max_position_embeddings:
        return (
            f"algo.max_response_length={a.max_response_length} exceeds "
            f"model.max_position_embeddings={c.model.max_position_embeddings}"
        )
    need = c.data.max_prompt_length + a.max_response_length
    if c.rollout.max_model_len < need:
        return (
            f"rollout.max_model_len={c.rollout.max_model_len} cannot hold data.max_prompt_length + "
            f"algo.max_response_length = {need} tokens"
        )
    if c.rollout.max_model_len > c.model.max_position_embeddings:
        return (
            f"rollout.max_model_len={c.rollout.max_model_len} exceeds "
            f"model.max_position_embeddings={c.model.max_position_embeddings}"
        )
    if a.overlong_buffer >= a.max_response_length:
        return f"algo.overlong_buffer={a.overlong_buffer} must be below algo.max_response_length"
    for name in ("mini_batches", "epochs"):
        if getattr(a, name) != 1:
            return (
                f"algo.{name}={getattr(a, name)} is not supported: the policy and the critic take one optimizer "
                "step per training step over the whole batch (the spec's reference runs: one mini-batch, 1 epoch)"
            )
    return None


def _cluster_rules(c: ExperimentConfig) -> str | None:
    cl, p = c.cluster, c.parallel
    gpus = cl.num_nodes * cl.gpus_per_node
    if c.run.device == "cuda" and gpus == 0:
        return "run.device=cuda needs cluster.gpus_per_node >= 1"
    if gpus and cl.placement == "colocated" and cl.policy_ranks > gpus:
        return f"cluster.policy_ranks={cl.policy_ranks} exceeds the {gpus} GPUs of the cluster"
    if gpus and cl.placement == "separate" and cl.policy_ranks + cl.critic_ranks + cl.rollout_workers > gpus:
        return (
            f"separate placement needs policy_ranks + critic_ranks + rollout_workers = "
            f"{cl.policy_ranks + cl.critic_ranks + cl.rollout_workers} GPUs; the cluster has {gpus}"
        )
    if cl.num_nodes > 1 and gpus and cl.policy_ranks % cl.num_nodes:
        return f"cluster.policy_ranks={cl.policy_ranks} cannot be spread evenly over cluster.num_nodes={cl.num_nodes}"
    # An EP group smaller than a node lives inside one node; a larger one must span whole nodes.
    if (
        c.relibra.enabled
        and p.expert_parallel > c.relibra.gpus_per_node
        and p.expert_parallel % c.relibra.gpus_per_node
    ):
        return (
            f"parallel.expert_parallel={p.expert_parallel} is not a multiple of "
            f"relibra.gpus_per_node={c.relibra.gpus_per_node}"
        )
    return None


def _eval_rules(c: ExperimentConfig) -> str | None:
    if not c.run.eval_every:
        return None
    if c.data.source != "dataset":
        return (
            f"run.eval_every={c.run.eval_every} needs a dataset task (data.source=dataset, with a tokenizer) to "
            f"evaluate; data.source is {c.data.source!r}"
        )
    try:
        c.eval.validate()
    except ConfigError as err:
        return f"eval: {err}"
    return None


_CROSS_FIELD_RULES = (_model_rules, _parallel_rules, _algo_rules, _cluster_rules, _eval_rules)
