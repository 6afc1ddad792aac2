"""rollout.plan.schedule: a schedule's decode steps against a step-by-step replay, the slot cache's admission
order, and the costs that make a step's time independent of its rows."""

from __future__ import annotations

import numpy as np
import pytest
from rollout_testlib import replay

from rollout.plan.hardware import gpu_preset, model_preset
from rollout.plan.schedule import decode_iterations, fifo_starts, variant_cost


def trim(rows: list[int], keys: list[int]) -> tuple[list[int], list[int]]:
    while rows and not rows[-1]:
        rows, keys = rows[:-1], keys[:-1]
    return rows, keys


def test_decode_iterations_count_each_steps_rows_and_cached_positions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        context_N = rng.integers(1, 50, size=int(rng.integers(1, 9)))
        new_N = rng.integers(1, 30, size=len(context_N))
        rows_J, keys_J = decode_iterations(context_N, new_N)
        steps = int(new_N.max()) - 1
        assert len(rows_J) == len(keys_J) == steps
        for j in range(1, steps + 1):  # row i decodes its tokens 2 .. n_i at steps 1 .. n_i - 1
            live = [i for i in range(len(new_N)) if new_N[i] > j]
            assert rows_J[j - 1] == len(live)
            assert keys_J[j - 1] == sum(context_N[i] + j for i in live)
        assert rows_J.sum() == (new_N - 1).sum()  # every token after the first is one decode row


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 64])
def test_slot_schedule_matches_a_step_by_step_replay(slots):
    rng = np.random.default_rng(slots)
    for _ in range(10):
        context_N = rng.integers(1, 40, size=int(rng.integers(1, 12)))
        new_N = rng.integers(1, 25, size=len(context_N))
        want_start, want_rows, want_keys = replay(context_N, new_N, slots)
        start_N = fifo_starts(new_N, slots)
        assert start_N.tolist() == want_start
        rows_J, keys_J = decode_iterations(context_N, new_N, start_N)
        assert (rows_J.tolist(), keys_J.tolist()) == trim(want_rows, want_keys)
        assert rows_J.max() <= slots


def test_a_schedule_needs_a_slot():
    with pytest.raises(ValueError, match="slots=0"):
        fifo_starts(np.array([3, 4]), 0)


def test_row_free_decode_steps_cost_the_same_and_empty_steps_nothing():
    """With K/V free and every expert read, a memory-bound decode step costs the same whatever its rows and
    context, so a schedule's decode time is its busy steps times one step's; steps with no row cost nothing."""
    cost = variant_cost("row_free", model_preset("qwen3-30b-a3b"), gpu_preset("h200"), 2048)
    one = cost.decode_ms(1, 1.0)
    assert cost.decode_ms(37, 37 * 9000.0) == pytest.approx(one)
    rows_J, keys_J = np.array([3, 0, 1, 2, 0]), np.array([30.0, 0.0, 12.0, 40.0, 0.0])
    assert cost.decode_s(rows_J, keys_J) == pytest.approx(3 * one / 1e3)
