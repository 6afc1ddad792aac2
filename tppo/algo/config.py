"""The algorithm's configuration: T-PPO with EGAE and its estimators, losses and the two optimizers."""

from __future__ import annotations

from dataclasses import dataclass, field

from tppo.base.fields import spec
from tppo.engine.config import OptimConfig


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
    dynamic_sampling: bool = spec(
        False,
        help="DAPO: groups whose rewards are all equal are removed before the updates and the batch is refilled "
        "from further prompts (needs whole responses: algo.window >= algo.max_response_length)",
    )
    dynamic_sampling_rounds: int = spec(
        3, ge=1, help="refill generations per step at most (the bound on over-sampling)"
    )
    overlong_buffer: int = spec(0, ge=0, help="DAPO L_cache; 0 disables overlong shaping")
    routing_replay: str = spec("r3", choices=("r3", "r2", "off"))
    warm_start_steps: int = spec(
        0, ge=0, help="supervised warm start of the policy on the task's demonstrations"
    )
    mini_batches: int = spec(
        1,
        ge=1,
        help="optimizer steps per epoch of the policy's and the critic's updates (each over its share of the "
        "micro-batches, at most one per micro-batch)",
    )
    epochs: int = spec(1, ge=1, help="passes over the step's batch, micro-batches reshuffled each pass")
    old_logprobs: str = spec(
        "auto",
        choices=("auto", "pass", "update"),
        help="the policy's pre-update log-probs: from a forward pass of their own before the update (pass), or "
        "from the update's own forward, which still runs the old weights when the update is one optimizer step "
        "(update: needs algo.mini_batches = algo.epochs = 1 and routing_replay other than r2, whose routing that "
        "pass records); auto: update where it can, else pass",
    )
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-6))

    @property
    def old_logprobs_from_update(self) -> bool:
        """Whether the update's forward gives the old log-probs (algo.old_logprobs; see its help)."""
        if self.old_logprobs == "auto":
            return self.mini_batches * self.epochs == 1 and self.routing_replay != "r2"
        return self.old_logprobs == "update"
