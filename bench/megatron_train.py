"""Training throughput of the Megatron-Core MoE engine: forward + backward + optimizer step, tokens/s and MFU.

    python bench/megatron_train.py [--json bench/out/megatron_train.json]      # GPU: the full run
    python bench/megatron_train.py --tiny                                      # CPU smoke run, tiny model

Each variant runs in its own process (one model of ~5 B parameters at a time on the GPU):
- grouped:            grouped-GEMM experts (torch._grouped_mm), no activation recompute;
- grouped_recompute:  the same with full-layer activation recompute (peak memory comparison);
- sequential:         Megatron's SequentialMLP experts (a loop over experts), no recompute; one micro-batch
                      per step and at most 2 timed steps (it is slow);
- checks:             a small bf16 model: state_dict round trip, offload/onload, packed forward (GPU paths
                      the CPU tests cannot reach);
- parts:              micro-benchmarks at the model's shapes: attention kernels (flash / cuDNN / efficient,
                      GQA by repeat or native), RMSNorm, the grouped-GEMM experts.
`--profile` adds to the grouped variant one step under torch.profiler (top kernels, GPU busy vs wall time,
host syncs by Python line; trace.json.gz and ops.txt under --out-dir) and A/B timings on the same weights
(Megatron's token permutation vs tppo.engine.dispatch, fused vs multi-tensor Adam).

MFU = model FLOPs / (step time x peak), with model FLOPs per token = 6 x (active matmul parameters:
attention projections, the top-k experts' SwiGLU, router, LM head) + 6 x L x heads x head_dim x S
(causal attention, forward + backward) and peak = 790 TFLOP/s (bf16, measured on this H200). Steps are
timed with CUDA events after warm-up; the median over steps is reported. A step is `--microbatches`
micro-batches of one `--seq` sequence each, then one optimizer step (the optimizer is counted in the
step time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

PEAK_TFLOPS = 790.0


@dataclass
class Shape:
    num_layers: int = 16
    hidden: int = 2048
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 64
    topk: int = 8
    expert_ffn: int = 768
    vocab: int = 32768
    seq: int = 4096


TINY = Shape(
    num_layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    experts=8,
    topk=2,
    expert_ffn=32,
    vocab=128,
    seq=64,
)


def flops_per_token(s: Shape) -> float:
    """6 x active matmul parameters + causal attention (forward + backward) per token."""
    attn_proj = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    experts = s.topk * 3 * s.hidden * s.expert_ffn
    router = s.hidden * s.experts
    active = s.num_layers * (attn_proj + experts + router) + s.hidden * s.vocab
    attention = 6 * s.num_layers * s.heads * s.head_dim * s.seq  # 12 L h d S x 1/2 (causal)
    return 6.0 * active + attention


def param_counts(s: Shape) -> tuple[float, float]:
    attn_proj = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    total = s.num_layers * (attn_proj + s.experts * 3 * s.hidden * s.expert_ffn + s.hidden * s.experts)
    active = s.num_layers * (attn_proj + s.topk * 3 * s.hidden * s.expert_ffn + s.hidden * s.experts)
    return total + 2 * s.vocab * s.hidden, active + s.vocab * s.hidden


def model_config(s: Shape, dtype: str):
    from tppo.engine.config import ModelConfig

    return ModelConfig(
        arch="qwen3_moe",
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        num_layers=s.num_layers,
        num_attention_heads=s.heads,
        num_query_groups=s.kv_heads,
        head_dim=s.head_dim,
        ffn_hidden_size=4 * s.hidden,
        moe_ffn_hidden_size=s.expert_ffn,
        num_experts=s.experts,
        moe_topk=s.topk,
        max_position_embeddings=max(s.seq, 2048),
        rope_theta=1e6,
        dtype=dtype,
        init_std=0.02,
    )


class _Timer:
    """CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.cuda = cuda
        self.torch = torch

    def mark(self):
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def _nll(out, batch):
    from tppo.engine.batch import LossOutput

    lp = out.logprobs_BT
    return LossOutput(loss_sum=-lp[:, 1:].sum(), denominator=lp[:, 1:].numel())


def run_variant(variant: str, s: Shape, args) -> dict:
    """One variant in this process: build, warm up, time `args.steps` optimizer steps."""
    import torch

    from tppo.engine.batch import TrainBatch
    from tppo.engine.config import OptimConfig, ParallelConfig
    from tppo.engine.engine import MegatronEngine

    cuda = torch.cuda.is_available()
    experts = "sequential" if variant.startswith("sequential") else "grouped"
    recompute = variant.endswith("recompute")
    micro = 1 if experts == "sequential" else args.microbatches
    steps = min(args.steps, 2) if experts == "sequential" else args.steps
    t0 = time.perf_counter()
    engine = MegatronEngine(
        model_config(s, "bfloat16" if cuda else "float32"),
        ParallelConfig(recompute=recompute),
        OptimConfig(lr=1e-5, grad_clip=1.0),
        experts=experts,
    )
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    batches = [
        TrainBatch(input_ids_BT=torch.randint(0, s.vocab, (1, s.seq), generator=g)) for _ in range(micro)
    ]
    timer = _Timer(cuda)
    step_ms, fb_ms, opt_ms, losses = [], [], [], []
    for i in range(args.warmup + steps):
        if cuda and i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        a = timer.mark()
        loss, _ = engine.forward_backward(batches, _nll)
        b = timer.mark()
        result = engine.optimizer_step()
        c = timer.mark()
        losses.append(loss)
        if i >= args.warmup:
            fb_ms.append(timer.ms(a, b))
            opt_ms.append(timer.ms(b, c))
            step_ms.append(timer.ms(a, c))
        assert not result.skipped, "non-finite gradients in the benchmark"
    tokens = micro * s.seq
    med = statistics.median(step_ms)
    tflops = flops_per_token(s) * tokens / (med / 1e3) / 1e12
    out = dict(
        variant=variant,
        experts=experts,
        recompute=recompute,
        microbatches=micro,
        seq=s.seq,
        steps=steps,
        step_ms=med,
        step_ms_all=step_ms,
        fwd_bwd_ms=statistics.median(fb_ms),
        optimizer_ms=statistics.median(opt_ms),
        tokens_per_s=tokens / (med / 1e3),
        tflops=tflops,
        mfu=tflops / PEAK_TFLOPS if cuda else None,
        build_s=build_s,
        losses=losses,
    )
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["device"] = torch.cuda.get_device_name()
    # Extras below must never cost the main numbers above.
    try:
        fwd_only = []
        for _ in range(3):  # inference forward of one micro-batch (old log-probs): no grad, no recompute
            a = timer.mark()
            engine.forward(batches[:1])
            fwd_only.append(timer.ms(a, timer.mark()))
        out["forward_only_ms"] = statistics.median(fwd_only)
        if cuda:
            from tppo.engine import experts as experts_mod

            out["grouped_mm_column_major"] = experts_mod._COLUMN_MAJOR_OK["cuda"]
    except Exception as exc:  # report it beside the numbers
        out["extras_error"] = f"{type(exc).__name__}: {exc}"[:500]
    if args.profile and experts == "grouped" and not recompute:
        try:
            out["profile"] = profile_engine(engine, batches[: args.profile_microbatches], args)
        except Exception as exc:
            out["profile_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return out


def run_checks(args) -> dict:
    """GPU paths the CPU tests cannot reach, on a small bf16 model: each check reports ok or its error."""
    import torch

    from tppo.engine.batch import TrainBatch
    from tppo.engine.config import OptimConfig, ParallelConfig
    from tppo.engine.engine import MegatronEngine

    s = Shape(
        num_layers=2,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        experts=8,
        topk=2,
        expert_ffn=128,
        vocab=512,
        seq=256,
    )
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    make = lambda: MegatronEngine(model_config(s, dtype), ParallelConfig(), OptimConfig(lr=1e-3))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    batch = TrainBatch(input_ids_BT=torch.randint(0, s.vocab, (2, s.seq), generator=g))
    results = {}

    def check(name, fn):
        try:
            results[name] = {"ok": True, **(fn() or {})}
        except Exception as exc:  # report, keep going: one call must return every finding
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}

    def state_round_trip():
        torch.manual_seed(0)
        a = make()
        a.train_step([batch], _nll)
        sd = a.state_dict()
        a.train_step([batch], _nll)
        torch.manual_seed(0)
        b = make()
        b.load_state_dict(sd)
        b.train_step([batch], _nll)
        diff = max((p - q).abs().max().item() for p, q in zip(a.module.parameters(), b.module.parameters()))
        assert diff == 0.0, f"resumed weights differ by {diff}"
        return {"max_diff": diff}

    def offload_round_trip():
        torch.manual_seed(0)
        e = make()
        e.train_step([batch], _nll)
        before = [p.detach().clone() for p in e.module.parameters()]
        mem0 = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        e.offload()
        mem1 = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        e.onload()
        same = all(torch.equal(x, p) for x, p in zip(before, e.module.parameters()))
        assert same, "weights changed across offload/onload"
        r = e.train_step([batch], _nll)
        assert not r.skipped
        return {"released_mib": (mem0 - mem1) / 2**20}

    def packed_equals_padded():
        torch.manual_seed(0)
        e = make()
        ids = batch.input_ids_BT
        pad = e.forward([batch])[0].logprobs_BT
        packed = e.forward(
            [TrainBatch(input_ids_BT=ids.reshape(1, -1), cu_seqlens=torch.tensor([0, s.seq, 2 * s.seq]))]
        )
        diff = (packed[0].logprobs_BT.view(2, -1) - pad).abs().max().item()
        assert diff < 0.05, f"packed vs padded log-probs differ by {diff}"
        return {"max_diff": diff}

    def replay_identical():
        torch.manual_seed(0)
        e = make()
        rec = e.forward([batch], record_routing=True)[0]
        again = e.forward(
            [TrainBatch(input_ids_BT=batch.input_ids_BT, routed_experts_BTLK=rec.routed_experts_BTLK)]
        )
        assert torch.equal(again[0].logprobs_BT, rec.logprobs_BT)

    for name, fn in (
        ("state_dict_round_trip", state_round_trip),
        ("offload_onload", offload_round_trip),
        ("packed_equals_padded", packed_equals_padded),
        ("replay_identical", replay_identical),
    ):
        check(name, fn)
    return {"variant": "checks", "checks": results}


def _cuda_ms(fn, cuda: bool, repeats: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, perf_counter on CPU)."""
    import torch

    timer = _Timer(cuda)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a = timer.mark()
        fn()
        times.append(timer.ms(a, timer.mark()))
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(times)


def count_host_syncs(fn) -> dict:
    """Run fn() with CUDA's sync debug mode on: the number of host syncs and the Python lines that caused them."""
    import collections
    import warnings

    import torch

    if not torch.cuda.is_available():
        fn()
        return {}
    where = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
    return {"total": sum(where.values()), "top": where.most_common(12)}


def trace_summary(path: str, ranges=("fwd_bwd", "optimizer")) -> dict:
    """Kernel time by name, GPU busy vs idle per annotated range, and host-side sync calls, from a chrome trace."""
    import collections

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_name[e["name"]][0] += e["dur"] / 1e3
        by_name[e["name"]][1] += 1
    out = {
        "kernel_ms_total": sum(v[0] for v in by_name.values()),
        "num_kernels": len(kernels),
        "top_kernels": sorted(
            ([k[:110], round(v[0], 3), v[1]] for k, v in by_name.items()), key=lambda r: -r[1]
        )[:30],
    }
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and e.get("name") in ranges:
            lo, hi = e["ts"], e["ts"] + e["dur"]
            busy, cur_end = 0.0, lo
            for a, b in spans:
                a, b = max(a, cur_end), min(b, hi)
                if b > a:
                    busy += b - a
                    cur_end = b
            out[e["name"]] = {"wall_ms": (hi - lo) / 1e3, "gpu_busy_ms": busy / 1e3}
    runtime = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "cuda_runtime" and ("ynchronize" in name or "Memcpy" in name):
            runtime[name][0] += e["dur"] / 1e3
            runtime[name][1] += 1
    out["runtime_sync_calls"] = {k: [round(v[0], 3), v[1]] for k, v in runtime.items()}
    return out


def _swap_dispatchers(engine, sorted_permute: bool) -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from tppo.engine.dispatch import SortedAlltoAllDispatcher

    cls = SortedAlltoAllDispatcher if sorted_permute else MoEAlltoAllTokenDispatcher
    for layer in engine.moe_layers:
        old = layer.token_dispatcher
        layer.token_dispatcher = cls(
            old.num_local_experts, old.local_expert_indices, config=old.config, pg_collection=layer_pgs(layer)
        )


def layer_pgs(layer):
    from megatron.core.process_groups_config import ProcessGroupCollection

    d = layer.token_dispatcher
    return ProcessGroupCollection(ep=d.ep_group, expt_tp=d.tp_group, tp_ep=d.tp_ep_group)


def run_profile(s: Shape, args) -> dict:
    """Build the grouped-GEMM engine and profile it (`profile_engine`)."""
    import torch

    from tppo.engine.batch import TrainBatch
    from tppo.engine.config import OptimConfig, ParallelConfig
    from tppo.engine.engine import MegatronEngine

    cuda = torch.cuda.is_available()
    engine = MegatronEngine(
        model_config(s, "bfloat16" if cuda else "float32"),
        ParallelConfig(),
        OptimConfig(lr=1e-5, grad_clip=1.0),
    )
    g = torch.Generator().manual_seed(0)
    batches = [
        TrainBatch(input_ids_BT=torch.randint(0, s.vocab, (1, s.seq), generator=g))
        for _ in range(args.profile_microbatches)
    ]
    for _ in range(2):
        engine.train_step(batches, _nll)
    return {"variant": "profile", **profile_engine(engine, batches, args)}


def profile_engine(engine, batches, args) -> dict:
    """One training step of `batches` under torch.profiler (kernel table, GPU busy vs wall, host syncs), then
    A/B timings on the same weights: Megatron's token permutation against ours, fused against multi-tensor
    Adam. The engine must be warm. Writes trace.json.gz and ops.txt under args.out_dir."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.cuda.is_available()
    out: dict = {"profile_microbatches": len(batches)}
    fwd_bwd = lambda: engine.forward_backward(batches, _nll)  # noqa: E731
    out["host_syncs_fwd_bwd"] = count_host_syncs(fwd_bwd)
    out["host_syncs_optimizer"] = count_host_syncs(engine.optimizer_step)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        with record_function("fwd_bwd"):
            fwd_bwd()
        with record_function("optimizer"):
            engine.optimizer_step()
        if cuda:
            torch.cuda.synchronize()
    os.makedirs(args.out_dir, exist_ok=True)
    trace = os.path.join(args.out_dir, "trace.json")
    prof.export_chrome_trace(trace)
    out["trace"] = trace_summary(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    with open(os.path.join(args.out_dir, "ops.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
    ab = {}
    for name, fast in (("permute_megatron", False), ("permute_sorted", True)):
        _swap_dispatchers(engine, fast)
        ab[f"fwd_bwd_ms_{name}"] = _cuda_ms(fwd_bwd, cuda, repeats=3, warmup=1)
    experts = [m for m in engine.module.modules() if hasattr(m, "fuse_wgrad_accumulation")]
    fused = [m.fuse_wgrad_accumulation for m in experts]
    for m in experts:
        m.fuse_wgrad_accumulation = False
    ab["fwd_bwd_ms_wgrad_unfused"] = _cuda_ms(fwd_bwd, cuda, repeats=3, warmup=1)
    for m, f in zip(experts, fused):
        m.fuse_wgrad_accumulation = f
    ab["optimizer_step_ms_fused"] = _cuda_ms(engine.optimizer_step, cuda, repeats=3, warmup=1)
    for inner in engine._torch_optimizers():
        for group in inner.param_groups:
            group["fused"], group["foreach"] = False, None
    ab["optimizer_step_ms_foreach"] = _cuda_ms(engine.optimizer_step, cuda, repeats=3, warmup=1)
    out["ab"] = ab
    return out


def run_parts(s: Shape, args) -> dict:
    """Micro-benchmarks of single pieces at the model's shapes: attention kernels, RMSNorm, experts."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tppo.engine.experts import grouped_swiglu

    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out: dict = {"variant": "parts"}

    def fwd_bwd(fn, *inputs):
        def run():
            y = fn(*inputs)
            y.backward(torch.ones_like(y))

        return run

    S, Hq, G, D = s.seq, s.heads, s.kv_heads, s.head_dim
    q = torch.randn(S, 1, Hq, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(S, 1, G, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(S, 1, G, D, device=dev, dtype=dt, requires_grad=True)

    def attn(repeat: bool, contiguous: bool):
        def fn(q, k, v):
            qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            if contiguous:
                qb, kb, vb = qb.contiguous(), kb.contiguous(), vb.contiguous()
            if repeat:
                kb, vb = kb.repeat_interleave(Hq // G, 1), vb.repeat_interleave(Hq // G, 1)
            y = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=not repeat)
            return y.permute(2, 0, 1, 3).reshape(S, 1, -1)

        return fn

    attn_flops = 4 * S * S * Hq * D / 2 * 3.5  # causal forward + backward (2.5x forward)
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    res = {}
    for bname, backend in backends.items():
        for repeat in (True, False):
            for contiguous in (False, True):
                key = f"{bname}{'+repeat' if repeat else '+gqa'}{'+contig' if contiguous else ''}"
                try:
                    with sdpa_kernel([backend]):
                        ms = _cuda_ms(fwd_bwd(attn(repeat, contiguous), q, k, v), cuda)
                    res[key] = {"ms": ms, "tflops": attn_flops / ms / 1e9}
                except RuntimeError as exc:
                    res[key] = {"error": str(exc)[:160]}
    out["attention_fwd_bwd"] = res

    from tppo.engine.model import RMSNorm

    class _Cfg:
        use_cpu_initialization = not cuda
        params_dtype = dt
        sequence_parallel = False

    norm = RMSNorm(_Cfg(), s.hidden)
    qnorm = RMSNorm(_Cfg(), s.head_dim)
    x = torch.randn(S, 1, s.hidden, device=dev, dtype=dt, requires_grad=True)
    out["rmsnorm_fwd_bwd_ms"] = {
        "hidden_ours": _cuda_ms(fwd_bwd(norm, x), cuda),
        "hidden_F.rms_norm": _cuda_ms(
            fwd_bwd(lambda t: F.rms_norm(t, (s.hidden,), norm.weight, 1e-6), x), cuda
        ),
        "qk_ours": _cuda_ms(fwd_bwd(qnorm, q), cuda),
        "qk_F.rms_norm": _cuda_ms(
            fwd_bwd(lambda t: F.rms_norm(t, (s.head_dim,), qnorm.weight, 1e-6), q), cuda
        ),
    }
    n = S * s.topk
    xe = torch.randn(n, s.hidden, device=dev, dtype=dt, requires_grad=True)
    counts = torch.full((s.experts,), n // s.experts, dtype=torch.long, device=dev)
    pe = torch.rand(n, device=dev, requires_grad=True)
    w1 = (torch.randn(s.experts, 2 * s.expert_ffn, s.hidden, device=dev, dtype=dt) * 0.02).requires_grad_()
    w2 = (torch.randn(s.experts, s.hidden, s.expert_ffn, device=dev, dtype=dt) * 0.02).requires_grad_()
    ms = _cuda_ms(fwd_bwd(grouped_swiglu, xe, counts, pe, w1, w2), cuda)
    out["experts_fwd_bwd"] = {"ms": ms, "tflops": 6 * n * 3 * s.hidden * s.expert_ffn / ms / 1e9}
    if cuda:
        out["expert_wgrad_into_main_grad"] = _wgrad_parts(s, xe.detach(), counts)
        out["swiglu_probs_fwd_bwd_ms"] = _swiglu_parts(s, n)
    return out


def _swiglu_parts(s: Shape, n: int) -> dict:
    """The experts' gated activation (forward + backward) at the model's shapes: eager vs the Triton kernels."""
    import torch

    from tppo.engine import swiglu

    h = torch.randn(n, 2 * s.expert_ffn, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(n, device="cuda", requires_grad=True)

    def run(fn):
        def step():
            fn(h, p).backward(torch.ones(n, s.expert_ffn, device="cuda", dtype=torch.bfloat16))

        return step

    return {
        "eager": _cuda_ms(run(swiglu.swiglu_probs_eager), True),
        "triton": _cuda_ms(run(swiglu.swiglu_probs), True),
    }


def _wgrad_parts(s: Shape, x_NH, counts_E) -> dict:
    """W1's weight gradient added to an fp32 main grad: grouped GEMM to bf16 + add, vs the fused kernel
    (tppo.engine.grouped_wgrad) at a few tile configurations."""
    import torch

    from tppo.engine import grouped_wgrad

    o = 2 * s.expert_ffn
    dy = torch.randn(x_NH.shape[0], o, device="cuda", dtype=torch.bfloat16)
    offs = counts_E.cumsum(0).to(torch.int32)
    main = torch.zeros(s.experts, o, s.hidden, device="cuda")
    flops = 2 * x_NH.shape[0] * o * s.hidden

    def unfused():
        main.add_(torch._grouped_mm(dy.t(), x_NH, offs=offs))

    res = {"unfused_ms": _cuda_ms(unfused, True)}
    default = grouped_wgrad._CONFIG
    for cfg in [default, (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3)]:
        grouped_wgrad._CONFIG = cfg
        try:
            ms = _cuda_ms(lambda: grouped_wgrad.grouped_wgrad_accumulate(dy, x_NH, offs, main), True)
            res[str(cfg)] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as exc:
            res[str(cfg)] = {"error": str(exc)[:120]}
    grouped_wgrad._CONFIG = default
    return res


def _child(args) -> None:
    s = TINY if args.tiny else Shape(seq=args.seq)
    if args.variant == "profile":
        result = run_profile(s, args)
    elif args.variant == "parts":
        result = run_parts(s, args)
    else:
        result = run_checks(args) if args.variant == "checks" else run_variant(args.variant, s, args)
    with open(args.child_json, "w") as f:
        json.dump(result, f)


def _run_child(variant: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{variant}.json")
    cmd = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--variant",
            variant,
            "--child-json",
            out,
            "--microbatches",
            str(args.microbatches),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--seq",
            str(args.seq),
            "--profile-microbatches",
            str(args.profile_microbatches),
            "--out-dir",
            args.out_dir,
        ]
        + (["--tiny"] if args.tiny else [])
        + (["--profile"] if args.profile else [])
    )
    return child_result(variant, cmd, out, args.timeout)


def child_result(variant: str, cmd: list[str], out: str, timeout: float) -> dict:
    """Run one variant's process; its JSON result with wall_s, or an error with the log's tail (also on timeout)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        log = b"".join(x or b"" for x in (exc.stdout, exc.stderr)).decode(errors="replace")
        return {"variant": variant, "error": f"timed out after {timeout:.0f} s", "log_tail": log[-3000:]}
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"variant": variant, "error": f"exit {proc.returncode}", "log_tail": tail}
    with open(out) as f:
        result = json.load(f)
    result["wall_s"] = time.perf_counter() - t0
    return result


def run_variants(variants: list[str], run_one, path: str, extra: dict) -> list[dict]:
    """run_one(variant, tmp_dir) for each variant in turn; {**extra, "results": [...]} rewritten to `path` after
    every variant (a run cut short keeps what it measured); the log tails of failed variants printed at the end."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for v in variants:
            results.append(run_one(v, tmp))
            keys = ("variant", "step_ms", "mfu", "peak_mem_gib", "error")
            print(json.dumps({k: results[-1][k] for k in keys if k in results[-1]}), flush=True)
            with open(path, "w") as f:
                json.dump({**extra, "results": results}, f, indent=2)
    for r in results:
        if "log_tail" in r:
            print(f"--- {r['variant']} log tail ---\n{r['log_tail']}")
    return results


def shape_line(s: Shape) -> str:
    total, active = param_counts(s)
    return (
        f"model: {s.num_layers} layers, hidden {s.hidden}, {s.experts} experts top-{s.topk}, expert FFN "
        f"{s.expert_ffn}, vocab {s.vocab}; {total / 1e9:.2f} B params, {active / 1e9:.2f} B active; seq {s.seq}"
    )


def _profile_lines(p: dict) -> list[str]:
    t = p.get("trace", {})
    lines = [f"profile ({p.get('profile_microbatches')} micro-batches + optimizer):"]
    for name in ("fwd_bwd", "optimizer"):
        if name in t:
            lines.append(
                f"  {name}: wall {t[name]['wall_ms']:.1f} ms, GPU busy {t[name]['gpu_busy_ms']:.1f} ms"
            )
    lines.append(
        f"  kernels {t.get('num_kernels')}, {t.get('kernel_ms_total', 0):.1f} ms; runtime {t.get('runtime_sync_calls')}"
    )
    for key in ("host_syncs_fwd_bwd", "host_syncs_optimizer"):
        lines.append(f"  {key}: {p.get(key)}")
    lines.append(f"  A/B: {p.get('ab')}")
    lines += [f"  {ms:9.2f} ms {n:6d}x  {name[:90]}" for name, ms, n in t.get("top_kernels", [])[:20]]
    return lines


def _parts_lines(r: dict) -> list[str]:
    lines = ["parts (ms, fwd+bwd):"]
    for key, v in r.get("attention_fwd_bwd", {}).items():
        lines.append(
            f"  attention {key}: "
            + (f"{v['ms']:.3f} ms {v['tflops']:.0f} TFLOP/s" if "ms" in v else v["error"][:80])
        )
    lines.append(f"  rmsnorm {r.get('rmsnorm_fwd_bwd_ms')}")
    lines.append(f"  experts {r.get('experts_fwd_bwd')}")
    lines.append(f"  expert wgrad into main grad {r.get('expert_wgrad_into_main_grad')}")
    lines.append(f"  swiglu x probs {r.get('swiglu_probs_fwd_bwd_ms')}")
    return lines


def _table(results: list[dict], s: Shape) -> str:
    lines = [
        shape_line(s),
        f"{'variant':<20}{'mb':>4}{'step ms':>10}{'fwd+bwd':>10}{'optim':>8}{'tok/s':>10}{'TFLOP/s':>9}"
        f"{'MFU':>7}{'peak GiB':>10}",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:<20} FAILED: {r['error']}")
            continue
        if r["variant"] == "parts":
            lines += _parts_lines(r)
            continue
        if r["variant"] == "profile":
            lines += _profile_lines(r)
            continue
        if r["variant"] == "checks":
            lines.append(
                "checks: "
                + ", ".join(
                    f"{k}={'ok' if v['ok'] else 'FAIL ' + v['error']}" for k, v in r["checks"].items()
                )
            )
            continue
        if "profile" in r:
            lines += _profile_lines(r["profile"])
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        peak = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
        lines.append(
            f"{r['variant']:<20}{r['microbatches']:>4}{r['step_ms']:>10.1f}{r['fwd_bwd_ms']:>10.1f}"
            f"{r['optimizer_ms']:>8.1f}{r['tokens_per_s']:>10.0f}{r['tflops']:>9.1f}{mfu:>7}{peak:>10}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    p.add_argument("--variants", default="grouped,grouped_recompute,sequential,checks")
    p.add_argument(
        "--microbatches", type=int, default=8, help="sequences per optimizer step (grouped variants)"
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default="bench/out/megatron_train.json")
    p.add_argument("--profile-microbatches", type=int, default=2, help="micro-batches of the profiled step")
    p.add_argument("--out-dir", default="bench/out", help="where the profile variant writes its trace")
    p.add_argument("--profile", action="store_true", help="also profile the grouped variant (profile_engine)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--child-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        _child(args)
        return
    s = TINY if args.tiny else Shape(seq=args.seq)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    extra = {"shape": asdict(s), "flops_per_token": flops_per_token(s), "peak_tflops": PEAK_TFLOPS}
    results = run_variants(
        args.variants.split(","), lambda v, tmp: _run_child(v, args, tmp), args.json, extra
    )
    print(_table(results, s))


if __name__ == "__main__":
    main()
