"""python -m rollout.plan: the deployment planner's command line (see rollout/plan/__init__.py).

python -m rollout.plan --model qwen3-30b-a3b --gpus 8 --gpu h100 --prompt-len 1024 --output-len 8192
python -m rollout.plan --profile bench/out/rollout_disagg_profile.json --gpus 8 --latency-ms 60 --json plan.json
python -m rollout.plan --profile prof.json --validate prof.json
python -m rollout.plan --arch shared --model minimax-m2 --gpu h800 --gpus 8 --tpot-ms 50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from rollout.model_spec import MoeModelSpec
from rollout.plan.hardware import (
    GB,
    GPU_PRESETS,
    MODEL_PRESETS,
    GpuSpec,
    ModelShape,
    gpu_preset,
    model_preset,
    shape_from_spec,
)
from rollout.plan.profile import (
    EXPERT_FORMS,
    PHASES,
    LayerTimes,
    Profile,
    analytic_times,
    fitted_times,
    load_profile,
)
from rollout.plan.report import (
    check_row,
    format_checks,
    format_plan,
    format_table,
    plan_row,
    predict_replica_step,
    search_meta,
    validate,
)
from rollout.plan.search import DISPATCH_MODES, Cluster, Search, Workload, search_plans
from rollout.plan.shared import (
    build_kernels,
    drift_goodputs,
    format_drift,
    format_shared,
    make_ctx,
    plan_shared,
    predict_step_ms,
    shared_rows,
)

WIDTHS = ("hidden_size", "num_experts", "top_k", "moe_ffn", "num_heads", "num_kv_heads", "head_dim")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollout.plan", description="MoE rollout deployment planner")
    p.add_argument(
        "--arch",
        choices=("decode", "shared"),
        default="decode",
        help="decode: MegaScale-Infer replicas vs disaggregated (#30); shared: ExpertPlex (#29)",
    )
    p.add_argument(
        "--model",
        help=f"HF checkpoint folder or preset {sorted(MODEL_PRESETS)} "
        "(default: the profile's model, else qwen3-30b-a3b)",
    )
    p.add_argument("--gpus", type=int, default=8, help="GPUs to plan for")
    p.add_argument("--gpu", default="h100", help=f"GPU preset {sorted(GPU_PRESETS)}")
    p.add_argument("--gpu-memory-gb", type=float, help="override the preset's memory")
    p.add_argument("--mem-util", type=float, default=0.9, help="usable fraction of GPU memory")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=4096)
    p.add_argument("--latency-ms", type=float, help="per-token (decode step) latency target")
    p.add_argument("--nvlink-gbps", type=float, help="intra-node GB/s per GPU (default: the preset's)")
    p.add_argument("--nic-gbps", type=float, default=50.0, help="inter-node GB/s per GPU")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--link-latency-us", type=float, default=10.0, help="fixed cost of one message")
    p.add_argument(
        "--dispatch",
        choices=DISPATCH_MODES,
        default="routed",
        help="routed: a token only to the expert workers holding its experts (rollout/disagg.py); all: to every one",
    )
    p.add_argument(
        "--profile", help="rollout-profile/4 (or /3, /2, /1) JSON (bench/rollout_disagg.py --profile)"
    )
    p.add_argument("--expert-fit", choices=EXPERT_FORMS, default="touched", help="form of the T_e fit")
    p.add_argument("--layout", choices=("auto", "replicas", "disaggregated"), default="auto")
    p.add_argument("--micro-batches", default="3,4", help="m values to try, within 1..4")
    p.add_argument(
        "--exhaustive-na",
        action="store_true",
        help="try every attention-worker count, not only Algorithm 1's n_a = k1 E / (k3 K)",
    )
    p.add_argument("--top", type=int, default=8, help="alternatives to print")
    p.add_argument("--json", help="write the result here")
    p.add_argument(
        "--validate",
        metavar="MEASURED",
        help="compare its 'steps' with --arch's model (decode: decode steps; shared: decode and prefill) and exit",
    )
    p.add_argument("--tpot-ms", type=float, default=50.0, help="--arch shared: decode time-per-token SLO")
    p.add_argument("--prefill-tokens", type=int, default=16384, help="--arch shared: tokens per prefill pass")
    p.add_argument("--drift", help="--arch shared: prompt:output pairs to evaluate the chosen pools under")
    return p


def resolve_model(name: str | None, profile: Profile | None) -> ModelShape:
    if name is None:
        return profile.model if profile else model_preset("qwen3-30b-a3b")
    if Path(name).is_dir():
        shape = shape_from_spec(Path(name).name, MoeModelSpec.from_pretrained(name))
    else:
        shape = model_preset(name)
    if profile is not None:
        diff = [k for k in WIDTHS if getattr(shape, k) != getattr(profile.model, k)]
        if diff:
            raise ValueError(f"--model {name} and profile {profile.source} differ in {diff}")
        shape = replace(
            shape,
            weight_bytes=profile.model.weight_bytes,
            kv_bytes=profile.model.kv_bytes,
            act_bytes=profile.model.act_bytes,
        )
    return shape


def resolve_gpu(args: argparse.Namespace) -> GpuSpec:
    gpu = gpu_preset(args.gpu)
    if args.gpu_memory_gb:
        gpu = replace(gpu, memory_bytes=args.gpu_memory_gb * GB)
    return gpu


def micro_choices(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError as err:
        raise ValueError(f"--micro-batches {text!r}: expected integers like 3,4") from err
    if not values or any(not 1 <= v <= 4 for v in values):
        raise ValueError(f"--micro-batches {text!r}: values must lie in 1..4")
    return values


def build(args: argparse.Namespace) -> tuple[Search, Profile | None]:
    profile = load_profile(args.profile) if args.profile else None
    model, gpu = resolve_model(args.model, profile), resolve_gpu(args)
    times: LayerTimes = fitted_times(profile, gpu, args.expert_fit) if profile else analytic_times(model, gpu)
    if args.gpus < 1 or args.prompt_len < 1 or args.output_len < 0:
        raise ValueError("--gpus and --prompt-len must be >= 1, --output-len >= 0")
    cluster = Cluster(
        args.gpus,
        gpu,
        args.gpus_per_node,
        args.nvlink_gbps,
        args.nic_gbps,
        args.link_latency_us,
        args.mem_util,
        args.dispatch,
    )
    return Search(model, times, Workload(args.prompt_len, args.output_len, args.latency_ms), cluster), profile


def print_times(times: LayerTimes) -> None:
    print(f"times: {times.source}")
    if times.note:
        print(f"note: {times.note}")


def run_validate(args: argparse.Namespace, s: Search, profile: Profile | None) -> dict[str, Any]:
    """The measured steps of --validate against the model of --arch, fitted to --profile, else to the measured
    file's own layer rows (else the roofline)."""
    measured = load_profile(args.validate)
    own = profile is None and bool(measured.attention and measured.experts)
    if args.arch == "shared":
        kernels = build_kernels(s, measured if own else profile)
        checks = validate(measured.steps, partial(predict_step_ms, kernels, s.model), PHASES)
        source, note = kernels.source, None
    else:
        times = fitted_times(measured, s.cluster.gpu, args.expert_fit) if own else s.times
        checks = validate(measured.steps, partial(predict_replica_step, times, s.model))
        source, note = times.source, times.note
    print(f"times: {source}" + (f"\nnote: {note}" if note else ""))
    print(format_checks(checks))
    return {
        "validate": str(args.validate),
        "times": source,
        "note": note,
        "rows": [check_row(c) for c in checks],
    }


def run_decode(args: argparse.Namespace, s: Search) -> dict[str, Any]:
    layouts = ("replicas", "disaggregated") if args.layout == "auto" else (args.layout,)
    plans = search_plans(s, layouts, micro_choices(args.micro_batches), args.exhaustive_na)
    w = s.workload
    print(
        f"model: {s.model.name}; {s.cluster.num_gpus} x {s.cluster.gpu.name}; context {w.prompt_len}+"
        f"{w.output_len}; latency target {w.latency_ms if w.latency_ms is not None else 'none'} ms"
    )
    print_times(s.times)
    print()
    print(format_plan(plans[0]))
    print(f"\ntop {min(args.top, len(plans))} of {len(plans)} structures (best batch of each):")
    print(format_table(plans, args.top))
    return {
        **search_meta(s),
        "plan": plan_row(plans[0]),
        "alternatives": [plan_row(p) for p in plans[1 : args.top]],
    }


def drift_pairs(text: str | None) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(v) for v in item.split(":")) for item in (text or "").split(",") if item.strip()]
    except ValueError as err:
        raise ValueError(f"--drift {text!r}: expected prompt:output pairs like 4000:200,200:4000") from err
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise ValueError(f"--drift {text!r}: expected prompt:output pairs of positive integers")
    return [(p[0], p[1]) for p in pairs]


def run_shared(args: argparse.Namespace, s: Search, profile: Profile | None) -> dict[str, Any]:
    pairs = drift_pairs(args.drift)
    result = plan_shared(s, args.tpot_ms, args.prefill_tokens, profile)
    print(format_shared(result))
    out = {**search_meta(s), **shared_rows(result)}
    if pairs:
        table = drift_goodputs(
            make_ctx(s, result.kernels, args.tpot_ms, args.prefill_tokens), result.best, pairs
        )
        print(format_drift(pairs, table))
        out["drift"] = {"demands": pairs, "goodput": table}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        s, profile = build(args)
        if args.validate:
            out = run_validate(args, s, profile)
        elif args.arch == "shared":
            out = run_shared(args, s, profile)
        else:
            out = run_decode(args, s)
    except (ValueError, KeyError, OSError) as err:
        if os.environ.get("PLAN_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
