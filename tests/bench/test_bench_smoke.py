"""Every benchmark script runs end to end on the CPU at toy sizes, prints its table and writes JSON that parses:
a script broken by a change is found here, not at the next GPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "rollout_kernels": ["--tiny"],
    "rollout_decode": [
        "--tiny", "--device", "cpu", "--dtype", "float32", "--layers", "2", "--hf-layers", "2", "--check-layers", "1",
        "--batches", "1,4", "--new-tokens", "8", "--hf-new-tokens", "4", "--repeats", "2",
    ],
    "rollout_long": ["--tiny"],
    "rollout_host": ["--tiny"],
    "rollout_overlap": ["--tiny"],
    "rollout_expertplex": ["--tiny"],
    "rollout_disagg": ["--profile", "--tiny"],
    "relibra_executor": ["--tiny"],
    "megatron_train": ["--tiny"],
    "relibra_sim": [
        "--ep", "16", "--gen-steps", "1", "--tokens-per-rank", "256", "--timing-repeats", "1",
        "--timing-processes", "1",
    ],
    "relibra_floor_milp": ["--ep", "16", "--layers", "0", "--time-limit", "3"],
    "tppo_vs_ppo": ["rollout", "--tiny"],
    "trainer_microbatches": ["--tiny"],
    "train_backends": [
        "--tiny", "--same-init", "--variants", "megatron,deepspeed_z2,reference_offload", "--steps", "2",
    ],
}  # fmt: skip


def test_every_benchmark_script_has_a_smoke_run():
    assert sorted(SCRIPTS) == sorted(p.stem for p in (REPO / "bench").glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_runs_at_toy_size_and_writes_json(script, tmp_path):
    out = tmp_path / f"{script}.json"
    done = subprocess.run(
        [sys.executable, f"bench/{script}.py", *SCRIPTS[script], "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the script printed nothing"
    data = json.loads(out.read_text())
    assert data, "the JSON is empty"
