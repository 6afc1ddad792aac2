"""bench/tppo_vs_ppo.py: the length law, the two algorithms' step semantics on a real (toy) engine, and the
end-to-end sanity check that T-PPO with W = L_max trains exactly like synchronous PPO."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

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
        rec, retired = bench.rollout_step(engine, pool, args, step)
        assert rec.batch == rec.completed == len(retired) == 8 and rec.continuations == 0
        assert [s.num_response_tokens for s in retired] == lengths_of(retired, args)
        assert rec.completed_tokens == rec.generated_tokens == sum(lengths_of(retired, args))


def test_tppo_windows_generate_each_response_to_its_target_in_windows(engine):
    args = tiny_args()
    window = 24
    pool = bench.make_pool(args, 8, window, engine.spec.vocab_size)
    retired_all, generated, continued = [], 0, 0
    for step in range(10):
        rec, retired = bench.rollout_step(engine, pool, args, step)
        assert rec.batch == 8 and rec.generated_tokens <= 8 * window
        continued += rec.continuations
        generated += rec.generated_tokens
        retired_all += retired
    assert continued > 0  # some responses were longer than one window and came back as continuations
    assert [s.num_response_tokens for s in retired_all] == lengths_of(retired_all, args)
    assert all(s.window_round == math.ceil(s.num_response_tokens / window) for s in retired_all)
    in_flight = sum(s.num_response_tokens for s in pool)  # pending fresh items hold none yet
    assert generated == sum(s.num_response_tokens for s in retired_all) + in_flight


@pytest.mark.slow
def test_rollout_part_compares_on_the_same_completed_work(tmp_path):
    out = tmp_path / "rollout.json"
    bench.main(["rollout", "--tiny", "--json", str(out)])
    runs = {r["name"]: r for r in json.loads(out.read_text())["runs"]}
    ppo, tppo = runs["ppo"]["totals"], runs["tppo W=24"]["totals"]
    assert ppo["completed"] == bench.TINY_ROLLOUT["ppo_steps"] * 8
    assert tppo["completed"] >= ppo["completed"]
    assert tppo["prefill_tokens"] > ppo["prefill_tokens"]  # continuations prefill their prefix again


@pytest.mark.slow
def test_e2e_tppo_with_a_whole_window_trains_exactly_like_ppo(tmp_path):
    out = tmp_path / "e2e.json"
    bench.main(
        [
            "e2e",
            "--tiny",
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
    assert set(results["algos"]) == {"tppo", "ppo", "tppo_wmax"}
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 0
    for algo in results["algos"].values():
        assert 0 < algo["phase_share"]["rollout"] < 1
    for name, algo in results["algos"].items():
        for c, rows in zip(algo["curves"], runs_metrics(tmp_path / "runs", name)):
            step_s = [r["perf/step_s"] for r in rows]
            assert c["finished_per_s"] == pytest.approx(
                sum(r["rollout/finished"] for r in rows) / sum(step_s)
            )
            if name != "tppo":  # whole responses: every item of every step finishes
                assert c["finished_per_s"] * c["step_s_mean"] == pytest.approx(rows[0]["rollout/finished"])
            rollout_s_per_token = sum(r["perf/rollout_s"] for r in rows) / sum(
                r["rollout/tokens"] for r in rows
            )
            assert (
                0 < c["generation_us_per_token"] < 1e6 * rollout_s_per_token
            )  # generation is part of rollout


def runs_metrics(root, name: str) -> list[list[dict]]:
    return [bench.read_metrics(p) for p in sorted(root.glob(f"{name}_s*/metrics.jsonl"))]
