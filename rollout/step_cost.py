"""How much prefill a mixed step may carry so its decoding rows slow by at most a set fraction (ExpertPlex's tile
cost model, its section 6; `rollout.max_decode_slowdown`).

A step of `rows` decoding rows attending to `keys` cached positions, plus `p` prefill tokens, is modelled as

    t = c0 + c_rows rows + c_keys keys + c_dtiles x_dec + c_ptok p + c_ptiles x_pre

with x_dec = sum_l sum_e ceil(m_le^dec / M_dec) and x_pre = sum_l sum_e ceil(m_le^pre / M_pre) the MoE tiles of
each phase over the L MoE layers (m_le: the phase's (token, expert) pairs of expert e in layer l; M: the tile
heights of the persistent kernel, 16 for decode and 64 for prefill). The coefficients are fitted by
non-negative least squares from the engine's own steps (their wall time and their actual tiles, counted from
the routing they recorded). Before a step the tiles are not known yet: they are taken at their expectation under
uniform routing, E[x] = L E E[ceil(m / M)] with m ~ Binomial(tokens, K / E).

The prefill budget of a step is the largest p with

    c_ptok p + c_ptiles E[x_pre(p)] <= s (c0 + c_rows rows + c_keys keys + c_dtiles E[x_dec(rows)]),

i.e. predicted time <= (1 + s) x the decode-only step's, and at least `min_tokens` so prefill always progresses.
Both sides grow monotonically in p, so a binary search finds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from rollout.kernels.persistent_moe import BLOCK_M_DECODE, BLOCK_M_PREFILL
from rollout.plan.perf import expected_tiles, tiles

FEATURES = ("one", "rows", "keys", "dec_tiles", "prefill_tokens", "prefill_tiles")


def layer_expert_counts(routes_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """[L * E]: the (token, top-k) pairs of each MoE layer's experts in a step's routing."""
    layers = routes_TLK.shape[1]
    flat = (np.arange(layers)[None, :, None] * num_experts + routes_TLK.astype(np.int64)).ravel()
    return np.bincount(flat, minlength=layers * num_experts)


def phase_tiles(routes_TLK: np.ndarray, num_experts: int, tile_m: int) -> int:
    """sum over MoE layers l and experts e of ceil(m_le / tile_m): the tiles one phase's tokens occupy."""
    return tiles(layer_expert_counts(routes_TLK, num_experts), tile_m)


@dataclass(frozen=True)
class StepShape:
    """What the cost model reads of a step (tiles summed over the MoE layers)."""

    rows: int
    keys: int
    dec_tiles: float
    prefill_tokens: int
    prefill_tiles: float

    def features(self) -> np.ndarray:
        return np.array([1.0, self.rows, self.keys, self.dec_tiles, self.prefill_tokens, self.prefill_tiles])


@dataclass
class PrefillBudget:
    """The fitted model and the budget rule (see the module docstring). `record` feeds it the engine's steps;
    it refits every `refit_every` steps once it has `min_steps`, at least `min_each` of them decode-only and
    mixed; unfitted, the budget is `max_tokens`."""

    slowdown: float
    num_experts: int
    top_k: int
    num_moe_layers: int
    max_tokens: int
    min_tokens: int = 16
    min_steps: int = 12
    min_each: int = 3
    refit_every: int = 8
    coef: np.ndarray | None = None
    _X: list[np.ndarray] = field(default_factory=list)
    _y: list[float] = field(default_factory=list)

    def record(self, shape: StepShape, seconds: float) -> None:
        self._X.append(shape.features())
        self._y.append(seconds)
        if len(self._y) >= self.min_steps and len(self._y) % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        """Non-negative least squares over the recorded steps (kept unfitted without both kinds of step)."""
        X = np.stack(self._X)
        mixed = int((X[:, 4] > 0).sum())
        decode_only = int(((X[:, 1] > 0) & (X[:, 4] == 0)).sum())
        if min(mixed, decode_only) < self.min_each:
            return
        self.coef, _ = nnls(X, np.asarray(self._y))

    def expected(self, rows: int, keys: int, prefill_tokens: int) -> StepShape:
        """A step's shape before it runs: its tiles at their expectation under uniform routing."""
        e, k, layers = self.num_experts, self.top_k, self.num_moe_layers
        return StepShape(
            rows,
            keys,
            layers * expected_tiles(rows, e, k, BLOCK_M_DECODE),
            prefill_tokens,
            layers * expected_tiles(prefill_tokens, e, k, BLOCK_M_PREFILL),
        )

    def predict(self, shape: StepShape) -> float:
        if self.coef is None:
            raise ValueError("the step cost model is not fitted yet")
        return float(shape.features() @ self.coef)

    def budget(self, rows: int, keys: int) -> int:
        """Prefill tokens a step with these decoding rows may carry (max_tokens while unfitted or without rows)."""
        if self.coef is None or rows == 0:
            return self.max_tokens
        bound = (1.0 + self.slowdown) * self.predict(self.expected(rows, keys, 0))
        lo, hi = 0, self.max_tokens  # lo fits; find the largest p that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(self.expected(rows, keys, mid)) <= bound:
                lo = mid
            else:
                hi = mid - 1
        return max(lo, min(self.min_tokens, self.max_tokens))
