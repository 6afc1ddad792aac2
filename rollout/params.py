"""Per-request sampling parameters (no torch import: drivers build these without loading the engine)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to generate one request's tokens (`ignore_eos` is for benchmarks: only stop ids and length stop it)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an int >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r}: expected a number >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: expected 0 < top_p <= 1")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an int >= 0 (0 disables top-k)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed={self.seed!r}: expected an int or None")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
