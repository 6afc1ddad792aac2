"""The mixed steps' prefill sizing (rollout.step_cost): tile counts against a per-pair loop, the least-squares fit
against known coefficients, the budget as the largest prefill within the slowdown bound, and the engine with a
budget against the engine without one (same tokens, log-probs and routes; every mixed step within its budget)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from rollout_testlib import save_tiny_model

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig
from rollout.plan.perf import expected_tiles
from rollout.runner import StepInputs, StepOutputs
from rollout.step_cost import FEATURES, PrefillBudget, StepShape, phase_tiles

COEF = np.array([2e-3, 1e-5, 2e-8, 4e-6, 3e-6, 2e-5])  # seconds: per step, row, key, decode tile, token, tile


def test_phase_tiles_equals_a_loop():
    rng = np.random.default_rng(0)
    routes = rng.integers(0, 8, size=(50, 3, 2))
    want = 0
    for layer in range(3):
        for e in range(8):
            want += math.ceil(int((routes[:, layer] == e).sum()) / 16)
    assert phase_tiles(routes, 8, 16) == want
    assert phase_tiles(routes[:0], 8, 16) == 0


def _budget(**kw) -> PrefillBudget:
    return PrefillBudget(
        **{"slowdown": 0.1, "num_experts": 64, "top_k": 8, "num_moe_layers": 4, "max_tokens": 2048, **kw}
    )


def test_fit_recovers_the_coefficients_of_exact_steps():
    model, rng = _budget(), np.random.default_rng(1)
    for _ in range(40):
        rows, p = int(rng.integers(0, 64)), int(rng.choice([0, 0, int(rng.integers(1, 2000))]))
        shape = model.expected(rows, int(rng.integers(0, 300_000)), p)
        model.record(shape, float(shape.features() @ COEF))
    assert model.coef is not None and len(model.coef) == len(FEATURES)
    np.testing.assert_allclose(model.coef, COEF, rtol=1e-6, atol=1e-12)


def test_fit_ignores_steps_that_paid_a_one_off_cost():
    model, rng = _budget(), np.random.default_rng(2)
    for i in range(64):
        rows, p = int(rng.integers(1, 64)), int(rng.choice([0, int(rng.integers(1, 2000))]))
        shape = model.expected(rows, int(rng.integers(0, 300_000)), p)
        slow = 30.0 if i % 8 == 3 else 1.0  # e.g. a kernel compiled at its first launch
        model.record(shape, slow * float(shape.features() @ COEF))
    np.testing.assert_allclose(model.coef, COEF, rtol=1e-6, atol=1e-12)


def test_fit_keeps_the_last_steps_of_every_scale_and_refits_less_past_the_window(monkeypatch):
    """An engine records every step of its life: each stratum (binary magnitude of the decoding rows and of the
    prefill tokens) keeps its last `per_stratum` steps (memory bounded), the fit reads those alone (older steps
    of a stratum drop out), and past `window` recorded steps it refits every window / 8 steps instead of every
    `refit_every` (host time linear in the steps, not quadratic)."""
    model, rng = _budget(window=64, per_stratum=4), np.random.default_rng(3)
    refits = []
    fit = model.refit
    monkeypatch.setattr(model, "refit", lambda: (refits.append(model.recorded), fit()))
    for i in range(320):
        rows, p = (3, 20, 50)[i % 3], (0, 10, 1000)[i // 3 % 3]  # 9 strata, visited in turn
        shape = model.expected(rows, int(rng.integers(0, 300_000)), p)
        coef = COEF if i >= 320 - 9 * 4 else 3 * COEF  # the costs changed 4 steps per stratum before the end
        model.record(shape, float(shape.features() @ coef))
    np.testing.assert_allclose(model.coef, COEF, rtol=1e-6, atol=1e-12)
    assert len(model._strata) == 9 and model.steps()[0].shape == (9 * 4, len(FEATURES))
    assert model.recorded == 320
    assert refits == [*range(16, 65, 8), *range(72, 321, 8)]  # every 8, then every max(8, 64 // 8) = 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_throttled_engine_still_knows_what_a_large_chunk_costs(seed):
    """Unfitted, the engine runs whole chunks; fitted, a tight bound holds its chunks to ~50 tokens for
    thousands of steps. Over such small chunks a chunk's tokens and tiles grow together, so a fit of the recent
    steps alone splits their cost by noise and mis-prices a large chunk (up to 14% here, 2x measured on an H100);
    the strata keep the large chunks' steps, and with them the price. Truth: a linear cost, 3% noise."""
    true = np.array([3e-3, 2e-6, 1e-9, 5e-7, 1.5e-5, 1.2e-6])
    model, rng = PrefillBudget(0.1, 128, 8, 48, max_tokens=2048), np.random.default_rng(seed)

    def step(rows: int, p: int) -> None:
        shape = model.expected(rows, rows * int(rng.integers(500, 8000)), p)
        model.record(shape, float(shape.features() @ true) * (1 + 0.03 * rng.standard_normal()))

    for i in range(64):
        step(int(rng.integers(8, 128)), int(rng.integers(256, 2049)) * (i % 2))
    for i in range(4000):
        step(int(rng.integers(64, 160)), int(rng.integers(40, 57)) * (i % 2))
    decode, large = model.expected(100, 400_000, 0), model.expected(100, 400_000, 2048)
    got = model.predict(large) - model.predict(decode)
    assert got == pytest.approx(float((large.features() - decode.features()) @ true), rel=0.04)


def test_refits_thin_out_past_a_full_window(monkeypatch):
    """window = 256: refits every 8 steps up to 256, then every 32."""
    model = _budget(window=256)
    refits = []
    monkeypatch.setattr(model, "refit", lambda: refits.append(model.recorded))
    for i in range(1024):
        model.record(model.expected(1 + i % 60, 1000, (i % 2) * 100), 0.01)
    assert refits == [*range(16, 257, 8), *range(288, 1025, 32)]


def test_unfitted_without_both_kinds_of_step():
    model = _budget(min_steps=4, refit_every=1)
    for rows in range(1, 9):  # decode-only steps
        model.record(model.expected(rows, 1000, 0), 0.01)
    assert model.coef is None and model.budget(8, 1000) == 2048


CHEAP_TILES = np.array([2e-3, 1e-5, 2e-8, 4e-6, 3e-6, 2e-6])


@pytest.mark.parametrize(
    ("rows", "keys", "slowdown"), [(8, 40_000, 0.3), (64, 500_000, 0.2), (64, 500_000, 0.05)]
)
def test_budget_is_the_largest_prefill_within_the_bound(rows, keys, slowdown):
    model = _budget(slowdown=slowdown, coef=CHEAP_TILES)
    p = model.budget(rows, keys)
    bound = (1 + slowdown) * model.predict(model.expected(rows, keys, 0))
    assert model.predict(model.expected(rows, keys, p)) <= bound
    assert p == model.max_tokens or model.predict(model.expected(rows, keys, p + 1)) > bound
    assert model.min_tokens < p < model.max_tokens  # these cases bind above the floor


def _extra_per_token(model: PrefillBudget, rows: int, keys: int, p: int) -> float:
    decode_s = model.predict(model.expected(rows, keys, 0))
    return p / (model.predict(model.expected(rows, keys, p)) - decode_s)


# a prefill tile (128 rows) costs 2x a decode tile (16)
TILE_BOUND = np.array([2e-3, 1e-5, 2e-8, 4e-5, 3e-6, 8e-5])


def test_an_unreachable_bound_with_a_fixed_prefill_cost_takes_whole_chunks(caplog):
    model = _budget(slowdown=0.02, coef=TILE_BOUND)
    # each prefill token opens decode tiles in the ~3 of its 8 experts x 4 layers that the 8 rows left untouched:
    # even one breaks a 2% bound here, and the first tokens' tiles are most of a small chunk's extra time, so
    # larger chunks cost less per token, up to the size where the experts' second prefill tiles begin (p tokens
    # put p / 8 pairs on each of the 64 experts: a 128-row tile is full at 1,024)
    assert model.predict(model.expected(8, 40_000, 1)) > 1.02 * model.predict(model.expected(8, 40_000, 0))
    with caplog.at_level("WARNING", logger="rollout.step_cost"):
        p = model.budget(8, 40_000)
        assert model.budget(4, 20_000) > 512
    best = max(_extra_per_token(model, 8, 40_000, q) for q in range(16, 2049))
    assert _extra_per_token(model, 8, 40_000, p) >= 0.98 * best
    assert p > 512 and _extra_per_token(model, 8, 40_000, p) > 10 * _extra_per_token(model, 8, 40_000, 16)
    assert model.unmet_steps == 2
    assert [r.getMessage() for r in caplog.records if "max_decode_slowdown=0.02" in r.getMessage()] != []
    assert len(caplog.records) == 1  # logged once
    assert model.budget(0, 0) == 2048  # no decoding row to protect


def test_chunks_are_priced_in_the_tiles_the_kernel_cuts():
    """The kernel cuts up to S = 16 E / K prefill tokens into decode tiles with the decoding rows: such a chunk's
    extra time is its decode tiles beyond the rows' own (experts the rows touched already cost nothing more)
    plus its tokens. A larger chunk takes the rows into prefill tiles with it: the step's tiles are all prefill
    tiles, of rows + p tokens."""
    model = _budget(coef=COEF)
    assert model.small_prefill == 16 * 64 // 8
    small, large = model.expected(20, 1000, 100), model.expected(20, 1000, 129)
    assert small.prefill_tiles == 0 and small.dec_tiles == model.expected(120, 1000, 0).dec_tiles
    assert large.dec_tiles == 0 and large.prefill_tiles == model.expected(0, 0, 149).prefill_tiles
    assert model.expected(0, 0, 149).prefill_tiles > model.expected(0, 0, 129).prefill_tiles > 0
    routes = np.random.default_rng(0).integers(0, 64, size=(30, 4, 8))
    assert model.measured(10, 500, routes) == StepShape(10, 500, phase_tiles(routes, 64, 16), 20, 0.0)
    assert model.measured(30, 500, routes) == StepShape(30, 500, phase_tiles(routes, 64, 16), 0, 0.0)
    prefill_alone = StepShape(0, 0, 0, 30, phase_tiles(routes, 64, 128))
    assert model.measured(0, 0, routes) == prefill_alone
    routes = np.random.default_rng(0).integers(0, 64, size=(10 + 500, 4, 8))
    assert model.measured(10, 500, routes) == StepShape(10, 500, 0.0, 500, phase_tiles(routes, 64, 128))
    # from S tokens on, decode tiles hold 32 pairs: fewer tiles than S - 1 tokens' 16-row tiles
    wide = model.expected(100, 1000, 28)
    assert wide.dec_tiles == 4 * expected_tiles(128, 64, 8, 32) < model.expected(100, 1000, 27).dec_tiles
    routes = np.random.default_rng(1).integers(0, 64, size=(128, 4, 8))
    assert model.measured(100, 500, routes) == StepShape(100, 500, phase_tiles(routes, 64, 32), 28, 0.0)
    # the budget is the largest chunk within the bound, on either side of S, and where rows + p reach S
    for rows, slowdown in ((8, 0.3), (8, 2.0), (64, 0.05), (60, 0.05), (88, 0.02)):
        model = _budget(coef=COEF, slowdown=slowdown)
        p, bound = model.budget(rows, 40_000), (1 + slowdown) * model.predict(model.expected(rows, 40_000, 0))
        fitting = [q for q in range(2049) if model.predict(model.expected(rows, 40_000, q)) <= bound]
        assert p == max(fitting)


def test_an_unreachable_bound_with_a_per_token_prefill_cost_keeps_the_floor():
    # a prefill token costs 30 decode rows; tiles are free
    per_token = np.array([2e-3, 1e-5, 2e-8, 0.0, 3e-4, 0.0])
    model = _budget(slowdown=0.1, coef=per_token)
    assert model.budget(8, 40_000) == 16  # every chunk costs the same per token: the least per step
    assert model.unmet_steps == 1


def test_engine_with_a_budget_gives_the_same_outputs_within_each_steps_budget(tmp_path):
    save_tiny_model("qwen3_moe", tmp_path, seed=2)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in (30, 9, 41, 14, 60, 22, 7)]
    params = [
        SamplingParams(max_new_tokens=n, temperature=1.0, seed=s)
        for s, n in enumerate((20, 35, 9, 28, 14, 30, 25))
    ]
    base = dict(
        max_model_len=128, max_batch_size=4, kv_cache_tokens=4 * 128, max_step_tokens=64, trace_steps=True
    )
    plain = RolloutEngine.from_pretrained(tmp_path, config=RolloutConfig(**base)).generate(prompts, params)
    engine = RolloutEngine.from_pretrained(tmp_path, config=RolloutConfig(**base, max_decode_slowdown=0.2))
    model = engine.prefill_budget
    # a fitted model (as if from earlier calls) whose budget binds: prefill tokens cost as much as decode rows
    model.coef = np.array([1e-4, 1e-4, 0.0, 0.0, 1e-4, 0.0])
    model.min_steps = 10**9  # keep it: a refit from this machine's step times would set other budgets
    outs = engine.generate(prompts, params)
    for a, b in zip(outs, plain):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
    steps = engine.last_stats.steps
    mixed = [s for s in steps if s.num_decode and s.num_prefill]
    assert mixed and all(s.num_prefill <= max(16, round(0.2 * (1 + s.num_decode))) for s in mixed)
    assert any(s.num_prefill < 64 - s.num_decode for s in mixed)  # the budget, not max_step_tokens, bound


def _budgeted_engine(path) -> RolloutEngine:
    """A tiny engine with max_decode_slowdown=0.1 and room for 4 sequences of 128 positions."""
    save_tiny_model("qwen3_moe", path, seed=3)
    config = RolloutConfig(
        max_model_len=128,
        max_batch_size=4,
        kv_cache_tokens=4 * 128,
        max_step_tokens=32,
        max_decode_slowdown=0.1,
        trace_steps=True,
    )
    return RolloutEngine.from_pretrained(path, config=config)


def test_engine_fits_its_cost_model_from_its_own_steps(tmp_path):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 96, size=n).tolist() for n in rng.integers(5, 60, size=12)]
    engine = _budgeted_engine(tmp_path)
    budget, asked = engine.prefill_budget.budget, []
    engine.prefill_budget.budget = lambda rows, keys: asked.append(rows) or budget(rows, keys)
    engine.generate(prompts, SamplingParams(max_new_tokens=20, temperature=0))
    assert engine.prefill_budget.coef is not None and (engine.prefill_budget.coef >= 0).all()
    # consulted on the steps that prefill only (a budget costs host time: decode-only steps skip it)
    assert len(asked) == sum(s.num_prefill > 0 for s in engine.last_stats.steps)
    assert isinstance(engine.prefill_budget.expected(4, 100, 10), StepShape)


class _CapturingRunner:
    """The engine's runner, reporting a new CUDA graph on every third step (as a graph capture would)."""

    def __init__(self, runner):
        self.runner, self.calls, self.captured = runner, 0, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    @property
    def num_graphs(self) -> int:
        return len(self.captured)

    def run(self, x: StepInputs) -> StepOutputs:
        self.calls += 1
        if self.calls % 3 == 0:
            self.captured.append(self.calls)
        return self.runner.run(x)


def test_engine_does_not_fit_steps_that_captured_a_graph(tmp_path):
    engine = _budgeted_engine(tmp_path)
    engine.runner = runner = _CapturingRunner(engine.runner)
    recorded = []
    engine.prefill_budget.record = lambda shape, seconds: recorded.append(shape)
    engine.generate([[5, 6, 7, 8]] * 6, SamplingParams(max_new_tokens=10, temperature=0))
    assert runner.calls > 6 and len(recorded) == runner.calls - len(runner.captured)
