"""Decode throughput of the rollout engine vs transformers' generate() on a Qwen3-30B-A3B-shaped MoE.

    python bench/rollout_decode.py --device cuda --json bench/out/rollout_decode.json
    python bench/rollout_decode.py --tiny          # CPU smoke run of every code path with a toy model

Sections (each recorded in the JSON, an error in one does not stop the others):
1. check: our engine vs transformers on the same random bf16 weights (a few layers of the real widths):
   greedy tokens, log-prob differences and router agreement, so the timed engine is known to compute the model.
2. engine: decode tokens/s at each batch size, `--layers` layers, random bf16 weights, temperature 1, ignore_eos,
   prompts of `--prompt-len` random tokens, `--new-tokens` new tokens each. Counted over the decode-only steps
   of the engine's step trace (steps that also carry prefill chunks are left out: their time is mostly the
   chunk's): decode time = their wall time (graph replay + sampling + bookkeeping, host syncs included),
   decode tokens = the rows they fed (a finished request's one extra row, fed to record its last token's
   experts, included). Also the bare time of one runner step of the padded batch at the mid length.
   Roofline: bytes a step must read = non-expert weights (attention, norms, routers, final norm, all lm_head
   rows) + (distinct experts the step's tokens routed to, summed over layers, from the trace) x bytes of one
   expert + K/V of every attended position; over `--bandwidth` (by default the card's measured copy bandwidth)
   that is the floor; fraction = mean floor / mean step time.
3. hf: transformers' generate() (sampling, temperature 1, top_k 0) at `--hf-layers` layers on the same shapes;
   decode rate = B (n - 1) / (t(n new tokens) - t(1 new token)).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig
from rollout.engine import StepTrace
from rollout.plan.hardware import MODEL_PRESETS
from rollout.runner import CACHE_ROW, POSITION, SEQ, TOKEN, StepInputs

QWEN3_30B_A3B = MODEL_PRESETS["qwen3-30b-a3b"]  # the published config.json's widths and ids
TINY = dict(
    QWEN3_30B_A3B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
)


def int_list(text: str) -> list[int]:
    """A comma-separated list of ints (a command-line option)."""
    return [int(x) for x in text.split(",")]


def model_config(base: dict, layers: int) -> dict:
    return dict(base, num_hidden_layers=layers)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a `gib` GiB buffer, best of `repeats`).

    The roofline's denominator, measured on the card the benchmark runs on (4.3e12 on the H200 we use, ~3.0e12
    on an H100 SXM); off CUDA it returns the H200 figure so CPU smoke runs still print a fraction.
    """
    if device.type != "cuda":
        return 4.3e12
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    del src, dst
    free_memory()
    return 2 * gib * 2**30 / best


def add_bandwidth_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--bandwidth",
        type=float,
        default=0.0,
        help="bytes/s of the roofline; 0 (default): measured device-to-device copy bandwidth of this card",
    )


def add_attention_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--attention",
        default="",
        metavar="DECODE:PREFILL:WAVES",
        help="the engine's attention kernel settings for this run (rollout.paged_attention's DECODE_KEY_TILE, "
        "PREFILL_KEY_TILE: keys per loop step, 0 for one cache block's; DECODE_WAVES: split-K waves); "
        "empty: the module's",
    )


def apply_attention(args) -> dict:
    """Set rollout.paged_attention's kernel settings from --attention (before the engine's first step); returns
    the settings in force, for the JSON."""
    from rollout import paged_attention as pa

    if args.attention:
        try:
            decode, prefill, waves = (int(x) for x in args.attention.split(":"))
        except ValueError:
            raise SystemExit(
                f"--attention wants DECODE:PREFILL:WAVES (three ints), got {args.attention!r}"
            ) from None
        pa.DECODE_KEY_TILE, pa.PREFILL_KEY_TILE, pa.DECODE_WAVES = decode or None, prefill or None, waves
    return {
        "decode_key_tile": pa.DECODE_KEY_TILE,
        "prefill_key_tile": pa.PREFILL_KEY_TILE,
        "waves": pa.DECODE_WAVES,
    }


def resolve_bandwidth(args, device: torch.device) -> float:
    if args.bandwidth <= 0:
        args.bandwidth = copy_bandwidth(device)
    print(f"roofline bandwidth: {args.bandwidth / 1e12:.2f} TB/s", flush=True)
    return args.bandwidth


class GpuStalled(RuntimeError):
    """Work on the GPU did not finish within the watchdog's time: the device is stuck, and anything that waits on
    it (another timing, freeing cached memory, the interpreter's CUDA teardown) would wait forever too."""


def wait_event(event, stall_s: float | None, poll_s: float = 1e-4) -> None:
    """event.synchronize(), or with `stall_s` a poll of event.query() that raises GpuStalled after stall_s s."""
    if stall_s is None:
        event.synchronize()
        return
    deadline = time.monotonic() + stall_s
    while not event.query():
        if time.monotonic() > deadline:
            raise GpuStalled(f"the GPU has not finished the timed work after {stall_s:g} s")
        time.sleep(poll_s)


def median_ms(device: torch.device, fn, warmup: int, repeats: int, stall_s: float | None = None) -> float:
    """Median milliseconds of fn() over `repeats` calls after `warmup` calls: CUDA events on a GPU (each call
    timed alone), the wall clock elsewhere. With `stall_s`, a GPU wait longer than that raises GpuStalled."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        done = torch.cuda.Event()
        done.record()
        wait_event(done, stall_s)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            wait_event(end, stall_s)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(batch, prompt_len)).tolist()


# --------------------------------------------------------------------------------------------- roofline
def roofline_parts(engine: RolloutEngine) -> dict:
    """Bytes a decode step must read, by part, counted from the engine's own tensors: every non-expert tensor
    of every layer (fused qkv, o, norms, router, a dense MLP where a layer has one), the final norm and all
    lm_head rows (each sampled row needs every logit); one expert's gate_up + down; K + V of one attended
    position over all layers. The embedding rows a step gathers (one per token, a few KiB) are left out."""
    w = engine.weights
    non_expert = w.final_norm_H.nbytes + w.lm_head_VH.nbytes
    expert = 0
    for layer in w.layers:
        for name, t in vars(layer).items():
            if t is None:
                continue
            if name in ("gate_up_EFH", "down_EHF"):
                expert = expert or layer.gate_up_EFH[0].nbytes + layer.down_EHF[0].nbytes
            else:
                non_expert += t.nbytes
    return {"non_expert": non_expert, "expert": expert, "kv_per_position": engine.cache_plan.bytes_per_token}


def step_floor_bytes(step: StepTrace, parts: dict) -> int:
    """Bytes the step reads at least: non-expert weights, the experts its tokens touched, the decoding rows'
    keys and values. A prefill chunk's reads of its own prompt's K/V are not counted (small next to the
    weights), nor its compute: for a mixed step this is a loose floor."""
    return (
        parts["non_expert"]
        + step.experts_touched * parts["expert"]
        + step.decode_keys * parts["kv_per_position"]
    )


# --------------------------------------------------------------------------------------------- sections
def run_engine(args, cfg: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    max_len = args.prompt_len + args.new_tokens
    config = RolloutConfig(
        max_model_len=-(-max_len // 128) * 128,
        max_batch_size=max(args.batches),
        cuda_graphs=not args.eager,
        kv_cache_fraction=args.kv_cache_fraction,
        trace_steps=True,
    )
    engine = RolloutEngine.from_config(cfg, device=device, dtype=dtype, config=config, seed=0)
    parts = roofline_parts(engine)
    rows = []
    for batch in args.batches:
        prompts = prompts_for(batch, args.prompt_len, cfg["vocab_size"], seed=batch)
        params = [
            SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=i, ignore_eos=True)
            for i in range(batch)
        ]
        engine.generate(prompts, params)  # warm-up: captures this batch's graphs
        sync(device)
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        sync(device)
        wall = time.perf_counter() - t0
        st = engine.last_stats
        decode_only = [s for s in st.steps if s.num_decode and not s.num_prefill]
        decode_s = sum(s.seconds for s in decode_only)
        step_s = decode_s / len(decode_only)
        floor_s = statistics.mean(step_floor_bytes(s, parts) / args.bandwidth for s in decode_only)
        kv_bytes = [s.decode_keys * parts["kv_per_position"] for s in decode_only]
        replay_ms = time_replay(engine, batch, args, device)
        eager_ms = None
        if engine.runner.use_cuda_graphs:  # the same step launched op by op, to show what the graphs buy
            engine.runner.use_cuda_graphs = False
            eager_ms = time_replay(engine, batch, args, device)
            engine.runner.use_cuda_graphs = True
        profile = (
            profile_step(engine, batch, args, device) if device.type == "cuda" and batch in (1, 256) else None
        )
        rows.append(
            {
                "batch": batch,
                "layers": cfg["num_hidden_layers"],
                "decode_tok_s": sum(s.num_decode for s in decode_only) / decode_s,
                "end_to_end_tok_s": st.num_generated_tokens / wall,
                "prefill_s": st.prefill_s,
                "decode_s": st.decode_s,
                "mixed_s": st.mixed_s,
                "decode_only_s": decode_s,
                "decode_steps": st.num_decode_steps,
                "mixed_steps": st.num_mixed_steps,
                "decode_only_steps": len(decode_only),
                "step_ms": 1e3 * step_s,
                "replay_ms": replay_ms,
                "eager_step_ms": eager_ms,
                "roofline_step_ms": 1e3 * floor_s,
                "roofline_fraction": floor_s / step_s,
                "weights_gb_per_step": statistics.mean(
                    parts["non_expert"] + s.experts_touched * parts["expert"] for s in decode_only
                )
                / 1e9,
                "kv_gb_per_step": statistics.mean(kv_bytes) / 1e9,
                "distinct_experts_per_layer": statistics.mean(s.experts_touched for s in decode_only)
                / engine.spec.num_moe_layers,
                "cuda_graphs": st.cuda_graphs,
                "num_graphs": st.num_graphs,
                "capture_error": engine.runner.capture_error,
                "kernel_profile": profile,
            }
        )
        print(
            f"engine L={cfg['num_hidden_layers']} B={batch}: {rows[-1]['decode_tok_s']:.0f} tok/s, "
            f"step {rows[-1]['step_ms']:.2f} ms (replay {replay_ms:.2f}, eager {eager_ms or 0:.2f}), "
            f"roofline {100 * rows[-1]['roofline_fraction']:.0f}%",
            flush=True,
        )
    del engine
    free_memory()
    return rows


@contextlib.contextmanager
def held_rows(engine: RolloutEngine, count: int, num_positions: int):
    """`count` rows opened in the engine's block table, each with blocks for positions [0, num_positions), so a
    step built on them reads and writes real cache blocks; released on exit (the engine's next step, or
    generate, finds the table as it was)."""
    table = engine.cache.table
    rows = []
    try:
        for _ in range(count):
            rows.append(table.open_row())
            if not table.grow(rows[-1], num_positions):
                raise RuntimeError(f"the KV cache cannot hold {count} rows of {num_positions} positions")
        yield rows
    finally:
        for r in rows:
            table.release(r)


def sampled_at_temperature_1(num_samples: int) -> dict:
    """StepInputs' sampling fields for `num_samples` rows at temperature 1, no top-k/top-p (the sort is a graph
    of its own), seeds 0..S-1."""
    return dict(
        seeds_S=np.arange(num_samples, dtype=np.uint64),
        top_k_S=np.zeros(num_samples, dtype=np.int64),
        temperature_S=np.ones(num_samples, dtype=np.float32),
        top_p_S=np.ones(num_samples, dtype=np.float32),
    )


@contextlib.contextmanager
def decode_step(engine: RolloutEngine, batch: int, args, seed: int = 0):
    """A decode-only step of `batch` rows at the middle of the generation, sampling at temperature 1 (the
    runner pads it to its bucket as it pads the engine's steps). The rows are opened in the engine's block
    table with blocks for positions [0, mid], so the step reads and writes real cache blocks, and released on
    exit. Each row feeds its own random token (drawn from `seed`): rows fed one token over one cache content
    would route alike, and a step whose tokens all pick the same top-k experts reads K experts' weights, not
    the ~E (1 - (1 - K/E)^b) that distinct sequences touch."""
    position = args.prompt_len + args.new_tokens // 2
    with held_rows(engine, batch, position + 1) as rows:
        tokens_T4 = np.zeros((batch, 4), dtype=np.int64)
        tokens_T4[:, TOKEN] = np.random.default_rng(seed).integers(0, engine.spec.vocab_size, batch)
        tokens_T4[:, POSITION], tokens_T4[:, SEQ] = position, rows
        tokens_T4[:, CACHE_ROW] = engine.cache.table.cache_rows(tokens_T4[:, SEQ], tokens_T4[:, POSITION])
        yield StepInputs(
            tokens_T4=tokens_T4,
            num_decode=batch,
            pieces=[],
            samples_S=np.arange(batch, dtype=np.int64),
            **sampled_at_temperature_1(batch),
        )


@contextlib.contextmanager
def prefill_step(engine: RolloutEngine, seqs: int, length: int, seed: int = 0):
    """A prefill-only step of `seqs` prompts of `length` random tokens each (drawn from `seed`), all from
    position 0: the step that admits them whole, as the engine's scheduler builds it (one piece per prompt,
    its last token sampled at temperature 1). The rows are opened in the engine's block table with blocks for
    positions [0, length), so the step writes its K/V into real cache blocks and attends to them, and
    released on exit. The prompts are inputs.tokens_T4[:, TOKEN].reshape(seqs, length)."""
    with held_rows(engine, seqs, length) as rows:
        tokens_T4 = np.zeros((seqs * length, 4), dtype=np.int64)
        tokens_T4[:, TOKEN] = np.random.default_rng(seed).integers(0, engine.spec.vocab_size, seqs * length)
        tokens_T4[:, POSITION] = np.tile(np.arange(length), seqs)
        tokens_T4[:, SEQ] = np.repeat(rows, length)
        tokens_T4[:, CACHE_ROW] = engine.cache.table.cache_rows(tokens_T4[:, SEQ], tokens_T4[:, POSITION])
        starts_S = np.arange(seqs, dtype=np.int64) * length
        yield StepInputs(
            tokens_T4=tokens_T4,
            num_decode=0,
            pieces=[(int(start), length) for start in starts_S],
            samples_S=starts_S + length - 1,
            **sampled_at_temperature_1(seqs),
        )


def time_step(engine: RolloutEngine, inputs: StepInputs, repeats: int, device: torch.device) -> float:
    """Median time of one whole runner step on `inputs` (inputs in, graph replay or eager forward + sampling,
    outputs on the host) over `repeats` runs after 3 warm-up runs (which capture the step's graph): CUDA events
    on a GPU, the wall clock elsewhere. Rerunning a step rewrites the same K/V at the same cache rows, so every
    run does the same work."""
    times = []
    with torch.inference_mode():
        for _ in range(3):
            engine.runner.run(inputs)
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                engine.runner.run(inputs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                engine.runner.run(inputs)
                times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def time_replay(engine: RolloutEngine, batch: int, args, device: torch.device) -> float:
    """Median time of one whole decode step of the runner (inputs in, graph replay or eager forward + sampling,
    outputs on the host) at the mid length."""
    with torch.inference_mode(), decode_step(engine, batch, args) as inputs:
        return time_step(engine, inputs, args.repeats, device)


def profile_step(engine: RolloutEngine, batch: int, args, device: torch.device) -> dict:
    """GPU kernels of one eager decode step (same kernels a graph replays): count, busy time, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.use_cuda_graphs = engine.runner.use_cuda_graphs, False
    try:
        with torch.inference_mode(), decode_step(engine, batch, args) as inputs:
            engine.runner.run(inputs)
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.runner.run(inputs)
                sync(device)
    finally:
        engine.runner.use_cuda_graphs = graphs
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append({"name": e.key[:120], "calls": e.count, "us": t})
    rows.sort(key=lambda r: -r["us"])
    total = sum(r["us"] for r in rows)
    print(
        f"  profile B={batch}: {sum(r['calls'] for r in rows)} kernels, {total / 1e3:.2f} ms busy", flush=True
    )
    for r in rows[:12]:
        print(f"    {r['us'] / 1e3:8.3f} ms {r['calls']:5d}x {r['name'][:90]}", flush=True)
    return {"num_kernels": sum(r["calls"] for r in rows), "busy_ms": total / 1e3, "top": rows[:40]}


def build_hf(cfg: dict, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    keys = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    hf_cfg = Qwen3MoeConfig(**keys)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


def run_hf(args, cfg: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    model = build_hf(cfg, device, dtype)
    rows = []
    for batch in args.batches:
        ids = torch.tensor(prompts_for(batch, args.prompt_len, cfg["vocab_size"], seed=batch), device=device)

        def gen(n: int, ids=ids, model=model) -> float:
            sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    pad_token_id=0,
                )
            sync(device)
            return time.perf_counter() - t0

        gen(2)  # warm-up
        t1, tn = gen(1), gen(args.hf_new_tokens)
        rate = batch * (args.hf_new_tokens - 1) / (tn - t1)
        rows.append(
            {
                "batch": batch,
                "layers": cfg["num_hidden_layers"],
                "decode_tok_s": rate,
                "t_first_s": t1,
                "t_all_s": tn,
                "new_tokens": args.hf_new_tokens,
            }
        )
        print(f"transformers L={cfg['num_hidden_layers']} B={batch}: {rate:.1f} tok/s", flush=True)
    del model
    free_memory()
    return rows


def compare_with_hf(engine: RolloutEngine, model, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy tokens of both; log-probs and router picks of transformers on the engine's own sequences."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )[:, ids.shape[1] :]
    picks = []
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    handles = [m.register_forward_hook(lambda _m, _i, o: picks.append(o[2])) for m in routers]
    seqs = torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)], device=device)
    try:
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(seqs).logits.float(), dim=-1)
    finally:
        for h in handles:
            h.remove()
    n_prompt = len(prompts[0])
    gen = seqs[:, n_prompt:]
    ref_lp = logprobs[:, n_prompt - 1 : -1].gather(2, gen[..., None])[..., 0].cpu().numpy()
    ours_lp = np.stack([o.logprobs for o in outs])
    hf_routes = torch.stack(picks, dim=1).view(len(prompts), seqs.shape[1], len(routers), -1).cpu().numpy()
    ours_routes = np.stack([o.routed_experts for o in outs]).astype(np.int64)
    overlap = (np.sort(hf_routes, -1)[..., :, None] == np.sort(ours_routes, -1)[..., None, :]).any(-1).mean()
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(o.token_ids, r)) if a != b), new_tokens)
        for o, r in zip(outs, ref.tolist())
    ]
    return {
        "greedy_tokens_equal_before_divergence": statistics.mean(first_diff) / new_tokens,
        "first_token_equal": float(np.mean([d > 0 for d in first_diff])),
        "logprob_max_abs_diff": float(np.abs(ref_lp - ours_lp).max()),
        "logprob_mean_abs_diff": float(np.abs(ref_lp - ours_lp).mean()),
        "router_pick_agreement": float(overlap),
    }


def run_check(args, cfg: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Same weights in transformers and the engine: greedy agreement, log-prob gap, router agreement."""
    model = build_hf(cfg, device, dtype)
    config = RolloutConfig(
        max_model_len=256, max_batch_size=8, kv_cache_fraction=0.2, cuda_graphs=not args.eager
    )
    engine = RolloutEngine.from_config(cfg, device=device, dtype=dtype, config=config)
    engine.load_weights(model.state_dict().items())
    result = compare_with_hf(engine, model, prompts_for(4, 24, cfg["vocab_size"], seed=3), new_tokens=16)
    print(f"check L={cfg['num_hidden_layers']}: {result}", flush=True)
    del model, engine
    free_memory()
    return result


def section(name: str, fn, results: dict) -> None:
    try:
        results[name] = fn()
    except GpuStalled:
        raise  # nothing after it can run: the caller writes what it has and ends the process
    except Exception as err:  # one failing section must not lose the others' numbers
        traceback.print_exc()
        results[name + "_error"] = f"{type(err).__name__}: {err}"
        free_memory()


def print_table(results: dict, hf_layers: int) -> None:
    hf = {r["batch"]: r for r in results.get("hf", [])}
    ours_same = {r["batch"]: r for r in results.get("engine_hf_layers", [])}
    print(
        "\n| batch | layers | engine tok/s | step ms | roofline ms | roofline % | graphs | "
        f"engine tok/s @{hf_layers}L | transformers tok/s @{hf_layers}L | speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results.get("engine", []):
        b = r["batch"]
        same = ours_same.get(b, {}).get("decode_tok_s")
        ref = hf.get(b, {}).get("decode_tok_s")
        speed = f"{same / ref:.1f}x" if same and ref else "-"
        print(
            f"| {b} | {r['layers']} | {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | {r['roofline_step_ms']:.2f} | "
            f"{100 * r['roofline_fraction']:.0f}% | {r['cuda_graphs']} | {same or float('nan'):.0f} | "
            f"{ref or float('nan'):.1f} | {speed} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hf-layers", type=int, default=48, help="layers of the transformers comparison model")
    ap.add_argument("--check-layers", type=int, default=2)
    ap.add_argument("--batches", type=int_list, default=[1, 32, 256])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hf-new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=20)
    add_bandwidth_arg(ap)
    ap.add_argument(
        "--kv-cache-fraction", type=float, default=0.5, help="of the free GPU memory given to the KV cache"
    )
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: check,engine,hf")
    ap.add_argument("--tiny", action="store_true", help="toy widths (CPU smoke test of the script)")
    add_attention_arg(ap)
    ap.add_argument("--json", default="bench/out/rollout_decode.json")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    resolve_bandwidth(args, device)
    base = TINY if args.tiny else QWEN3_30B_A3B
    skip = set(args.skip.split(",")) - {""}
    results: dict = {
        "args": vars(args),
        "attention": apply_attention(args),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if "check" not in skip:
        section(
            "check", lambda: run_check(args, model_config(base, args.check_layers), device, dtype), results
        )
    if "engine" not in skip:
        section("engine", lambda: run_engine(args, model_config(base, args.layers), device, dtype), results)
    if "hf" not in skip:
        hf_cfg = model_config(base, args.hf_layers)
        section("hf", lambda: run_hf(args, hf_cfg, device, dtype), results)
        if args.hf_layers != args.layers:
            section("engine_hf_layers", lambda: run_engine(args, hf_cfg, device, dtype), results)
        else:
            results["engine_hf_layers"] = results.get("engine", [])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    print_table(results, args.hf_layers)


if __name__ == "__main__":
    main()
