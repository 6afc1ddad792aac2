"""The simulator CLI end to end: table, JSON, dumped plans that can be checked without the simulator."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel, ideal_step_cost, step_cost
from relibra.loads import LoadTrace, load_loads, save_loads
from relibra.plan import Topology, static_home_LE
from relibra.planners.base import home_plan
from relibra.simulate import fold_sources, main, simulate_trace
from relibra.synthetic import SyntheticLoads, generate_loads

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def load_file(tmp_path_factory):
    params = SyntheticLoads(
        num_steps=2, num_microbatches=3, num_layers=2, num_source_ranks=16, num_experts=32, topk=4,
        tokens_per_rank=512, group_size=4,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("loads") / "loads.npz"
    save_loads(path, generate_loads(params))
    return path


def test_cli_table_json_and_dumps(load_file, tmp_path, capsys):
    out, dumps = tmp_path / "sim.json", tmp_path / "plans"
    plans = "static,eplb_oracle,relibra,ideal"
    code = main([
        "--loads", str(load_file), "--ep", "16", "--gpus-per-node", "8", "--replica-slots", "2",
        "--plans", plans, "--json", str(out), "--dump-plans", str(dumps), "--set", "min_replica_tokens=32",
    ])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    for name in plans.split(","):
        assert name in table
    rows = {r["plan"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ideal"]["moe_vs_ideal"] == pytest.approx(1.0)
    assert rows["relibra"]["mean_skew"] < rows["static"]["mean_skew"]
    assert json.loads(out.read_text())["meta"]["config"]["min_replica_tokens"] == 32
    loads = np.load(load_file)["loads"]
    assert not (dumps / "ideal.npz").exists()
    for name in ("static", "eplb_oracle", "relibra"):
        with np.load(dumps / f"{name}.npz") as f:
            home, served = f["home"], f["served"]
        assert home.shape == (2, 2, 32) and served.shape == (2, 3, 2, 16, 32)
        np.testing.assert_array_equal(served.sum(axis=3), loads.sum(axis=3))  # every pair computed once
        if name != "eplb_oracle":  # ReLibra-style plans: E/EP owners per GPU, copies only on the owner's node
            for n, layer in np.ndindex(2, 2):
                np.testing.assert_array_equal(np.bincount(home[n, layer], minlength=16), 2)
            n, _m, layer, g, e = np.nonzero(served)
            np.testing.assert_array_equal(g // 8, home[n, layer, e] // 8)


def test_cli_nic_routing(load_file, tmp_path):
    """Four nodes of four GPUs: pxn routing prices static's all-to-alls differently from direct routing."""
    moe = {}
    for routing in ("direct", "pxn"):
        out = tmp_path / f"{routing}.json"
        code = main([
            "--loads", str(load_file), "--ep", "16", "--gpus-per-node", "4", "--replica-slots", "2",
            "--plans", "static,ideal", "--json", str(out), "--nic-routing", routing,
        ])  # fmt: skip
        assert code == 0
        data = json.loads(out.read_text())
        assert data["meta"]["cost_model"]["nic_routing"] == routing
        moe[routing] = {r["plan"]: r["moe_us"] for r in data["rows"]}
    assert moe["pxn"]["static"] != pytest.approx(moe["direct"]["static"])


def test_cli_errors(load_file, capsys):
    assert main(["--loads", str(load_file), "--ep", "6", "--gpus-per-node", "8", "--replica-slots", "2"]) == 2
    assert "--ep" in capsys.readouterr().err
    args = ["--loads", str(load_file), "--ep", "16", "--gpus-per-node", "8", "--replica-slots", "2"]
    assert main([*args, "--plans", "nope"]) == 2
    assert "unknown relibra planner" in capsys.readouterr().err
    assert main([*args, "--set", "anneal_t0=-1"]) == 2
    # The topology's knobs have their own options: a --set of them would reach the JSON but not the planners.
    assert main([*args, "--set", "replica_slots=4"]) == 2
    assert "--set replica_slots: set it with --replica-slots" in capsys.readouterr().err
    missing = [
        "--loads",
        "/nonexistent/loads.npz",
        "--ep",
        "16",
        "--gpus-per-node",
        "8",
        "--replica-slots",
        "2",
    ]
    assert main(missing) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: [Errno 2] No such file or directory: '/nonexistent/loads.npz'"
    )


@pytest.mark.parametrize(
    ("loads_dtype", "spoil", "topk", "message"),
    [
        (
            np.float64,
            lambda a: a + 0.5,
            4,
            r"loads must be finite integers: \d+ value\(s\) not whole numbers, the first \d+\.5 "
            r"at index \[0, 0, 0, 0, 0\]",
        ),
        (
            np.float64,
            lambda a: np.where(a == a.max(), np.nan, a),
            4,
            "loads must be finite integers: .* NaN or Inf",
        ),
        (
            np.float32,
            lambda a: np.where(a == a.max(), np.inf, a),
            4,
            "loads must be finite integers: .* NaN or Inf",
        ),
        (np.int64, lambda a: a, 4.5, "topk must be finite integers: 1 value"),
        (np.bool_, lambda a: a > 0, 4, "loads must be finite integers, got dtype bool"),
    ],
)
def test_cli_refuses_loads_a_cast_would_change(
    load_file, tmp_path, capsys, loads_dtype, spoil, topk, message
):
    """A cast to int would truncate 0.5 and 4.5 and turn NaN into a huge negative count: the file is refused
    with one line saying loads must be finite integers."""
    with np.load(load_file) as f:
        loads = f["loads"]
    bad = tmp_path / "bad.npz"
    np.savez(bad, loads=spoil(loads.astype(loads_dtype)), topk=np.asarray(topk))
    args = [
        "--loads",
        str(bad),
        "--ep",
        "16",
        "--gpus-per-node",
        "8",
        "--replica-slots",
        "2",
        "--plans",
        "static",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {bad}: ")
    assert re.search(message, err), err


def test_whole_numbers_stored_as_floats_read_as_the_same_counts(load_file, tmp_path):
    with np.load(load_file) as f:
        loads, topk = f["loads"], f["topk"]
    floats = tmp_path / "floats.npz"
    np.savez(floats, loads=loads.astype(np.float64), topk=np.float64(topk))
    trace = load_loads(floats)
    assert trace.loads_NMLSE.dtype == np.int64 and trace.topk == int(topk)
    np.testing.assert_array_equal(trace.loads_NMLSE, loads)


def test_fold_sources():
    rng = np.random.default_rng(0)
    loads = rng.integers(0, 5, size=(1, 2, 1, 8, 3))
    folded = fold_sources(loads, 4)
    np.testing.assert_array_equal(folded, loads[:, :, :, :4] + loads[:, :, :, 4:])
    LoadTrace(np.zeros((1, 1, 1, 4, 3), dtype=int), 1)  # a trivially valid trace still constructs


def test_module_entry_point(load_file):
    result = subprocess.run(
        [sys.executable, "-m", "relibra.simulate", "--loads", str(load_file), "--ep", "16", "--gpus-per-node", "8",
         "--replica-slots", "2", "--plans", "static,ideal"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "MoE/ideal" in result.stdout


def test_warm_ratio_leaves_out_the_first_step(load_file):
    """warm_moe_vs_ideal is the steps after the first, priced independently with the cost model's step_cost."""
    trace = load_loads(load_file)
    topo, cost = Topology(16, 8, 32, 2), CostModel.from_yaml()
    (row,) = simulate_trace(trace, topo, RelibraConfig(), cost, ["static"])
    home = static_home_LE(trace.num_layers, topo)
    loads = trace.loads_NMLSE[1]
    want = step_cost(home_plan(loads, home, topo), loads, trace.topk, topo, cost, home).moe_us
    want /= ideal_step_cost(loads, trace.topk, topo, cost).moe_us
    assert row.warm_moe_vs_ideal == pytest.approx(want, rel=1e-12)
    first = LoadTrace(trace.loads_NMLSE[:1], trace.topk)
    (one,) = simulate_trace(first, topo, RelibraConfig(), cost, ["static"])
    assert np.isnan(one.warm_moe_vs_ideal)
