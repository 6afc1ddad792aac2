"""bench/rollout_long.py --bound: the slot and paged schedules of the benchmark's own workload, costed without an
engine, against a step-by-step replay of the same admissions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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
