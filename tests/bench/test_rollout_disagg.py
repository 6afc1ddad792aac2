"""bench/rollout_disagg.py --profile: the JSON follows the rollout-profile/2 schema with every requested point
present or reported as skipped, a failing point does not stop the run, the attention part it times is the
model's own layer (same output, reads the cached context through the block table), each timed rep runs its own
layer, and the overhead rows are a one-layer step minus its layer."""

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

import rollout_decode  # noqa: E402
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
    "overhead": {"batch", "context", "ms", "step_ms", "attention_ms", "experts_ms"},
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
        "overhead": [{"batch": b, "context": c} for c in args["step_contexts"] for b in args["step_batches"]],
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
    assert profile["schema"] == "rollout-profile/2"
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
            times = [v for k, v in row.items() if k.endswith("ms") and (name, k) != ("overhead", "ms")]
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
    assert not out["attention"] and not out["experts"] and not out["steps"] and not out["overhead"]
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


def tiny_layer(
    device: str = "cpu", dtype: torch.dtype = torch.float32, layers: int = 1
) -> bench.LayerProfile:
    return bench.LayerProfile(
        bench.TINY, torch.device(device), dtype, **bench.engine_sizes([(4, 40), (2, 100)]), num_layers=layers
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


def test_overhead_rows_are_a_one_layer_step_minus_its_layer(profile):
    """ms = step_ms - attention_ms - experts_ms, with the parts those sections measured at the same point (the
    tiny step batches 1 and 4 are not expert token counts of the run: measured for the overhead section)."""
    attention = {(r["batch"], r["context"]): r["ms"] for r in profile["attention"]}
    experts = {r["tokens"]: r["ms"] for r in profile["experts"]}
    assert len(profile["overhead"]) == len(requested(profile["meta"]["args"])["overhead"])
    for row in profile["overhead"]:
        assert row["ms"] == pytest.approx(row["step_ms"] - row["attention_ms"] - row["experts_ms"])
        assert row["attention_ms"] == attention[row["batch"], row["context"]]
        if row["batch"] in experts:
            assert row["experts_ms"] == experts[row["batch"]]


def test_each_rep_runs_its_own_layer_and_the_time_is_per_rep(monkeypatch):
    """The graph of R reps calls the part on layers 0..R-1 (distinct weights: no rep finds the last one's in
    L2), and the reported time is the timed call / R."""
    prof = tiny_layer(layers=3)
    calls = []
    monkeypatch.setattr(bench, "median_ms", lambda device, fn, warmup, repeats: (fn(), 6.0)[1])
    assert bench.per_rep_ms(prof, calls.append, bench.parse_args(["--profile", "--tiny"])) == 2.0
    assert calls == [0, 1, 2]
    with torch.inference_mode(), prof.decode_rows(2, 20, seed=3) as step:
        x_TH, cos_TD, sin_TD = prof.model.embed(step)
        outs = [prof.attention(step, x_TH, cos_TD, sin_TD, i)["residual_TH"] for i in range(3)]
        moe = [prof.experts(prof.inputs(4, seed=0), i) for i in range(3)]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    assert not torch.equal(moe[0], moe[1])


def test_a_json_is_written_after_each_section(tmp_path, monkeypatch):
    """A run cut short (here: the steps section dies) keeps the sections before it on disk."""
    written = []
    monkeypatch.setattr(
        bench, "save", lambda out, path: written.append(json.loads(json.dumps(out, default=str)))
    )

    def boom(*args):
        raise RuntimeError("killed")

    monkeypatch.setattr(bench, "steps_section", boom)
    bench.main(["--profile", "--tiny", "--json", str(tmp_path / "p.json")])
    with_overhead = [w for w in written if w["overhead"]]
    assert with_overhead and "steps_error" not in with_overhead[0]
    assert written[-1]["steps_error"] == "RuntimeError: killed"


class NeverDone:
    """A CUDA event stand-in whose work never finishes (a stuck GPU)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("a watched wait must poll, not block")


class DoneAfter(NeverDone):
    def __init__(self, polls: int) -> None:
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls <= 0


def test_a_watched_wait_raises_on_a_stuck_gpu_and_returns_when_the_work_ends():
    with pytest.raises(rollout_decode.GpuStalled, match=r"after 0\.05 s"):
        rollout_decode.wait_event(NeverDone(), stall_s=0.05)
    done = DoneAfter(polls=5)
    rollout_decode.wait_event(done, stall_s=5.0)
    assert done.polls == 0


def test_a_stalled_overlap_writes_the_profile_and_exits_with_status_3(tmp_path, monkeypatch):
    """The overlap section runs last: a stall there keeps every other section on disk, records itself, and ends
    the process (os._exit, no CUDA teardown) instead of hanging."""

    def stuck(*args):
        raise bench.GpuStalled("the GPU has not finished the timed work after 60 s")

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(bench, "overlap_section", stuck)
    monkeypatch.setattr(bench.os, "_exit", exit_)
    path = tmp_path / "p.json"
    with pytest.raises(SystemExit) as ended:
        bench.main(["--profile", "--tiny", "--json", str(path)])
    assert ended.value.code == 3
    out = json.loads(path.read_text())
    assert out["steps"] and out["overhead"] and out["attention"] and out["experts"]
    assert out["errors"] == [
        {"section": "overlap", "error": "GpuStalled: the GPU has not finished the timed work after 60 s"}
    ]


def test_step_rows_route_like_distinct_sequences():
    """The steps and overhead sections time the runner on decode_step's rows: each row's own random token over a
    random cache, so a step of b rows touches about E (1 - (1 - K/E)^b) experts per layer, as the experts
    section assumes; rows fed one token over a zeroed cache would all pick the same K."""
    args = bench.parse_args(["--profile", "--tiny", "--step-batches", "8", "--step-contexts", "20"])
    run = bench.Recorder(bench.new_profile(args, bench.TINY, torch.device("cpu")), args.time_budget_s)
    engine, why = bench.step_engine(run, args, bench.TINY, 2, torch.device("cpu"), torch.float32)
    assert not why
    spec = engine.spec
    with torch.inference_mode(), bench.decode_step(engine, 8, bench.at_context(20)) as inputs:
        engine.cache.sync_table()
        routes_TLK = engine.runner.run(inputs).routes_TLK[:8]
    expected = spec.num_experts * (1 - (1 - spec.top_k / spec.num_experts) ** 8)
    for layer in range(spec.num_layers):
        touched = len(np.unique(routes_TLK[:, layer]))
        assert touched > spec.top_k and touched >= 0.6 * expected, (layer, touched, expected)
