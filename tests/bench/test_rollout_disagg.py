"""bench/rollout_disagg.py --profile: the JSON follows the rollout-profile/4 schema with every requested point
(decode and prefill) present or reported as skipped, a failing point does not stop the run, the attention part it
times is the model's own layer (same output, reads the cached context through the block table) for decode rows
and prefill prompts, the prefill steps it times are the engine's own prefill, each timed rep runs its own layer,
the overhead rows come from steps of one and two layers, and --expert-kernel reaches every engine."""

from __future__ import annotations

import dataclasses
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

from rollout import SamplingParams  # noqa: E402
from rollout.paged_attention import prefill_tiles  # noqa: E402
from rollout.runner import POSITION, SEQ, TOKEN  # noqa: E402

MODEL_KEYS = {
    "hidden_size", "num_experts", "top_k", "moe_ffn", "num_heads", "num_kv_heads", "head_dim", "num_layers",
    "vocab_size",
}  # fmt: skip
ROW_KEYS = {
    "attention": {"batch", "context", "ms"},
    "prefill_attention": {"seqs", "length", "ms"},
    "experts": {"tokens", "phase", "ms"},
    "overlap": {"batch", "context", "tokens", "attention_ms", "experts_ms", "sum_ms", "two_streams_ms"},
    "steps": {"layout", "phase", "batch", "context", "num_layers", "step_ms"},
    "overhead": {
        "phase",
        "batch",
        "context",
        "ms",
        "layer_ms",
        "step_ms",
        "step2_ms",
        "attention_ms",
        "experts_ms",
    },
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
        "prefill_attention": [{"seqs": n, "length": s} for n, s in args["prefill_points"]],
        "experts": [{"tokens": t, "phase": "decode"} for t in args["expert_tokens"]]
        + [{"tokens": t, "phase": "prefill"} for t in args["prefill_expert_tokens"]],
        "overlap": [{"batch": b, "context": c, "tokens": t} for b, c, t in args["overlap"]],
        "steps": [
            {
                "layout": "replicas",
                "phase": "decode",
                "batch": b,
                "context": c,
                "num_layers": args["step_layers"],
            }
            for c in args["step_contexts"]
            for b in args["step_batches"]
        ]
        + [
            {
                "layout": "replicas",
                "phase": "prefill",
                "batch": n,
                "context": s,
                "num_layers": args["step_layers"],
            }
            for n, s in args["prefill_points"]
        ],
        "overhead": [
            {"phase": "decode", "batch": b, "context": c}
            for c in args["step_contexts"]
            for b in args["step_batches"]
        ]
        + [{"phase": "prefill", "batch": n, "context": s} for n, s in args["prefill_points"]],
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
    assert profile["schema"] == "rollout-profile/4"
    assert profile["expert_kernel"] == "grouped"  # --expert-kernel auto on the CPU
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
            differences = {("overhead", "ms"), ("overhead", "layer_ms")}
            times = [v for k, v in row.items() if k.endswith("ms") and (name, k) not in differences]
            assert all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times), (name, row)
    assert all(r["layout"] == "replicas" for r in profile["steps"])
    assert profile["errors"] == [] and not [k for k in profile if k.endswith("_error")]


def test_steps_rows_carry_their_phase_and_every_prefill_point_is_timed(profile):
    """The tiny run fits every point: the steps section has a decode row per step point and a prefill row per
    prefill point (batch = prompts, context = their length), and prefill_attention a row per prefill point."""
    args = profile["meta"]["args"]
    phases = [r["phase"] for r in profile["steps"]]
    assert set(phases) == {"decode", "prefill"}
    assert phases.count("decode") == len(args["step_batches"]) * len(args["step_contexts"])
    prefill = [(r["batch"], r["context"]) for r in profile["steps"] if r["phase"] == "prefill"]
    assert prefill == [tuple(p) for p in args["prefill_points"]] == [(1, 8), (2, 16)]
    assert [(r["seqs"], r["length"]) for r in profile["prefill_attention"]] == prefill
    # the experts section's prefill passes default to those steps' token counts (the planner's prefill MoE fit)
    assert args["prefill_expert_tokens"] == [8, 32]
    assert [r["tokens"] for r in profile["experts"] if r["phase"] == "prefill"] == [8, 32]


def test_an_experts_pass_of_the_prefill_phase_has_no_decode_rows(monkeypatch):
    """Phase decode hands the model every token as a decode row, phase prefill none (the persistent kernel's
    tile heights differ by phase)."""
    prof = tiny_layer()
    num_decode = []
    monkeypatch.setattr(prof.model, "experts", lambda *args: num_decode.append(args[-1]))
    x = prof.inputs(6, seed=0)
    prof.experts(x, 0, "decode")
    prof.experts(x, 0, "prefill")
    assert num_decode == [6, 0]


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

    def flaky(prof, tokens, args, phase="decode"):
        if (tokens, phase) == (8, "decode"):
            raise RuntimeError("boom")
        return measure(prof, tokens, args, phase)

    monkeypatch.setattr(bench, "experts_ms", flaky)
    out = run_tiny(tmp_path, "--expert-tokens", "1,8,32")
    assert [(r["tokens"], r["phase"]) for r in out["experts"]] == [
        (1, "decode"), (32, "decode"), (8, "prefill"), (32, "prefill")
    ]  # fmt: skip
    assert out["errors"] == [
        {"section": "experts", "tokens": 8, "phase": "decode", "error": "RuntimeError: boom"}
    ]
    assert len(out["steps"]) == len(requested(out["meta"]["args"])["steps"])  # later sections still ran


def test_points_past_the_time_budget_are_skipped_and_the_json_still_written(tmp_path):
    out = run_tiny(tmp_path, "--time-budget-s", "0")
    assert not out["attention"] and not out["experts"] and not out["steps"] and not out["overhead"]
    assert not out["prefill_attention"]
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


def assert_parts_are_the_forward(prof, step) -> None:
    """The timed attention part then the experts give the model's own forward of the step: its routes and its
    sampled rows' logits, bit for bit."""
    logits_SV, routes_TLK = prof.model.forward(step)
    x_TH, cos_TD, sin_TD = prof.model.embed(step)
    handed = prof.attention(step, x_TH, cos_TD, sin_TD)
    out_TH = prof.experts(handed)
    assert torch.equal(handed["ids_TK"], routes_TLK[:, 0])
    torch.testing.assert_close(prof.model.logits(out_TH, step.sample_S), logits_SV, rtol=0, atol=0)


def test_timed_attention_part_is_the_models_layer_forward():
    """The attention part then the experts give the model's own forward of the step (logits and routes), on the
    same block-table rows: what is timed is the layer's real computation."""
    prof = tiny_layer()
    with torch.inference_mode(), prof.decode_rows(3, 37, seed=5) as step:
        assert step.attention.num_decode == 3 and step.positions_T.tolist() == [37] * 3
        assert_parts_are_the_forward(prof, step)


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


def test_timed_prefill_attention_part_is_the_models_layer_forward():
    """The same for a prefill-only step of 2 prompts of 20 tokens (two attention tiles or more, crossing a cache
    block): the attention part then the experts give the model's own forward of the step, whose sampled rows
    are the prompts' last tokens."""
    prof = tiny_layer()
    with torch.inference_mode(), prof.prefill_rows(2, 20, seed=5) as step:
        assert step.attention.num_decode == 0 and step.positions_T.tolist() == [*range(20), *range(20)]
        assert step.sample_S.tolist() == [19, 39] and len(set(step.attention.seq_T.tolist())) == 2
        assert_parts_are_the_forward(prof, step)


def tiny_engine(layers: int = 2) -> bench.RolloutEngine:
    """A float32 CPU engine of TINY widths whose cache holds random K/V (fill_cache), as the bench's engines."""
    config = bench.RolloutConfig(max_model_len=64, max_batch_size=4, kv_cache_tokens=512, cuda_graphs=False)
    engine = bench.RolloutEngine.from_config(
        bench.model_config(bench.TINY, layers), torch.device("cpu"), torch.float32, config, seed=0
    )
    bench.fill_cache(engine)
    return engine


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_runner_on_prefill_step_inputs_computes_the_engines_own_prefill(temperature):
    """The runner's step on prefill_step's inputs gives the tokens, log-probs and routes that generate() gives
    for the same prompts (one step that admits them whole; seeds 0..n-1 as prefill_step's). Wrong positions
    (RoPE), cache rows (attention would read the random cache) or samples would change them. The CPU's
    attention reads each token's own row, so wrong pieces would not: the GPU kernel takes a tile's row and
    first position from its first token, so every tile the runner cuts from the pieces must be a run of one
    prompt, and the tiles must cover the step's tokens once."""
    engine = tiny_engine()
    seqs, length = 3, 20
    with torch.inference_mode(), rollout_decode.prefill_step(engine, seqs, length, seed=7) as inputs:
        starts, lengths = prefill_tiles(inputs.pieces, engine.runner.tile)
        covered = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)])
        np.testing.assert_array_equal(covered, np.arange(seqs * length))
        for a, n in zip(starts, lengths):
            tile_T4 = inputs.tokens_T4[a : a + n]
            assert len(set(tile_T4[:, SEQ])) == 1 and (np.diff(tile_T4[:, POSITION]) == 1).all()
        inputs = dataclasses.replace(inputs, temperature_S=np.full(seqs, temperature, dtype=np.float32))
        out = engine.runner.run(inputs)
        tokens_S, logprobs_S, routes_TLK = out.tokens_S.copy(), out.logprobs_S.copy(), out.routes_TLK.copy()
        prompts = inputs.tokens_T4[:, TOKEN].reshape(seqs, length).tolist()
    assert engine.cache.table.num_used_blocks == 0  # the rows were released
    params = [
        SamplingParams(max_new_tokens=1, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(seqs)
    ]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [[t] for t in tokens_S.tolist()]
    np.testing.assert_allclose([o.logprobs[0] for o in outs], logprobs_S, rtol=1e-5, atol=1e-5)
    routes = np.concatenate([o.routed_experts[:length] for o in outs]).astype(np.int64)
    np.testing.assert_array_equal(routes, routes_TLK.astype(np.int64))


def test_prefill_points_size_the_engines_and_those_that_do_not_fit_are_skipped():
    """A prefill point of n prompts of s tokens holds n rows of positions 0..s-1 and needs steps of n s tokens:
    the engines are sized for it, and a point whose KV or positions do not fit is skipped with the reason."""
    spec = bench.MoeModelSpec.from_hf_config(bench.model_config(bench.TINY, 1))
    budget = bench.kv_bytes(spec, 4, 99, 4)  # 4 rows of 100 positions
    longest = spec.max_position_embeddings
    fit, why = bench.prefill_fitting(
        [(4, 100), (8, 100), (1, longest), (1, longest + 1)], spec, torch.float32, budget
    )
    assert fit == [(4, 100)] and set(why) == {(8, 100), (1, longest), (1, longest + 1)}
    assert "GiB" in why[8, 100] and "max_position_embeddings" in why[1, longest + 1]
    sizes = bench.engine_sizes([(2, 40)], [(4, 100), (1, 3000)])
    assert sizes["max_step_tokens"] == 3000 and sizes["max_rows"] == 4 and sizes["max_len"] >= 3000
    assert sizes["num_positions"] >= 3000 and bench.engine_sizes([(2, 40)])["max_step_tokens"] == 2048
    args = bench.parse_args(["--profile", "--tiny", "--prefill-points", "1:3000,2:16", "--step-batches", "1"])
    run = bench.Recorder(bench.new_profile(args, bench.TINY, torch.device("cpu")), args.time_budget_s)
    engine, why, prefill_why = bench.step_engine(
        run, args, bench.TINY, 1, torch.device("cpu"), torch.float32, args.prefill_points
    )
    assert not why and not prefill_why and engine.config.max_step_tokens >= 3000
    with rollout_decode.prefill_step(engine, 1, 3000) as inputs:  # the cache holds it
        assert inputs.num_tokens == 3000 and inputs.pieces == [(0, 3000)]


def test_the_expert_kernel_option_reaches_every_engine(tmp_path, monkeypatch):
    """--expert-kernel is every RolloutConfig's expert_kernel, and the JSON names the path the engines ran; the
    overhead section's step engines have one and two layers, the steps section's --step-layers."""
    kernels, layers = [], []
    config, step_engine = bench.RolloutConfig, bench.step_engine

    def recorded(**kwargs):
        kernels.append(kwargs.get("expert_kernel"))
        return config(**kwargs)

    def counted(run, args, base, num_layers, *rest):
        layers.append(num_layers)
        return step_engine(run, args, base, num_layers, *rest)

    monkeypatch.setattr(bench, "RolloutConfig", recorded)
    monkeypatch.setattr(bench, "step_engine", counted)
    out = run_tiny(tmp_path, "--expert-kernel", "padded", "--step-layers", "3")
    assert layers == [1, 2, 3]
    assert len(kernels) == 4 and set(kernels) == {"padded"}  # the layer, two overhead and the steps engines
    assert out["expert_kernel"] == "padded" and out["errors"] == []
    assert out["meta"]["expert_paths"] == {"1": "grouped", "8": "grouped", "32": "padded"}  # padded_capacity


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


def test_overhead_rows_are_steps_of_one_and_two_layers_beside_the_layer_timed_alone(profile):
    """layer_ms = step2_ms - step_ms and ms = step_ms - layer_ms; the parts are what those sections measured at
    the same point (the tiny step batches 1 and 4 are not expert token counts of the run: measured for the
    overhead section); a prefill row's parts are its point's prefill attention and the prefill-phase experts of
    seqs x length."""
    attention = {(r["batch"], r["context"]): r["ms"] for r in profile["attention"]}
    prefill = {(r["seqs"], r["length"]): r["ms"] for r in profile["prefill_attention"]}
    experts = {(r["phase"], r["tokens"]): r["ms"] for r in profile["experts"]}
    assert len(profile["overhead"]) == len(requested(profile["meta"]["args"])["overhead"])
    for row in profile["overhead"]:
        assert row["layer_ms"] == pytest.approx(row["step2_ms"] - row["step_ms"])
        assert row["ms"] == pytest.approx(row["step_ms"] - row["layer_ms"])
        if row["phase"] == "prefill":
            assert row["attention_ms"] == prefill[row["batch"], row["context"]]
            assert row["experts_ms"] == experts["prefill", row["batch"] * row["context"]]
            continue
        assert row["attention_ms"] == attention[row["batch"], row["context"]]
        if ("decode", row["batch"]) in experts:
            assert row["experts_ms"] == experts["decode", row["batch"]]
    assert {r["phase"] for r in profile["overhead"]} == {"decode", "prefill"}


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
    engine, why, _ = bench.step_engine(run, args, bench.TINY, 2, torch.device("cpu"), torch.float32)
    assert not why
    spec = engine.spec
    with torch.inference_mode(), bench.decode_step(engine, 8, bench.at_context(20)) as inputs:
        engine.cache.sync_table()
        routes_TLK = engine.runner.run(inputs).routes_TLK[:8]
    expected = spec.num_experts * (1 - (1 - spec.top_k / spec.num_experts) ** 8)
    for layer in range(spec.num_layers):
        touched = len(np.unique(routes_TLK[:, layer]))
        assert touched > spec.top_k and touched >= 0.6 * expected, (layer, touched, expected)
