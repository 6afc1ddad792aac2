"""bench/rollout_long.py --bound: the slot and paged schedules of the benchmark's own workload, costed without an
engine, against a step-by-step replay of the same admissions."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "rollout"))

import rollout_long as bench  # noqa: E402
from rollout_testlib import replay  # noqa: E402

from rollout.plan.hardware import gpu_preset, shape_from_spec  # noqa: E402
from rollout.plan.schedule import variant_cost  # noqa: E402


def test_bound_costs_the_slot_and_unlimited_paged_schedules(tmp_path):
    out = tmp_path / "bound.json"
    cmd = [sys.executable, "bench/rollout_long.py", "--tiny", "--bound", "--variants", "row_free,roofline"]
    done = subprocess.run([*cmd, "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    args = bench.argparse.Namespace(**data["args"])
    prompts, lengths, _ = bench.workload(args, bench.TINY_LONG["vocab_size"])
    context_N, new_N = [len(p) for p in prompts], lengths
    slot_plan = data["plans"]["slot"]
    assert data["bound"]["slots"] == slot_plan["num_blocks"] - 1 == 5  # what the slot engine holds
    spec = bench.MoeModelSpec.from_hf_config(bench.TINY_LONG)
    step_s = 1e-3 * variant_cost("row_free", shape_from_spec("t", spec), gpu_preset("h200"), 64).decode_ms(
        1, 1
    )
    row_free, roofline = data["bound"]["runs"]
    busy = {}
    for name, slots in (("slot (5 slots)", 5), ("paged, unlimited K/V", args.max_batch_size)):
        _, rows, _ = replay(context_N, new_N, slots)
        busy[name] = sum(r > 0 for r in rows)
        got = row_free["engines"][name]
        assert got["decode_steps"] == busy[name]
        assert got["decode_s"] == pytest.approx(busy[name] * step_s)  # every step costs the same
        assert got["peak_rows"] == max(rows) <= slots
    assert busy["paged, unlimited K/V"] == max(new_N) - 1  # everything fits: the longest request's steps
    for run in (row_free, roofline):
        slot, paged = run["engines"].values()
        assert run["paged_over_slot"] == pytest.approx(paged["tok_s"] / slot["tok_s"])
        assert slot["tok_s"] == pytest.approx(sum(new_N) / (slot["decode_s"] + slot["prefill_s"]))
    # rows cost something at the roofline, so packing more of them into a step gains less than their count
    assert 1 < roofline["paged_over_slot"] < row_free["paged_over_slot"]
    assert np.isclose(slot["prefill_s"], paged["prefill_s"])


TRUE_COEF = np.array(
    [2e-3, 1e-5, 3e-8, 0.0, 4e-5, 1e-8]
)  # s: per step, row, key, expert touched, token, position


def _trace(rng, n: int) -> list[bench.StepTrace]:
    steps = []
    for _ in range(n):
        rows, prefill = int(rng.integers(0, 64)), int(rng.choice([0, int(rng.integers(1, 512))]))
        rows = rows or (0 if prefill else 1)
        keys, held, touched = rows * int(rng.integers(100, 4000)), int(rng.integers(1000, 90_000)), 0
        x = np.array([1.0, rows, keys, touched, prefill, held])
        steps.append(bench.StepTrace(rows, prefill, keys, held, touched, float(x @ TRUE_COEF), False))
    return steps


def _stats(steps) -> bench.GenerateStats:
    return bench.GenerateStats(
        num_steps=len(steps),
        prefill_s=sum(s.seconds for s in steps if not s.num_decode),
        decode_s=sum(s.seconds for s in steps if s.num_decode),
        mixed_s=sum(s.seconds for s in steps if s.num_decode and s.num_prefill),
        steps=steps,
    )


def test_extrapolate_predicts_the_cut_steps_from_the_measured_ones():
    """Steps whose seconds are linear in the features: the steps after the cut (their seconds, as an instant
    runner leaves them, near zero) get their true seconds back, and each call's phase sums follow."""
    rng = np.random.default_rng(0)
    truth = _trace(rng, 90)
    cut = [dataclasses.replace(s, seconds=1e-6) if i >= 40 else s for i, s in enumerate(truth)]
    calls = [_stats(cut[:30]), _stats(cut[30:90])]  # two generate calls (windows mode), cut inside the second
    spec = bench.MoeModelSpec.from_hf_config(bench.TINY_LONG)
    out, added, info = bench.extrapolate(calls, 40, spec)
    assert info["measured_steps"] == 40 and info["predicted_steps"] == 50
    assert info["holdout_median_error"] < 1e-6
    got = [s.seconds for st in out for s in st.steps]
    np.testing.assert_allclose(got, [s.seconds for s in truth], rtol=1e-6)
    assert added == pytest.approx(sum(s.seconds for s in truth[40:]) - 50e-6)
    for st, want in zip(out, (_stats(truth[:30]), _stats(truth[30:]))):
        assert (st.prefill_s, st.decode_s, st.mixed_s) == pytest.approx(
            (want.prefill_s, want.decode_s, want.mixed_s)
        )
    assert bench.extrapolate(calls, 90, spec) == (calls, 0.0, {"measured_steps": 90, "predicted_steps": 0})
    with pytest.raises(RuntimeError, match=r"too few.*raise the limit"):
        bench.extrapolate(calls, 5, spec)


def test_first_launches_are_priced_at_their_groups_median():
    """A step over 2x the median of its group (bin of decoding rows, binary magnitude of prefill tokens) paid a
    first launch: its excess over that median is counted; steps of a slower group (a larger prefill chunk, more
    rows) are not measured against a faster one's median."""

    def step(rows: int, prefill: int, seconds: float, graph: bool = False) -> bench.StepTrace:
        return bench.StepTrace(rows, prefill, 0, 0, 0, seconds, graph)

    steps = [step(8, 0, 0.01)] * 9 + [step(8, 0, 0.5, graph=True)]  # a bucket's capture
    steps += [step(40, 0, 0.03)] * 5 + [step(40, 0, 0.05)]  # 33-64 rows; 1.7x its median: not a first launch
    steps += [step(8, 2000, 0.06)] * 4 + [step(8, 2040, 0.9)]  # a new chunk shape's compile
    steps += [step(8, 20, 0.02)] * 3  # small chunks: 0.02 s, not slow beside the large chunks' 0.06
    steps += [step(0, 1000, 0.1), step(0, 1000, 0.1), step(0, 1000, 0.35)]  # prefill-only
    assert bench.first_launch_s(steps, 32) == pytest.approx(0.49 + 0.84 + 0.25)
    assert bench.first_launch_s(steps[:9], 32) == 0.0


@pytest.mark.parametrize("mode", ["plain", "windows"])
def test_a_time_limited_section_runs_the_whole_schedule(mode):
    """Cut after 15 steps (a clock that ticks once a step), a section's schedule is the uncut run's step for
    step (the instant runner's tokens do not change it: ignore_eos, drawn lengths), every request generates its
    drawn length, and the steps after the cut get predicted seconds. (No mixed-step budget: it learns from step
    times, and the bench refuses it with a time limit.)"""
    args = bench.parse_args(["--tiny", "--engines", "paged", "--max-decode-slowdown", "0"])
    cfg = bench.TINY_LONG
    engine = bench.build("paged", args, cfg, torch.device("cpu"), torch.float32, {})
    work = bench.workload(args, cfg["vocab_size"])
    _, full, _, none = bench.run_mode(engine, mode, args, work)
    args.time_limit_s = 15
    ticks = iter(range(10**6))
    tokens, rounds, _, cut = bench.run_mode(engine, mode, args, work, clock=lambda: next(ticks))
    assert none is None and cut.real_steps == 14  # the deadline is read once when the runner is made
    assert engine.runner is cut.real  # the section gave the engine its runner back
    assert [len(t) for t in tokens] == work[1]

    def schedule(calls):
        return [
            (s.num_decode, s.num_prefill, s.decode_keys, s.kv_positions) for st in calls for s in st.steps
        ]

    assert schedule(rounds) == schedule(full) and len(schedule(full)) > 30
    out, added, info = bench.extrapolate(rounds, cut.real_steps, engine.spec)
    assert info["predicted_steps"] == len(schedule(full)) - 14
    predicted = [s.seconds for st in out for s in st.steps][14:]
    instant = [s.seconds for st in rounds for s in st.steps][14:]
    assert min(predicted) > 0 and added == pytest.approx(sum(predicted) - sum(instant))


def test_a_time_limit_with_a_mixed_step_budget_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--time-limit-s", "60"])  # --tiny sets --max-decode-slowdown 0.2
    assert "budget learns from step times" in capsys.readouterr().err


def test_a_time_limit_with_overlapped_steps_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--time-limit-s", "60", "--overlap-steps"])
    assert "cut runner waits for every step" in capsys.readouterr().err
    assert bench.engine_config(bench.parse_args(["--overlap-steps"]), "paged").overlap_steps
