"""bench/tppo_vs_ppo.py: the length law, the two algorithms' step semantics on a real (toy) engine, and the
end-to-end sanity check that T-PPO with W = L_max trains exactly like synchronous PPO."""

from __future__ import annotations

import json
import math
import statistics
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import tppo_vs_ppo as bench  # noqa: E402


def tiny_args(**overrides):
    ap = bench.argparse.ArgumentParser()
    bench.add_rollout_args(ap)
    ap.set_defaults(**bench.TINY_ROLLOUT)
    args = ap.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def test_target_lengths_follow_the_clipped_lognormal():
    lengths = [bench.target_length(f"g{i}.0", 0, 16384, 0.25, 0.7) for i in range(4000)]
    assert lengths == [bench.target_length(f"g{i}.0", 0, 16384, 0.25, 0.7) for i in range(4000)]
    assert min(lengths) >= math.ceil(16384 / 100) and max(lengths) <= 16384
    assert abs(statistics.median(lengths) / 4096 - 1) < 0.05  # the law's median, 0.25 L_max
    # P(X > L_max) = P(Z > ln 4 / 0.7) = 2.4%: those are clipped to L_max exactly.
    capped = sum(n == 16384 for n in lengths) / len(lengths)
    assert 0.015 < capped < 0.035
    assert bench.target_length("g0.0", 1, 16384, 0.25, 0.7) != bench.target_length(
        "g0.0", 0, 16384, 0.25, 0.7
    )


@pytest.fixture(scope="module")
def engine():
    args = tiny_args()
    return bench.build_engine(args, bench.TINY_MOE, torch.device("cpu"), torch.float32)


def lengths_of(samples, args):
    return [
        bench.target_length(s.uid, args.seed, args.max_length, args.median_frac, args.sigma) for s in samples
    ]


def test_synchronous_ppo_completes_every_response_of_the_batch_each_step(engine):
    args = tiny_args()
    pool = bench.make_pool(args, 8, args.max_length, engine.spec.vocab_size)
    for step in range(2):
        rec, retired = bench.rollout_step(engine, args, pool, step)
        assert rec.batch == rec.completed == len(retired) == 8 and rec.continuations == 0
        assert [s.num_response_tokens for s in retired] == lengths_of(retired, args)
        assert rec.completed_tokens == rec.generated_tokens == sum(lengths_of(retired, args))


def test_tppo_windows_generate_each_response_to_its_target_in_windows(engine):
    args = tiny_args()
    window = 24
    pool = bench.make_pool(args, 8, window, engine.spec.vocab_size)
    retired_all, generated, continued = [], 0, 0
    for step in range(10):
        rec, retired = bench.rollout_step(engine, args, pool, step)
        assert rec.batch == 8 and rec.generated_tokens <= 8 * window
        continued += rec.continuations
        generated += rec.generated_tokens
        retired_all += retired
    assert continued > 0  # some responses were longer than one window and came back as continuations
    assert [s.num_response_tokens for s in retired_all] == lengths_of(retired_all, args)
    assert all(s.window_round == math.ceil(s.num_response_tokens / window) for s in retired_all)
    in_flight = sum(s.num_response_tokens for s in pool)  # pending fresh items hold none yet
    assert generated == sum(s.num_response_tokens for s in retired_all) + in_flight


def test_bound_steps_schedule_the_engines_work_exactly(engine):
    """The roofline part replays the pool without an engine: step for step, it must see the batches, windows,
    prefills and completions that the real (toy) engine saw."""
    args = tiny_args()
    cost = bench.variant_cost(
        "roofline", bench.shape_from_spec("tiny", engine.spec), bench.gpu_preset("h200"), 64
    )
    for window in (args.max_length, 24):
        real = bench.make_pool(args, 8, window, engine.spec.vocab_size)
        model = bench.make_pool(args, 8, window, engine.spec.vocab_size)
        for step in range(6):
            got, got_retired = bench.bound_step(cost, args, model, step)
            want, want_retired = bench.rollout_step(engine, args, real, step)
            for key in ("batch", "continuations", "completed", "completed_tokens", "generated_tokens"):
                assert getattr(got, key) == getattr(want, key), (window, step, key)
            assert got.prefill_tokens == want.prefill_tokens  # continuations prefill their whole context
            assert [s.uid for s in got_retired] == [s.uid for s in want_retired]
            assert 0 < got.prefill_s < got.seconds


def test_roofline_cost_is_the_bytes_and_flops_of_the_step():
    """A decode step of b rows is memory-bound: L (attention weights + b C K/V + the touched experts) plus the
    LM head, over the bandwidth. A prefill of c tokens in one chunk is compute-bound: L (2 c (attention
    params) + 2 c^2 (q width) + 2 c K (expert params)) over the peak."""
    spec = bench.MoeModelSpec.from_hf_config(bench.MOE_16L)
    model, gpu = bench.shape_from_spec("moe16", spec), bench.gpu_preset("h200")
    cost = bench.variant_cost("roofline", model, gpu, 4096)
    h, f, E, K, L = 2048, 768, 64, 8, 16
    q, kv = 32 * 128, 4 * 128
    attn_params = h * (q + 2 * kv) + q * h + h * E
    expert_params = 3 * h * f
    for b, keys in ((1, 1000.0), (32, 32 * 5000.0)):
        touched = E * (1 - (1 - K / E) ** b)
        layer_bytes = 2 * attn_params + keys * 2 * kv * 2 + touched * expert_params * 2
        head_bytes = 2 * 32768 * h
        want_ms = 1e3 * (L * layer_bytes + head_bytes) / gpu.mem_bandwidth
        assert cost.decode_ms(b, keys) == pytest.approx(want_ms, rel=1e-9)
    c = 4000
    flops = L * (2 * c * attn_params + 2 * c * c * q + 2 * c * K * expert_params)
    assert cost.prefill_s(np.array([c])) == pytest.approx(flops / gpu.peak_flops, rel=1e-9)
    assert cost.decode_s(np.array([1, 32]), np.array([1000.0, 160000.0])) == pytest.approx(
        1e-3 * (cost.decode_ms(1, 1000.0) + cost.decode_ms(32, 160000.0))
    )


@pytest.mark.slow
def test_rollout_part_compares_on_the_same_completed_work(tmp_path):
    out = tmp_path / "rollout.json"
    bench.main(["rollout", "--tiny", "--json", str(out)])
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    ppo, tppo = runs["ppo"]["totals"], runs["tppo W=24"]["totals"]
    assert ppo["completed"] == bench.TINY_ROLLOUT["ppo_steps"] * 8
    assert tppo["completed"] >= ppo["completed"]
    assert tppo["prefill_tokens"] > ppo["prefill_tokens"]  # continuations prefill their prefix again
    # The same runs replayed step for step at a GPU's roofline: every run, its steps, a positive bound.
    bound_out = tmp_path / "bound.json"
    bench.main(["bound", "--measured", str(out), "--gpu", "h100", "--json", str(bound_out)])
    rows = {r["name"]: r for r in json.loads(bound_out.read_text())["runs"]}
    assert set(rows) == set(runs)
    for name, row in rows.items():
        assert row["steps"] == len(runs[name]["steps"])
        assert row["seconds"] == pytest.approx(sum(s["seconds"] for s in runs[name]["steps"]))
        assert 0 < row["bound_prefill_s"] < row["bound_s"]
    measured = json.loads(out.read_text())
    measured["args"]["seed"] += 1
    out.write_text(json.dumps(measured))
    with pytest.raises(ValueError, match="not the same stream"):
        bench.main(["bound", "--measured", str(out), "--json", str(bound_out)])


def test_a_measured_runs_gpu_preset_is_read_from_its_device_name():
    assert bench.measured_gpu("NVIDIA H100 80GB HBM3", "h200") == "h100"
    assert bench.measured_gpu("NVIDIA H200", "h100") == "h200"
    assert bench.measured_gpu("cpu", "h200") == "h200"


@pytest.mark.slow
def test_e2e_tppo_with_a_whole_window_trains_exactly_like_ppo(tmp_path):
    out = tmp_path / "e2e.json"
    bench.main(
        [
            "e2e",
            "--tiny",
            "--algos",  # the windowed run takes the same code paths (the default recipe's tests run it)
            "ppo,tppo_wmax",
            "--run-root",
            str(tmp_path / "runs"),
            "--plots",
            str(tmp_path / "plots"),
            "--json",
            str(out),
        ]
    )
    results = json.loads(out.read_text())
    assert results["tppo_wmax_vs_ppo_max_reward_diff"] == 0.0
    assert set(results["algos"]) == {"ppo", "tppo_wmax"}
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 0
    for algo in results["algos"].values():
        assert 0 < algo["phase_share"]["rollout"] < 1
    for name, algo in results["algos"].items():
        for c, rows in zip(algo["curves"], runs_metrics(tmp_path / "runs", name)):
            later = rows[1:]  # the rates leave out the first step's warm-up
            later_s = sum(r["perf/step_s"] for r in later)
            # whole responses in both: every item of every step finishes
            assert c["finished_per_s"] == pytest.approx(len(later) * rows[0]["rollout/finished"] / later_s)
            rollout_s_per_token = sum(r["perf/rollout_s"] for r in later) / sum(
                r["rollout/tokens"] for r in later
            )
            assert (
                0 < c["generation_us_per_token"] < 1e6 * rollout_s_per_token
            )  # generation is part of rollout


def runs_metrics(root, name: str) -> list[list[dict]]:
    return [bench.read_metrics(p) for p in sorted(root.glob(f"{name}_s*/metrics.jsonl"))]


def test_row_free_variant_makes_a_decode_step_cost_the_same_whatever_its_rows_and_context():
    """The counterfactual of T-PPO's premise: K/V free and every expert read, so a memory-bound step costs
    (L (attention weights + E expert weights) + LM head) / bandwidth at any rows and context."""
    model = bench.shape_from_spec("moe16", bench.MoeModelSpec.from_hf_config(bench.MOE_16L))
    gpu = bench.gpu_preset("h100")
    cost = bench.variant_cost("row_free", model, gpu, 2048)
    step_bytes = 16 * 2 * (model.attention_params_per_layer + 64 * model.expert_params) + 2 * 32768 * 2048
    for rows, keys in ((1, 10.0), (8, 8 * 16000.0), (64, 64 * 2000.0)):  # memory-bound: FLOPs below bytes
        assert cost.decode_ms(rows, keys) == pytest.approx(1e3 * step_bytes / gpu.mem_bandwidth, rel=1e-9)
    free_kv = bench.variant_cost("free_kv", model, gpu, 2048)
    assert free_kv.decode_ms(8, 8 * 16000.0) == free_kv.decode_ms(8, 8.0) < cost.decode_ms(8, 8.0)
    with pytest.raises(bench.argparse.ArgumentTypeError, match="unknown variants"):
        bench.variant_list("roofline,fast")


def test_bound_part_writes_each_variants_runs(tmp_path):
    out = tmp_path / "bound.json"
    bench.main(
        ["bound", "--batch-sizes", "8", "--windows", "24", "--max-length", "96", "--prompt-min", "4"]
        + ["--prompt-max", "12", "--ppo-steps", "3", "--json", str(out)]
    )
    runs = json.loads(out.read_text())["runs"]
    assert [(r["variant"], r["name"]) for r in runs] == [
        (v, n) for v in bench.BOUND_VARIANTS for n in ("ppo", "tppo W=24")
    ]
    for ppo, tppo in zip(runs[::2], runs[1::2]):
        assert ppo["totals"]["completed"] == 24 <= tppo["totals"]["completed"]
        assert tppo["totals"]["occupancy"] > ppo["totals"]["occupancy"]


def e2e_args(tmp_path, **overrides):
    ap = bench.argparse.ArgumentParser()
    bench.add_e2e_args(ap)
    args = ap.parse_args(["--run-root", str(tmp_path), "--steps", "3"])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def write_run(run_dir: Path, overrides: list[str], steps: int) -> None:
    (run_dir / "hydra" / ".hydra").mkdir(parents=True)
    (run_dir / "hydra" / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in range(steps)))


def test_a_finished_run_with_the_same_overrides_is_read_not_rerun(tmp_path, monkeypatch):
    args = e2e_args(tmp_path)
    launched = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: launched.append(cmd) or FinishedProcess())
    variant = bench.variant_overrides(args)["ppo"]

    def recipe(seed: int) -> list[str]:
        return [
            f"experiment={args.experiment}",
            f"run.name=ppo_s{seed}",
            f"run.output_dir={tmp_path}",
            f"run.seed={seed}",
            "run.num_steps=3",
            "logging=disabled",
            *variant,
        ]

    write_run(tmp_path / "ppo_s0", recipe(0), steps=3)
    assert bench.train("ppo_s0", 0, variant, args) == tmp_path / "ppo_s0" / "metrics.jsonl"
    assert launched == []

    write_run(tmp_path / "ppo_s1", recipe(1), steps=2)
    bench.train("ppo_s1", 1, variant, args)  # two of three steps: the loop resumes it
    assert [cmd[3:] for cmd in launched] == [recipe(1)]

    write_run(tmp_path / "ppo_s2", recipe(0), steps=3)  # a finished run of other overrides (seed 0's)
    with pytest.raises(ValueError, match="ppo_s2 holds a finished run launched with"):
        bench.train("ppo_s2", 2, variant, args)


class FinishedProcess:
    returncode = 0


def test_a_shared_warm_start_runs_once_per_seed_and_every_run_starts_from_it(tmp_path, monkeypatch):
    args = e2e_args(tmp_path, shared_warm_start=True)
    launched = []

    def run(
        cmd, **kw
    ):  # a launch that writes what the loop would: metrics, overrides, the warm-started policy
        overrides = cmd[3:]
        name = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.name="))
        steps = int(next(o.split("=", 1)[1] for o in overrides if o.startswith("run.num_steps=")))
        write_run(tmp_path / name, overrides, steps)
        (tmp_path / name / "rollout_init").mkdir()
        (tmp_path / name / "rollout_init" / "config.json").write_text("{}")
        launched.append(overrides)
        return FinishedProcess()

    monkeypatch.setattr(bench.subprocess, "run", run)
    variants = bench.variant_overrides(args)
    for seed in (0, 1):
        for name in ("tppo", "ppo"):
            bench.train(f"{name}_s{seed}", seed, variants[name], args)
    names = [next(o for o in overrides if o.startswith("run.name=")) for overrides in launched]
    assert names == [
        f"run.name={n}" for n in ("warm_start_s0", "tppo_s0", "ppo_s0", "warm_start_s1", "tppo_s1", "ppo_s1")
    ]
    warm, tppo = launched[0], launched[1]
    assert "run.num_steps=0" in warm and not any(o.startswith("model.hf_path=") for o in warm)
    assert tppo[-2:] == [
        f"model.hf_path={tmp_path / 'warm_start_s0' / 'rollout_init'}",
        "algo.warm_start_steps=0",
    ]
    assert launched[4][-2] == f"model.hf_path={tmp_path / 'warm_start_s1' / 'rollout_init'}"
    launched.clear()
    bench.train("ppo_s0", 0, variants["ppo"], args)  # finished, and so is its warm start: nothing runs
    assert launched == []


def test_warm_start_jobs_run_the_seeds_warm_starts_side_by_side(tmp_path, monkeypatch):
    args = e2e_args(tmp_path, shared_warm_start=True, warm_start_jobs=2, seeds=[0, 1])
    together = threading.Barrier(
        2, timeout=30
    )  # broken, and raising, unless both launches are under way at once

    def run(cmd, **kw):
        together.wait()
        name = next(o.split("=", 1)[1] for o in cmd[3:] if o.startswith("run.name="))
        write_run(tmp_path / name, cmd[3:], 0)
        return FinishedProcess()

    monkeypatch.setattr(bench.subprocess, "run", run)
    bench.warm_starts(args)
    assert sorted(p.parent.name for p in tmp_path.glob("*/metrics.jsonl")) == [
        "warm_start_s0",
        "warm_start_s1",
    ]


def test_a_failed_run_keeps_its_output_in_its_run_directory(tmp_path):
    args = e2e_args(tmp_path)
    with pytest.raises(
        RuntimeError, match=r"ppo_s0: recipes.train exited 2 \(.*bench_train.log\)"
    ) as err:  # 2: a config error
        bench.train("ppo_s0", 0, ["algo.window=0"], args)  # refused by the recipe's config check
    log = (tmp_path / "ppo_s0" / "bench_train.log").read_text()
    assert "algo.window" in log and "algo.window" in str(err.value)
    with pytest.raises(RuntimeError):
        bench.train("ppo_s0", 0, ["algo.window=0"], args)
    assert (tmp_path / "ppo_s0" / "bench_train.log").read_text() == log + log  # appended, not replaced


def test_time_after_the_first_step_leaves_out_its_warm_up():
    steps = [(30.0, 28.0, -1.0), (1.0, 0.25, -0.6), (2.0, 1.0, -0.2), (1.5, 0.5, -0.2)]
    c = bench.curve(
        [{"perf/step_s": s, "perf/rollout_s": ro, "rollout/reward_mean": r} for s, ro, r in steps], smooth=1
    )
    reached = bench.time_to(c, -0.5)
    assert reached == pytest.approx(33.0)
    assert bench.after_first_step(c, reached) == pytest.approx(3.0)
    assert bench.after_first_step(c, bench.time_to(c, 0.5)) is None
    # the step time and phase shares are of the steps after the warm-up, which is reported apart
    assert c["first_step_s"] == 30.0 and c["step_s_median"] == 1.5
    assert c["phase_share"]["rollout"] == pytest.approx(1.75 / 4.5)
    # the reward at equal wall clock too: a run whose warm-up alone outlasts the others' steps is compared at
    # the same time after it
    assert bench.reward_at(c, 0.5) == -1.0 and bench.reward_at(c, 3.0) == -0.2
    assert bench.reward_at(c, 2.9) == pytest.approx(-0.6)
    other = bench.curve([{"perf/step_s": s} for s in (2.0, 1.0, 1.0)], smooth=1)
    assert bench.equal_wall_s({"a": [c], "b": [other]}) == pytest.approx(2.0)


def test_a_threshold_counts_once_the_smoothing_window_is_full():
    rewards = [
        -0.4,
        -0.9,
        -0.9,
        -0.3,
        -0.3,
        -0.3,
    ]  # trailing means of 3: -0.4, -0.65, -0.73, -0.7, -0.5, -0.3
    c = bench.curve([{"perf/step_s": 1.0, "rollout/reward_mean": r} for r in rewards], smooth=3)
    assert bench.time_to(c, -0.5) == pytest.approx(5.0)  # not 1.0: step 0 alone is not a window
    assert bench.time_to(c, -0.2) is None
    short = bench.curve([{"perf/step_s": 1.0, "rollout/reward_mean": 0.0}] * 2, smooth=3)
    assert bench.time_to(short, -0.5) is None  # the window never fills
