"""The training backends side by side: the critic update of the benchmark model shape on Megatron-Core and on
DeepSpeed ZeRO, and a reference policy on ZeRO-3 with its parameters offloaded to host memory.

    python bench/train_backends.py [--layers 8] [--json bench/out/train_backends.json]   # GPU
    python bench/train_backends.py --tiny                                                  # CPU smoke run

Variants, each in its own process (one model at a time on the GPU):
- megatron:              MegatronEngine(role="critic"), Megatron's distributed optimizer (the default backend);
- deepspeed_z2 / _z3:    DeepSpeedEngine(role="critic") under ZeRO-2 / ZeRO-3, torch's AdamW;
- deepspeed_z2_offload:  ZeRO-2 with the optimizer state (and its step) in host memory;
- reference_offload:     DeepSpeedEngine(role="policy", optimizer="none") under ZeRO-3 with offload_param: GPU
                         memory before the engine, after it is built and after each forward (the reference's
                         "between calls"), against the model's parameter bytes, and the parameters whose data is on
                         the GPU between calls (ZeRO-3 leaves a partitioned parameter an empty placeholder).

A critic step is `--microbatches` sequences of `--seq` tokens, forward + backward with the algorithm layer's value
loss (tppo.algo.objectives.ValueObjective: clipped, per-sample token mean over finished samples, every token
finished here with returns +-1), then one optimizer step: the same loss callable runs on both engines. The model
is bench/megatron_train.py's shape (Qwen3-30B-A3B widths, 64 experts top-8, vocab 32768) with `--layers` layers
(8 by default, so that Megatron's fp32 main weights, gradients and Adam state fit an 80 GB card next to the
activations); the engines start from their own random weights of that shape, or with `--same-init` from one
transformers checkpoint of it (the losses then compare step by step). Steps are timed with CUDA events
after `--warmup` steps (perf_counter on CPU); the median is reported with the peak memory over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_train import (
    TINY,
    Shape,
    _Timer,
    child_result,
    model_config,
    run_variants,
    shape_line,
)

VARIANTS = ("megatron", "deepspeed_z2", "reference_offload", "deepspeed_z3", "deepspeed_z2_offload")
GIB = 2**30


def critic_batches(s: Shape, microbatches: int, seed: int = 0):
    """`microbatches` sequences of s.seq tokens, every token a finished response's with return +-1."""
    import torch

    from tppo.algo.batching import CriticTargets
    from tppo.engine.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(microbatches):
        ids_BT = torch.randint(0, s.vocab, (1, s.seq), generator=g)
        ret = float(torch.randint(0, 2, (1,), generator=g)) * 2 - 1
        targets = CriticTargets(
            mask_BT=torch.ones(1, s.seq),
            returns_BT=torch.full((1, s.seq), ret),
            old_values_BT=torch.zeros(1, s.seq),
        )
        batches.append(TrainBatch(input_ids_BT=ids_BT, payload=targets))
    return batches


def save_init(s: Shape, dtype: str, path: str) -> str:
    """One random transformers checkpoint of the shape (`--same-init`): both backends load it, so their losses
    compare step by step (the value heads still start from each engine's own N(0, init_std) draw)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tppo.engine.convert import hf_config_dict

    cfg = model_config(s, dtype)
    config = AutoConfig.for_model(**hf_config_dict(cfg), initializer_range=cfg.init_std)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(path)
    return path


def build_engine(variant: str, s: Shape, dtype: str, hf_path: str | None = None):
    from tppo.engine.config import BackendConfig, OptimConfig, ParallelConfig

    optim = OptimConfig(lr=1e-5, grad_clip=1.0)
    cfg = replace(model_config(s, dtype), hf_path=hf_path)
    if variant == "megatron":
        from tppo.engine.engine import MegatronEngine

        return MegatronEngine(cfg, ParallelConfig(), optim, role="critic")
    from tppo.engine.deepspeed_engine import DeepSpeedEngine

    if variant == "reference_offload":
        zero = BackendConfig("deepspeed", zero_stage=3, offload_param=True)
        return DeepSpeedEngine(cfg, optim, role="policy", zero=zero, optimizer="none")
    zero = BackendConfig(
        "deepspeed",
        zero_stage=3 if variant == "deepspeed_z3" else 2,
        offload_optimizer=variant.endswith("offload"),
    )
    return DeepSpeedEngine(cfg, optim, role="critic", zero=zero)


def _dtype() -> str:
    """bf16 on a GPU; fp32 on the CPU (the engines train in fp32 there)."""
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def _memory(cuda: bool) -> float | None:
    import torch

    return torch.cuda.memory_allocated() / GIB if cuda else None


def run_critic(variant: str, s: Shape, args) -> dict:
    """Build one critic engine, warm up, time `args.steps` critic updates."""
    import torch

    from tppo.algo.objectives import ValueObjective

    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    engine = build_engine(variant, s, _dtype(), args.hf_path)
    build_s = time.perf_counter() - t0
    batches = critic_batches(s, args.microbatches)
    loss_fn = ValueObjective(num_samples=len(batches))
    timer = _Timer(cuda)
    step_ms, fb_ms, opt_ms, losses = [], [], [], []
    for i in range(args.warmup + args.steps):
        if cuda and i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        a = timer.mark()
        loss, _ = engine.forward_backward(batches, loss_fn)
        b = timer.mark()
        result = engine.optimizer_step()
        c = timer.mark()
        if result.skipped:
            raise RuntimeError(f"{variant}: non-finite gradients (grad norm {result.grad_norm})")
        losses.append(loss)
        if i >= args.warmup:
            fb_ms.append(timer.ms(a, b))
            opt_ms.append(timer.ms(b, c))
            step_ms.append(timer.ms(a, c))
    med = statistics.median(step_ms)
    out = dict(
        variant=variant,
        microbatches=len(batches),
        seq=s.seq,
        steps=args.steps,
        step_ms=med,
        step_ms_all=step_ms,
        fwd_bwd_ms=statistics.median(fb_ms),
        optimizer_ms=statistics.median(opt_ms),
        tokens_per_s=len(batches) * s.seq / (med / 1e3),
        build_s=build_s,
        losses=losses,
    )
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["resident_gib"] = _memory(cuda)
        out["device"] = torch.cuda.get_device_name()
    return out


def _params_on_gpu(module) -> int:
    """Parameters whose data is on the GPU and not empty (ZeRO-3 leaves a partitioned one an empty placeholder)."""
    return sum(p.data.is_cuda and p.data.numel() > 0 for p in module.parameters())


def run_reference(s: Shape, args) -> dict:
    """GPU memory around the offloaded reference's life: built, then between forward calls."""
    import torch

    cuda = torch.cuda.is_available()
    torch.zeros(1, device="cuda" if cuda else "cpu")  # the CUDA context before the baseline
    before = _memory(cuda)
    t0 = time.perf_counter()
    engine = build_engine("reference_offload", s, _dtype(), args.hf_path)
    build_s = time.perf_counter() - t0
    param_bytes = sum(
        getattr(p, "ds_numel", p.numel()) * p.element_size() for p in engine.module.parameters()
    )
    after_build = _memory(cuda)
    batches = critic_batches(s, 1)
    timer = _Timer(cuda)
    between, forward_ms, on_gpu = [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup + args.steps):
        a = timer.mark()
        engine.forward(batches)
        forward_ms.append(timer.ms(a, timer.mark()))
        between.append(_memory(cuda))
        on_gpu.append(_params_on_gpu(engine.module))
    out = dict(
        variant="reference_offload",
        seq=s.seq,
        build_s=build_s,
        param_gib=param_bytes / GIB,
        num_params=len(list(engine.module.parameters())),
        params_on_gpu_between_calls=max(on_gpu),
        forward_ms=statistics.median(forward_ms[args.warmup :]),
        tokens_per_s=s.seq / (statistics.median(forward_ms[args.warmup :]) / 1e3),
    )
    if cuda:
        out.update(
            gpu_gib_before=before,
            gpu_gib_after_build=after_build,
            gpu_gib_between_calls=max(between),
            held_between_calls_gib=max(between) - before,
            peak_mem_gib=torch.cuda.max_memory_allocated() / GIB,
            device=torch.cuda.get_device_name(),
        )
    return out


def shape_of(args) -> Shape:
    base = TINY if args.tiny else Shape(num_layers=args.layers)
    return replace(base, seq=args.seq or base.seq)


def _child(args) -> None:
    s = shape_of(args)
    result = (
        run_reference(s, args) if args.variant == "reference_offload" else run_critic(args.variant, s, args)
    )
    with open(args.child_json, "w") as f:
        json.dump(result, f)


def _run_child(variant: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{variant}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--child-json", out]
    cmd += [
        "--microbatches",
        str(args.microbatches),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    cmd += ["--layers", str(args.layers), "--seq", str(args.seq)] + (["--tiny"] if args.tiny else [])
    cmd += ["--hf-path", args.hf_path] if args.hf_path else []
    return child_result(variant, cmd, out, args.timeout)


def _fmt(value, spec: str, width: int = 0) -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


def table(results: list[dict], s: Shape) -> str:
    lines = [
        shape_line(s),
        f"{'critic backend':<22}{'mb':>4}{'step ms':>10}{'fwd+bwd':>10}{'optim':>9}{'tok/s':>9}{'peak GiB':>10}"
        f"{'held GiB':>10}",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:<22} FAILED: {r['error']}")
        elif r["variant"] != "reference_offload":
            lines.append(
                f"{r['variant']:<22}{r['microbatches']:>4}{r['step_ms']:>10.1f}{r['fwd_bwd_ms']:>10.1f}"
                f"{r['optimizer_ms']:>9.1f}{r['tokens_per_s']:>9.0f}{_fmt(r.get('peak_mem_gib'), '.1f', 10)}"
                f"{_fmt(r.get('resident_gib'), '.1f', 10)}"
            )
    for r in results:
        if r.get("losses"):  # every update's value loss, warm-up included: the backends compare step by step
            lines.append(
                f"{r['variant']} value loss per update: {', '.join(f'{v:.4f}' for v in r['losses'])}"
            )
    for r in results:
        if r["variant"] == "reference_offload" and "error" not in r:
            lines.append(
                f"reference on ZeRO-3, parameters offloaded: {r['param_gib']:.2f} GiB of parameters; GPU memory "
                f"before {_fmt(r.get('gpu_gib_before'), '.3f')} GiB, built {_fmt(r.get('gpu_gib_after_build'), '.3f')}"
                f", between calls {_fmt(r.get('gpu_gib_between_calls'), '.3f')} (held "
                f"{_fmt(r.get('held_between_calls_gib'), '.3f')}), peak in a forward "
                f"{_fmt(r.get('peak_mem_gib'), '.2f')}; parameters with data on the GPU between calls: "
                f"{r['params_on_gpu_between_calls']} of {r['num_params']}; forward {r['forward_ms']:.0f} ms "
                f"({r['tokens_per_s']:.0f} tok/s)"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the benchmark shape")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (0: the shape's, 4096)")
    p.add_argument("--microbatches", type=int, default=4, help="sequences per critic update")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    p.add_argument("--json", default="bench/out/train_backends.json")
    p.add_argument(
        "--same-init",
        action="store_true",
        help="every variant loads one random transformers checkpoint of the shape (step-by-step loss comparison)",
    )
    p.add_argument("--hf-path", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--child-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        _child(args)
        return
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    s = shape_of(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with tempfile.TemporaryDirectory() as init_dir:
        if args.same_init:
            args.hf_path = save_init(s, _dtype(), init_dir)
        results = run_variants(
            args.variants.split(","), lambda v, tmp: _run_child(v, args, tmp), args.json, {"shape": asdict(s)}
        )
    print(table(results, s))


if __name__ == "__main__":
    main()
