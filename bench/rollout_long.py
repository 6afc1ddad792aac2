"""Long-tail rollouts on one GPU: the paged KV cache vs a slot cache under the same KV budget (issue #27).

    python bench/rollout_long.py --json bench/out/rollout_long.json    # H200, bf16, Qwen3-30B-A3B shape
    python bench/rollout_long.py --tiny                                # CPU smoke run of every code path
    python bench/rollout_long.py --bound --gpu h200                   # the schedules at the roofline (CPU)

Model: the Qwen3-30B-A3B shape (all 48 layers, 128 experts top-8) with random weights; `--tiny` is a 2-layer
toy (8 experts top-2, vocab 512) in float32 on the CPU.
Workload: `--requests` requests of random token ids, prompt lengths uniform in [--prompt-min, --prompt-max],
output lengths drawn from a lognormal (median `--median-output`, sigma `--sigma`), rounded, clipped to
[1, --max-output]; every request generates exactly its drawn length (ignore_eos), temperature 1; all prompts,
lengths and sampling seeds come from `--seed`.
Engines (both built once and reused by both modes, with the same KV budget `--kv-tokens`, `--max-batch-size`,
`--max-step-tokens` and `--expert-kernel`):
- paged: blocks of `--block-size` positions; a sequence holds the blocks its length needs.
- slot: kv_block_size=0, i.e. one block of max_model_len = prompt_max + max_output (rounded up to 16)
  positions reserved per sequence at admission, so the budget bounds the concurrent sequences to
  budget / max_model_len.
Modes:
- plain: one generate call; every request generates its whole length.
- windows: T-PPO rounds of `--window` tokens; each round is one generate call over the unfinished requests,
  each generating min(window, remaining) tokens from prompt + all its tokens so far (the continuation is
  prefilled again), with its own seed, so it continues the same random stream (`same_tokens_as_plain` says how
  many requests came out token for token as in plain mode; numerics of other batch shapes may flip a sample).
Before timing, each engine runs a warm-up generate of `--max-batch-size` requests (short prompts,
`--warmup-tokens` new tokens) that captures the CUDA graphs of the decode-only row buckets; graphs
captured later (mixed-step shapes of at most `--cuda-graph-max-tokens` tokens) are in the timed run, and the
table counts them.

Per section (engine x mode; an error in one is recorded and the others still run): generated tokens, wall
seconds and tokens/s, decode rows per step, peak concurrent sequences, KV positions held (mean over steps and
peak; blocks held x block size, so the slot cache counts its whole reservation), the share of prefill tokens
among computed tokens (recomputation after preemption included) and of prefill-only / mixed steps in step
time, preemptions, mixed steps, CUDA graphs.
Roofline, per step with decoding rows (from the engine's step trace): bytes = non-expert weights (attention,
norms, routers of all layers, final norm, every lm_head row; the embedding rows a step gathers are left out) +
distinct experts the step's tokens touched (summed over layers) x bytes of one expert (gate_up + down) + the
keys the decoding rows attend to x K/V bytes per position (all layers); a mixed step's prefill chunk reads of
its own prompt's K/V are not counted (small next to the weights). Floor = bytes / `--bandwidth` (by default the
card's measured copy bandwidth, see rollout_decode.py); reported: mean floor / step time over decode-only
steps, and over decode-only steps with >= `--long-rows` rows and mean context >= `--long-context` positions.
Step time by decode rows: steps binned by decoding rows (`--bin-rows` per bin), per bin the median time of
decode-only steps and of mixed steps and their ratio (the issue's target: a mixed step at most 10% slower than
a decode-only step of the same rows). Comparison: paged / slot ratios of peak sequences, decode rows per step
and tokens/s, per mode.
The full run is long (the longest requests decode alone for up to max_output steps); `--engines paged` and
`--engines slot` split it into two runs, and the JSON is rewritten after every section.
Time limit (`--time-limit-s T`, for runs longer than a device call): after T seconds of a section its steps stop
running on the device. The runner then answers at once (random tokens of each step's shapes, rollout_host's
InstantRunner), so the schedule, which does not depend on the tokens (ignore_eos, drawn lengths), runs to its
end on the host: step counts, rows, KV positions, peaks and preemptions stay the real schedule's. Each such
step's device time is predicted by a non-negative least-squares fit of the measured steps' seconds over (1,
decode rows, their keys, experts touched, prefill tokens, KV positions held); a predicted step's experts touched
are their expectation under uniform routing. Wall time and tokens/s are then measured + predicted, and the
section records its measured share and the fit's median error on its last fifth of measured steps, fitted on
the rest (`extrapolation`); the roofline and step-time bins read the measured steps only.
Bound (`--bound`, no engine, seconds of CPU): the workload's two schedules costed step by step at `--gpu`'s
roofline by the planner's model (rollout/plan/schedule.py): the slot cache's (its slots admit the requests in
order) and a paged cache's with unlimited K/V (every request admitted at once, up to --max-batch-size rows).
Their ratio is the most tokens/s a paged engine at the roofline gains over a slot engine at the roofline on
this workload; `--variants` also makes K/V reads free (free_kv) or a step's cost independent of its rows
(row_free: the ratio is then about the slot schedule's decode steps over the longest request's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_decode import (
    QWEN3_30B_A3B,
    TINY,
    add_attention_arg,
    add_bandwidth_arg,
    apply_attention,
    free_memory,
    resolve_bandwidth,
    roofline_parts,
    step_floor_bytes,
    sync,
)
from rollout_host import InstantRunner

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig
from rollout.engine import GenerateStats, StepTrace
from rollout.kv_cache import CachePlan, plan_cache
from rollout.model_spec import MoeModelSpec
from rollout.plan import GPU_PRESETS, gpu_preset
from rollout.plan.hardware import shape_from_spec
from rollout.plan.perf import distinct_experts
from rollout.plan.schedule import (
    BOUND_VARIANTS,
    RooflineCost,
    decode_iterations,
    fifo_starts,
    variant_cost,
    variant_list,
)
from rollout.step_cost import FEATURES, PrefillBudget

WARMUP_PROMPT = 16  # tokens per warm-up prompt (see warm_up)
FIRST_LAUNCH = 2.0  # a step over this many times its group's median paid a first launch (first_launch_s)
TINY_LONG = dict(TINY, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
# --tiny: a KV budget in which the slot cache holds fewer sequences than the paged one (480 tokens: 5 slots of
# 96 positions vs 30 blocks of 16 positions for 12 requests of up to 88 positions).
TINY_ARGS = dict(
    device="cpu",
    dtype="float32",
    requests=12,
    prompt_min=8,
    prompt_max=24,
    median_output=16,
    max_output=64,
    window=16,
    kv_tokens=480,
    max_batch_size=16,
    max_step_tokens=64,
    max_decode_slowdown=0.2,  # exercises the tile cost model (rollout.step_cost) in the smoke run
    warmup_tokens=4,
    long_rows=4,
    long_context=32,
    bin_rows=4,
    json="bench/out/rollout_long_tiny.json",
)


# --------------------------------------------------------------------------------------------- workload
def workload(args, vocab: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompts, output lengths and sampling seeds of every request, all drawn from --seed."""
    rng = np.random.default_rng(args.seed)
    prompt_len_R = rng.integers(args.prompt_min, args.prompt_max + 1, size=args.requests)
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in prompt_len_R]
    drawn_R = rng.lognormal(np.log(args.median_output), args.sigma, size=args.requests)
    output_len_R = np.clip(np.round(drawn_R), 1, args.max_output).astype(np.int64)
    seeds_R = rng.integers(0, 2**62, size=args.requests)
    return prompts, [int(n) for n in output_len_R], [int(s) for s in seeds_R]


def slot_len(args) -> int:
    """max_model_len of both engines: the longest request, rounded up to the cache's 16-position granule."""
    return -(-(args.prompt_max + args.max_output) // 16) * 16


def engine_config(args, kind: str) -> RolloutConfig:
    return RolloutConfig(
        max_model_len=slot_len(args),
        kv_block_size=args.block_size if kind == "paged" else 0,
        max_batch_size=args.max_batch_size,
        max_step_tokens=args.max_step_tokens,
        max_decode_slowdown=args.max_decode_slowdown,
        expert_kernel=args.expert_kernel,
        kv_cache_tokens=args.kv_tokens,
        cuda_graphs=not args.eager,
        cuda_graph_max_tokens=args.cuda_graph_max_tokens,
        overlap_steps=args.overlap_steps,
        trace_steps=True,
    )


def plan_for(kind: str, args, spec: MoeModelSpec, element: int) -> CachePlan:
    """The cache plan the engine of this kind will make (the engine's own planner, before any weights)."""
    return plan_cache(
        spec,
        element,
        max_model_len=slot_len(args),
        block_size=args.block_size if kind == "paged" else slot_len(args),
        max_seqs=args.max_batch_size,
        budget_bytes=args.kv_tokens * spec.kv_bytes_per_token(element),
        source=f"--kv-tokens={args.kv_tokens}",
    )


def describe(kind: str, args, spec: MoeModelSpec, element: int) -> tuple[dict, str]:
    """The plan (JSON) and a config line; a budget too small for one sequence is reported, not raised (the
    engine build then records the same error in its sections)."""
    try:
        plan = plan_for(kind, args, spec, element)
    except ValueError as err:
        return {"error": str(err)}, f"{kind}: {err}"
    if kind == "paged":
        line = (
            f"paged: blocks of {plan.block_size}, {plan.num_blocks - 1} usable = {plan.num_positions} "
            f"positions, up to {plan.max_seqs} sequences"
        )
    else:
        line = (
            f"slot: max_model_len {plan.max_model_len} (prompt_max {args.prompt_max} + max_output "
            f"{args.max_output}): {plan.num_blocks - 1} slots fit the budget (= {plan.num_positions} "
            "positions; the cache's null block takes one slot's worth)"
        )
    return vars(plan), line


# --------------------------------------------------------------------------------------------- runs
def params_for(lengths: list[int], seeds: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=n, temperature=1.0, seed=s, ignore_eos=True)
        for n, s in zip(lengths, seeds)
    ]


def warm_up(engine: RolloutEngine, args, vocab: int) -> dict:
    """Capture the decode-only buckets' graphs before timing: max_batch_size requests of WARMUP_PROMPT tokens,
    admitted within a step or two, decode together, then finish one after another, so the decode-only steps meet
    every row bucket from max_batch_size down to 1. The prompts are short because a decode step's graph depends
    on its rows, not on their context: the workload's 512-2048-token prompts would add ~170 prefill steps of
    2048 tokens (158 s at 48 layers on an H100) and capture nothing more."""
    rng = np.random.default_rng([args.seed, 1])
    n = args.max_batch_size
    prompts = [rng.integers(0, vocab, size=WARMUP_PROMPT).tolist() for _ in range(n)]
    sync(engine.device)
    t0 = time.perf_counter()
    engine.generate(prompts, params_for([args.warmup_tokens] * n, list(range(n))))
    sync(engine.device)
    return {"requests": n, "new_tokens": args.warmup_tokens, "seconds": time.perf_counter() - t0}


def run_plain(
    engine: RolloutEngine, prompts, lengths, seeds
) -> tuple[list[list[int]], list[GenerateStats], float]:
    sync(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params_for(lengths, seeds))
    sync(engine.device)
    wall = time.perf_counter() - t0
    return [o.token_ids for o in outs], [engine.last_stats], wall


def run_windows(
    engine: RolloutEngine, prompts, lengths, seeds, window: int
) -> tuple[list[list[int]], list[GenerateStats], float]:
    """T-PPO rounds: every unfinished request generates min(window, remaining) tokens per round, its prompt
    the original one plus all its tokens so far. The wall time includes the host work between rounds."""
    tokens: list[list[int]] = [[] for _ in prompts]
    rounds = []
    sync(engine.device)
    t0 = time.perf_counter()
    while todo := [i for i, n in enumerate(lengths) if len(tokens[i]) < n]:
        outs = engine.generate(
            [prompts[i] + tokens[i] for i in todo],
            params_for([min(window, lengths[i] - len(tokens[i])) for i in todo], [seeds[i] for i in todo]),
        )
        for i, o in zip(todo, outs):
            tokens[i] += o.token_ids
        st = engine.last_stats
        rounds.append(st)
        print(
            f"    round {len(rounds)}: {len(todo)} requests, {st.num_generated_tokens} tokens, "
            f"{st.prefill_s + st.decode_s:.1f} s in steps, {st.num_preemptions} preemptions",
            flush=True,
        )
    sync(engine.device)
    return tokens, rounds, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------- time limit
class CutRunner:
    """The engine's runner for a section under --time-limit-s: the real runner until the limit, then an
    InstantRunner (the step's shapes answered at once). Every other attribute is the real runner's."""

    def __init__(self, real, instant: InstantRunner, limit_s: float, clock=time.perf_counter) -> None:
        self.real, self.instant, self.clock = real, instant, clock
        self.deadline = clock() + limit_s
        self.real_steps = 0  # the section's steps that ran on the device: the first ones of its trace

    def run(self, x):
        if self.clock() < self.deadline:
            self.real_steps += 1
            return self.real.run(x)
        return self.instant.run(x)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


def cut_runner(engine: RolloutEngine, limit_s: float, clock=time.perf_counter) -> CutRunner:
    spec, c = engine.spec, engine.config
    instant = InstantRunner(
        spec.vocab_size, spec.num_moe_layers, spec.top_k, c.max_step_tokens + c.max_batch_size
    )
    return CutRunner(engine.runner, instant, limit_s, clock)


def step_features(steps: list[StepTrace], measured: int, spec: MoeModelSpec) -> np.ndarray:
    """[N, 6]: (1, decode rows, their keys, experts touched, prefill tokens, KV positions) per step; a predicted
    step's (index >= measured) experts touched at their expectation under uniform routing, L E (1 - (1 - K/E)^n)."""
    X = np.array(
        [[1.0, s.num_decode, s.decode_keys, s.experts_touched, s.num_prefill, s.kv_positions] for s in steps]
    ).reshape(len(steps), 6)
    tokens_N = X[measured:, 1] + X[measured:, 4]
    X[measured:, 3] = spec.num_moe_layers * distinct_experts(tokens_N, spec.num_experts, spec.top_k)
    return X


def extrapolate(
    rounds: list[GenerateStats], measured: int, spec: MoeModelSpec
) -> tuple[list[GenerateStats], float, dict]:
    """The section's calls with every step after the first `measured` given its predicted device time (the
    calls' step seconds adjusted to match), the seconds this adds to the wall time, and what the fit was."""
    steps = [s for st in rounds for s in st.steps]
    info = {"measured_steps": measured, "predicted_steps": len(steps) - measured}
    if measured >= len(steps):
        return rounds, 0.0, info
    X, y = step_features(steps, measured, spec), np.array([s.seconds for s in steps])
    fit = np.array([i for i in range(measured) if not steps[i].captured_graph], dtype=np.int64)
    if len(fit) < 2 * X.shape[1]:
        raise RuntimeError(
            f"--time-limit-s: {len(fit)} measured steps are too few to predict {len(steps) - measured} more; "
            "raise the limit"
        )
    coef, _ = nnls(X[fit], y[fit])
    head, tail = fit[: len(fit) * 4 // 5], fit[len(fit) * 4 // 5 :]
    head_coef, _ = nnls(X[head], y[head])
    predicted_N = X[measured:] @ coef
    out, i = [], 0
    for st in rounds:
        new_steps, add = [], {"prefill_s": 0.0, "decode_s": 0.0, "mixed_s": 0.0}
        for s in st.steps:
            if i >= measured:
                delta = float(predicted_N[i - measured]) - s.seconds
                add["decode_s" if s.num_decode else "prefill_s"] += delta
                add["mixed_s"] += delta if s.num_decode and s.num_prefill else 0.0
                s = dataclasses.replace(s, seconds=float(predicted_N[i - measured]))
            new_steps.append(s)
            i += 1
        out.append(
            dataclasses.replace(st, steps=new_steps, **{k: getattr(st, k) + v for k, v in add.items()})
        )
    added = float(predicted_N.sum() - y[measured:].sum())
    info.update(
        predicted_s=float(predicted_N.sum()),
        coef=dict(zip(("one", "rows", "keys", "touched", "prefill_tokens", "kv_positions"), coef.tolist())),
        holdout_steps=len(tail),
        holdout_median_error=float(np.median(np.abs(X[tail] @ head_coef - y[tail]) / y[tail])),
    )
    return out, added, info


# --------------------------------------------------------------------------------------------- metrics
def roofline(steps: list[StepTrace], parts: dict, args) -> dict:
    """Mean floor / measured time per step, over decode-only steps, the long ones among them, and mixed steps
    (for mixed steps the floor ignores the prefill chunk's compute, so it is a loose bound there); steps that
    captured a CUDA graph are left out."""
    with_rows = [
        (s, step_floor_bytes(s, parts) / args.bandwidth)
        for s in steps
        if s.num_decode and not s.captured_graph
    ]
    decode_only = [(s, f) for s, f in with_rows if not s.num_prefill]
    long = [
        (s, f)
        for s, f in decode_only
        if s.num_decode >= args.long_rows and s.decode_keys / s.num_decode >= args.long_context
    ]
    mixed = [(s, f) for s, f in with_rows if s.num_prefill]

    def fraction(sel):
        return statistics.mean(f / s.seconds for s, f in sel) if sel else None

    def ms(values):
        return 1e3 * statistics.mean(values) if values else None

    return {
        "decode_only_steps": len(decode_only),
        "fraction": fraction(decode_only),
        "floor_ms_mean": ms([f for _, f in decode_only]),
        "step_ms_mean": ms([s.seconds for s, _ in decode_only]),
        "long_steps": len(long),
        "long_fraction": fraction(long),
        "long_floor_ms_mean": ms([f for _, f in long]),
        "long_step_ms_mean": ms([s.seconds for s, _ in long]),
        "mixed_steps": len(mixed),
        "mixed_fraction": fraction(mixed),
    }


def step_time_bins(steps: list[StepTrace], width: int) -> list[dict]:
    """Median step time of decode-only and of mixed steps per bin of decoding rows ((k w, (k + 1) w]); steps
    that captured a CUDA graph are left out (their time holds the capture)."""
    bins: dict[int, tuple[list[StepTrace], list[StepTrace]]] = {}
    for s in steps:
        if s.num_decode and not s.captured_graph:
            bins.setdefault((s.num_decode - 1) // width, ([], []))[bool(s.num_prefill)].append(s)
    out = []
    for k in sorted(bins):
        decode, mixed = bins[k]
        decode_ms = 1e3 * statistics.median(s.seconds for s in decode) if decode else None
        mixed_ms = 1e3 * statistics.median(s.seconds for s in mixed) if mixed else None
        out.append(
            {
                "rows": f"{k * width + 1}-{(k + 1) * width}",
                "decode_steps": len(decode),
                "decode_ms": decode_ms,
                "mixed_steps": len(mixed),
                "mixed_ms": mixed_ms,
                "mixed_prefill_tokens_mean": statistics.mean(s.num_prefill for s in mixed) if mixed else None,
                "mixed_over_decode": mixed_ms / decode_ms if decode_ms and mixed_ms else None,
            }
        )
    return out


def first_launch_s(steps: list[StepTrace], width: int, outlier: float = FIRST_LAUNCH) -> float:
    """Seconds the steps spent over their group's median where they took more than `outlier` x it. A group is
    the steps of one bin of decoding rows ((k w, (k + 1) w]; prefill-only steps apart) and one binary magnitude of
    prefill tokens. Such steps are first launches: a shape's first eager step compiles Triton kernels, a bucket's
    first graph step captures it. What they cost depends on what ran on the machine before (Triton's disk cache),
    not on the engine's path, so runs compared on one machine differ by their order."""
    groups: dict[tuple[int, int], list[float]] = {}
    for s in steps:
        key = ((s.num_decode - 1) // width if s.num_decode else -1, s.num_prefill.bit_length())
        groups.setdefault(key, []).append(s.seconds)
    excess = 0.0
    for seconds in groups.values():
        median = statistics.median(seconds)
        excess += sum(t - median for t in seconds if t > outlier * median)
    return excess


def summarize(
    rounds: list[GenerateStats], wall: float, parts: dict, args, measured: int | None = None
) -> dict:
    """One section's numbers over all its generate calls (one for plain, one per round for windows); the
    roofline and the step-time bins over its first `measured` steps (all by default)."""
    steps = [s for st in rounds for s in st.steps][:measured]
    block = rounds[0].kv_block_size
    generated = sum(st.num_generated_tokens for st in rounds)
    decode_steps = sum(st.num_decode_steps for st in rounds)
    num_steps = sum(st.num_steps for st in rounds)
    prefill_tokens = sum(st.num_prefill_tokens for st in rounds)
    decode_rows = sum(st.num_decode_rows for st in rounds)
    step_s = sum(st.prefill_s + st.decode_s for st in rounds)
    bins = step_time_bins(steps, args.bin_rows)
    paired = [b for b in bins if b["mixed_over_decode"] is not None]
    first = first_launch_s(steps, args.bin_rows)
    return {
        "generate_calls": len(rounds),
        "requests": rounds[0].num_requests,
        "prompt_tokens": sum(st.num_prompt_tokens for st in rounds),
        "generated_tokens": generated,
        "wall_s": wall,
        "tok_s": generated / wall,
        # the same run with its first launches at their group's median (`first_launch_s`): order-independent
        "first_launch_s": first,
        "warm_tok_s": generated / (wall - first),
        "steps": num_steps,
        "decode_steps": decode_steps,
        "mixed_steps": sum(st.num_mixed_steps for st in rounds),
        "decode_rows_mean": decode_rows / decode_steps if decode_steps else 0.0,
        "peak_running": max(st.peak_running for st in rounds),
        "max_seqs": rounds[0].max_seqs,
        "kv_block_size": block,
        "kv_positions_capacity": rounds[0].kv_blocks * block,
        "kv_positions_mean": block * sum(st.kv_block_steps for st in rounds) / num_steps,
        "kv_positions_peak": block * max(st.kv_blocks_peak for st in rounds),
        "prefill_tokens": prefill_tokens,
        "prefill_token_share": prefill_tokens / (prefill_tokens + decode_rows),
        "prefill_s": sum(st.prefill_s for st in rounds),
        "decode_s": sum(st.decode_s for st in rounds),
        "mixed_s": sum(st.mixed_s for st in rounds),
        "prefill_step_s_share": sum(st.prefill_s for st in rounds) / step_s,
        "mixed_step_s_share": sum(st.mixed_s for st in rounds) / step_s,
        "host_s": wall - step_s,
        "preemptions": sum(st.num_preemptions for st in rounds),
        "cuda_graphs": rounds[-1].cuda_graphs,
        "roofline": roofline(steps, parts, args),
        "step_time_bins": bins,
        # weighted by the mixed steps of each bin: the typical slowdown a decoding row sees while prefill runs
        "mixed_over_decode_weighted": (
            sum(b["mixed_over_decode"] * b["mixed_steps"] for b in paired)
            / sum(b["mixed_steps"] for b in paired)
            if paired
            else None
        ),
        "mixed_over_decode_max": max((b["mixed_over_decode"] for b in paired), default=None),
    }


def step_cost_state(budget: PrefillBudget) -> dict:
    """The mixed-step cost model as the section left it: its coefficients by feature (seconds) and how many
    steps the bound could not hold."""
    coef = budget.coef.tolist() if budget.coef is not None else None
    return {"coef": dict(zip(FEATURES, coef)) if coef else None, "unmet_steps": budget.unmet_steps}


def write_steps(path: Path, rounds: list[GenerateStats]) -> None:
    """Every step of a section, one JSON line each (StepTrace's fields), for offline analysis."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for st in rounds:
            for step in st.steps:
                f.write(json.dumps(dataclasses.asdict(step)) + "\n")


# --------------------------------------------------------------------------------------------- driver
def save(results: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=str))


def build(kind: str, args, cfg: dict, device, dtype, info: dict) -> RolloutEngine:
    t0 = time.perf_counter()
    engine = RolloutEngine.from_config(
        cfg, device=device, dtype=dtype, config=engine_config(args, kind), seed=0
    )
    sync(device)
    info.update(
        build_s=time.perf_counter() - t0,
        weights_gib=engine.weights.num_bytes() / 2**30,
        plan=vars(engine.cache_plan),
    )
    print(f"{kind}: built in {info['build_s']:.1f} s, plan {info['plan']}", flush=True)
    return engine


def run_mode(
    engine: RolloutEngine, mode: str, args, work, clock=time.perf_counter
) -> tuple[list[list[int]], list[GenerateStats], float, CutRunner | None]:
    """One section's generate calls (under --time-limit-s through a CutRunner timed by `clock`, which it
    returns)."""
    prompts, lengths, seeds = work
    real, cut = engine.runner, cut_runner(engine, args.time_limit_s, clock) if args.time_limit_s else None
    engine.runner = cut or real
    try:
        if mode == "plain":
            return (*run_plain(engine, prompts, lengths, seeds), cut)
        return (*run_windows(engine, prompts, lengths, seeds, args.window), cut)
    finally:
        engine.runner = real


def leaked(engine: RolloutEngine) -> bool:
    """Whether a generate call that raised left sequence rows or blocks held (the engine does not release
    them), which would shrink every later call's capacity."""
    table = engine.cache.table
    return table.num_used_blocks > 0 or table.num_free_rows < engine.max_seqs


def run_engine_kind(kind: str, args, cfg: dict, device, dtype, work, results: dict) -> None:
    """Build one engine, warm it up, run the selected modes on it; a failure is recorded where it happened
    (and the engine rebuilt if the failed call left its cache occupied)."""
    prompts, lengths, seeds = work
    info = results["engines"][kind] = {"rebuilds": 0}
    engine = None
    plain_tokens = None
    for mode in ["warmup", *args.modes]:
        name = f"{kind}/{mode}"
        try:
            if engine is None:
                engine = build(kind, args, cfg, device, dtype, info)
                parts = info["roofline_bytes"] = roofline_parts(engine)
            if mode == "warmup":
                if args.warmup_tokens:
                    info["warmup"] = warm_up(engine, args, cfg["vocab_size"])
                    info["warmup"]["graphs"] = engine.runner.num_graphs
                    print(f"{kind}: warm-up {info['warmup']}", flush=True)
                continue
            print(f"{name}: running", flush=True)
            graphs_before = engine.runner.num_graphs
            tokens, rounds, wall, cut = run_mode(engine, mode, args, (prompts, lengths, seeds))
            if [len(t) for t in tokens] != lengths:
                raise RuntimeError(f"{name}: some request did not generate its drawn length")
            measured = cut.real_steps if cut else sum(st.num_steps for st in rounds)
            rounds, added_s, extrapolation = extrapolate(rounds, measured, engine.spec)
            row = summarize(rounds, wall + added_s, parts, args, measured)
            if cut:
                row["extrapolation"] = extrapolation
            if mode == "plain":
                plain_tokens = None if cut and extrapolation["predicted_steps"] else tokens
            row["graphs"] = engine.runner.num_graphs
            row["graphs_new"] = engine.runner.num_graphs - graphs_before
            row["capture_error"] = engine.runner.capture_error
            if engine.prefill_budget is not None:
                row["step_cost"] = step_cost_state(engine.prefill_budget)
            if args.steps_out:
                write_steps(Path(args.steps_out) / f"{kind}_{mode}.jsonl", rounds)
            if mode == "windows" and plain_tokens is not None and "extrapolation" not in row:
                row["same_tokens_as_plain"] = statistics.mean(a == b for a, b in zip(tokens, plain_tokens))
            results["sections"][name] = row
            print(
                f"{name}: {row['generated_tokens']} tokens in {row['wall_s']:.1f} s = "
                f"{row['tok_s']:.0f} tok/s, {row['decode_rows_mean']:.1f} rows/step, "
                f"peak {row['peak_running']} sequences, {row['preemptions']} preemptions",
                flush=True,
            )
        except Exception as err:  # one failing section must not lose the others' numbers
            traceback.print_exc()
            error = f"{type(err).__name__}: {err}"
            if engine is None:  # the build failed: it would fail again for every mode still to run
                for m in args.modes:
                    results["sections"].setdefault(f"{kind}/{m}", {"error": f"engine build failed: {error}"})
                info["error"] = error
                break
            if mode == "warmup":  # timing without a warm-up is still worth having: the graph count shows it
                info["warmup_error"] = error
            else:
                results["sections"][name] = {"error": error}
            if leaked(engine):
                engine = None
                info["rebuilds"] += 1
        finally:
            free_memory()
        save(results, args.json)
    del engine
    free_memory()


def compare(results: dict, modes: list[str]) -> dict:
    out = {}
    for mode in modes:
        paged, slot = (
            results["sections"].get(f"paged/{mode}", {}),
            results["sections"].get(f"slot/{mode}", {}),
        )
        if "tok_s" in paged and "tok_s" in slot:
            out[mode] = {
                "peak_running": paged["peak_running"] / slot["peak_running"],
                "decode_rows_mean": paged["decode_rows_mean"] / slot["decode_rows_mean"],
                "tok_s": paged["tok_s"] / slot["tok_s"],
            }
    return out


def fmt(x, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if x is None else format(scale * x, spec)


def print_tables(results: dict) -> None:
    sections = results["sections"]
    print(
        "\n| engine/mode | tokens | wall s | tok/s (first launches at the median) | rows/step | peak seqs | "
        "KV pos mean | KV pos peak | "
        "prefill tok share | prefill-step s share | mixed-step s share | preempt | mixed steps | "
        "graphs (new) | roofline decode | roofline long (steps) | same tokens as plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in sections.items():
        if "error" in r:
            print(f"| {name} | error: {r['error'][:120]} |")
            continue
        rf = r["roofline"]
        print(
            f"| {name} | {r['generated_tokens']} | {r['wall_s']:.1f} | {r['tok_s']:.0f} ({r['warm_tok_s']:.0f}) | "
            f"{r['decode_rows_mean']:.1f} | {r['peak_running']} | {r['kv_positions_mean']:.0f} | "
            f"{r['kv_positions_peak']} | {100 * r['prefill_token_share']:.1f}% | "
            f"{100 * r['prefill_step_s_share']:.1f}% | {100 * r['mixed_step_s_share']:.1f}% | "
            f"{r['preemptions']} | {r['mixed_steps']} | {r['graphs']} ({r['graphs_new']}) | "
            f"{fmt(rf['fraction'], '.0%')} | {fmt(rf['long_fraction'], '.0%')} ({rf['long_steps']}) | "
            f"{fmt(r.get('same_tokens_as_plain'), '.0%')} |"
        )
    for name, r in sections.items():
        if r.get("extrapolation", {}).get("predicted_steps"):
            x = r["extrapolation"]
            print(
                f"{name}: --time-limit-s cut the run after {x['measured_steps']} of "
                f"{x['measured_steps'] + x['predicted_steps']} steps; {x['predicted_s']:.2f} s of its "
                f"wall time are predicted (fit's median error on the held-out measured steps: "
                f"{fmt(x.get('holdout_median_error'), '.1%')})"
            )
    print(
        "\n| engine/mode | decode rows | decode-only steps | decode-only ms | mixed steps | mixed ms | "
        "prefill tok / mixed step | mixed / decode-only |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in sections.items():
        for b in r.get("step_time_bins", []):
            print(
                f"| {name} | {b['rows']} | {b['decode_steps']} | {fmt(b['decode_ms'])} | "
                f"{b['mixed_steps']} | {fmt(b['mixed_ms'])} | {fmt(b['mixed_prefill_tokens_mean'], '.0f')} | "
                f"{fmt(b['mixed_over_decode'])} |"
            )
        if "step_time_bins" in r:
            print(
                f"| {name} | all (mixed-step weighted) | | | | | | {fmt(r['mixed_over_decode_weighted'])} "
                f"(max {fmt(r['mixed_over_decode_max'])}; target <= 1.10) |"
            )
    if results["comparison"]:
        print("\n| mode | peak seqs paged/slot | rows/step paged/slot | tok/s paged/slot |")
        print("|---|---|---|---|")
        for mode, c in results["comparison"].items():
            print(f"| {mode} | {c['peak_running']:.2f}x | {c['decode_rows_mean']:.2f}x | {c['tok_s']:.2f}x |")


# --------------------------------------------------------------------------------------------- the roofline bound
def schedule_row(cost: RooflineCost, context_N: np.ndarray, new_N: np.ndarray, start_N: np.ndarray) -> dict:
    rows_J, keys_J = decode_iterations(context_N, new_N, start_N)
    decode_s, prefill_s = cost.decode_s(rows_J, keys_J), cost.prefill_s(context_N)
    busy = rows_J[rows_J > 0]
    return {
        "decode_steps": len(busy),
        "decode_rows_mean": float(busy.mean()),
        "peak_rows": int(busy.max()),
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "tok_s": int(new_N.sum()) / (decode_s + prefill_s),
    }


def bound_part(args, spec: MoeModelSpec, element: int, prompts: list[list[int]], lengths: list[int]) -> dict:
    """The workload's two schedules costed at `--gpu`'s roofline (rollout/plan/schedule.py), no engine:
    - slot: the slots the KV budget holds (the engine's own cache plan) admit the requests in order, each slot
      freed when its request ends;
    - paged, unlimited K/V: every request admitted as soon as a row of `--max-batch-size` frees (all at step 0
      when they fit), never preempted: the most rows any paged engine can decode together.
    Prefill is costed the same for both (each prompt once). The ratio of their times is the largest tokens/s
    ratio an engine running at the roofline can show on this workload."""
    model, gpu = shape_from_spec("bound", spec), gpu_preset(args.gpu)
    slot = plan_for("slot", args, spec, element)
    slots = min(slot.num_blocks - 1, slot.max_seqs)
    context_N = np.array([len(p) for p in prompts])
    new_N = np.array(lengths)
    schedules = {
        f"slot ({slots} slots)": fifo_starts(new_N, slots),
        "paged, unlimited K/V": fifo_starts(new_N, args.max_batch_size),
    }
    runs = []
    for variant in args.variants:
        cost = variant_cost(variant, model, gpu, args.max_step_tokens)
        rows = {name: schedule_row(cost, context_N, new_N, s) for name, s in schedules.items()}
        slot_row, paged_row = rows.values()
        runs.append(
            {"variant": variant, "engines": rows, "paged_over_slot": paged_row["tok_s"] / slot_row["tok_s"]}
        )
    return {"gpu": dataclasses.asdict(gpu), "slots": slots, "runs": runs}


def print_bound(bound: dict) -> None:
    print(f"\nroofline of {bound['gpu']['name']} (no engine; rollout/plan/schedule.py)")
    print(
        "| variant | schedule | decode steps | rows/step | peak rows | decode s | prefill s | tok/s | paged / slot |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run in bound["runs"]:
        for i, (name, r) in enumerate(run["engines"].items()):
            ratio = f"**{run['paged_over_slot']:.2f}x**" if i else ""
            print(
                f"| {run['variant']} | {name} | {r['decode_steps']} | {r['decode_rows_mean']:.1f} | {r['peak_rows']} "
                f"| {r['decode_s']:.1f} | {r['prefill_s']:.1f} | {r['tok_s']:.0f} | {ratio} |"
            )
    for name in dict.fromkeys(run["variant"] for run in bound["runs"]):
        print(f"{name}: {BOUND_VARIANTS[name]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tiny", action="store_true", help="2-layer toy model on the CPU, small workload (smoke test)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-min", type=int, default=512)
    ap.add_argument("--prompt-max", type=int, default=2048)
    ap.add_argument("--median-output", type=float, default=2048)
    ap.add_argument("--sigma", type=float, default=1.0, help="of the output lengths' lognormal")
    ap.add_argument("--max-output", type=int, default=16384)
    ap.add_argument("--window", type=int, default=4096, help="T-PPO window of the windows mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engines", type=lambda s: s.split(","), default=["paged", "slot"])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["plain", "windows"])
    ap.add_argument("--block-size", type=int, default=16, help="positions per block of the paged engine")
    ap.add_argument(
        "--kv-tokens",
        type=int,
        default=700_000,
        help="KV budget of both engines (700k tokens: 64 GiB in bf16)",
    )
    ap.add_argument("--max-batch-size", type=int, default=256)
    ap.add_argument("--max-step-tokens", type=int, default=2048)
    ap.add_argument(
        "--max-decode-slowdown",
        type=float,
        default=0.0,
        help="rollout.max_decode_slowdown: mixed steps' prefill sized by the tile cost model (0: off)",
    )
    ap.add_argument(
        "--expert-kernel",
        default="auto",
        choices=("auto", "grouped", "padded", "persistent"),
        help="rollout.expert_kernel of both engines (persistent: ExpertPlex's tile-scheduled kernel, issue #29)",
    )
    ap.add_argument("--cuda-graph-max-tokens", type=int, default=1024)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument(
        "--overlap-steps",
        action="store_true",
        help="rollout.overlap_steps: each step launched while the device runs the one before (step seconds are "
        "then the device's, from CUDA events)",
    )
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=256,
        help="new tokens per warm-up request (0: no warm-up); must outlast the admission ramp (see warm_up)",
    )
    add_bandwidth_arg(ap)
    ap.add_argument(
        "--long-rows", type=int, default=128, help="roofline of decode steps with at least these rows"
    )
    ap.add_argument("--long-context", type=int, default=8192, help="... and at least this mean context")
    ap.add_argument(
        "--bin-rows", type=int, default=32, help="decode rows per bin of the step-time comparison"
    )
    add_attention_arg(ap)
    ap.add_argument(
        "--time-limit-s",
        type=float,
        default=0.0,
        help="per section: run the steps on the device for this long, predict the rest's time (0: no limit)",
    )
    ap.add_argument("--json", default="bench/out/rollout_long.json")
    ap.add_argument("--steps-out", default=None, help="folder for each section's step trace (JSON lines)")
    ap.add_argument(
        "--bound",
        action="store_true",
        help="no engine: cost the slot and paged schedules of the workload at --gpu's roofline (CPU, seconds)",
    )
    ap.add_argument("--gpu", default="h200", choices=sorted(GPU_PRESETS), help="the bound's GPU preset")
    ap.add_argument(
        "--variants",
        type=variant_list,
        default=list(BOUND_VARIANTS),
        help=f"what the bound makes free, some of {','.join(BOUND_VARIANTS)}",
    )
    if ap.parse_known_args(argv)[0].tiny:  # toy defaults; flags given on the command line still win
        ap.set_defaults(**TINY_ARGS)
    args = ap.parse_args(argv)
    unknown = (set(args.engines) - {"paged", "slot"}) | (set(args.modes) - {"plain", "windows"})
    if unknown:
        ap.error(
            f"unknown engines/modes {sorted(unknown)}: expected --engines paged,slot --modes plain,windows"
        )
    if args.time_limit_s and args.max_decode_slowdown:
        ap.error(
            "--time-limit-s with --max-decode-slowdown: the mixed steps' budget learns from step times, which "
            "the steps after the cut do not have, so the schedule would not be the real one; drop one of them"
        )
    if args.time_limit_s and args.overlap_steps:
        ap.error(
            "--time-limit-s with --overlap-steps: the cut runner waits for every step, so the section would not "
            "run overlapped; drop one of them"
        )
    return args


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if not args.bound:
        resolve_bandwidth(args, device)
    cfg = TINY_LONG if args.tiny else QWEN3_30B_A3B
    prompts, lengths, seeds = workload(args, cfg["vocab_size"])
    spec = MoeModelSpec.from_hf_config(cfg)
    element = torch.empty((), dtype=dtype).element_size()
    per_token = spec.kv_bytes_per_token(element)
    described = {kind: describe(kind, args, spec, element) for kind in ("paged", "slot")}
    results: dict = {
        "args": vars(args),
        "attention": apply_attention(args),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {
            k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok")
        },
        "kv_bytes_per_token": per_token,
        "kv_budget_gib": args.kv_tokens * per_token / 2**30,
        "plans": {kind: plan for kind, (plan, _) in described.items()},
        "workload": {
            "requests": args.requests,
            "prompt_tokens": sum(len(p) for p in prompts),
            "output_tokens": sum(lengths),
            "output_mean": statistics.mean(lengths),
            "output_median": statistics.median(lengths),
            "output_max": max(lengths),
            "outputs_capped": sum(n == args.max_output for n in lengths),
        },
        "engines": {},
        "sections": {},
    }
    w = results["workload"]
    print(
        f"model: {cfg['num_hidden_layers']} layers, {cfg['num_experts']} experts "
        f"top-{cfg['num_experts_per_tok']}, {args.dtype} on {results['device_name']}\n"
        f"KV: {per_token} bytes/token (K and V, {spec.num_layers} layers); budget {args.kv_tokens} tokens = "
        f"{results['kv_budget_gib']:.2f} GiB\n"
        f"{described['paged'][1]}\n{described['slot'][1]}\n"
        f"workload: {w['requests']} requests, {w['prompt_tokens']} prompt tokens, {w['output_tokens']} "
        f"output tokens (mean {w['output_mean']:.0f}, median {w['output_median']:.0f}, "
        f"max {w['output_max']}, {w['outputs_capped']} capped at {args.max_output})",
        flush=True,
    )
    if args.bound:
        results["bound"] = bound_part(args, spec, element, prompts, lengths)
        save(results, args.json)
        print_bound(results["bound"])
        return
    for kind in args.engines:
        run_engine_kind(kind, args, cfg, device, dtype, (prompts, lengths, seeds), results)
    results["comparison"] = compare(results, args.modes)
    save(results, args.json)
    print_tables(results)


if __name__ == "__main__":
    main()
