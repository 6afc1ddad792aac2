"""The configuration of a run: `ExperimentConfig` composes the layers' own dataclasses and checks the rules that
join them.

Each layer owns its config (tppo.engine.config: model, parallel, optimizer; tppo.algo.config; tppo.cluster.config;
tppo.eval.config; tppo.base.metrics.LoggingConfig; relibra.config; rollout.config), with the field-level rules
(ranges, choices) declared next to each field with `spec(...)`. Hydra composes YAML over them (recipes/ registers
them in its ConfigStore) and the entry point converts the result to an `ExperimentConfig` once; nothing below
recipes/ sees omegaconf. The rules that join fields of several layers live here, in `ExperimentConfig.validate`.
Only tppo.loop and recipes/ import this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from relibra.config import RelibraConfig
from rollout.config import DataConfig, RolloutConfig
from tppo.algo.config import AlgoConfig
from tppo.base.fields import ConfigError, check_fields, spec
from tppo.base.metrics import LoggingConfig
from tppo.cluster.config import ClusterConfig
from tppo.engine.config import BackendsConfig, ModelConfig, ParallelConfig
from tppo.eval.config import EvalConfig

__all__ = ["ConfigError", "ExperimentConfig"]


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
    device: str = spec(
        "auto",
        choices=("auto", "cuda"),
        help="cuda: the experiment needs GPUs (validated here; recipes.submit refuses a job without them); the roles "
        "run on GPUs exactly when cluster.gpus_per_node >= 1",
    )


@dataclass
class ExperimentConfig:
    """Everything a recipe needs, as composed by Hydra from configs/."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    backend: BackendsConfig = field(default_factory=BackendsConfig)
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

    @property
    def max_model_len(self) -> int:
        """The rollout engine's longest sequence: rollout.max_model_len, or the model's limit when it is 0."""
        return self.rollout.max_model_len or self.model.max_position_embeddings

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
    if c.max_model_len < need:
        return (
            f"rollout.max_model_len={c.max_model_len} cannot hold data.max_prompt_length + "
            f"algo.max_response_length = {need} tokens"
        )
    if c.rollout.max_model_len > c.model.max_position_embeddings:
        return (
            f"rollout.max_model_len={c.rollout.max_model_len} exceeds "
            f"model.max_position_embeddings={c.model.max_position_embeddings}"
        )
    if a.dynamic_sampling and a.window < a.max_response_length:
        return (
            f"algo.dynamic_sampling needs whole responses: set algo.window >= algo.max_response_length="
            f"{a.max_response_length} (with windows a group's rewards are known only once its last response "
            "finishes, after the others' windows have trained)"
        )
    if a.dynamic_sampling and a.group_size < 2:
        return "algo.dynamic_sampling needs algo.group_size >= 2 (a group of one always has equal rewards)"
    if a.overlong_buffer >= a.max_response_length:
        return f"algo.overlong_buffer={a.overlong_buffer} must be below algo.max_response_length"
    if a.old_logprobs == "update" and a.mini_batches * a.epochs > 1:
        return (
            f"algo.old_logprobs=update needs one optimizer step per update (algo.mini_batches={a.mini_batches}, "
            f"algo.epochs={a.epochs}): after the first step the weights are no longer the old policy's"
        )
    if a.old_logprobs == "update" and a.routing_replay == "r2":
        return (
            "algo.old_logprobs=update cannot run with algo.routing_replay=r2: its replayed routing is recorded by "
            "a forward pass before the update"
        )
    return None


def _cluster_rules(c: ExperimentConfig) -> str | None:
    cl, p = c.cluster, c.parallel
    gpus = cl.num_nodes * cl.gpus_per_node
    if c.run.device == "cuda" and gpus == 0:
        return "run.device=cuda needs cluster.gpus_per_node >= 1"
    if gpus and cl.placement == "colocated" and cl.policy_ranks > gpus:
        return f"cluster.policy_ranks={cl.policy_ranks} exceeds the {gpus} GPUs of the cluster"
    if gpus and cl.placement == "separate" and cl.policy_ranks + cl.critic_ranks + cl.rollout_ranks > gpus:
        return (
            f"separate placement needs policy_ranks + critic_ranks + rollout processes = "
            f"{cl.policy_ranks + cl.critic_ranks + cl.rollout_ranks} GPUs; the cluster has {gpus}"
        )
    if cl.rollout_layout == "disaggregated" and cl.time_shared:
        return (
            "cluster.rollout_layout=disaggregated needs devices of its own: its workers do not time-share them "
            f"with the trainers (cluster.placement={cl.placement}, cluster.offload={cl.offload}); set "
            "cluster.placement=separate or cluster.offload=off"
        )
    if cl.overlap_updates == "on" and cl.time_shared:
        return (
            "cluster.overlap_updates=on needs roles that do not time-share devices (the critic offloads after its "
            f"update to make room for the policy's; cluster.placement={cl.placement}, cluster.offload="
            f"{cl.offload}): set cluster.offload=off or cluster.placement=separate"
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


def _run_rules(c: ExperimentConfig) -> str | None:
    name = c.run.name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        return (
            f"run.name={name!r} must be a plain name (letters, digits, '.', '_', '-'; no path): the run directory "
            f"is {c.run.output_dir}/<run.name>"
        )
    return None


def _backend_rules(c: ExperimentConfig) -> str | None:
    """The DeepSpeed backend is data parallel over transformers' model: no TP/PP/EP, no ReLibra."""
    b, p = c.backend, c.parallel
    for role in ("policy", "critic", "reference"):
        r = getattr(b, role)
        if r.offload_param and r.zero_stage != 3:
            return f"backend.{role}.offload_param=true needs backend.{role}.zero_stage=3"
    if b.policy.engine == "deepspeed":
        if c.relibra.enabled:
            return (
                "backend.policy.engine=deepspeed cannot run relibra.enabled=true (ReLibra places the experts of "
                "the Megatron backend's expert parallelism)"
            )
        split = {"tensor_parallel": p.tensor_parallel, "pipeline_parallel": p.pipeline_parallel}
        split["expert_parallel"] = p.expert_parallel
        for name, size in split.items():
            if size > 1:
                return f"backend.policy.engine=deepspeed runs data parallel only: parallel.{name}={size} needs megatron"
    return None


_CROSS_FIELD_RULES = (
    _run_rules,
    _model_rules,
    _parallel_rules,
    _backend_rules,
    _algo_rules,
    _cluster_rules,
    _eval_rules,
)
