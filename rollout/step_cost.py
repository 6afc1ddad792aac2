"""How much prefill a mixed step may carry so its decoding rows slow by at most a set fraction (ExpertPlex's tile
cost model, its section 6; `rollout.max_decode_slowdown`).

A step of `rows` decoding rows attending to `keys` cached positions, plus `p` prefill tokens, is modelled as

    t = c0 + c_rows rows + c_keys keys + c_dtiles x_dec + c_ptok p + c_ptiles x_pre

with x_dec and x_pre the persistent kernel's decode and prefill tiles over the L MoE layers, sum_l sum_e
ceil(m_le / M) (m_le: the (token, expert) pairs of expert e in layer l that the tiles hold; M: their height,
BLOCK_M_PREFILL, or for decode tiles BLOCK_M_DECODE below S tokens in them and BLOCK_M_DECODE_WIDE from S on).
The kernel cuts a mixed step's tokens by the size of its prefill segment (rollout.kernels.tiling): at most S
tokens go into decode tiles with the decoding rows (x_dec counts the tiles of all rows + p tokens, x_pre is 0),
a larger segment takes the rows into prefill tiles with it (x_pre counts them all, x_dec is 0). The
coefficients are fitted by non-negative least squares from the engine's own steps (their wall time and their
actual tiles, counted from the routing they recorded). Before a step the tiles are not known yet: they are taken
at their expectation under uniform routing, E[x] = L E E[ceil(m / M)] with m ~ Binomial(tokens, K / E).

The prefill budget of a step is the largest p whose extra time, over the decode-only step's, stays within
s x that step's time:

    extra(p) = c_ptok p + c_ptiles E[x_pre(rows + p)] - c_dtiles E[x_dec(rows)]  (all in prefill tiles: p > S)
    extra(p) = c_ptok p + c_dtiles (E[x_dec(rows + p)] - E[x_dec(rows)])         (all in decode tiles: p <= S)
    extra(p) <= s (c0 + c_rows rows + c_keys keys + c_dtiles E[x_dec(rows)]),

i.e. predicted time <= (1 + s) x the decode-only step's. The first branch grows monotonically in p: it is
tabulated for p = 0..max_tokens once per fit and number of decoding rows and searched above S. The second drops
where rows + p reaches S and the decode tiles widen; its S + 1 values are computed per step and scanned, so a
step's budget costs microseconds of host time.

When not even `min_tokens` fit the bound, no chunk size keeps it, and throttling would only multiply the mixed
steps: a few decoding rows of a fine-grained MoE touch a fraction of its experts, and the first prefill tokens
touch most of the rest, so a step's extra time is mostly fixed (on an H100, 48 layers of 128 experts top-8 at ~10
decode rows: 12.9 ms decode-only, 24.7 ms with 16 prefill tokens in prefill tiles, about 3x with ~2,000). The
step then carries the chunk that costs the decoding rows least per prefill token, the smallest within 1% of the
best over `min_tokens`, twice that, ... and `max_tokens`: all of `max_tokens` when the extra time is mostly fixed,
the floor when it grows with the tokens. `unmet_steps` counts those steps, and the first one is logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from rollout.kernels.tiling import (
    BLOCK_M_DECODE,
    BLOCK_M_DECODE_WIDE,
    BLOCK_M_PREFILL,
    decode_block_m,
    kernel_num_decode,
    max_small_prefill,
)
from rollout.plan.perf import expected_tiles, tiles

log = logging.getLogger(__name__)

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


class _ExpectedTiles:
    """E[x(n)] over the MoE layers for n = 0, 1, ... tokens in tiles of one height, computed once and extended on
    demand."""

    def __init__(self, layers: int, num_experts: int, top_k: int, tile_m: int):
        self.layers, self.num_experts, self.top_k, self.tile_m = layers, num_experts, top_k, tile_m
        self.table_N = np.zeros(0)

    def upto(self, n: int) -> np.ndarray:
        """[n + 1]: E[x(0..n)]."""
        have = len(self.table_N)
        if have <= n:
            more = [
                self.layers * expected_tiles(t, self.num_experts, self.top_k, self.tile_m)
                for t in range(have, n + 1)
            ]
            self.table_N = np.concatenate([self.table_N, more])
        return self.table_N[: n + 1]


class _Ring:
    """The last `size` steps of one stratum."""

    def __init__(self, size: int):
        self.X, self.y, self.added = np.zeros((size, len(FEATURES))), np.zeros(size), 0

    @property
    def held(self) -> int:
        return min(self.added, len(self.y))

    def add(self, features: np.ndarray, seconds: float) -> None:
        slot = self.added % len(self.y)
        self.X[slot], self.y[slot] = features, seconds
        self.added += 1


@dataclass
class PrefillBudget:
    """The fitted model and the budget rule (see the module docstring). `record` feeds it the engine's steps;
    it refits once it has `min_steps`, at least `min_each` of them decode-only and mixed; unfitted, the budget is
    `max_tokens`. The engine does not record steps that captured a CUDA graph.

    Memory is bounded and keeps every scale of step it has seen: steps fall into strata by the binary
    magnitude of their decoding rows and of their prefill tokens, and each stratum keeps its last `per_stratum`
    steps. An engine records every step of every rollout for its whole life (a run of RL steps makes millions),
    so a fit over all of them grew without bound; one over the last steps alone forgets what it has not seen
    lately, and a throttled engine sees only the small chunks it allows: their tokens and tiles grow together
    (each pair its own tile), so the split between c_ptok and c_ptiles, which decides a large chunk's cost, was
    left to noise and then never tested again. The model refits every `refit_every` steps until `window`
    steps were recorded, then every window / 8 (host time linear in the steps)."""

    slowdown: float
    num_experts: int
    top_k: int
    num_moe_layers: int
    max_tokens: int
    min_tokens: int = 16
    min_steps: int = 12
    min_each: int = 3
    refit_every: int = 8
    window: int = 2048
    per_stratum: int = 64
    outlier: float = 2.0
    coef: np.ndarray | None = None
    unmet_steps: int = 0
    recorded: int = 0  # steps recorded over the model's life
    # (rows scale, prefill scale) -> a ring of that stratum's last steps: features [per_stratum, F], seconds
    _strata: dict[tuple[int, int], _Ring] = field(default_factory=dict)
    _tiles: dict[int, _ExpectedTiles] = field(init=False)  # tile height -> E[x(n)] over the MoE layers
    # rows -> [max_tokens + 1]: extra(p) of p prefill tokens in prefill tiles beside `rows` rows, under `coef`
    _extra: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layers, e, k = self.num_moe_layers, self.num_experts, self.top_k
        heights = (BLOCK_M_DECODE, BLOCK_M_DECODE_WIDE, BLOCK_M_PREFILL)
        self._tiles = {m: _ExpectedTiles(layers, e, k, m) for m in heights}

    @property
    def small_prefill(self) -> int:
        """S: the most prefill tokens the kernel still cuts into decode tiles."""
        return min(self.max_tokens, max_small_prefill(self.top_k, self.num_experts))

    def record(self, shape: StepShape, seconds: float) -> None:
        key = (shape.rows.bit_length(), shape.prefill_tokens.bit_length())
        if key not in self._strata:
            self._strata[key] = _Ring(self.per_stratum)
        self._strata[key].add(shape.features(), seconds)
        self.recorded += 1
        every = self.refit_every if self.recorded <= self.window else max(self.refit_every, self.window // 8)
        if self.recorded >= self.min_steps and self.recorded % every == 0:
            self.refit()

    def refit(self) -> None:
        """Non-negative least squares over the strata's steps (kept unfitted without both kinds of step), then
        once more without the steps that took over `outlier` x the first fit's prediction: a step that paid a
        one-off cost (a kernel's first-launch compile) would otherwise pull every coefficient up."""
        if not self._strata:
            return
        X, y = self.steps()
        mixed = int((X[:, 4] > 0).sum())
        decode_only = int(((X[:, 1] > 0) & (X[:, 4] == 0)).sum())
        if min(mixed, decode_only) < self.min_each:
            return
        coef, _ = nnls(X, y)
        typical = y <= self.outlier * (X @ coef)
        if not typical.all() and typical.sum() >= self.min_steps:
            coef, _ = nnls(X[typical], y[typical])
        self.coef = coef
        self._extra.clear()

    def steps(self) -> tuple[np.ndarray, np.ndarray]:
        """The steps the fit reads: features [N, F] and seconds [N], every stratum's."""
        rings = list(self._strata.values())
        return np.concatenate([r.X[: r.held] for r in rings]), np.concatenate([r.y[: r.held] for r in rings])

    def expected(self, rows: int, keys: int, prefill_tokens: int) -> StepShape:
        """A step's shape before it runs: its tiles, cut as the kernel cuts them, at their expectation under
        uniform routing."""
        n = rows + prefill_tokens
        d = kernel_num_decode(n, rows, self.top_k, self.num_experts)
        dec, pre = self._decode_tiles_of(d), self._tiles[BLOCK_M_PREFILL].upto(n - d)[-1]
        return StepShape(rows, keys, dec, prefill_tokens, pre)

    def measured(self, rows: int, keys: int, routes_TLK: np.ndarray) -> StepShape:
        """A step's shape after it ran, its tiles counted from its routing (decoding rows first, then prefill),
        cut as the kernel cut them."""
        e, n = self.num_experts, routes_TLK.shape[0]
        d = kernel_num_decode(n, rows, self.top_k, e)
        dec, pre = (
            phase_tiles(routes_TLK[:d], e, decode_block_m(d, self.top_k, e)),
            phase_tiles(routes_TLK[d:], e, BLOCK_M_PREFILL),
        )
        return StepShape(rows, keys, dec, n - rows, pre)

    def _extra_large(self, rows: int) -> np.ndarray:
        """The predicted extra step time of p = 0..max_tokens prefill tokens taking `rows` decoding rows into
        prefill tiles (the kernel's cut above S), tabulated once per fit and number of rows."""
        if rows not in self._extra:
            tiles_N = self._tiles[BLOCK_M_PREFILL].upto(rows + self.max_tokens)[rows:]
            decode_tiles = self._decode_tiles_of(rows)
            p_P = np.arange(self.max_tokens + 1)
            self._extra[rows] = self.coef[4] * p_P + self.coef[5] * tiles_N - self.coef[3] * decode_tiles
        return self._extra[rows]

    def _extra_small(self, rows: int) -> np.ndarray:
        """The predicted extra step time of p = 0..S prefill tokens in decode tiles beside `rows` rows."""
        s = self.small_prefill
        tiles_N = self._expected_decode(rows + s)
        return self.coef[4] * np.arange(s + 1) + self.coef[3] * (tiles_N[rows:] - tiles_N[rows])

    def _decode_tiles_of(self, tokens: int) -> float:
        """E[x_dec] of `tokens` tokens in decode tiles, in the height the kernel gives them."""
        return self._tiles[decode_block_m(tokens, self.top_k, self.num_experts)].upto(tokens)[-1]

    def _expected_decode(self, n: int) -> np.ndarray:
        """[n + 1]: E[x_dec(0..n)], each count of tokens in the decode tiles' height the kernel gives it (narrow
        below S, wide from S on: `decode_block_m`)."""
        narrow, wide_from = (
            self._tiles[BLOCK_M_DECODE].upto(n),
            max_small_prefill(self.top_k, self.num_experts),
        )
        if n < wide_from:
            return narrow
        return np.concatenate([narrow[:wide_from], self._tiles[BLOCK_M_DECODE_WIDE].upto(n)[wide_from:]])

    def predict(self, shape: StepShape) -> float:
        if self.coef is None:
            raise ValueError("the step cost model is not fitted yet")
        return float(shape.features() @ self.coef)

    def budget(self, rows: int, keys: int) -> int:
        """Prefill tokens a step with these decoding rows may carry (max_tokens while unfitted or without rows)."""
        if self.coef is None or rows == 0:
            return self.max_tokens
        decode_s = self.predict(self.expected(rows, keys, 0))
        bound = self.slowdown * decode_s
        # the largest p whose extra time fits: above S from the table, else among the small chunks (p = 0 fits)
        fits = int(np.searchsorted(self._extra_large(rows), bound, side="right")) - 1
        if fits <= self.small_prefill:
            fits = int(np.flatnonzero(self._extra_small(rows) <= bound)[-1])
        floor = min(self.min_tokens, self.max_tokens)
        if fits >= floor:
            return fits
        return self._cheapest_chunk(rows, keys, decode_s, floor)

    def _cheapest_chunk(self, rows: int, keys: int, decode_s: float, floor: int) -> int:
        """The chunk with the most prefill tokens per second of extra step time (the bound cannot hold)."""
        sizes_P = np.array([*range(floor, self.max_tokens, floor), self.max_tokens])
        small_P = sizes_P <= self.small_prefill
        extra_P = self._extra_large(rows)[sizes_P]
        extra_P[small_P] = self._extra_small(rows)[sizes_P[small_P]]
        per_s_P = sizes_P / np.maximum(extra_P, 1e-12)
        chosen = int(sizes_P[np.argmax(per_s_P >= 0.99 * per_s_P.max())])
        if not self.unmet_steps:
            log.warning(
                "rollout.max_decode_slowdown=%g cannot hold at %d decoding rows: %d prefill tokens are predicted "
                "to slow the step %.2fx; mixed steps carry %d tokens, the fewest seconds per prefill token",
                self.slowdown,
                rows,
                floor,
                self.predict(self.expected(rows, keys, floor)) / decode_s,
                chosen,
            )
        self.unmet_steps += 1
        return chosen
