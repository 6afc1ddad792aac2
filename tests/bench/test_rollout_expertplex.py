"""The arrival section's timeline helper, on a hand-written chrome trace (the profiled arrival itself needs CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rollout_expertplex import gpu_timeline


def test_gpu_timeline_keeps_gpu_activities_in_start_order_from_the_first():
    events = [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 50.0},
        {"cat": "kernel", "name": "_down_kernel", "ts": 130.5, "dur": 20.0, "args": {"stream": 7}},
        {
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 110.0,
            "dur": 2.5,
            "args": {"stream": 9},
        },
        {
            "cat": "kernel",
            "name": "_gate_up_kernel_" + "x" * 80,
            "ts": 100.0,
            "dur": 25.0,
            "args": {"stream": 7},
        },
        {"cat": "ac2g", "name": "flow", "ts": 0.0},
    ]
    assert gpu_timeline(events) == [
        {"name": ("_gate_up_kernel_" + "x" * 80)[:60], "stream": 7, "start_us": 0.0, "end_us": 25.0},
        {"name": "Memcpy HtoD (Pinned -> Device)", "stream": 9, "start_us": 10.0, "end_us": 12.5},
        {"name": "_down_kernel", "stream": 7, "start_us": 30.5, "end_us": 50.5},
    ]


def test_gpu_timeline_of_a_trace_without_gpu_activity_is_empty():
    assert gpu_timeline([{"cat": "cpu_op", "name": "aten::add", "ts": 3.0, "dur": 1.0}]) == []
