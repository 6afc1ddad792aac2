"""One sampled evaluation's configuration (the eval recipe's schema, and `eval.` of a training run)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.config import DataConfig
from tppo.base.fields import ConfigError, check_fields, spec
from tppo.base.metrics import LoggingConfig
from tppo.eval.metrics import default_ks

# "synthetic": the countdown task's own verdict (tppo.eval.countdown), for data.source=synthetic only
SCORED_REWARDS = ("math", "exact", "synthetic")


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
    max_new_tokens: int = spec(32768, ge=1, help="data=synthetic: at most the countdown's longest answer, 61")
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
        if (self.data.source == "synthetic") != (self.data.reward == "synthetic"):
            raise ConfigError(
                f"data.source={self.data.source!r} with data.reward={self.data.reward!r}: the synthetic "
                "(countdown) task is scored by its own verifier and only it; use data=synthetic or a dataset "
                "with math/exact"
            )
        return self

    @property
    def pass_ks(self) -> list[int]:
        return sorted(set(self.ks)) if self.ks else default_ks(self.n)

    @property
    def tokenizer_spec(self) -> str | None:
        return self.tokenizer or self.data.tokenizer
