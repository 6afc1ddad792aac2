"""The deployment planner (rollout.plan): the papers' worked numbers, Algorithm 1 against a brute force, the
monotonicity the search relies on, the fits, the CLI end to end and its errors. CPU only, numpy only."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from rollout.plan.__main__ import main
from rollout.plan.hardware import GB, GpuSpec, ModelShape, gpu_preset, model_preset
from rollout.plan.perf import (
    compute_bound_batch,
    distinct_experts,
    expected_tiles,
    gemm_mfu,
    hit_probability,
    min_micro_batches,
    paper_iteration_ms,
    pingpong_check,
    pingpong_iteration_ms,
    tiles,
    tokens_per_expert,
)
from rollout.plan.profile import (
    FittedAttention,
    FittedExperts,
    FittedOverhead,
    LayerTimes,
    OverheadPoint,
    StepPoint,
    analytic_times,
    fit_attention,
    fit_experts,
    fit_in_step,
    fit_overhead,
    in_step,
    nnls,
    parse_profile,
)
from rollout.plan.search import (
    Cluster,
    Search,
    Shape,
    Workload,
    best_for_shape,
    brute_force,
    candidate_shapes,
    evaluate,
    search_plans,
    with_latency,
)
from rollout.plan.shared import KernelFit, moe_tiles

TINY = ModelShape(
    "tiny",
    hidden_size=256,
    num_experts=8,
    top_k=2,
    moe_ffn=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=1000,
)
TINY_GPU = GpuSpec("tiny-gpu", 100e12, 1e12, 0.06 * GB, 100 * GB)


# ------------------------------------------------------------------------------- MegaScale-Infer section 2.3
def test_section_2_3_compute_bound_batch_and_mixtral_expert_batch():
    # The paper's inputs: an A100 at 312 TFLOP/s and 2 TB/s; Mixtral-8x22B routes top-2 of 8 experts.
    assert compute_bound_batch(312e12, 2e12) == pytest.approx(156)
    a100 = gpu_preset("a100")
    assert compute_bound_batch(a100.peak_flops, a100.mem_bandwidth) == pytest.approx(156)
    mixtral = model_preset("mixtral-8x22b")
    assert tokens_per_expert(156, mixtral.top_k, mixtral.num_experts) == pytest.approx(39)
    assert gemm_mfu(39, 312e12, 2e12) == pytest.approx(0.25)


def test_equation_8_boundary():
    from rollout.plan.perf import kv_fits, max_kv_seqs

    n = max_kv_seqs(1000, 2e3, 10e6, 50e6)  # (50 - 10) MB of room / 2 MB per sequence
    assert n == 20
    assert kv_fits(n, 1000, 2e3, 10e6, 50e6) and not kv_fits(n + 1, 1000, 2e3, 10e6, 50e6)
    assert max_kv_seqs(1000, 2e3, 60e6, 50e6) == 0


def test_fine_grained_experts_touch_nearly_all_weights():
    qwen = model_preset("qwen3-30b-a3b")
    assert distinct_experts(1, qwen.num_experts, qwen.top_k) == pytest.approx(8)
    assert distinct_experts(64, qwen.num_experts, qwen.top_k) / qwen.num_experts > 0.98
    assert hit_probability(1, 8, 2) == pytest.approx(1 - 21 / 28)
    assert hit_probability(8, 8, 2) == 1.0


# ------------------------------------------------------------------------------- MegaScale-Infer section 4.1
def test_section_4_1_micro_batch_conditions():
    rng = random.Random(0)
    for _ in range(200):
        t_f = rng.uniform(0.1, 5)
        x = rng.uniform(0.01, 0.99)
        m = min_micro_batches(t_f, x * t_f)
        assert m == (3 if x < 0.5 else 4)
        assert pingpong_check(t_f, t_f, x * t_f, m).pipeline_full
        assert not pingpong_check(t_f, t_f, x * t_f, m - 1).pipeline_full
    assert min_micro_batches(1.0, 0.0) == 2


def test_section_4_1_iteration_time_hand_cases():
    # T_a = 1, T_e = 2, T_c = 0.3, m = 3, L = 2: (1 + 2 + 0.6) + 2 (3 * 2 - 1) = 13.6
    assert paper_iteration_ms(1, 2, 0.3, 3, 2) == pytest.approx(13.6)
    assert pingpong_iteration_ms(1, 2, 0.3, 3, 2) == pytest.approx(13.6)
    # m = 1: no overlap, L (T_a + T_e + 2 T_c)
    assert pingpong_iteration_ms(1, 2, 0.3, 1, 2) == pytest.approx(7.2)
    # m = 2 with T_c = 1: m T_f = 4 < 2 (T_f + T_c) = 6, so the round trip sets the period: 5 + 5 + 2 = 12
    assert pingpong_iteration_ms(1, 2, 1.0, 2, 2) == pytest.approx(12.0)
    assert paper_iteration_ms(1, 2, 1.0, 2, 2) < 12.0  # the paper's formula assumes its conditions


def _simulate_pingpong(t_a: float, t_e: float, t_c: float, m: int, num_layers: int) -> float:
    """Event loop: attention serves (layer, micro-batch) in order once the micro-batch is back; experts in order."""
    attn_free = expert_free = 0.0
    back = [0.0] * m
    for _ in range(num_layers):
        arrive = []
        for j in range(m):
            attn_free = max(attn_free, back[j]) + t_a
            arrive.append(attn_free + t_c)
        for j in range(m):
            expert_free = max(expert_free, arrive[j]) + t_e
            back[j] = expert_free + t_c
    return back[-1]


def test_iteration_time_equals_event_simulation():
    rng = random.Random(1)
    for _ in range(2000):
        t = (rng.uniform(0.1, 2), rng.uniform(0.1, 2), rng.uniform(0, 2))
        m, num_layers = rng.randint(1, 4), rng.randint(1, 6)
        assert pingpong_iteration_ms(*t, m, num_layers) == pytest.approx(
            _simulate_pingpong(*t, m, num_layers)
        )
        if pingpong_check(*t, m).pipeline_full:
            assert paper_iteration_ms(*t, m, num_layers) == pytest.approx(
                _simulate_pingpong(*t, m, num_layers)
            )


# ----------------------------------------------------------------------------------------- ExpertPlex tiles
def test_tiles_hand_case_and_expectation():
    assert tiles([0, 1, 16, 17, 64], 16) == 0 + 1 + 1 + 2 + 4
    rng = np.random.default_rng(0)
    num_experts, top_k, tokens = 16, 2, 100
    draws = [
        np.bincount(
            np.concatenate([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]),
            minlength=num_experts,
        )
        for _ in range(400)
    ]
    mc = np.mean([tiles(d, 4) for d in draws])
    assert expected_tiles(tokens, num_experts, top_k, 4) == pytest.approx(mc, rel=0.03)


# --------------------------------------------------------------------------------------------------- fits
def test_nnls_matches_lstsq_when_unconstrained_is_feasible_and_clips_otherwise():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 2, size=(20, 3))
    y = a @ np.array([1.0, 2.0, 0.5])
    assert nnls(a, y) == pytest.approx([1.0, 2.0, 0.5])
    x = nnls(a, a @ np.array([1.0, -2.0, 0.5]))
    assert np.all(x >= 0) and x[1] == 0


def test_fits_recover_known_times():
    attn = FittedAttention((0.02, 3e-4, 2e-7), 4)
    points = [_apoint(b, c, attn.ms(b, c, 1)) for b in (1, 8, 64) for c in (512, 4096)]
    assert fit_attention(tuple(points), 4).coef == pytest.approx(attn.coef, rel=1e-6)
    exp = FittedExperts("touched", (0.05, 2e-3, 1e-5), TINY.num_experts, TINY.top_k)
    epoints = [_epoint(t, exp.ms(t, TINY.num_experts, 1)) for t in (1, 2, 4, 16, 256, 4096)]
    assert fit_experts(tuple(epoints), TINY, "touched").coef == pytest.approx(exp.coef, rel=1e-5)


def _apoint(b, c, ms):
    from rollout.plan.profile import AttentionPoint

    return AttentionPoint(b, c, ms)


def _epoint(t, ms):
    from rollout.plan.profile import ExpertPoint

    return ExpertPoint(t, ms)


# -------------------------------------------------------------------------------- Algorithm 1 vs brute force
def _random_search(seed: int, latency: bool = True) -> Search:
    rng = random.Random(seed)
    attn = FittedAttention(
        (rng.uniform(0, 0.05), rng.uniform(0, 2e-3), rng.uniform(0, 5e-6)), TINY.num_kv_heads
    )
    exp = FittedExperts(
        rng.choice(["touched", "linear"]),
        (rng.uniform(0, 0.05), rng.uniform(0, 0.01), rng.uniform(0, 1e-3)),
        TINY.num_experts,
        TINY.top_k,
    )
    gpu = replace(TINY_GPU, memory_bytes=rng.uniform(0.04, 0.08) * GB)
    times = LayerTimes(attn, exp, gpu, f"random {seed}")
    cluster = Cluster(
        rng.choice([2, 4, 6]),
        gpu,
        gpus_per_node=4,
        nic_GBps=rng.uniform(1, 50),
        link_latency_us=rng.uniform(0, 20),
        dispatch=rng.choice(["all", "routed"]),
    )
    workload = Workload(rng.randint(16, 64), rng.randint(16, 64), rng.uniform(1.0, 4.0) if latency else None)
    # drawn last so the draws above stay those of the searches without an overhead term
    if rng.random() < 0.5:
        times = replace(times, overhead=FittedOverhead((rng.uniform(0, 0.3), rng.uniform(0, 2e-3))))
    return Search(TINY, times, workload, cluster)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", ["replicas", "disaggregated"])
@pytest.mark.parametrize("exhaustive", [False, True])
def test_algorithm_1_equals_brute_force(seed, layout, exhaustive):
    s = _random_search(seed)
    micro = (1, 2, 3, 4)
    ref = brute_force(s, (layout,), micro, exhaustive)
    if ref is None:
        with pytest.raises(ValueError, match="no plan"):
            search_plans(s, (layout,), micro, exhaustive)
        return
    best = search_plans(s, (layout,), micro, exhaustive)[0]
    assert best.tokens_per_s_per_gpu == pytest.approx(ref.tokens_per_s_per_gpu, rel=1e-12)
    assert best.batch == ref.batch


def test_search_covers_both_layouts_and_n_a_balances():
    s = _random_search(3, latency=False)
    layouts = {p.shape.layout for p in search_plans(s, micro_choices=(3,))}
    assert layouts == {"replicas", "disaggregated"}


# ----------------------------------------------------------------------------------------- monotonicity
@pytest.mark.parametrize("seed", range(4))
def test_more_bandwidth_never_worse(seed):
    s = _random_search(seed, latency=False)
    last = 0.0
    for nic, nvlink in [(1, 5), (5, 20), (25, 100), (100, 400)]:
        c = replace(s.cluster, nic_GBps=nic, nvlink_GBps=nvlink)
        best = search_plans(replace(s, cluster=c))[0].tokens_per_s_per_gpu
        assert best >= last * (1 - 1e-12)
        last = best


@pytest.mark.parametrize("seed", range(4))
def test_looser_latency_never_smaller_batch(seed):
    s = _random_search(seed, latency=False)
    shapes = candidate_shapes(s, ("replicas", "disaggregated"), (3, 4))
    last_batch = {sh: 0 for sh in shapes}
    last_best = 0.0
    for target in (0.5, 1.0, 2.0, 4.0, 8.0, None):
        t = with_latency(s, target)
        for sh in shapes:
            p = best_for_shape(t, sh)
            batch = p.batch if p else 0
            assert batch >= last_batch[sh]
            last_batch[sh] = batch
        plans = [p for p in (best_for_shape(t, sh) for sh in shapes) if p]
        best = max((p.tokens_per_s_per_gpu for p in plans), default=0.0)
        assert best >= last_best
        last_best = best


# ---------------------------------------------------------------------------------------------------- CLI
def _profile_json(times: LayerTimes, model: ModelShape) -> dict:
    """A rollout-profile/1 document whose rows come from `times` (+-3% noise), with steps to validate."""
    rng = np.random.default_rng(0)
    noise = lambda: float(rng.uniform(0.97, 1.03))  # noqa: E731
    steps = [
        {
            "layout": "replicas",
            "batch": b,
            "context": c,
            "num_layers": 4,
            "step_ms": (
                4 * (times.attention.ms(b, c, 1) + times.experts.ms(b, model.num_experts, 1))
                + times.head_ms(model, b, 1)
            )
            * noise(),
        }
        for b in (8, 32)
        for c in (512, 2048)
    ]
    return {
        "schema": "rollout-profile/1",
        "device": "synthetic",
        "dtype": "bfloat16",
        "copy_GBps": times.head_gpu.mem_bandwidth / 1e9,
        "model": {
            "hidden_size": model.hidden_size,
            "num_experts": model.num_experts,
            "top_k": model.top_k,
            "moe_ffn": model.moe_ffn,
            "num_heads": model.num_heads,
            "num_kv_heads": model.num_kv_heads,
            "head_dim": model.head_dim,
            "num_layers": model.num_layers,
            "vocab_size": model.vocab_size,
        },
        "attention": [
            {"batch": b, "context": c, "ms": times.attention.ms(b, c, 1) * noise()}
            for b in (1, 8, 32, 128)
            for c in (256, 1024, 4096)
        ],
        "experts": [
            {"tokens": t, "ms": times.experts.ms(t, model.num_experts, 1) * noise()}
            for t in (1, 4, 16, 64, 256, 1024, 4096)
        ],
        "overlap": [],
        "steps": steps,
    }


def test_cli_preset_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "--model",
            "qwen3-30b-a3b",
            "--gpus",
            "8",
            "--gpu",
            "h100",
            "--prompt-len",
            "1024",
            "--output-len",
            "4096",
            "--latency-ms",
            "40",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "analytic roofline" in text and "tokens/s per GPU" in text
    data = json.loads(out.read_text())
    assert data["plan"]["layout"] in ("replicas", "disaggregated")
    assert data["plan"]["step_ms"] <= 40
    assert data["plan"]["tokens_per_s_per_gpu"] > 0


def test_cli_profile_plan_and_validate(tmp_path, capsys):
    qwen = model_preset("qwen3-30b-a3b")
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(_profile_json(analytic_times(qwen, gpu_preset("h200")), qwen)))
    out = tmp_path / "plan.json"
    assert main(["--profile", str(prof), "--gpus", "4", "--gpu", "h200", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"profile {prof}" in text and "T_e (touched)" in text
    assert json.loads(out.read_text())["plan"]["batch"] > 0
    check = tmp_path / "check.json"
    assert main(["--profile", str(prof), "--gpu", "h200", "--validate", str(prof), "--json", str(check)]) == 0
    rows = json.loads(check.read_text())["rows"]
    assert len(rows) == 4 and all(r["ok"] for r in rows)
    assert "4 of 4 rows within 15%" in capsys.readouterr().out


def test_cli_reads_a_checkpoint_folder(tmp_path, capsys):
    from rollout.plan.hardware import MODEL_PRESETS

    (tmp_path / "config.json").write_text(json.dumps(MODEL_PRESETS["qwen3-30b-a3b"]))
    assert main(["--model", str(tmp_path), "--gpus", "2", "--layout", "replicas"]) == 0
    assert "replicas" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "no-such-model"], "unknown preset"),
        (["--gpu", "tpu"], "--gpu 'tpu': unknown preset"),
        (["--latency-ms", "0.01"], "no plan meets --latency-ms 0.01"),
        (["--model", "mixtral-8x22b", "--gpus", "1"], "no plan fits memory"),
        (["--micro-batches", "5"], "values must lie in 1..4"),
    ],
)
def test_cli_errors_name_the_problem(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_a_wrong_profile(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something-else/2"}))
    assert main(["--profile", str(bad)]) == 2
    schemas = [f"rollout-profile/{v}" for v in (1, 2, 3, 4)]
    assert f"schema='something-else/2'; expected one of {schemas}" in capsys.readouterr().err
    qwen = model_preset("qwen3-30b-a3b")
    doc = _profile_json(analytic_times(qwen, gpu_preset("h100")), qwen)
    del doc["attention"][2]["ms"]
    bad.write_text(json.dumps(doc))
    assert main(["--profile", str(bad)]) == 2
    assert "attention[2] lacks ['ms']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'model'"):
        parse_profile({"schema": "rollout-profile/1", "model": {"hidden_size": 1}}, "x.json")


def test_profile_and_model_must_agree(tmp_path, capsys):
    qwen = model_preset("qwen3-30b-a3b")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_profile_json(analytic_times(qwen, gpu_preset("h100")), qwen)))
    assert main(["--profile", str(prof), "--model", "mixtral-8x22b"]) == 2
    assert "differ in" in capsys.readouterr().err


def test_roofline_times_are_monotone_and_finite():
    qwen = model_preset("qwen3-30b-a3b")
    times = analytic_times(qwen, gpu_preset("h100"))
    prev = 0.0
    for t in (1, 8, 64, 512, 4096):
        cur = times.experts.ms(t, qwen.num_experts, 1)
        assert cur >= prev and math.isfinite(cur)
        prev = cur
    # the weight-read floor of one layer's 128 experts: 1.21 GB over 3.35 TB/s
    assert times.experts.ms(256, qwen.num_experts, 1) == pytest.approx(
        qwen.expert_bytes(qwen.num_experts) / qwen.num_layers / 3.35e12 * 1e3, rel=0.01
    )


# --------------------------------------------------------------------------------- ExpertPlex (--arch shared)
def test_kernel_fit_recovers_equation_2():
    from rollout.plan.shared import KernelFit, fit_kernel

    true = KernelFit(0.01, 2e-3, 4e-6, 3e-9)
    points = [(x, s, true.ms(x, s)) for x in (1, 4, 16, 64) for s in (0, 128, 1024, 8192)]
    got = fit_kernel(points)
    assert (got.alpha, got.beta, got.gamma, got.delta) == pytest.approx((0.01, 2e-3, 4e-6, 3e-9), rel=1e-6)


def test_goodput_is_the_slower_phase():
    from rollout.plan.shared import goodput

    # 16 prompts per 400 ms pass = 40 req/s; 300 rows at 20 ms per token for 1000 tokens = 15 req/s
    assert goodput(1e3 * 16 / 400, 1e3 * 300 / (20 * 1000)) == pytest.approx(15.0)


def _minimax_ctx():
    from rollout.plan.shared import build_kernels, make_ctx

    model = model_preset("minimax-m2")
    gpu = gpu_preset("h800")
    s = Search(model, analytic_times(model, gpu), Workload(1000, 1000), Cluster(8, gpu))
    return make_ctx(s, build_kernels(s, None), tpot_ms=50.0, prefill_tokens=16384)


def test_expertplex_shared_experts_beat_per_phase_replicas_under_drift():
    """ExpertPlex's qualitative claim on its own model (MiniMax-M2 widths, fp8, 8 x H800): experts are ~98% of
    the weights, so per-phase replicas fit only as 1 prefill + 1 decode instance of 4 GPUs, while the shared
    pool holds the experts once and leaves whole GPUs to the attention pools. Deployed for 1000:1000 and kept
    while the prompt:output mix drifts 16-fold either way, the shared layout gives more goodput everywhere."""
    from rollout.plan.shared import drift_goodputs, optimize

    c = _minimax_ctx()
    assert c.model.expert_bytes(c.model.num_experts) / c.model.total_bytes > 0.95
    best = optimize(c, ("shared", "pd-replicas"))
    shared, pd = best["shared"], best["pd-replicas"]
    assert shared is not None and pd is not None
    assert (pd.layout.num_prefill, pd.layout.num_decode, pd.layout.instance_gpus) == (1, 1, 4)
    assert shared.goodput > 1.5 * pd.goodput
    demands = [(4000, 250), (2000, 500), (1000, 1000), (500, 2000), (250, 4000)]
    table = drift_goodputs(c, best, demands)
    assert all(s > p for s, p in zip(table["shared"], table["pd-replicas"]))
    assert min(table["shared"]) > min(table["pd-replicas"])


def test_cli_shared_end_to_end(tmp_path, capsys):
    out = tmp_path / "shared.json"
    rc = main(
        [
            "--arch",
            "shared",
            "--model",
            "minimax-m2",
            "--gpu",
            "h800",
            "--gpus",
            "8",
            "--prompt-len",
            "1000",
            "--output-len",
            "1000",
            "--tpot-ms",
            "50",
            "--drift",
            "4000:250,250:4000",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "| shared |" in text and "| pd-replicas |" in text and "| colocated |" in text
    assert "when the demand drifts" in text
    data = json.loads(out.read_text())
    assert data["architectures"]["shared"]["goodput"] > data["architectures"]["pd-replicas"]["goodput"]
    assert len(data["drift"]["goodput"]["shared"]) == 2


def test_cli_shared_from_a_profile(tmp_path, capsys):
    qwen = model_preset("qwen3-30b-a3b")
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps(_profile_json(analytic_times(qwen, gpu_preset("h100")), qwen)))
    assert main(["--arch", "shared", "--profile", str(prof), "--gpus", "4", "--tpot-ms", "40"]) == 0
    assert "kernels (t = alpha + beta x + gamma x s + delta x s^2): profile rows" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arch", "shared", "--tpot-ms", "0.01"], "no layout meets --tpot-ms 0.01"),
        (["--arch", "shared", "--drift", "1000-200"], "--drift '1000-200'"),
    ],
)
def test_cli_shared_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_fine_grained_steps_need_the_touched_form(tmp_path, capsys):
    """The caveat of #30: with 128 experts top-8 the expert time follows the weight bytes touched; a fit linear
    in tokens (MegaScale-Infer's T_e = k3 b + k4) misses the measured steps."""
    qwen = model_preset("qwen3-30b-a3b")
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(_profile_json(analytic_times(qwen, gpu_preset("h200")), qwen)))
    out = {}
    for form in ("touched", "linear"):
        path = tmp_path / f"{form}.json"
        assert main(["--validate", str(prof), "--expert-fit", form, "--json", str(path)]) == 0
        out[form] = json.loads(path.read_text())["rows"]
    capsys.readouterr()
    assert all(r["ok"] for r in out["touched"])
    assert not any(r["ok"] for r in out["linear"])


# ----------------------------------------------------------------------------------- the step's fixed cost
QWEN_ATTN = FittedAttention((0.02, 4e-4, 1.5e-7), 4)
QWEN_EXPERTS = FittedExperts("touched", (0.01, 3e-3, 2e-6), 128, 8)
OVERHEAD = FittedOverhead((0.9, 2e-3))


def _exact_profile(model: ModelShape, with_overhead: bool) -> dict:
    """A rollout-profile/2 document without noise: attention and experts rows from QWEN_ATTN / QWEN_EXPERTS (forms
    the fits recover exactly), steps of exactly L (T_a + T_e) + O(b), overhead rows O(b) (or none)."""
    doc = _profile_json(LayerTimes(QWEN_ATTN, QWEN_EXPERTS, gpu_preset("h100"), "exact"), model)
    doc["schema"] = "rollout-profile/2"
    for r in doc["attention"]:
        r["ms"] = QWEN_ATTN.ms(r["batch"], r["context"], 1)
    for r in doc["experts"]:
        r["ms"] = QWEN_EXPERTS.ms(r["tokens"], model.num_experts, 1)
    points = [(b, c) for b in (1, 32, 256) for c in (1024, 4096)]
    doc["steps"] = [
        {
            "layout": "replicas",
            "batch": b,
            "context": c,
            "num_layers": 4,
            "step_ms": 4 * (QWEN_ATTN.ms(b, c, 1) + QWEN_EXPERTS.ms(b, model.num_experts, 1))
            + OVERHEAD.ms(b),
        }
        for b, c in points
    ]
    doc["overhead"] = (
        [{"batch": b, "context": c, "ms": OVERHEAD.ms(b)} for b, c in points] if with_overhead else []
    )
    return doc


def _validate_rows(tmp_path, doc: dict, capsys) -> tuple[list[dict], str]:
    prof = tmp_path / "exact.json"
    prof.write_text(json.dumps(doc))
    out = tmp_path / "check.json"
    assert main(["--profile", str(prof), "--gpu", "h100", "--validate", str(prof), "--json", str(out)]) == 0
    return json.loads(out.read_text())["rows"], capsys.readouterr().out


def test_validate_with_the_fitted_overhead_is_exact(tmp_path, capsys):
    qwen = model_preset("qwen3-30b-a3b")
    rows, text = _validate_rows(tmp_path, _exact_profile(qwen, with_overhead=True), capsys)
    assert len(rows) == 6 and all(abs(r["error"]) < 1e-9 for r in rows)
    assert "O = 0.9000 + 2.00e-03 b ms per step" in text and "note:" not in text


def test_validate_without_overhead_rows_keeps_the_lm_head_roofline_and_says_so(tmp_path, capsys):
    qwen = model_preset("qwen3-30b-a3b")
    times = LayerTimes(QWEN_ATTN, QWEN_EXPERTS, gpu_preset("h100"), "exact")
    doc = _exact_profile(qwen, with_overhead=False)
    doc["copy_GBps"] = times.head_gpu.mem_bandwidth / 1e9
    for schema in ("rollout-profile/2", "rollout-profile/1"):
        doc["schema"] = schema
        if schema.endswith("/1"):
            del doc["overhead"]
        rows, text = _validate_rows(tmp_path, doc, capsys)
        assert "note: profile" in text and "has no 'overhead' rows" in text
        for r in rows:  # the old prediction: L (T_a + T_e) + the LM head's roofline
            old = 4 * (QWEN_ATTN.ms(r["batch"], r["context"], 1) + QWEN_EXPERTS.ms(r["batch"], 128, 1))
            assert r["predicted_ms"] == pytest.approx(old + times.head_ms(qwen, r["batch"], 1), rel=1e-9)
            assert abs(r["error"]) > 1e-3


def test_fit_overhead_recovers_clips_and_takes_one_batch():
    points = tuple(OverheadPoint(b, 4096, OVERHEAD.ms(b)) for b in (1, 8, 64, 256))
    assert fit_overhead(points).coef == pytest.approx(OVERHEAD.coef, rel=1e-9)
    # a slope that falls with the batch is clipped to 0 (O stays nondecreasing, as the binary search needs)
    falling = tuple(OverheadPoint(b, 1024, 1.0 - 1e-3 * b) for b in (1, 100, 200))
    o0, o1 = fit_overhead(falling).coef
    assert o1 == 0 and o0 == pytest.approx(np.mean([p.ms for p in falling]), rel=1e-9)
    assert fit_overhead((OverheadPoint(4, 1024, 0.5), OverheadPoint(4, 4096, 0.7))).coef == pytest.approx(
        (0.6, 0)
    )
    assert fit_overhead((OverheadPoint(4, 1024, -0.1),)).coef == (0.0, 0.0)


def test_overhead_rows_parse_and_bad_ones_are_named():
    qwen = model_preset("qwen3-30b-a3b")
    doc = _exact_profile(qwen, with_overhead=True)
    doc["overhead"][0]["ms"] = -0.01  # a difference of two measurements may dip below 0
    assert parse_profile(doc, "x.json").overhead[0] == OverheadPoint(1, 1024, -0.01)
    del doc["overhead"][1]["ms"]
    with pytest.raises(ValueError, match=r"overhead\[1\]"):
        parse_profile(doc, "x.json")
    doc["overhead"][1]["ms"] = 0.5
    doc["overhead"][1].update(layer_ms=0.2, attention_ms=0.1, experts_ms=0.15)  # /4: a two-layer step
    assert parse_profile(doc, "x.json").overhead[1] == OverheadPoint(1, 4096, 0.5, "decode", 0.2, 0.25)
    doc["overhead"][1]["layer_ms"] = float("nan")
    with pytest.raises(ValueError, match=r"overhead\[1\] = .*layer_ms must be finite"):
        parse_profile(doc, "x.json")
    del doc["overhead"][1]["experts_ms"]
    with pytest.raises(ValueError, match=r"overhead\[1\] = .*layer_ms without attention_ms, experts_ms"):
        parse_profile(doc, "x.json")


def test_the_overhead_enters_every_step_of_the_search():
    """Replicas: L (T_a + T_e + 2 T_c) + O(b); disaggregated: the ping-pong + O(m b_a); equation 7 tests those."""
    qwen = model_preset("qwen3-30b-a3b")
    base = LayerTimes(QWEN_ATTN, QWEN_EXPERTS, gpu_preset("h100"), "exact")
    s = Search(qwen, replace(base, overhead=OVERHEAD), Workload(1024, 4096), Cluster(8, gpu_preset("h100")))
    s_head = replace(s, times=base)
    for shape, b in ((Shape("replicas", 1, 1, 1, 1, 1), 64), (Shape("disaggregated", 1, 3, 1, 4, 3), 16)):
        p, old = evaluate(s, shape, b), evaluate(s_head, shape, b)
        rows = b if shape.layout == "replicas" else shape.num_micro * b
        assert p.step_ms == pytest.approx(old.step_ms - base.head_ms(qwen, rows, 1) + OVERHEAD.ms(rows))
        assert p.tokens_per_s_per_gpu == pytest.approx(old.tokens_per_s_per_gpu * old.step_ms / p.step_ms)
    replicas = Shape("replicas", 1, 1, 1, 1, 1)
    target = evaluate(s, replicas, 16).step_ms  # the latency target a batch of 16 just meets with O(b)
    assert best_for_shape(with_latency(s, target), replicas).batch == 16  # (the KV admits 21)
    assert best_for_shape(with_latency(s_head, target), replicas).batch > 16  # the LM head alone costs less


# ----------------------------------------------------------------------------- ExpertPlex's model on one GPU
DEC_ATTN = KernelFit(0.02, 4e-4, 1.5e-7, 0.0)  # x rows, s context
PRE_ATTN = KernelFit(0.03, 1e-2, 2e-5, 1e-9)  # x prompts, s their length
MOE_DECODE = KernelFit(0.05, 4e-3, 0.0, 0.0)  # x tiles of 16 rows
MOE_PREFILL = KernelFit(0.06, 2e-2, 0.0, 0.0)  # x tiles of 128 rows
PREFILL_OVERHEAD = FittedOverhead((0.1, 2e-5))  # a prefill step's fixed cost, per prompt token


def _exact_v3_profile(model: ModelShape) -> dict:
    """A rollout-profile/3 document without noise, in the forms the shared planner fits (equation 2): decode and
    prefill attention, expert passes of each phase in its own tiles, O(b), O_p(n s), and steps of both phases of
    exactly L (attention + MoE) + O(tokens)."""
    doc = _exact_profile(model, with_overhead=True)
    doc["schema"], doc["expert_kernel"] = "rollout-profile/3", "persistent"
    for r in doc["attention"]:
        r["ms"] = DEC_ATTN.ms(r["batch"], r["context"])
    doc["prefill_attention"] = [
        {"seqs": n, "length": s, "ms": PRE_ATTN.ms(n, s)} for n in (1, 4) for s in (512, 2048, 8192)
    ]
    tokens = (1, 8, 32, 256, 1024, 4096, 8192)
    doc["experts"] = [
        {"tokens": t, "phase": "decode", "ms": MOE_DECODE.ms(moe_tiles(model, t, 16), 0)} for t in tokens
    ] + [{"tokens": t, "phase": "prefill", "ms": MOE_PREFILL.ms(moe_tiles(model, t, 128), 0)} for t in tokens]

    def decode(b, c):
        return 4 * (DEC_ATTN.ms(b, c) + MOE_DECODE.ms(moe_tiles(model, b, 16), 0)) + OVERHEAD.ms(b)

    def prefill(n, s):
        return 4 * (
            PRE_ATTN.ms(n, s) + MOE_PREFILL.ms(moe_tiles(model, n * s, 128), 0)
        ) + PREFILL_OVERHEAD.ms(n * s)

    doc["overhead"] += [
        {"phase": "prefill", "batch": n, "context": s, "ms": PREFILL_OVERHEAD.ms(n * s)}
        for n in (1, 4)
        for s in (512, 2048)
    ]

    doc["steps"] = [
        {
            "layout": "replicas",
            "phase": "decode",
            "batch": b,
            "context": c,
            "num_layers": 4,
            "step_ms": decode(b, c),
        }
        for b in (1, 32, 256)
        for c in (1024, 4096)
    ] + [
        {
            "layout": "replicas",
            "phase": "prefill",
            "batch": n,
            "context": s,
            "num_layers": 4,
            "step_ms": prefill(n, s),
        }
        for n in (1, 4)
        for s in (512, 2048)
    ]
    return doc


def test_shared_validation_on_one_gpu_is_exact_on_an_exact_profile(tmp_path, capsys):
    qwen = model_preset("qwen3-30b-a3b")
    doc = _exact_v3_profile(qwen)
    # decode passes larger than any decode batch (attention rows reach 256) run cheaper tiles (L2 hits): the
    # decode line must not be fitted through them
    doc["experts"] += [
        {"tokens": t, "phase": "decode", "ms": 0.3 * MOE_DECODE.ms(moe_tiles(qwen, t, 16), 0)}
        for t in (4096, 8192)
    ]
    prof = tmp_path / "v3.json"
    prof.write_text(json.dumps(doc))
    out = tmp_path / "check.json"
    argv = ["--arch", "shared", "--gpus", "1", "--gpu", "h100", "--validate", str(prof), "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted(r["phase"] for r in rows) == ["decode"] * 6 + ["prefill"] * 4
    assert all(abs(r["error"]) < 1e-6 for r in rows), rows
    text = capsys.readouterr().out
    assert "10 of 10 rows within 15%" in text and "prefill attention: roofline" not in text
    # the decode model (replicas, #30) times decode steps only, from the decode-phase expert rows
    assert main(["--gpu", "h100", "--validate", str(prof), "--json", str(out)]) == 0
    assert [r["phase"] for r in json.loads(out.read_text())["rows"]] == ["decode"] * 6
    assert "O = 0.9000 + 2.00e-03 b ms per step" in capsys.readouterr().out  # the decode steps' overhead rows


R_DECODE, R_PREFILL = 1.1, 0.75  # what a layer adds inside a step over its passes timed alone


def _exact_v4_profile(model: ModelShape) -> dict:
    """/4: the /3 document's passes timed alone; a layer adds r times them inside a step (a constant r per
    phase, which keeps the scaled rows in equation 2's forms); overhead rows from steps of one and two layers
    and steps of exactly O(tokens) + L r (attention + MoE)."""
    doc = _exact_v3_profile(model)
    doc["schema"] = "rollout-profile/4"

    def parts(phase: str, b: int, c: int) -> tuple[float, float]:
        if phase == "prefill":
            return PRE_ATTN.ms(b, c), MOE_PREFILL.ms(moe_tiles(model, b * c, 128), 0)
        return DEC_ATTN.ms(b, c), MOE_DECODE.ms(moe_tiles(model, b, 16), 0)

    def step(phase: str, b: int, c: int, layers: int) -> float:
        fixed = PREFILL_OVERHEAD.ms(b * c) if phase == "prefill" else OVERHEAD.ms(b)
        return fixed + layers * (R_PREFILL if phase == "prefill" else R_DECODE) * sum(parts(phase, b, c))

    for row in doc["steps"]:
        row["step_ms"] = step(row["phase"], row["batch"], row["context"], row["num_layers"])
    doc["overhead"] = []
    for row in doc["steps"]:
        point = (row.get("phase", "decode"), row["batch"], row["context"])
        one, two = step(*point, 1), step(*point, 2)
        doc["overhead"].append(
            dict(zip(("phase", "batch", "context"), point), ms=2 * one - two, layer_ms=two - one, step_ms=one,
                 step2_ms=two, attention_ms=parts(*point)[0], experts_ms=parts(*point)[1])
        )  # fmt: skip
    return doc


def test_validate_scales_the_passes_by_what_a_layer_adds_inside_a_step(tmp_path, capsys):
    qwen = model_preset("qwen3-30b-a3b")
    doc = _exact_v4_profile(qwen)
    prof, out = tmp_path / "v4.json", tmp_path / "check.json"
    prof.write_text(json.dumps(doc))
    argv = ["--arch", "shared", "--gpus", "1", "--gpu", "h100", "--validate", str(prof), "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10 and all(abs(r["error"]) < 1e-6 for r in rows), rows
    # read as /3 (the fixed cost a one-layer step minus its passes timed alone, no in-step ratio), the same
    # steps come out r + 3 passes for 4 r: too slow where r < 1, too fast where r > 1
    for row in doc["overhead"]:
        row["ms"] = row.pop("step_ms") - row["attention_ms"] - row["experts_ms"]
        del row["layer_ms"], row["step2_ms"]
    doc["schema"] = "rollout-profile/3"
    prof.write_text(json.dumps(doc))
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["error"] > 0.01 for r in rows if r["phase"] == "prefill"), rows
    assert all(r["error"] < -0.005 for r in rows if r["phase"] == "decode"), rows


def test_in_step_interpolates_the_ratio_in_log2_tokens_per_phase():
    qwen = model_preset("qwen3-30b-a3b")
    v3 = parse_profile(_exact_v3_profile(qwen), "v3")
    assert in_step(v3) == v3  # no two-layer steps: the passes as timed
    rows = (
        OverheadPoint(1, 1024, 0.5, "decode", layer_ms=1.2, parts_ms=1.0),
        OverheadPoint(1, 4096, 0.5, "decode", layer_ms=1.0, parts_ms=1.0),  # same tokens: r = mean 1.1
        OverheadPoint(64, 1024, 0.5, "decode", layer_ms=1.8, parts_ms=2.0),
        OverheadPoint(8, 1024, 0.5, "decode", layer_ms=-0.1, parts_ms=1.0),  # below the noise: no ratio
        OverheadPoint(1, 512, 0.5, "prefill", layer_ms=0.3, parts_ms=0.6),
        OverheadPoint(4, 2048, 0.5, "prefill", layer_ms=2.0, parts_ms=2.0),
    )
    decode = fit_in_step(tuple(p for p in rows if p.phase == "decode"))
    assert [decode.at(t) for t in (0.5, 1, 8, 64, 1000)] == pytest.approx([1.1, 1.1, 1.0, 0.9, 0.9])
    prefill = fit_in_step(tuple(p for p in rows if p.phase == "prefill"))
    assert [prefill.at(t) for t in (100, 512, 2048, 8192, 1e5)] == pytest.approx([0.5, 0.5, 0.75, 1, 1])
    assert fit_in_step(rows[:1] + (OverheadPoint(4, 64, 0.5),)) is not None
    assert fit_in_step((OverheadPoint(4, 64, 0.5), rows[3])) is None
    scaled = in_step(replace(v3, overhead=rows))
    for old, new in zip(v3.attention, scaled.attention):
        assert new.ms == pytest.approx(old.ms * decode.at(old.batch))
    for old, new in zip(v3.prefill_attention, scaled.prefill_attention):
        assert new.ms == pytest.approx(old.ms * prefill.at(old.seqs * old.length))
    for old, new in zip(v3.experts, scaled.experts):
        assert new.ms == pytest.approx(old.ms * (decode if old.phase == "decode" else prefill).at(old.tokens))
    assert scaled.steps == v3.steps and scaled.overhead == rows


def test_shared_kernels_fit_each_phase_from_its_own_rows():
    from rollout.plan.shared import build_kernels, predict_step_ms

    qwen = model_preset("qwen3-30b-a3b")
    profile = parse_profile(_exact_v3_profile(qwen), "v3")
    assert profile.expert_kernel == "persistent" and len(profile.prefill_attention) == 6
    s = Search(
        qwen, analytic_times(qwen, gpu_preset("h100")), Workload(1024, 1024), Cluster(1, gpu_preset("h100"))
    )
    k = build_kernels(s, profile)
    for n, length in ((2, 1000), (8, 300)):  # off the profiled grid: the fitted forms, not a lookup
        assert k.prefill_attention.ms(n, length) == pytest.approx(PRE_ATTN.ms(n, length), rel=1e-6)
    for t in (3000, 20000):
        assert k.moe_prefill.ms(moe_tiles(qwen, t, 128), 0) == pytest.approx(
            MOE_PREFILL.ms(moe_tiles(qwen, t, 128), 0), rel=1e-6
        )
    step = StepPoint("replicas", 16, 5000, 48, 0.0)
    want = 48 * (DEC_ATTN.ms(16, 5000) + MOE_DECODE.ms(moe_tiles(qwen, 16, 16), 0)) + OVERHEAD.ms(16)
    assert predict_step_ms(k, qwen, step) == pytest.approx(want, rel=1e-6)
    # without the profile the roofline stands in, and no step has a fixed cost
    assert build_kernels(s, None).fixed_ms(64) == 0.0


def test_profile_phases_default_to_decode_and_are_checked():
    qwen = model_preset("qwen3-30b-a3b")
    old = parse_profile(_exact_profile(qwen, with_overhead=True), "v2")
    assert {p.phase for p in old.experts} == {s.phase for s in old.steps} == {"decode"}
    assert old.prefill_attention == () and old.expert_kernel is None
    doc = _exact_v3_profile(qwen)
    doc["steps"][0]["phase"] = "mixed"
    with pytest.raises(
        ValueError, match=r"steps\[0\] phase='mixed'; expected one of \['decode', 'prefill'\]"
    ):
        parse_profile(doc, "bad")
    doc = _exact_v3_profile(qwen)
    doc["prefill_attention"][1] = {"seqs": 1, "ms": 0.3}
    with pytest.raises(ValueError, match=r"prefill_attention\[1\] lacks \['length'\]"):
        parse_profile(doc, "bad")
