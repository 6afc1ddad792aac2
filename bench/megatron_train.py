"""Training throughput of the Megatron-Core MoE engine: forward + backward + optimizer step, tokens/s and MFU.

    python bench/megatron_train.py [--json bench/out/megatron_train.json]      # GPU: the full run
    python bench/megatron_train.py --tiny                                      # CPU smoke run, tiny model

Each variant runs in its own process (one model of ~5 B parameters at a time on the GPU):
- grouped:            grouped-GEMM experts (torch._grouped_mm), no activation recompute;
- grouped_recompute:  the same with full-layer activation recompute (peak memory comparison);
- sequential:         Megatron's SequentialMLP experts (a loop over experts), no recompute; one micro-batch
                      per step and at most 2 timed steps (it is slow);
- checks:             a small bf16 model: state_dict round trip, offload/onload, packed forward (GPU paths
                      the CPU tests cannot reach).

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
    from tppo.config import ModelConfig

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

    from tppo.config import OptimConfig, ParallelConfig
    from tppo.engine.batch import TrainBatch
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
    with _attention_context(cuda):
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
            with _attention_context(cuda):  # a fresh context each time: generator contexts enter once
                a = timer.mark()
                engine.forward(batches[:1])
                fwd_only.append(timer.ms(a, timer.mark()))
        out["forward_only_ms"] = statistics.median(fwd_only)
        if cuda:
            from tppo.engine import experts as experts_mod

            out["attention"] = flash_probe(s)
            out["grouped_mm_column_major"] = experts_mod._COLUMN_MAJOR_OK["cuda"]
    except Exception as exc:  # report it beside the numbers
        out["extras_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return out


def _attention_context(cuda: bool):
    """A NEW context each call (sdpa_kernel is a one-shot generator context, so is this on CPU)."""
    import contextlib

    if not cuda:

        @contextlib.contextmanager
        def cpu():
            yield

        return cpu()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # Flash first; the memory-efficient kernel only if flash cannot take the inputs (`flash_probe` says).
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def flash_probe(s: Shape) -> str:
    """Does the flash kernel take attention inputs laid out as the model's ([S, B, H, D] permuted)?"""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(s.seq, 1, s.heads, s.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            x = q.permute(1, 2, 0, 3)
            torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward()
        return "flash"
    except RuntimeError as exc:
        return f"no flash: {exc}"[:300]


def run_checks(args) -> dict:
    """GPU paths the CPU tests cannot reach, on a small bf16 model: each check reports ok or its error."""
    import torch

    from tppo.config import OptimConfig, ParallelConfig
    from tppo.engine.batch import TrainBatch
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


def _child(args) -> None:
    s = TINY if args.tiny else Shape(seq=args.seq)
    result = run_checks(args) if args.variant == "checks" else run_variant(args.variant, s, args)
    with open(args.child_json, "w") as f:
        json.dump(result, f)


def _run_child(variant: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"{variant}.json")
    cmd = [
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
    ] + (["--tiny"] if args.tiny else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stdout + proc.stderr)[-3000:]
        return {"variant": variant, "error": f"exit {proc.returncode}", "log_tail": tail}
    with open(out) as f:
        result = json.load(f)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _table(results: list[dict], s: Shape) -> str:
    total, active = param_counts(s)
    lines = [
        f"model: {s.num_layers} layers, hidden {s.hidden}, {s.experts} experts top-{s.topk}, expert FFN "
        f"{s.expert_ffn}, vocab {s.vocab}; {total / 1e9:.2f} B params, {active / 1e9:.2f} B active; seq {s.seq}",
        f"{'variant':<20}{'mb':>4}{'step ms':>10}{'fwd+bwd':>10}{'optim':>8}{'tok/s':>10}{'TFLOP/s':>9}"
        f"{'MFU':>7}{'peak GiB':>10}",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:<20} FAILED: {r['error']}")
            continue
        if r["variant"] == "checks":
            lines.append(
                "checks: "
                + ", ".join(
                    f"{k}={'ok' if v['ok'] else 'FAIL ' + v['error']}" for k, v in r["checks"].items()
                )
            )
            continue
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
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--child-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        _child(args)
        return
    import tempfile

    s = TINY if args.tiny else Shape(seq=args.seq)
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for v in args.variants.split(","):
            results.append(_run_child(v, args, tmp))
            print(
                json.dumps(
                    {k: results[-1].get(k) for k in ("variant", "step_ms", "mfu", "peak_mem_gib", "error")}
                ),
                flush=True,
            )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "shape": asdict(s),
                "flops_per_token": flops_per_token(s),
                "peak_tflops": PEAK_TFLOPS,
                "results": results,
            },
            f,
            indent=2,
        )
    for r in results:
        if "log_tail" in r:
            print(f"--- {r['variant']} log tail ---\n{r['log_tail']}")
    print(_table(results, s))


if __name__ == "__main__":
    main()
