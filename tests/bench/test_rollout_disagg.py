"""bench/rollout_disagg.py --profile: the JSON follows the rollout-profile/1 schema with every requested point
present or reported as skipped, a failing point does not stop the run, and the attention part it times is the
model's own layer (same output, reads the cached context through the block table)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import rollout_disagg as bench  # noqa: E402

MODEL_KEYS = {
    "hidden_size", "num_experts", "top_k", "moe_ffn", "num_heads", "num_kv_heads", "head_dim", "num_layers",
    "vocab_size",
}  # fmt: skip
ROW_KEYS = {
    "attention": {"batch", "context", "ms"},
    "experts": {"tokens", "ms"},
    "overlap": {"batch", "context", "tokens", "attention_ms", "experts_ms", "sum_ms", "two_streams_ms"},
    "steps": {"layout", "batch", "context", "num_layers", "step_ms"},
}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_tiny(tmp_path: Path, *extra: str) -> dict:
    """main() at toy size; returns the JSON as written."""
    path = tmp_path / "profile.json"
    bench.main(["--profile", "--tiny", "--json", str(path), *extra])
    return json.loads(path.read_text())


def requested(args: dict) -> dict[str, list[dict]]:
    """Every point the arguments ask for, per section, as the keys that name it."""
    return {
        "attention": [{"batch": b, "context": c} for c in args["contexts"] for b in args["batches"]],
        "experts": [{"tokens": t} for t in args["expert_tokens"]],
        "overlap": [{"batch": b, "context": c, "tokens": t} for b, c, t in args["overlap"]],
        "steps": [
            {"layout": "replicas", "batch": b, "context": c, "num_layers": args["step_layers"]}
            for c in args["step_contexts"]
            for b in args["step_batches"]
        ],
    }


def find(rows: list[dict], point: dict, section: str | None = None) -> list[dict]:
    return [
        r
        for r in rows
        if all(r.get(k) == v for k, v in point.items()) and section in (None, r.get("section"))
    ]


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> dict:
    return run_tiny(tmp_path_factory.mktemp("disagg"))


def test_profile_json_follows_the_schema(profile):
    assert profile["schema"] == "rollout-profile/1"
    assert profile["device"] == "cpu" and profile["dtype"] == "float32"
    assert isinstance(profile["copy_GBps"], float) and profile["copy_GBps"] > 0
    assert set(profile["model"]) == MODEL_KEYS
    assert all(isinstance(v, int) and v > 0 for v in profile["model"].values())
    assert profile["model"]["hidden_size"] == bench.TINY["hidden_size"]
    assert profile["model"]["num_layers"] == bench.TINY["num_hidden_layers"]
    for name, keys in ROW_KEYS.items():
        assert isinstance(profile[name], list)
        for row in profile[name]:
            assert set(row) == keys, (name, row)
            times = [v for k, v in row.items() if k.endswith("ms")]
            assert all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times), (name, row)
    assert all(r["layout"] == "replicas" for r in profile["steps"])
    assert profile["errors"] == [] and not [k for k in profile if k.endswith("_error")]


def test_every_requested_point_is_measured_or_skipped_with_a_reason(profile):
    for name, points in requested(profile["meta"]["args"]).items():
        for point in points:
            measured = find(profile[name], point)
            skipped = find(profile["skipped"], point, name)
            assert len(measured) + len(skipped) == 1, (name, point)
            assert all(s["reason"] for s in skipped)
    # off CUDA the overlap section has no streams: every point is skipped with that note; the others all run
    assert profile["overlap"] == [] and len(profile["skipped"]) == len(profile["meta"]["args"]["overlap"])
    assert all("CUDA" in s["reason"] for s in profile["skipped"])


def test_a_failing_point_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    measure = bench.experts_ms

    def flaky(prof, tokens, args):
        if tokens == 8:
            raise RuntimeError("boom")
        return measure(prof, tokens, args)

    monkeypatch.setattr(bench, "experts_ms", flaky)
    out = run_tiny(tmp_path, "--expert-tokens", "1,8,32")
    assert [r["tokens"] for r in out["experts"]] == [1, 32]
    assert out["errors"] == [{"section": "experts", "tokens": 8, "error": "RuntimeError: boom"}]
    assert len(out["steps"]) == len(requested(out["meta"]["args"])["steps"])  # later sections still ran


def test_points_past_the_time_budget_are_skipped_and_the_json_still_written(tmp_path):
    out = run_tiny(tmp_path, "--time-budget-s", "0")
    assert not out["attention"] and not out["experts"] and not out["steps"]
    for name, points in requested(out["meta"]["args"]).items():
        assert all(len(find(out["skipped"], p, name)) == 1 for p in points)


def test_points_whose_kv_does_not_fit_are_skipped():
    spec = bench.MoeModelSpec.from_hf_config(bench.model_config(bench.TINY, 1))
    budget = bench.kv_bytes(spec, 4, 100, 4)
    too_long = spec.max_position_embeddings
    fit, why = bench.fitting([(4, 100), (1, 100), (8, 100), (1, too_long)], spec, torch.float32, budget)
    assert fit == [(4, 100), (1, 100)]
    assert set(why) == {(8, 100), (1, too_long)}
    assert "GiB" in why[8, 100] and "max_position_embeddings" in why[1, too_long]
    # one layer of K + V for the rows, in whole blocks: batch * blocks * block_size * kv_heads * head_dim * 2 * 4
    blocks = -(-101 // bench.BLOCK_SIZE)
    assert budget == 4 * blocks * bench.BLOCK_SIZE * spec.num_kv_heads * spec.head_dim * 2 * 4


def tiny_layer(device: str = "cpu", dtype: torch.dtype = torch.float32) -> bench.LayerProfile:
    return bench.LayerProfile(
        bench.TINY, torch.device(device), dtype, **bench.engine_sizes([(4, 40), (2, 100)])
    )


def test_timed_attention_part_is_the_models_layer_forward():
    """The attention part then the experts give the model's own forward of the step (logits and routes), on the
    same block-table rows: what is timed is the layer's real computation."""
    prof = tiny_layer()
    with torch.inference_mode(), prof.decode_rows(3, 37, seed=5) as step:
        assert step.attention.num_decode == 3 and step.positions_T.tolist() == [37] * 3
        logits_SV, routes_TLK = prof.model.forward(step)
        x_TH, cos_TD, sin_TD = prof.model.embed(step)
        handed = prof.attention(step, x_TH, cos_TD, sin_TD)
        out_TH = prof.experts(handed)
        assert torch.equal(handed["ids_TK"], routes_TLK[:, 0])
        torch.testing.assert_close(prof.model.logits(out_TH, step.sample_S), logits_SV, rtol=0, atol=0)


def test_timed_attention_reads_each_rows_cached_context():
    """Changing the value cached at position 0 of row 0 changes row 0's output only: the part attends to the
    `context` cached positions through the block table."""
    prof = tiny_layer()
    with torch.inference_mode(), prof.decode_rows(3, 37, seed=5) as step:
        x_TH, cos_TD, sin_TD = prof.model.embed(step)
        before_TH = prof.attention(step, x_TH, cos_TD, sin_TD)["residual_TH"].clone()
        row0 = np.array([int(step.attention.seq_T[0])])
        cache_row = int(prof.engine.cache.table.cache_rows(row0, np.zeros(1, dtype=np.int64))[0])
        prof.engine.cache.v_LXMD[0, cache_row] += 10.0
        after_TH = prof.attention(step, x_TH, cos_TD, sin_TD)["residual_TH"]
    assert not torch.allclose(after_TH[0], before_TH[0])
    torch.testing.assert_close(after_TH[1:], before_TH[1:], rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_of_the_attention_part_equals_eager():
    prof = tiny_layer("cuda", torch.bfloat16)
    with torch.inference_mode(), prof.decode_rows(4, 40, seed=1) as step:
        x_TH, cos_TD, sin_TD = prof.model.embed(step)
        captured = {}

        def piece():
            captured.update(prof.attention(step, x_TH, cos_TD, sin_TD))

        replay = bench.graphed(piece, prof.device, eager=False)
        replay()
        torch.cuda.synchronize()
        eager = prof.attention(step, x_TH, cos_TD, sin_TD)
        for name, t in eager.items():
            torch.testing.assert_close(captured[name], t, rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_tiny_profile_on_cuda_times_every_section(tmp_path):
    out = run_tiny(tmp_path, "--device", "cuda", "--dtype", "bfloat16")
    assert out["errors"] == [] and out["skipped"] == []
    assert out["overlap"] and out["meta"]["cuda_graphs"]
    for row in out["overlap"]:
        assert row["sum_ms"] == pytest.approx(row["attention_ms"] + row["experts_ms"])
