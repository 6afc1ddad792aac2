"""T-PPO against synchronous PPO (issue #28): the rollout engine alone, and the training loop end to end.

    python bench/tppo_vs_ppo.py rollout --json bench/out/tppo_vs_ppo_rollout.json   # H200, bf16, 16-layer MoE
    python bench/tppo_vs_ppo.py bound --gpu h200    # the rollout part's schedules at the roofline (CPU, seconds)
    python bench/tppo_vs_ppo.py bound --measured bench/out/tppo_vs_ppo_rollout.json   # the engine against it
    python bench/tppo_vs_ppo.py e2e --json bench/out/tppo_vs_ppo_e2e.json           # 3 algorithms x seeds
    python bench/tppo_vs_ppo.py rollout --tiny        # CPU smoke runs of every code path (toy model, few steps)
    python bench/tppo_vs_ppo.py e2e --tiny

rollout: the engine with random weights and no learning, fed through the training loop's own `SamplePool`.
Every item of the stream has a target length drawn once from a lognormal law (median `--median-frac` x L_max,
sigma `--sigma`, clipped to [L_max / 100, L_max]) keyed by its uid, and generates exactly that many tokens
(`ignore_eos`), so both algorithms see the same requests in the same order:
- ppo: the pool with W = L_max, i.e. synchronous PPO: each step generates B whole responses.
- tppo W=w: the pool with window w: each step takes the unfinished continuations first and fills the batch with
  fresh items; each item generates min(w, remaining) tokens from its prompt plus all its tokens so far (the
  continuation is prefilled again); finished items retire and new prompts take their place.
PPO runs `--ppo-steps` steps; T-PPO runs until it has completed at least as many responses (at most
`--max-tppo-steps`), so both totals cover the same work. Per step and in total: wall seconds, completed
responses and their tokens, completed-response tokens per second, generated tokens, decode occupancy =
generated tokens / (decode steps x B) (the fraction of the batch's rows still decoding, averaged over the
engine's steps), prefill tokens (re-prefill of continuations included) and seconds per completed response.
A T-PPO run's completed tokens count only responses that finished within it: work left in flight at the end is
spent but not counted (the comparison is conservative for T-PPO).

bound: the rollout part's schedules (the same pool, stream and windows, no engine) costed step by step at a GPU
preset's roofline by the deployment planner's model (rollout/plan): what the hardware allows any engine on one
GPU, in seconds of CPU. `--variants` makes costs free one at a time to show which takes T-PPO's gain:
`roofline` (every kernel at its bound), `free_kv` (K/V reads free), `row_free` (K/V free and every expert read
at every step, so a memory-bound decode step costs the same whatever its rows: T-PPO's premise). Decode steps
are counted without the engine's chunked-prefill steps (a few more per step on the engine). With `--measured
R.json` (a rollout part's output) it replays R's runs step for step on R's stream and reports the engine's
efficiency: roofline seconds / measured seconds, whole and for prefill and decode.

e2e: the training loop (`python -m recipes.train`, one subprocess per run, as a user runs it) on the same
experiment, seeds and learning rates with three algorithms: `tppo` (window `--window`), `ppo` (whole responses,
GAE) and `tppo_wmax` (T-PPO with W = L_max, a sanity check whose curve must match PPO's: EGAE over a window that
holds the whole response is GAE). Read from each run's metrics.jsonl: reward per step (`rollout/reward_mean`,
smoothed over `--smooth` steps; a threshold counts once a whole window of them reaches it), cumulative wall clock
(sum of `perf/step_s`: the RL steps, not start-up or the warm start), and each phase's share of the step. Reported
per algorithm (median and spread over seeds): the wall clock to reach `--threshold` (also counted from the end of
the first step, which alone carries the one-time warm-up), the reward at equal wall clock (on that clock: the
time after step 0 that every run lasted), the first step's seconds, the median of the other steps and their phase
shares; plots of reward vs that clock and decode occupancy per step under `--plots`. A run directory under
`--run-root` that already holds every step of the same overrides is read, not re-run: the seeds of one table
may come from several calls. `--shared-warm-start` runs the experiment's warm start once per seed and starts each
algorithm's run from it (a long warm start, countdown_xl's 800 steps, then costs one run per seed, not one per
run); the warm starts come first, `--warm-start-jobs` of them at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_decode import (
    QWEN3_30B_A3B,
    TINY,
    add_attention_arg,
    apply_attention,
    free_memory,
    int_list,
    sync,
)
from rollout_long import save, warm_up

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig
from rollout.engine import GenerateStats
from rollout.model_spec import MoeModelSpec
from rollout.plan import (
    GPU_PRESETS,
    gpu_preset,
)
from rollout.plan.hardware import shape_from_spec
from rollout.plan.schedule import (
    BOUND_VARIANTS,
    RooflineCost,
    decode_iterations,
    variant_cost,
    variant_list,
)
from tppo.algo.pool import Prompt, Sample, SamplePool
from tppo.algo.stages import request_seed

REPO = Path(__file__).resolve().parents[1]
# The 16-layer MoE of bench/megatron_train.py (hidden 2048, 64 experts top-8, expert FFN 768, vocab 32768).
MOE_16L = dict(QWEN3_30B_A3B, num_hidden_layers=16, num_experts=64, vocab_size=32768)
TINY_MOE = dict(TINY, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
TINY_ROLLOUT = dict(
    device="cpu",
    dtype="float32",
    batch_sizes=[8],
    max_length=96,
    windows=[24],
    group_size=4,
    prompt_min=4,
    prompt_max=12,
    ppo_steps=2,
    max_tppo_steps=12,
    warmup_tokens=4,
    kv_tokens=4096,
    max_step_tokens=64,
)


# --------------------------------------------------------------------------------------------- the stream
class RandomPrompts:
    """`num` prompts of random token ids, lengths uniform in [low, high]; prompt i depends only on (seed, i)."""

    def __init__(self, num: int, low: int, high: int, vocab: int, seed: int) -> None:
        self.num, self.low, self.high, self.vocab, self.seed = num, low, high, vocab, seed

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, index: int) -> Prompt:
        rng = np.random.default_rng([self.seed, index])
        ids = rng.integers(0, self.vocab, size=int(rng.integers(self.low, self.high + 1)))
        return Prompt(uid=f"p{index}", prompt_ids=ids)


def target_length(uid: str, seed: int, max_length: int, median_frac: float, sigma: float) -> int:
    """The item's response length: lognormal(log(median_frac * L_max), sigma), rounded, clipped to
    [ceil(L_max / 100), L_max]; drawn from (seed, crc32(uid)) so every algorithm gives the item the same one."""
    rng = np.random.default_rng([seed, zlib.crc32(uid.encode())])
    draw = rng.lognormal(math.log(median_frac * max_length), sigma)
    return int(min(max(round(draw), math.ceil(max_length / 100)), max_length))


# --------------------------------------------------------------------------------------------- one algorithm
@dataclass
class StepRecord:
    step: int
    seconds: float
    prefill_s: float  # of `seconds`, in steps without a decoding row
    batch: int
    continuations: int
    completed: int
    completed_tokens: int
    generated_tokens: int
    prefill_tokens: int
    decode_steps: int
    decode_rows: int
    preemptions: int
    occupancy: float


@dataclass
class AlgoRun:
    name: str
    batch_size: int
    window: int
    steps: list[StepRecord] = field(default_factory=list)

    def totals(self) -> dict:
        seconds = sum(s.seconds for s in self.steps)
        completed = sum(s.completed for s in self.steps)
        completed_tokens = sum(s.completed_tokens for s in self.steps)
        decode_steps = sum(s.decode_steps for s in self.steps)
        return {
            "steps": len(self.steps),
            "seconds": seconds,
            "completed": completed,
            "completed_tokens": completed_tokens,
            "completed_tok_s": completed_tokens / seconds if seconds else 0.0,
            "generated_tokens": sum(s.generated_tokens for s in self.steps),
            "prefill_tokens": sum(s.prefill_tokens for s in self.steps),
            "preemptions": sum(s.preemptions for s in self.steps),
            "occupancy": sum(s.generated_tokens for s in self.steps) / (decode_steps * self.batch_size)
            if decode_steps
            else 0.0,
            "s_per_completed": seconds / completed if completed else float("inf"),
            "prefill_share": sum(s.prefill_s for s in self.steps) / seconds if seconds else 0.0,
        }


def window_params(batch: list[Sample], targets: list[int], args, step: int) -> list[SamplingParams]:
    """min(window budget, tokens the item still has to generate), ignore_eos, the loop's per-step seeds."""
    return [
        SamplingParams(
            max_new_tokens=min(s.max_new_tokens, t - s.num_response_tokens),
            temperature=1.0,
            seed=request_seed(args.seed, step, s.uid),
            ignore_eos=True,
        )
        for s, t in zip(batch, targets)
    ]


def take_windows(pool: SamplePool, args, step: int) -> tuple[list[Sample], list[int], list[SamplingParams]]:
    """The step's batch from the pool, each item's target length and its sampling parameters."""
    batch = pool.take()
    targets = [target_length(s.uid, args.seed, args.max_length, args.median_frac, args.sigma) for s in batch]
    return batch, targets, window_params(batch, targets, args, step)


def finish_windows(
    pool: SamplePool, batch: list[Sample], targets: list[int], tokens: list, logprobs: list
) -> list[Sample]:
    """Append each item's window, end the items that reached their target; returns the retired samples."""
    for s, t, ids, lps in zip(batch, targets, tokens, logprobs):
        done = s.num_response_tokens + len(ids) >= t and t < s.max_response_length
        s.add_window(ids, lps, finish_reason="eos" if done else None)
        if s.finished:
            s.reward = 0.0
    return pool.put_back(batch).retired


def step_record(
    step: int, seconds: float, batch: int, continuations: int, retired: list[Sample], stats: GenerateStats
) -> StepRecord:
    """What one rollout step of `batch` items, `continuations` of them unfinished before it, did."""
    return StepRecord(
        step=step,
        seconds=seconds,
        prefill_s=stats.prefill_s,
        batch=batch,
        continuations=continuations,
        completed=len(retired),
        completed_tokens=sum(s.num_response_tokens for s in retired),
        generated_tokens=stats.num_generated_tokens,
        prefill_tokens=stats.num_prefill_tokens,
        decode_steps=stats.num_decode_steps,
        decode_rows=stats.num_decode_rows,
        preemptions=stats.num_preemptions,
        occupancy=stats.num_generated_tokens / (stats.num_decode_steps * batch)
        if stats.num_decode_steps
        else 0.0,
    )


def rollout_step(engine: RolloutEngine, args, pool: SamplePool, step: int) -> tuple[StepRecord, list[Sample]]:
    """One step of the loop's rollout stage: take, generate one window each, retire what reached its target.
    Returns the step's record and the retired samples."""
    batch, targets, params = take_windows(pool, args, step)
    continuations = sum(s.num_response_tokens > 0 for s in batch)
    sync(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate([s.context_ids.tolist() for s in batch], params)
    sync(engine.device)
    seconds = time.perf_counter() - t0
    retired = finish_windows(pool, batch, targets, [o.token_ids for o in outs], [o.logprobs for o in outs])
    return step_record(step, seconds, len(batch), continuations, retired, engine.last_stats), retired


def make_pool(args, batch_size: int, window: int, vocab: int) -> SamplePool:
    """The loop's sample pool over the prompt stream (unshuffled: every algorithm reads it in the same order)."""
    prompts = RandomPrompts(10**9, args.prompt_min, args.prompt_max, vocab, args.seed)
    return SamplePool(
        prompts,
        batch_size=batch_size,
        group_size=args.group_size,
        window=window,
        max_response_length=args.max_length,
        shuffle=False,
    )


StepFn = Callable[[SamplePool, int], tuple[StepRecord, list[Sample]]]


def run_algo(
    step_fn: StepFn, vocab: int, name: str, batch_size: int, window: int, args, until: Callable
) -> AlgoRun:
    """Steps of one algorithm on a fresh pool over the same stream until `until(run)` says stop;
    `step_fn(pool, step)` runs one rollout step (the engine's, or the roofline model's)."""
    pool = make_pool(args, batch_size, window, vocab)
    run = AlgoRun(name, batch_size, window)
    while not until(run):
        rec, _ = step_fn(pool, len(run.steps))
        run.steps.append(rec)
        if not args.quiet:
            print(
                f"  {name} B={batch_size} step {rec.step}: {rec.seconds:.1f} s, {rec.completed} completed "
                f"({rec.completed_tokens} tokens), {rec.continuations} continuations, occupancy "
                f"{rec.occupancy:.2f}, prefill {rec.prefill_tokens}",
                flush=True,
            )
    return run


def build_engine(args, cfg: dict, device: torch.device, dtype: torch.dtype) -> RolloutEngine:
    config = RolloutConfig(
        max_model_len=args.prompt_max + args.max_length,
        max_batch_size=max(args.batch_sizes),
        kv_cache_tokens=args.kv_tokens,
        kv_cache_fraction=args.kv_cache_fraction,
        max_step_tokens=args.max_step_tokens,
        cuda_graphs=not args.eager,
    )
    return RolloutEngine.from_config(cfg, device=device, dtype=dtype, config=config, seed=args.seed)


def rollout_part(args) -> dict:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cfg = TINY_MOE if args.tiny else MOE_16L
    engine = build_engine(args, cfg, device, dtype)
    results: dict = {
        "args": vars(args),
        "attention": apply_attention(args),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {
            k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok")
        },
        "kv_positions": engine.cache_plan.num_positions,
        "runs": [],
    }
    if args.warmup_tokens:
        warm = argparse.Namespace(
            seed=args.seed,
            max_batch_size=max(args.batch_sizes),
            prompt_min=args.prompt_min,
            prompt_max=args.prompt_max,
            warmup_tokens=args.warmup_tokens,
        )
        results["warmup"] = warm_up(engine, warm, cfg["vocab_size"])
    run_sections(results, partial(rollout_step, engine, args), cfg["vocab_size"], args)
    del engine
    free_memory()
    print_rollout(results)
    return results


def run_sections(results: dict, step_fn: StepFn, vocab: int, args) -> None:
    """PPO, then T-PPO at each window, for each batch size; the JSON is rewritten after each."""
    for batch_size in args.batch_sizes:
        ppo = section(results, step_fn, vocab, "ppo", batch_size, args.max_length, args, ppo_done(args))
        save(results, args.json)
        for window in args.windows:
            until = tppo_done(args, ppo)
            section(results, step_fn, vocab, f"tppo W={window}", batch_size, window, args, until)
            save(results, args.json)


def ppo_done(args) -> Callable[[AlgoRun], bool]:
    return lambda run: len(run.steps) >= args.ppo_steps


def tppo_done(args, ppo: AlgoRun | None) -> Callable[[AlgoRun], bool]:
    """Stop once T-PPO has completed as many responses as PPO did (or after --max-tppo-steps)."""
    goal = ppo.totals()["completed"] if ppo else 0
    return lambda run: (
        len(run.steps) >= args.max_tppo_steps or (goal and sum(s.completed for s in run.steps) >= goal)
    )


def section(results: dict, *run_args) -> AlgoRun | None:
    """`run_algo(*run_args)`; an error is recorded in the JSON and the others still run."""
    try:
        run = run_algo(*run_args)
    except Exception as err:
        traceback.print_exc()
        results["runs"].append({"error": f"{type(err).__name__}: {err}"})
        return None
    results["runs"].append(
        {
            "name": run.name,
            "batch_size": run.batch_size,
            "window": run.window,
            "totals": run.totals(),
            "steps": [asdict(s) for s in run.steps],
        }
    )
    return run


def print_rollout(results: dict) -> None:
    print(
        "\n| B | algorithm | steps | wall s | completed | completed tok/s | vs ppo | occupancy | prefill tokens "
        "| prefill share | s / completed |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    base: dict[int, float] = {}
    for r in results["runs"]:
        if "error" in r:
            print(f"| | error: {r['error'][:100]} | | | | | | | | | |")
            continue
        t = r["totals"]
        if r["name"] == "ppo":
            base[r["batch_size"]] = t["completed_tok_s"]
        ratio = t["completed_tok_s"] / base[r["batch_size"]] if base.get(r["batch_size"]) else float("nan")
        name = f"{r['variant']}: {r['name']}" if "variant" in r else r["name"]
        print(
            f"| {r['batch_size']} | {name} | {t['steps']} | {t['seconds']:.1f} | {t['completed']} | "
            f"{t['completed_tok_s']:.0f} | {ratio:.2f}x | {t['occupancy']:.2f} | {t['prefill_tokens']} | "
            f"{t['prefill_share']:.2f} | {t['s_per_completed']:.3f} |"
        )


# --------------------------------------------------------------------------------------------- the roofline bound
# The models the bound part can cost: the rollout part's 16-layer MoE and the whole Qwen3-30B-A3B.
BOUND_MODELS = {"moe16": MOE_16L, "qwen3-30b-a3b": QWEN3_30B_A3B}


def bound_step(cost: RooflineCost, args, pool: SamplePool, step: int) -> tuple[StepRecord, list[Sample]]:
    """`rollout_step` with the roofline's time in place of an engine: the same pool, windows and targets, each
    window filled with placeholder tokens of its exact length."""
    batch, targets, params = take_windows(pool, args, step)
    continuations = sum(s.num_response_tokens > 0 for s in batch)
    context_N = np.array([s.prompt_ids.size + s.num_response_tokens for s in batch])
    new_N = np.array([p.max_new_tokens for p in params])
    rows_J, keys_J = decode_iterations(context_N, new_N)
    stats = GenerateStats(
        num_requests=len(batch),
        num_generated_tokens=int(new_N.sum()),
        num_decode_steps=len(rows_J),
        num_decode_rows=int(rows_J.sum()),
        num_prefill_tokens=int(context_N.sum()),
        prefill_s=cost.prefill_s(context_N),
        decode_s=cost.decode_s(rows_J, keys_J),
    )
    tokens = [np.zeros(n, dtype=np.int64) for n in new_N]
    retired = finish_windows(pool, batch, targets, tokens, [np.zeros(n, dtype=np.float32) for n in new_N])
    seconds = stats.prefill_s + stats.decode_s
    return step_record(step, seconds, len(batch), continuations, retired, stats), retired


def bound_part(args) -> dict:
    if args.measured:
        return measured_part(args)
    spec = MoeModelSpec.from_hf_config(BOUND_MODELS[args.model])
    model, gpu = shape_from_spec(args.model, spec), gpu_preset(args.gpu)
    results: dict = {"args": vars(args), "model": asdict(model), "gpu": asdict(gpu), "runs": []}
    for variant in args.variants:
        first = len(results["runs"])
        cost = variant_cost(variant, model, gpu, args.max_step_tokens)
        run_sections(results, partial(bound_step, cost, args), spec.vocab_size, args)
        for run in results["runs"][first:]:
            run["variant"] = variant
        save(results, args.json)
    print(f"roofline of {gpu.name}, {model.name} ({model.num_layers} layers, {model.num_experts} experts)")
    for variant in args.variants:
        print(f"{variant}: {BOUND_VARIANTS[variant]}")
    print_rollout(results)
    return results


# The stream's settings a measured rollout JSON carries and its replay must use.
STREAM_KEYS = (
    "max_length",
    "group_size",
    "prompt_min",
    "prompt_max",
    "median_frac",
    "sigma",
    "max_step_tokens",
    "seed",
)


def measured_gpu(device_name: str, default: str) -> str:
    """The GPU preset of a measured run's device ("NVIDIA H100 80GB HBM3" -> h100), else `default`."""
    return next((name for name in GPU_PRESETS if name.upper() in device_name.upper()), default)


def measured_part(args) -> dict:
    """Replay each run of a rollout-part JSON step for step at the roofline: how far from its bound the engine
    ran, overall and in prefill (steps without a decoding row) and decode. The replay must generate the same
    tokens as the measured step, or the stream settings differ and the comparison is refused."""
    measured = json.loads(Path(args.measured).read_text())
    stream = argparse.Namespace(**{**vars(args), **{k: measured["args"][k] for k in STREAM_KEYS}})
    cfg = TINY_MOE if measured["args"].get("tiny") else MOE_16L
    spec = MoeModelSpec.from_hf_config(cfg)
    gpu = gpu_preset(measured_gpu(measured.get("device_name", ""), args.gpu))
    cost = variant_cost("roofline", shape_from_spec("measured", spec), gpu, stream.max_step_tokens)
    rows = []
    for run in measured["runs"]:
        if "error" in run:
            continue
        pool = make_pool(stream, run["batch_size"], run["window"], spec.vocab_size)
        bound = [bound_step(cost, stream, pool, i)[0] for i in range(len(run["steps"]))]
        for got, want in zip(bound, run["steps"]):
            if got.generated_tokens != want["generated_tokens"]:
                raise ValueError(
                    f"{args.measured}: run {run['name']} step {want['step']} generated {want['generated_tokens']} "
                    f"tokens, the replay {got.generated_tokens}: not the same stream"
                )
        rows.append(efficiency_row(run, bound))
    results = {"args": vars(args), "measured": args.measured, "gpu": asdict(gpu), "runs": rows}
    save(results, args.json)
    print_efficiency(results)
    return results


def efficiency_row(run: dict, bound: list[StepRecord]) -> dict:
    """Measured and roofline seconds of one run, whole and split into prefill and decode. The split is the
    engine's: its prefill is the steps without a decoding row (a prefill chunk riding a decode step counts as
    decode), the bound's all prefill; the whole is exact."""
    seconds = sum(s["seconds"] for s in run["steps"])
    prefill = sum(s.get("prefill_s", math.nan) for s in run["steps"])
    bound_s = sum(b.seconds for b in bound)
    bound_prefill = sum(b.prefill_s for b in bound)
    return {
        "name": run["name"],
        "batch_size": run["batch_size"],
        "steps": len(bound),
        "seconds": seconds,
        "bound_s": bound_s,
        "prefill_s": prefill,
        "bound_prefill_s": bound_prefill,
        "decode_s": seconds - prefill,
        "bound_decode_s": bound_s - bound_prefill,
    }


def print_efficiency(results: dict) -> None:
    print(f"\n{results['measured']} against the roofline of {results['gpu']['name']} (bound / measured)")
    print(
        "| B | algorithm | steps | measured s | bound s | efficiency | prefill s (bound) | decode s (bound) "
        "| decode efficiency |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in results["runs"]:
        print(
            f"| {r['batch_size']} | {r['name']} | {r['steps']} | {r['seconds']:.3g} | {r['bound_s']:.3g} | "
            f"{r['bound_s'] / r['seconds']:.1%} | {r['prefill_s']:.3g} ({r['bound_prefill_s']:.3g}) | "
            f"{r['decode_s']:.3g} ({r['bound_decode_s']:.3g}) | {r['bound_decode_s'] / r['decode_s']:.1%} |"
        )


# --------------------------------------------------------------------------------------------- end to end
PHASES = ("rollout", "values", "critic_update", "old_logprobs", "policy_update", "weight_sync", "offload")
TINY_E2E = dict(
    seeds=[0],
    steps=4,
    overrides=["algo.warm_start_steps=10", "algo.critic_warmup_steps=1"],
    smooth=2,
)


def variant_overrides(args) -> dict[str, list[str]]:
    """The three algorithms as recipe overrides on the same experiment (command-line overrides win over it)."""
    length = f"algo.max_response_length={args.max_length}"
    return {
        "tppo": [length, f"algo.window={args.window}"],
        "ppo": ["algo=ppo", length, f"algo.window={args.max_length}"],
        "tppo_wmax": [length, f"algo.window={args.max_length}"],
    }


def train(name: str, seed: int, overrides: list[str], args) -> Path:
    """One training run, as a user launches it; a run directory that exists is resumed by the loop itself, and
    one that already holds every step with the same overrides is read as it is (so the seeds of one table can
    run in separate calls of a time-limited machine)."""
    warm = shared_warm_start(seed, args) if args.shared_warm_start else []
    recipe_overrides = recipe(name, seed, args.steps, [*overrides, *warm], args)
    run_dir = Path(args.run_root) / name
    if finished_run(run_dir, recipe_overrides, args.steps):
        print(f"{name}: {run_dir} holds its {args.steps} steps; read, not re-run", flush=True)
    else:
        launch(name, recipe_overrides, run_dir)
    return run_dir / "metrics.jsonl"


def shared_warm_start(seed: int, args) -> list[str]:
    """The overrides that start a run of `seed` from a shared warm start: the experiment's warm start run once,
    alone (a run of no RL step) and exported as a checkpoint, which the runs load (`model.hf_path`, which also
    starts the critic's trunk from it) in place of a warm start of their own. An export whose run had the same
    overrides is reused."""
    name = f"warm_start_s{seed}"
    run_dir, overrides = Path(args.run_root) / name, recipe(name, seed, 0, [], args)
    policy = run_dir / "rollout_init"  # relative as --run-root is (to the repository, the runs' directory)
    if finished_run(run_dir, overrides, 0) and (policy / "config.json").exists():
        print(f"{name}: {policy} holds the warm-started policy; reused", flush=True)
    else:
        launch(name, overrides, run_dir)
    return [f"model.hf_path={policy}", "algo.warm_start_steps=0"]


def warm_starts(args) -> None:
    """Every seed's shared warm start, `--warm-start-jobs` at a time: they are not timed, so they may share the
    machine, and every timed run starts after the last of them."""
    with ThreadPoolExecutor(args.warm_start_jobs) as pool:
        list(pool.map(partial(shared_warm_start, args=args), args.seeds))


def recipe(name: str, seed: int, steps: int, overrides: list[str], args) -> list[str]:
    """The recipe overrides of one run of the experiment: the bench's, then the command line's, then `overrides`."""
    return [
        f"experiment={args.experiment}",
        f"run.name={name}",
        f"run.output_dir={args.run_root}",
        f"run.seed={seed}",
        f"run.num_steps={steps}",
        "logging=disabled",
        *args.overrides,
        *overrides,
    ]


def launch(name: str, recipe_overrides: list[str], run_dir: Path) -> None:
    """`python -m recipes.train` with these overrides. Its output goes to a file as it comes, so a run cut by a
    time limit keeps its log (where the time went: start-up, warm start, steps) beside its metrics; appended, a
    resumed run's log follows the cut one's."""
    cmd = [sys.executable, "-m", "recipes.train", *recipe_overrides]
    print(" ".join(cmd[2:]), flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "bench_train.log"
    with log.open("a") as out:
        code = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"{name}: recipes.train exited {code} ({log}):\n{log.read_text()[-2000:]}")


def finished_run(run_dir: Path, recipe_overrides: list[str], steps: int) -> bool:
    """Whether `run_dir` holds a run of `steps` steps launched with exactly these overrides. A run of other
    overrides under the same name is refused: its curve would enter the table as this variant's."""
    metrics, launched = run_dir / "metrics.jsonl", run_dir / "hydra" / ".hydra" / "overrides.yaml"
    if not metrics.exists() or len(read_metrics(metrics)) < steps:
        return False
    found = OmegaConf.to_container(OmegaConf.load(launched)) if launched.exists() else None
    if found != recipe_overrides:
        raise ValueError(
            f"{run_dir} holds a finished run launched with {found}, not {recipe_overrides}: "
            "pass another --run-root or remove it"
        )
    return True


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def smoothed(values: list[float | None], width: int) -> list[float]:
    """Trailing mean over the known values among the last `width` (a step where no response finished has
    none); NaN until one is known."""
    out = []
    for i in range(len(values)):
        known = [v for v in values[max(0, i + 1 - width) : i + 1] if v is not None]
        out.append(statistics.fmean(known) if known else (out[-1] if out else math.nan))
    return out


def curve(rows: list[dict], smooth: int) -> dict:
    """Wall clock (cumulative RL step seconds), smoothed reward and occupancy per step, the first step's seconds;
    the step time (median), phase shares and rates are of the steps after the first, which alone carries
    one-time warm-up: on a GPU 14-60 s of kernel compiles and graph captures (more with a cold compile cache),
    more than ten ordinary steps."""
    step_s = [r["perf/step_s"] for r in rows]
    later = rows[1:] or rows
    later_total = sum(r["perf/step_s"] for r in later)
    return {
        "wall_s": list(np.cumsum(step_s)),
        "reward": smoothed([r.get("rollout/reward_mean") for r in rows], smooth),
        "smooth": smooth,
        "reward_raw": [r.get("rollout/reward_mean", math.nan) for r in rows],
        "occupancy": [occupancy(r) for r in rows],
        "first_step_s": step_s[0],
        "step_s_median": statistics.median(r["perf/step_s"] for r in later),
        "phase_share": {p: sum(r.get(f"perf/{p}_s", 0.0) for r in later) / later_total for p in PHASES},
        # the mechanism: T-PPO gains only where responses finish faster per second, which needs engine steps
        # whose cost does not grow with their rows (the generation time per token falls as occupancy rises)
        "finished_per_s": sum(r.get("rollout/finished", 0) for r in later) / later_total,
        "generation_us_per_token": 1e6 * generation_s_per_token(later),
    }


def generation_s_per_token(rows: list[dict]) -> float:
    """Engine seconds of decode and mixed steps per generated token over the run."""
    tokens = sum(r.get("rollout/tokens", 0) for r in rows)
    seconds = sum(r.get("rollout/decode_s", 0.0) + r.get("rollout/mixed_s", 0.0) for r in rows)
    return seconds / tokens if tokens else math.nan


def occupancy(row: dict) -> float:
    """Decode rows per engine step over the step's batch (its finished plus continuing items), as in the
    rollout part (the loop's own rollout/decode_occupancy divides by the engine's max_seqs instead)."""
    batch = row.get("rollout/finished", 0) + row.get("rollout/pool_num_continuing", 0)
    return row.get("rollout/decode_rows_mean", math.nan) / batch if batch else math.nan


def time_to(c: dict, threshold: float) -> float | None:
    """Wall clock at the first step whose smoothed reward, over a full window of `smooth` steps, reaches the
    threshold (None: never). Before the window fills, the mean is of the first few steps, and one lucky step
    near a threshold the run starts close to would count as reaching it."""
    full = zip(c["wall_s"][c["smooth"] - 1 :], c["reward"][c["smooth"] - 1 :])
    return next((t for t, r in full if r >= threshold), None)


def after_first_step(c: dict, wall_s: float | None) -> float | None:
    """Wall clock counted from the end of the first RL step, which alone carries the run's one-time warm-up
    (compilation, CUDA graph capture: 20-40 s on a GPU, the same work for every algorithm) that a run of
    hours amortises and a run of a hundred short steps does not."""
    return None if wall_s is None else wall_s - c["wall_s"][0]


def reward_at(c: dict, wall_s: float) -> float:
    """Smoothed reward of the last step finished `wall_s` after the end of the first (the clock of
    `after_first_step`); the first step's own when none was."""
    done = [r for t, r in zip(c["wall_s"], c["reward"]) if after_first_step(c, t) <= wall_s + 1e-9]
    return done[-1]


def equal_wall_s(curves: dict[str, list[dict]]) -> float:
    """The longest time after the first step that every run lasted."""
    return min(after_first_step(c, c["wall_s"][-1]) for cs in curves.values() for c in cs)


def spread(values: list[float | None]) -> dict:
    """Median, min and max over seeds; a run that never reached the threshold counts as infinite."""
    xs = [math.inf if v is None else v for v in values]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "values": xs}


def e2e_part(args) -> dict:
    if args.warm_starts_only and not args.shared_warm_start:
        raise SystemExit("--warm-starts-only needs --shared-warm-start")
    known = variant_overrides(args)
    if unknown := [a for a in args.algos if a not in known]:
        raise SystemExit(f"--algos: unknown {unknown}; choose from {sorted(known)}")
    variants = {k: v for k, v in known.items() if k in args.algos}
    curves: dict[str, list[dict]] = {name: [] for name in variants}
    if args.shared_warm_start:
        warm_starts(args)
        if args.warm_starts_only:
            return {}
    for seed in args.seeds:
        for name, overrides in variants.items():
            rows = read_metrics(train(f"{name}_s{seed}", seed, overrides, args))
            curves[name].append(curve(rows, args.smooth) | {"seed": seed})
    equal_wall = equal_wall_s(curves)
    results: dict = {"args": vars(args), "equal_wall_s": equal_wall, "algos": {}}
    for name, cs in curves.items():
        results["algos"][name] = {
            "time_to_threshold_s": spread([time_to(c, args.threshold) for c in cs]),
            "time_to_threshold_after_first_step_s": spread(
                [after_first_step(c, time_to(c, args.threshold)) for c in cs]
            ),
            "reward_at_equal_wall": spread([reward_at(c, equal_wall) for c in cs]),
            "final_reward": spread([c["reward"][-1] for c in cs]),
            "first_step_s": spread([c["first_step_s"] for c in cs]),
            "step_s": spread([c["step_s_median"] for c in cs]),
            "occupancy": spread([statistics.fmean(c["occupancy"]) for c in cs]),
            "finished_per_s": spread([c["finished_per_s"] for c in cs]),
            "generation_us_per_token": spread([c["generation_us_per_token"] for c in cs]),
            "phase_share": {p: statistics.median(c["phase_share"][p] for c in cs) for p in PHASES},
            "curves": cs,
        }
    if {"ppo", "tppo_wmax"} <= set(curves):
        results["tppo_wmax_vs_ppo_max_reward_diff"] = max(
            float(np.nanmax(np.abs(np.subtract(p["reward_raw"], t["reward_raw"]))))
            for p, t in zip(curves["ppo"], curves["tppo_wmax"])
        )
    save(results, args.json)
    plot_e2e(results, Path(args.plots))
    print_e2e(results)
    return results


def plot_e2e(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    for key, ylabel, x_wall in (
        ("reward", "reward (smoothed)", True),
        ("occupancy", "decode occupancy", False),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (name, algo) in enumerate(results["algos"].items()):
            for c in algo["curves"]:
                # the first step's point sits at 0: its warm-up is left out, as in the table
                xs = [after_first_step(c, t) for t in c["wall_s"]] if x_wall else range(1, len(c[key]) + 1)
                ax.plot(xs, c[key], color=f"C{i}", alpha=0.8, label=f"{name} seed {c['seed']}")
        ax.set_xlabel("wall clock of RL steps after step 0 (s)" if x_wall else "step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{key}.png", dpi=120)
        plt.close(fig)


def print_e2e(results: dict) -> None:
    def fmt(s: dict) -> str:
        return f"{s['median']:.3g} [{s['min']:.3g}, {s['max']:.3g}]"

    print(
        f"\n| algorithm | time to reward {results['args']['threshold']} (s) | after step 0 (s) "
        f"| reward at {results['equal_wall_s']:.0f} s after step 0 | final reward | step 0 s | step s | occupancy | finished / s "
        "| generation us / token | rollout / critic / policy / sync share |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for name, a in results["algos"].items():
        sh = a["phase_share"]
        shares = " / ".join(
            f"{sh[k]:.2f}" for k in ("rollout", "critic_update", "policy_update", "weight_sync")
        )
        print(
            f"| {name} | {fmt(a['time_to_threshold_s'])} | {fmt(a['time_to_threshold_after_first_step_s'])} | "
            f"{fmt(a['reward_at_equal_wall'])} | "
            f"{fmt(a['final_reward'])} | {fmt(a['first_step_s'])} | {fmt(a['step_s'])} | {fmt(a['occupancy'])} | "
            f"{fmt(a['finished_per_s'])} | "
            f"{fmt(a['generation_us_per_token'])} | {shares} |"
        )
    if "tppo_wmax_vs_ppo_max_reward_diff" in results:
        print(
            f"tppo W=L_max vs ppo: max reward difference per step {results['tppo_wmax_vs_ppo_max_reward_diff']:.3g}"
        )


# --------------------------------------------------------------------------------------------- CLI
def add_stream_args(ap: argparse.ArgumentParser) -> None:
    """The request stream and the algorithms' steps (the rollout and bound parts)."""
    ap.add_argument("--batch-sizes", type=int_list, default=[64, 128], help="B, items per step")
    ap.add_argument("--max-length", type=int, default=16384, help="L_max, response tokens")
    ap.add_argument("--windows", type=int_list, default=[4096, 8192], help="T-PPO windows W")
    ap.add_argument("--group-size", type=int, default=8, help="G, responses per prompt")
    ap.add_argument("--prompt-min", type=int, default=256)
    ap.add_argument("--prompt-max", type=int, default=1024)
    ap.add_argument("--median-frac", type=float, default=0.25, help="median target length / L_max")
    ap.add_argument("--sigma", type=float, default=0.7, help="of the target lengths' lognormal")
    ap.add_argument("--ppo-steps", type=int, default=3)
    ap.add_argument("--max-tppo-steps", type=int, default=40)
    ap.add_argument("--max-step-tokens", type=int, default=2048, help="prefill chunk of an engine step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no line per step")


def add_rollout_args(ap: argparse.ArgumentParser) -> None:
    add_stream_args(ap)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup-tokens", type=int, default=64, help="new tokens per warm-up request (0: none)")
    ap.add_argument("--kv-tokens", type=int, default=0, help="KV cache positions; 0 sizes it from memory")
    ap.add_argument("--kv-cache-fraction", type=float, default=0.8, help="of free memory, when --kv-tokens 0")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    add_attention_arg(ap)
    ap.add_argument("--json", default="bench/out/tppo_vs_ppo_rollout.json")


def add_bound_args(ap: argparse.ArgumentParser) -> None:
    add_stream_args(ap)
    ap.add_argument("--gpu", default="h200", choices=sorted(GPU_PRESETS), help="the roofline's GPU preset")
    ap.add_argument("--model", default="moe16", choices=sorted(BOUND_MODELS))
    ap.add_argument(
        "--variants", type=variant_list, default=list(BOUND_VARIANTS), help=", ".join(BOUND_VARIANTS)
    )
    ap.add_argument(
        "--measured",
        help="a rollout-part JSON: replay its runs at its GPU's roofline (its stream settings win) and report "
        "the engine's efficiency",
    )
    ap.add_argument("--json", default="bench/out/tppo_vs_ppo_bound.json")
    # The model is cheap: more PPO steps than the GPU run affords, for a stable mean.
    ap.set_defaults(ppo_steps=20, max_tppo_steps=400, quiet=True)


def add_e2e_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--experiment", default="default", help="the recipe's experiment (configs/experiment)")
    ap.add_argument("--algos", type=lambda t: t.split(","), default=["tppo", "ppo", "tppo_wmax"])
    ap.add_argument("--seeds", type=int_list, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100, help="RL steps per run")
    ap.add_argument("--window", type=int, default=16, help="W of the tppo run")
    ap.add_argument("--max-length", type=int, default=64, help="L_max of every run")
    ap.add_argument("--threshold", type=float, default=-0.2, help="reward whose wall clock is reported")
    ap.add_argument("--smooth", type=int, default=10, help="steps of the trailing mean of the reward")
    ap.add_argument("--overrides", nargs="*", default=[], help="more recipe overrides for every run")
    ap.add_argument(
        "--shared-warm-start",
        action="store_true",
        help="warm-start the policy once per seed (a run of no RL step) and start every algorithm's run of that "
        "seed from its export, critic trunk included, instead of a warm start in each run",
    )
    ap.add_argument(
        "--warm-start-jobs",
        type=int,
        default=1,
        help="shared warm starts run side by side (they are not timed; the RL runs always run one at a time)",
    )
    ap.add_argument(
        "--warm-starts-only",
        action="store_true",
        help="with --shared-warm-start: run the seeds' warm starts and stop (the timed runs may follow in a "
        "later call of a time-limited machine)",
    )
    ap.add_argument("--run-root", default="runs/tppo_vs_ppo")
    ap.add_argument("--plots", default="bench/out/tppo_vs_ppo")
    ap.add_argument("--json", default="bench/out/tppo_vs_ppo_e2e.json")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    rollout_ap = sub.add_parser("rollout", help="the engine alone: synchronous PPO vs T-PPO windows")
    rollout_ap.add_argument("--tiny", action="store_true", help="toy model on the CPU, few steps")
    add_rollout_args(rollout_ap)
    bound_ap = sub.add_parser(
        "bound", help="the rollout part's schedules costed at a GPU's roofline (no engine)"
    )
    add_bound_args(bound_ap)
    e2e_ap = sub.add_parser("e2e", help="the training loop: T-PPO vs synchronous PPO vs T-PPO with W = L_max")
    e2e_ap.add_argument("--tiny", action="store_true", help="one seed, a few steps (CPU smoke run)")
    add_e2e_args(e2e_ap)
    argv = sys.argv[1:] if argv is None else argv
    if getattr(
        ap.parse_known_args(argv)[0], "tiny", False
    ):  # toy defaults; flags given on the command line still win
        rollout_ap.set_defaults(**TINY_ROLLOUT)
        e2e_ap.set_defaults(**TINY_E2E)
    args = ap.parse_args(argv)
    parts = {"rollout": rollout_part, "bound": bound_part, "e2e": e2e_part}
    parts[args.part](args)


if __name__ == "__main__":
    main()
