"""Per-layer times a MegaScale-Infer deployment planner needs (issue #30), measured on one GPU.

    python bench/rollout_disagg.py --profile --json bench/out/rollout_disagg_profile.json   # one GPU, bf16
    python bench/rollout_disagg.py --profile --tiny      # CPU smoke run: toy shapes, fp32, wall time

Writes the profile JSON `rollout-profile/4` (read by `python -m rollout.plan --profile`): the device, its measured
copy bandwidth, the model's widths, the expert path the engines ran ("expert_kernel": persistent, padded or
grouped, from `--expert-kernel`, whose auto is the persistent Triton kernel on CUDA and grouped GEMMs on the CPU)
and, per section, one row per point. Model: decoder layers of Qwen3-30B-A3B (hidden 2048, 32 q / 4 kv heads of
128, 128 experts top-8, expert FFN 768) with random weights, bf16; `--tiny` takes rollout_decode's TINY widths in
fp32 on the CPU. Schema /2 over /1: the per-layer times are amortised over `--graph-reps` reps (below) and the
"overhead" section is new (the planner still reads /1 files: without overhead rows it keeps the LM head's
roofline as the step's only fixed cost, and says so). /3 over /2: "expert_kernel", the "prefill_attention"
section, prefill-phase experts rows and the steps' prefill rows (every experts and steps row has a "phase"), so a
plan's prefill side is checked on one GPU too, not only its decode steps. /4 over /3: overhead rows come from
steps of one and of two layers (below), which gives what a layer adds inside a step.

Sections (a point that raises is listed under "errors" and the others still run):
1. attention: for every `--batches` x `--contexts`, what an attention worker runs per layer for `batch` decode rows
   each at position `context` (positions 0..context-1 cached): MoeDecoder.attention_block (input RMSNorm, qkv, q/k
   norm, RoPE, K/V write, paged attention through the block table, o_proj + residual, post-attention RMSNorm)
   and MoeDecoder.route (router top-k). The rows are real block-table rows of an engine whose cache holds its
   `--graph-reps` layers (random K/V), sized for the largest point that fits the free memory; larger points are
   skipped.
2. prefill_attention: for every `--prefill-points` seqs:length, the same attention part for a prefill-only step
   of `seqs` prompts of `length` random tokens each from position 0 (rollout_decode.prefill_step: one piece per
   prompt, cut into the runner's attention tiles), on the same engine (its steps take the largest point whole).
   Rows: seqs, length, ms.
3. experts: MoeDecoder.experts of all E experts through the engine's expert path (persistent; padded: padded bmm
   for 8-64 pairs per expert, grouped GEMMs otherwise; grouped), routing from a softmax over random logits
   (rollout_expertplex.Layer.inputs): phase "decode" (every token a decode row) for every `--expert-tokens`,
   phase "prefill" (none: a prefill pass, cut into the persistent kernel's taller prefill tiles) for every
   `--prefill-expert-tokens` (default: the prefill points' seqs x length). Rows: tokens, phase, ms.
4. steps: whole steps of an engine of `--step-layers` layers (CUDA graphs on, layout "replicas": every GPU holds
   the whole model) where the KV fits: the runner's step (inputs in, replay or eager forward, sampling, outputs
   on the host) as rollout_decode.time_step times it. Phase "decode" at `--step-batches` x `--step-contexts`
   (rollout_decode.time_replay), each row fed its own random token over a cache of random K/V (so the rows
   route as distinct sequences do, touching the experts section 3 assumes); phase "prefill" at every
   `--prefill-points` (batch = seqs, context = length): the prefill-only step of section 2 (a step of more than
   cuda_graph_max_tokens tokens runs eagerly, as in the engine). `--validate` compares a plan's prediction with
   these.
5. overhead: the step's fixed cost (embedding, final norm + LM head, sampling, host copies and the step's one
   sync) and what a layer adds inside a step, per phase: whole steps of a ONE-layer and a TWO-layer engine (as
   in section 4) at every `--step-batches` x `--step-contexts` point (decode) and every `--prefill-points`
   seqs:length (prefill; batch = seqs, context = length). layer_ms = step2_ms - step_ms, ms = step_ms - layer_ms
   (noise can make it slightly negative). Beside them the layer's passes timed alone: decode attention (batch,
   context) and experts (tokens = batch) as in sections 1 and 3 (measured for this point if those sections did
   not); the point's prefill_attention row and the prefill-phase experts row of seqs x length tokens (skipped
   when either is missing). The planner scales the passes by layer_ms / (attention_ms + experts_ms): timed
   alone, a small prefill pass costs ~1.4x what it adds to a step. Rows: phase, batch, context, ms, layer_ms,
   step_ms, step2_ms, attention_ms, experts_ms.
6. overlap (CUDA only): for each `--overlap` point batch:context:tokens, the attention part of one micro-batch and
   the experts of another (`tokens` tokens) launched back to back on two CUDA streams, timed together, against
   each alone and their sum: how much of MegaScale-Infer's ping-pong one GPU can overlap. On a layer engine of
   its own, last, under a watchdog: a GPU wait longer than `--stall-s` writes the JSON (the stall under
   "errors") and ends the process with status 3 instead of hanging.
They run in the order attention, prefill_attention, experts, (the overhead's parts), overhead, steps, overlap,
and the JSON is rewritten after every section, so a run cut short keeps what it measured.

Timing: rollout_decode.median_ms (CUDA events, median of `--repeats` after `--warmup`; wall time on the CPU). On
CUDA each piece is captured as ONE CUDA graph of R = `--graph-reps` reps back to back and its replay time / R is
reported, because the engine runs all its layers inside one graph per step: launched op by op, the ~25 small
kernels of the attention part would time the host's launches, not the GPU (`--eager` times them so anyway), and
a graph of one rep would add a graph launch and tail (~0.06-0.08 ms on an H100) that a step pays once, not per
layer. Rep i runs layer i of an engine of R layers (its own weights and K/V cache, same inputs), so no rep finds
the previous rep's 38 MB of attention weights in the L2 cache, as a step's next layer would not. Off CUDA and
with --eager the R reps run in a Python loop. Points that start after `--time-budget-s` are skipped, so a slow
card still writes its JSON in a few minutes. Besides the schema's keys the JSON has "skipped" and "errors" (one
entry per point left out, with the reason) and "meta" (arguments, torch, each expert token count's path);
overlap rows also carry their `tokens`.

Legend: B decode rows, T tokens, H hidden, K top-k, E experts, V vocab.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_decode import (
    QWEN3_30B_A3B,
    TINY,
    GpuStalled,
    add_bandwidth_arg,
    decode_step,
    free_memory,
    int_list,
    median_ms,
    model_config,
    prefill_step,
    resolve_bandwidth,
    section,
    time_replay,
    time_step,
)
from rollout_expertplex import Layer, graphed
from rollout_long import save

from rollout import RolloutEngine
from rollout.config import RolloutConfig
from rollout.kv_cache import available_bytes
from rollout.model import MoeDecoder, StepBatch, padded_capacity
from rollout.model_spec import MoeModelSpec
from rollout.paged_attention import decode_splits, prefill_tiles
from rollout.plan.profile import SCHEMA  # the schema the planner reads
from rollout.runner import StepInputs, step_batch
from rollout.weights import allocate

HEADROOM_BYTES = 4 * 2**30  # left free beside weights and KV: activations, graph pools, allocator slack
BLOCK_SIZE = RolloutConfig().kv_block_size
STEP_TOKENS = RolloutConfig().max_step_tokens  # the engines' least max_step_tokens (the engine's default)
TINY_ARGS = dict(
    device="cpu",
    dtype="float32",
    batches=[1, 4],
    contexts=[16, 40],
    expert_tokens=[1, 8, 32],
    prefill_points=[(1, 8), (2, 16)],
    overlap=[(2, 16, 8)],
    step_layers=2,
    step_batches=[1, 4],
    step_contexts=[16, 40],
    repeats=2,
    warmup=1,
    graph_reps=2,
)


# --------------------------------------------------------------------------------------------- the layer
def fill_cache(engine: RolloutEngine) -> None:
    """The engine's K/V cache filled with N(0, 1): the same bytes move as with real keys, a test comparing
    outputs sees every attended position, and rows over different blocks attend to different contents (over a
    zeroed cache, rows fed the same token would compute the same hidden states and route alike)."""
    gen = torch.Generator(device=engine.device).manual_seed(0)
    for kv_LXMD in engine.cache.tensors():
        kv_LXMD.normal_(generator=gen)


class LayerProfile(Layer):
    """rollout_expertplex's Layer (MoE layers of an engine with random weights, expert inputs of T tokens) with
    `num_layers` layers (one per graph rep) whose KV cache holds `num_positions` positions for up to `max_rows`
    rows of `max_len`, so the layers' attention runs over real cached context too (the cache filled by
    fill_cache), and whose steps take up to `max_step_tokens` tokens (a prefill pass of that many). Its experts
    run the `expert_kernel` path (RolloutConfig.expert_kernel)."""

    def __init__(
        self,
        cfg: dict,
        device: torch.device,
        dtype: torch.dtype,
        max_rows: int,
        max_len: int,
        num_positions: int,
        num_layers: int = 1,
        max_step_tokens: int = STEP_TOKENS,
        expert_kernel: str = "auto",
    ) -> None:
        sizes = dict(
            max_rows=max_rows, max_len=max_len, num_positions=num_positions, max_step_tokens=max_step_tokens
        )
        # the engine's runner is not used; pieces are captured one by one
        config = sized_config(sizes, expert_kernel, cuda_graphs=False)
        self.engine = RolloutEngine.from_config(model_config(cfg, num_layers), device, dtype, config)
        self.model, self.layer, self.spec = self.engine.model, self.engine.weights.layers[0], self.engine.spec
        self.device, self.dtype, self.num_layers = device, dtype, num_layers
        fill_cache(self.engine)

    @contextlib.contextmanager
    def decode_rows(self, batch: int, context: int, seed: int = 0):
        """A decode-only StepBatch of `batch` rows of random tokens, each at position `context`: the rows are opened
        in the engine's block table with blocks for positions 0..context (rollout_decode.decode_step) and
        released on exit."""
        with decode_step(self.engine, batch, at_context(context), seed=seed) as inputs:
            yield self.device_step(inputs)

    @contextlib.contextmanager
    def prefill_rows(self, seqs: int, length: int, seed: int = 0):
        """A prefill-only StepBatch of `seqs` prompts of `length` random tokens, all from position 0: the rows
        are opened in the engine's block table with blocks for positions 0..length-1
        (rollout_decode.prefill_step) and released on exit."""
        with prefill_step(self.engine, seqs, length, seed=seed) as inputs:
            yield self.device_step(inputs)

    def device_step(self, inputs: StepInputs) -> StepBatch:
        """The step on the device, the block table copied first: the parts read it without the runner (which
        copies it in its staging)."""
        self.engine.cache.sync_table()
        return device_batch(self.engine, inputs)

    def attention(
        self, step: StepBatch, x_TH: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor, i: int = 0
    ) -> dict[str, torch.Tensor]:
        """What an attention worker runs per layer: layer i's attention block and router. Returns what it hands
        to the experts, keyed as Layer.inputs (so `experts` takes either)."""
        x_TH, h_TH = self.model.attention_block(i, x_TH, step, cos_TD, sin_TD)
        weights_TK, ids_TK = self.model.route(self.engine.weights.layers[i], h_TH)
        return dict(h_TH=h_TH, weights_TK=weights_TK, ids_TK=ids_TK, residual_TH=x_TH)

    def experts(self, x: dict[str, torch.Tensor], i: int = 0, phase: str = "decode") -> torch.Tensor:
        """residual + layer i's routed experts, through the engine's expert path for this token count: every
        token a decode row (phase "decode") or none (phase "prefill", a prefill pass): the persistent kernel
        cuts decode and prefill pairs into tiles of different heights (BLOCK_M_DECODE, BLOCK_M_PREFILL)."""
        num_tokens = x["h_TH"].shape[0]
        return self.model.experts(
            self.engine.weights.layers[i],
            x["h_TH"],
            x["weights_TK"],
            x["ids_TK"],
            x["residual_TH"],
            num_tokens if phase == "decode" else 0,
        )

    def expert_path(self, num_tokens: int) -> str:
        """The path `experts` takes for num_tokens decode tokens: the engine's kernel, where "padded" falls back
        to grouped GEMMs outside 8-64 pairs per expert (padded_capacity)."""
        kernel = kernel_of(self.model)
        if kernel != "padded":
            return kernel
        padded = self.model.capacity_for(num_tokens * self.spec.top_k, self.spec.num_experts) is not None
        return "padded" if padded else "grouped"


def kernel_of(model: MoeDecoder) -> str:
    """The expert path the model runs (what RolloutConfig.expert_kernel resolved to on its device): "persistent"
    (the Triton kernel), "padded" (padded bmm where padded_capacity allows) or "grouped" (grouped GEMMs)."""
    if model.persistent:
        return "persistent"
    return "padded" if model.capacity_for is padded_capacity else "grouped"


def sized_config(sizes: dict, expert_kernel: str, cuda_graphs: bool) -> RolloutConfig:
    """The RolloutConfig of an engine of engine_sizes' `sizes` (its steps at least the engine's default
    max_step_tokens and one token per row)."""
    return RolloutConfig(
        max_model_len=sizes["max_len"],
        max_batch_size=sizes["max_rows"],
        max_step_tokens=max(STEP_TOKENS, sizes["max_rows"], sizes["max_step_tokens"]),
        kv_cache_tokens=sizes["num_positions"],
        cuda_graphs=cuda_graphs,
        expert_kernel=expert_kernel,
    )


def at_context(context: int, repeats: int = 0) -> argparse.Namespace:
    """rollout_decode's decode_step / time_replay put their rows at position prompt_len + new_tokens // 2: this
    puts them at `context`, i.e. `context` cached positions before the decoded token."""
    return argparse.Namespace(prompt_len=context, new_tokens=0, repeats=repeats)


def device_batch(engine: RolloutEngine, inputs: StepInputs) -> StepBatch:
    """The device batch of a step as the runner builds it, at the step's exact (unpadded) shape: decode rows
    with its split-K rule, prefill pieces cut into its attention tiles, the sampled tokens."""
    n = inputs.num_decode
    splits = decode_splits(n, engine.spec.num_kv_heads, engine.runner.num_sms) if n else 1
    starts, lengths = prefill_tiles(inputs.pieces, engine.runner.tile)
    tiles_2Q = torch.tensor([starts, lengths], dtype=torch.int32).to(engine.device)
    sample_S = torch.from_numpy(inputs.samples_S).to(engine.device)
    return step_batch(torch.from_numpy(inputs.tokens_T4).to(engine.device), tiles_2Q, n, splits, sample_S)


# --------------------------------------------------------------------------------------------- timing
def repeated(part, reps: int):
    """part(0), part(1), ..., part(reps - 1) back to back: one call does rep i on layer i."""

    def run() -> None:
        for i in range(reps):
            part(i)

    return run


def per_rep_ms(prof: LayerProfile, part, args) -> float:
    """Median time of one rep of part(i): the graph (or Python loop) of R = prof.num_layers reps, timed, / R.
    Only the graph's launch and tail are shared by the R reps, so they cost 1/R each, as in a step's graph."""
    run = graphed(repeated(part, prof.num_layers), prof.device, args.eager)
    return median_ms(prof.device, run, args.warmup, args.repeats) / prof.num_layers


def two_streams(first, second, device: torch.device):
    """first and second launched back to back on two fresh streams that start after, and rejoin, the current one
    (so median_ms's events on the current stream bracket both)."""
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def run() -> None:
        main = torch.cuda.current_stream(device)
        for stream, fn in zip(streams, (first, second)):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                fn()
        for stream in streams:
            main.wait_stream(stream)

    return run


def kv_bytes(spec: MoeModelSpec, batch: int, context: int, element_size: int) -> int:
    """K + V of `batch` rows of positions 0..context in whole cache blocks, over the spec's layers."""
    blocks = -(-(context + 1) // BLOCK_SIZE)
    return batch * blocks * BLOCK_SIZE * spec.kv_bytes_per_token(element_size)


def weight_bytes(spec: MoeModelSpec, dtype: torch.dtype) -> int:
    """Bytes of the engine's weights for the spec (allocated on the meta device: no memory)."""
    tensors = allocate(spec, torch.device("meta"), dtype).tensors()
    return sum({id(t): t.numel() * t.element_size() for t in tensors}.values())


def fitting(points: list[tuple[int, int]], spec: MoeModelSpec, dtype: torch.dtype, budget: int):
    """(points whose KV fits `budget` bytes and the spec's positions, {point: why not} for the others)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    fit, why = [], {}
    for batch, context in points:
        need = kv_bytes(spec, batch, context, element_size)
        if context + 1 > spec.max_position_embeddings:
            why[batch, context] = (
                f"context {context} + 1 > max_position_embeddings {spec.max_position_embeddings}"
            )
        elif need > budget:
            why[batch, context] = f"KV {need / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB free for it"
        else:
            fit.append((batch, context))
    return fit, why


def kv_budget(spec: MoeModelSpec, device: torch.device, dtype: torch.dtype) -> int:
    """Free device memory left for the KV cache once the engine's weights and some headroom are taken (blocks
    cached by the allocator count as used in CUDA's free memory: released first)."""
    free_memory()
    return available_bytes(device) - weight_bytes(spec, dtype) - HEADROOM_BYTES


def prefill_fitting(prefill: list[tuple[int, int]], spec: MoeModelSpec, dtype: torch.dtype, budget: int):
    """`fitting` of prefill points (seqs, length): (those that fit, {point: why not} for the others)."""
    fit, why = fitting(as_rows(prefill), spec, dtype, budget)
    return [(n, c + 1) for n, c in fit], {(n, c + 1): reason for (n, c), reason in why.items()}


def as_rows(prefill: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Prefill points (seqs, length) as the cache rows they hold, (batch, context) as a decode point names them:
    `seqs` rows of positions 0..length-1, i.e. at context length - 1."""
    return [(n, s - 1) for n, s in prefill]


def engine_sizes(points: list[tuple[int, int]], prefill: list[tuple[int, int]] = ()) -> dict:
    """max_rows, max_len and num_positions of a cache that holds each decode point (batch, context) and each
    prefill point (seqs, length), one at a time; max_step_tokens for the largest prefill step."""
    rows = [*points, *as_rows(prefill)]
    blocks = [b * -(-(c + 1) // BLOCK_SIZE) for b, c in rows]
    longest = max(c for _, c in rows) + 1
    return dict(
        max_rows=max(b for b, _ in rows),
        max_len=-(-longest // BLOCK_SIZE) * BLOCK_SIZE,
        num_positions=max(blocks) * BLOCK_SIZE,
        max_step_tokens=max([STEP_TOKENS, *(n * s for n, s in prefill)]),
    )


# --------------------------------------------------------------------------------------------- points
class Recorder:
    """The profile being written: rows per section, skipped points, errors, the time budget, and the attention
    and experts times of the overhead section's points."""

    def __init__(self, out: dict, budget_s: float) -> None:
        self.out = out
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.parts: dict[tuple[int, int], tuple[float, float]] = {}  # step point -> (attention, experts) ms

    def mark(self, what: str) -> None:
        """Print the elapsed time at a section's start: where a slow run spends it (engine builds, compiles)."""
        print(f"[{time.monotonic() - self.start:.0f} s] {what}", flush=True)

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def built(self, engine: RolloutEngine) -> None:
        """Record the expert path the engine runs as the profile's expert_kernel. Every engine is built from
        the same --expert-kernel on the same device, so they agree; one that did not would make the profile
        mix paths under one name, hence the error."""
        kernel = kernel_of(engine.model)
        if self.out["expert_kernel"] not in (None, kernel):
            raise RuntimeError(f"an engine runs {kernel} experts, an earlier one {self.out['expert_kernel']}")
        self.out["expert_kernel"] = kernel

    def skip(self, name: str, point: dict, reason: str) -> None:
        self.out["skipped"].append({"section": name, **point, "reason": reason})
        print(f"{name} {point}: skipped ({reason})", flush=True)

    def attempt(self, name: str, point: dict, measure):
        """measure(), or None when it raised: the exception is recorded under "errors" (the run goes on); memory
        is freed after each point. GpuStalled propagates untouched: freeing memory would wait on the stuck GPU."""
        try:
            row = measure()
        except GpuStalled:
            raise
        except Exception as err:  # one failing point must not lose the others
            traceback.print_exc()
            self.out["errors"].append({"section": name, **point, "error": f"{type(err).__name__}: {err}"})
            row = None
        free_memory()
        return row

    def point(self, name: str, point: dict, measure) -> None:
        """Append {**point, **measure()} to the section's rows; over the time budget the point is skipped."""
        if self.over():
            self.skip(name, point, "time budget (--time-budget-s) spent")
            return
        row = self.attempt(name, point, measure)
        if row is not None:
            self.out[name].append({**point, **row})
            print(f"[{time.monotonic() - self.start:.0f} s]", name, self.out[name][-1], flush=True)

    def points(self, name: str, points: dict[tuple, dict], why: dict[tuple, str], measure) -> list[dict]:
        """Each point (its key -> its row keys) measured as {**point, **measure(*key)}, or skipped with why[key]
        where it does not fit. Returns the section's rows."""
        for key, point in points.items():
            if key in why:
                self.skip(name, point, why[key])
            else:
                self.point(name, point, lambda k=key: measure(*k))
        return self.out[name]


def attention_ms(prof: LayerProfile, batch: int, context: int, args) -> float:
    """The attention part of a decode step of `batch` rows each at position `context`, per rep."""
    with prof.decode_rows(batch, context, seed=batch + context) as step:
        return step_attention_ms(prof, step, args)


def prefill_attention_ms(prof: LayerProfile, seqs: int, length: int, args) -> float:
    """The attention part of a prefill-only step of `seqs` prompts of `length` tokens from position 0, per rep:
    what a prefill attention worker runs per layer."""
    with prof.prefill_rows(seqs, length, seed=seqs + length) as step:
        return step_attention_ms(prof, step, args)


def step_attention_ms(prof: LayerProfile, step: StepBatch, args) -> float:
    """Attention block + router of the step's tokens (LayerProfile.attention), per rep (per_rep_ms)."""
    x_TH, cos_TD, sin_TD = prof.model.embed(step)
    return per_rep_ms(prof, lambda i: prof.attention(step, x_TH, cos_TD, sin_TD, i), args)


def experts_ms(prof: LayerProfile, tokens: int, args, phase: str = "decode") -> float:
    """The experts of a pass of `tokens` tokens of `phase` (LayerProfile.experts), per rep."""
    x = prof.inputs(tokens, seed=tokens)
    return per_rep_ms(prof, lambda i: prof.experts(x, i, phase), args)


def overlap_row(prof: LayerProfile, batch: int, context: int, tokens: int, args) -> dict:
    """Attention of one micro-batch and experts of another: alone, summed, and on two streams at once (each a
    graph of R reps, so R layers of attention run beside R layers of experts; all times per rep)."""
    device, reps = prof.device, prof.num_layers
    x = prof.inputs(tokens, seed=tokens)
    with prof.decode_rows(batch, context, seed=batch + context) as step:
        x_TH, cos_TD, sin_TD = prof.model.embed(step)
        attention = graphed(
            repeated(lambda i: prof.attention(step, x_TH, cos_TD, sin_TD, i), reps), device, args.eager
        )
        experts = graphed(repeated(lambda i: prof.experts(x, i), reps), device, args.eager)
        both = two_streams(attention, experts, device)
        row = {
            name: median_ms(device, fn, args.warmup, args.repeats, args.stall_s) / reps
            for name, fn in (("attention_ms", attention), ("experts_ms", experts), ("two_streams_ms", both))
        }
    row["sum_ms"] = row["attention_ms"] + row["experts_ms"]
    return row


def step_parts(prof: LayerProfile, batch: int, context: int, rows: dict, args) -> tuple[float, float]:
    """(attention ms at batch x context, experts ms at `batch` tokens): the sections' rows where they have the
    point, else measured now the same way."""
    attention = {(r["batch"], r["context"]): r["ms"] for r in rows["attention"]}.get((batch, context))
    experts = {r["tokens"]: r["ms"] for r in rows["experts"] if r["phase"] == "decode"}.get(batch)
    if attention is None:
        attention = attention_ms(prof, batch, context, args)
    if experts is None:
        experts = experts_ms(prof, batch, args)
    return attention, experts


# --------------------------------------------------------------------------------------------- sections
def layer_sections(run: Recorder, args, base: dict, device: torch.device, dtype: torch.dtype) -> None:
    """Sections attention, prefill_attention and experts, and the parts of the overhead section's points
    (run.parts), on one LayerProfile of `--graph-reps` layers whose cache holds their largest point and whose
    steps take the largest prefill point."""
    spec = MoeModelSpec.from_hf_config(model_config(base, args.graph_reps))
    grid = [(b, c) for c in args.contexts for b in args.batches]
    budget = kv_budget(spec, device, dtype)
    fit, why = fitting(grid + step_grid(args), spec, dtype, budget)
    prefill_fit, prefill_why = prefill_fitting(args.prefill_points, spec, dtype, budget)
    sizes = engine_sizes(fit, prefill_fit) if fit or prefill_fit else engine_sizes([(1, 1)])
    prof = LayerProfile(
        base, device, dtype, **sizes, num_layers=args.graph_reps, expert_kernel=args.expert_kernel
    )
    run.built(prof.engine)
    tokens = sorted({*args.expert_tokens, *args.prefill_expert_tokens})
    run.out["meta"]["expert_paths"] = {t: prof.expert_path(t) for t in tokens}

    def attention() -> list[dict]:
        points = {(b, c): {"batch": b, "context": c} for b, c in grid}
        return run.points("attention", points, why, lambda b, c: {"ms": attention_ms(prof, b, c, args)})

    def prefill_attention() -> list[dict]:
        points = {(n, s): {"seqs": n, "length": s} for n, s in args.prefill_points}
        return run.points(
            "prefill_attention",
            points,
            prefill_why,
            lambda n, s: {"ms": prefill_attention_ms(prof, n, s, args)},
        )

    def experts() -> list[dict]:
        points = {(t, "decode"): {"tokens": t, "phase": "decode"} for t in args.expert_tokens}
        points |= {(t, "prefill"): {"tokens": t, "phase": "prefill"} for t in args.prefill_expert_tokens}
        return run.points("experts", points, {}, lambda t, phase: {"ms": experts_ms(prof, t, args, phase)})

    def parts() -> None:
        for batch, context in step_grid(args):
            if (batch, context) in why or run.over():
                continue  # the overhead section skips the point, with the reason
            point = {"batch": batch, "context": context}
            got = run.attempt(
                "overhead", point, lambda b=batch, c=context: step_parts(prof, b, c, run.out, args)
            )
            if got is not None:
                run.parts[batch, context] = got

    for name, fn in (
        ("attention", attention),
        ("prefill_attention", prefill_attention),
        ("experts", experts),
    ):
        section(name, fn, run.out)
        save(run.out, args.json)
    run.mark("the overhead's parts")
    parts()


def overlap_section(run: Recorder, args, base: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Attention of one micro-batch beside experts of another on two streams, on a LayerProfile of its own (built
    after the other sections' engines are gone, sized for these points only). It runs last: a stalled GPU (the
    `--stall-s` watchdog) then costs no other section's numbers."""
    if device.type != "cuda":
        for batch, context, tokens in args.overlap:
            run.skip("overlap", {"batch": batch, "context": context, "tokens": tokens}, "needs CUDA streams")
        return run.out["overlap"]
    spec = MoeModelSpec.from_hf_config(model_config(base, args.graph_reps))
    fit, why = fitting([(b, c) for b, c, _ in args.overlap], spec, dtype, kv_budget(spec, device, dtype))
    prof = None
    if fit:
        sizes = engine_sizes(fit)
        prof = LayerProfile(
            base, device, dtype, **sizes, num_layers=args.graph_reps, expert_kernel=args.expert_kernel
        )
        run.built(prof.engine)
    for batch, context, tokens in args.overlap:
        point = {"batch": batch, "context": context, "tokens": tokens}
        if (batch, context) in why:
            run.skip("overlap", point, why[batch, context])
        else:
            run.point("overlap", point, lambda p=(batch, context, tokens): overlap_row(prof, *p, args))
    return run.out["overlap"]


def step_grid(args) -> list[tuple[int, int]]:
    """(batch, context) points of the steps and overhead sections."""
    return [(b, c) for c in args.step_contexts for b in args.step_batches]


def step_engine(run: Recorder, args, base: dict, num_layers: int, device, dtype, prefill=()):
    """(an engine of `num_layers` layers, CUDA graphs on unless --eager, the --expert-kernel path, whose KV holds
    the largest step point and the largest `prefill` point (seqs, length) that fit and whose steps take that
    prefill whole, or None; {point: why not} for the step points and for the prefill points that do not
    fit)."""
    cfg = model_config(base, num_layers)
    spec = MoeModelSpec.from_hf_config(cfg)
    budget = kv_budget(spec, device, dtype)
    fit, why = fitting(step_grid(args), spec, dtype, budget)
    prefill_fit, prefill_why = prefill_fitting(list(prefill), spec, dtype, budget)
    if not (fit or prefill_fit) or run.over():  # past the budget every point is skipped: no engine to build
        return None, why, prefill_why
    config = sized_config(engine_sizes(fit, prefill_fit), args.expert_kernel, cuda_graphs=not args.eager)
    engine = RolloutEngine.from_config(cfg, device=device, dtype=dtype, config=config, seed=0)
    run.built(engine)
    fill_cache(engine)
    return engine, why, prefill_why


def prefill_step_ms(engine: RolloutEngine, seqs: int, length: int, args, device: torch.device) -> float:
    """Median time of one whole runner step prefilling `seqs` prompts of `length` tokens from position 0
    (rollout_decode.time_step; a step of more than cuda_graph_max_tokens tokens runs eagerly, as the engine
    runs it)."""
    with prefill_step(engine, seqs, length, seed=seqs + length) as inputs:
        return time_step(engine, inputs, args.repeats, device)


def steps_section(run: Recorder, args, base: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Whole decode steps and prefill-only steps of a `--step-layers` engine where the KV fits (rows marked by
    their phase)."""
    engine, why, prefill_why = step_engine(
        run, args, base, args.step_layers, device, dtype, args.prefill_points
    )

    def point(phase: str, batch: int, context: int) -> dict:
        return {
            "layout": "replicas",
            "phase": phase,
            "batch": batch,
            "context": context,
            "num_layers": args.step_layers,
        }

    decode = {(b, c): point("decode", b, c) for b, c in step_grid(args)}
    prefill = {(n, s): point("prefill", n, s) for n, s in args.prefill_points}
    run.points(
        "steps",
        decode,
        why,
        lambda b, c: {"step_ms": time_replay(engine, b, at_context(c, args.repeats), device)},
    )
    run.points(
        "steps", prefill, prefill_why, lambda n, s: {"step_ms": prefill_step_ms(engine, n, s, args, device)}
    )
    engine = None  # its KV cache goes before the JSON is written
    free_memory()
    return run.out["steps"]


def overhead_parts(steps: tuple[float, float], parts: tuple[float, float]) -> dict:
    """Steps of one and two layers: layer_ms = step2_ms - step_ms (what a layer adds inside a step) and ms =
    step_ms - layer_ms (the step with no layer); attention_ms + experts_ms are the layer's passes timed alone."""
    one, two = steps
    attention, experts = parts
    return {
        "ms": 2 * one - two,
        "layer_ms": two - one,
        "step_ms": one,
        "step2_ms": two,
        "attention_ms": attention,
        "experts_ms": experts,
    }


def prefill_parts(out: dict, seqs: int, length: int) -> tuple[float, float] | None:
    """(prefill attention ms of seqs x length, prefill-phase experts ms of seqs * length tokens) from the
    sections' rows, or None when either was not measured."""
    attention = {(r["seqs"], r["length"]): r["ms"] for r in out["prefill_attention"]}.get((seqs, length))
    experts = {r["tokens"]: r["ms"] for r in out["experts"] if r["phase"] == "prefill"}.get(seqs * length)
    return None if attention is None or experts is None else (attention, experts)


def overhead_section(run: Recorder, args, base: dict, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """The step's fixed cost of each phase and what a layer adds inside a step: whole steps of a ONE-layer and a
    TWO-layer engine at every step point (decode) and every prefill point, beside that point's layer timed
    alone by layer_sections (run.parts for decode; the prefill attention and prefill-phase experts rows). A
    prefill step's fixed cost differs from a decode step's (no graph replay at large steps, its own sampling and
    copies), so each phase gets its own rows."""
    timed: dict[tuple[str, int, int], list[float]] = {}  # point -> [one-layer step ms, two-layer step ms]
    for num_layers in (1, 2):
        engine, why, prefill_why = step_engine(
            run, args, base, num_layers, device, dtype, args.prefill_points
        )
        step_fns = {
            **{("decode", b, c): partial(time_replay, engine, b, at_context(c, args.repeats), device)
               for b, c in step_grid(args)},
            **{("prefill", n, s): partial(prefill_step_ms, engine, n, s, args, device)
               for n, s in args.prefill_points},
        }  # fmt: skip
        for key, step in step_fns.items():
            if len(timed.get(key, ())) == num_layers - 1:  # a point whose one-layer step failed stops there
                why_not = (why if key[0] == "decode" else prefill_why).get(key[1:])
                _time_step(run, timed, key, why_not, step)
        engine = None  # its KV cache goes before the next engine
        free_memory()
    for (phase, b, c), ms in timed.items():
        row = {"phase": phase, "batch": b, "context": c}
        parts = run.parts.get((b, c)) if phase == "decode" else prefill_parts(run.out, b, c)
        if len(ms) < 2:
            run.skip("overhead", row, "the two-layer step was not measured (see skipped and errors)")
        elif parts is None:
            run.skip("overhead", row, "no attention/experts time at this point (see skipped and errors)")
        else:
            run.point("overhead", row, lambda s=tuple(ms), p=parts: overhead_parts(s, p))
    return run.out["overhead"]


def _time_step(run: Recorder, timed: dict, key: tuple[str, int, int], why_not: str | None, step) -> None:
    """Append the step's time to timed[key], or record why it was not measured."""
    point = {"phase": key[0], "batch": key[1], "context": key[2], "num_layers": len(timed.get(key, ())) + 1}
    if why_not is not None:
        run.skip("overhead", point, why_not)
    elif run.over():
        run.skip("overhead", point, "time budget (--time-budget-s) spent")
    elif (ms := run.attempt("overhead", point, step)) is not None:
        timed.setdefault(key, []).append(ms)


def new_profile(args, base: dict, device: torch.device) -> dict:
    spec = MoeModelSpec.from_hf_config(base)
    return {
        "schema": SCHEMA,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "copy_GBps": args.bandwidth / 1e9,
        "expert_kernel": None,  # the path the engines run, set as the first is built (Recorder.built)
        "model": {
            "hidden_size": spec.hidden_size,
            "num_experts": spec.num_experts,
            "top_k": spec.top_k,
            "moe_ffn": spec.moe_ffn_size,
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "num_layers": spec.num_layers,
            "vocab_size": spec.vocab_size,
        },
        "attention": [],
        "prefill_attention": [],
        "experts": [],
        "overlap": [],
        "steps": [],
        "overhead": [],
        "skipped": [],
        "errors": [],
        "meta": {
            "args": vars(args),
            "torch": torch.__version__,
            "cuda_graphs": device.type == "cuda" and not args.eager,
        },
    }


# --------------------------------------------------------------------------------------------- output
def print_tables(out: dict) -> None:
    attention = {(r["batch"], r["context"]): r["ms"] for r in out["attention"]}
    batches = sorted({b for b, _ in attention})
    contexts = sorted({c for _, c in attention})
    print("\nattention ms per layer (rows: batch, columns: context)")
    print("| batch | " + " | ".join(str(c) for c in contexts) + " |\n|---|" + "---|" * len(contexts))
    for b in batches:
        cells = (f"{attention[b, c]:.3f}" if (b, c) in attention else "-" for c in contexts)
        print(f"| {b} | " + " | ".join(cells) + " |")
    print("\n| prefill seqs | length | attention ms per layer |\n|---|---|---|")
    for r in out["prefill_attention"]:
        print(f"| {r['seqs']} | {r['length']} | {r['ms']:.3f} |")
    paths = out["meta"].get("expert_paths", {})
    print(f"\n| expert tokens | phase | ms | path ({out['expert_kernel']}) |\n|---|---|---|---|")
    for r in out["experts"]:
        print(f"| {r['tokens']} | {r['phase']} | {r['ms']:.3f} | {paths.get(r['tokens'], '-')} |")
    print("\n| batch | context | tokens | attention ms | experts ms | sum ms | two streams ms | saved |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["overlap"]:
        saved = 1 - r["two_streams_ms"] / r["sum_ms"]
        print(
            f"| {r['batch']} | {r['context']} | {r['tokens']} | {r['attention_ms']:.3f} | {r['experts_ms']:.3f} | "
            f"{r['sum_ms']:.3f} | {r['two_streams_ms']:.3f} | {100 * saved:.0f}% |"
        )
    print("\n| layout | layers | phase | batch | context | step ms |\n|---|---|---|---|---|---|")
    for r in out["steps"]:
        print(
            f"| {r['layout']} | {r['num_layers']} | {r['phase']} | {r['batch']} | {r['context']} | "
            f"{r['step_ms']:.2f} |"
        )
    print("\n| phase | batch | context | 1-layer step ms | attention ms | experts ms | overhead ms |")
    print("|---|---|---|---|---|---|---|")
    for r in out["overhead"]:
        print(
            f"| {r['phase']} | {r['batch']} | {r['context']} | {r['step_ms']:.3f} | {r['attention_ms']:.3f} | "
            f"{r['experts_ms']:.3f} | {r['ms']:.3f} |"
        )
    errors = out["errors"] + [
        {"section": k[: -len("_error")], "error": v} for k, v in out.items() if k.endswith("_error")
    ]
    print(f"\n{len(out['skipped'])} points skipped, {len(errors)} errors")
    for e in errors:
        print(f"  {e}")


def overlap_points(text: str) -> list[tuple[int, int, int]]:
    """batch:context:tokens,... (a command-line option)."""
    return [tuple(int(x) for x in p.split(":")) for p in text.split(",") if p]


def prefill_points(text: str) -> list[tuple[int, int]]:
    """seqs:length,... (a command-line option): prompts per prefill step and tokens per prompt, both >= 1."""
    points = [tuple(int(x) for x in p.split(":")) for p in text.split(",") if p]
    if any(len(p) != 2 or min(p) < 1 for p in points):
        raise argparse.ArgumentTypeError(f"want seqs:length,... of positive ints, got {text!r}")
    return points


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="store_true", help="measure and write the profile JSON")
    ap.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (smoke test of the script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    # Defaults sized for ~150 s on a fresh H100 (cold Triton / Inductor caches: most of the time is compiling),
    # inside --time-budget-s 200: the fits have 3 coefficients each, and the step points are among them
    ap.add_argument("--batches", type=int_list, default=[1, 32, 128, 256])
    ap.add_argument("--contexts", type=int_list, default=[1024, 4096, 13312])
    ap.add_argument("--expert-tokens", type=int_list, default=[1, 8, 32, 64, 256, 1024, 2048, 4096, 8192])
    ap.add_argument(
        "--prefill-points",
        type=prefill_points,
        default=prefill_points("1:512,1:2048,4:512,4:2048,1:8192"),
        help="seqs:length points of the prefill_attention section and the steps section's prefill rows",
    )
    ap.add_argument(
        "--prefill-expert-tokens",
        type=int_list,
        default=None,
        help="token counts of the experts section's prefill passes (no decode rows); default: the "
        "--prefill-points' seqs x length",
    )
    ap.add_argument(
        "--expert-kernel",
        default="auto",
        choices=("auto", "grouped", "padded", "persistent"),
        help="every engine's RolloutConfig.expert_kernel (auto: persistent on CUDA, grouped on the CPU)",
    )
    ap.add_argument(
        "--overlap",
        type=overlap_points,
        default=overlap_points("32:4096:256,128:13312:1024"),
        help="batch:context:tokens points of the overlap section",
    )
    ap.add_argument("--step-layers", type=int, default=4)
    ap.add_argument("--step-batches", type=int_list, default=[1, 32, 256])
    ap.add_argument("--step-contexts", type=int_list, default=[4096, 13312])
    ap.add_argument(
        "--graph-reps",
        type=int,
        default=8,
        help="reps (one per layer of the timing engine) in one CUDA graph per timed layer part; time / reps",
    )
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="time op by op (no CUDA graphs)")
    ap.add_argument("--time-budget-s", type=float, default=200.0, help="points starting later are skipped")
    ap.add_argument(
        "--stall-s",
        type=float,
        default=60.0,
        help="overlap section: a timing the GPU has not finished after this many seconds ends the run (exit 3)",
    )
    add_bandwidth_arg(ap)
    ap.add_argument("--json", default="bench/out/rollout_disagg_profile.json")
    if ap.parse_known_args(argv)[0].tiny:
        ap.set_defaults(**TINY_ARGS)
    args = ap.parse_args(argv)
    if not args.profile:
        ap.error("nothing to do: pass --profile")
    if args.graph_reps < 1:
        ap.error("--graph-reps must be >= 1")
    if args.prefill_expert_tokens is None:  # the prefill steps' passes, so the planner's fit has their points
        args.prefill_expert_tokens = sorted({n * s for n, s in args.prefill_points})
    return args


def finish(run: Recorder, args, t0: float) -> None:
    """The run's time into the profile, the profile written, its tables printed."""
    run.out["meta"]["seconds"] = time.monotonic() - t0
    save(run.out, args.json)
    print_tables(run.out)


def stalled(run: Recorder, args, name: str, err: GpuStalled, t0: float) -> None:
    """Record the stall, finish the run, and end the process without waiting on the GPU (exit status 3): CUDA's
    teardown would wait for the stuck work."""
    print(f"{name}: {err}; writing what was measured and exiting", flush=True)
    run.out["errors"].append({"section": name, "error": f"GpuStalled: {err}"})
    finish(run, args, t0)
    sys.stdout.flush()
    os._exit(3)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    base = TINY if args.tiny else QWEN3_30B_A3B
    t0 = time.monotonic()
    resolve_bandwidth(args, device)
    run = Recorder(new_profile(args, base, device), args.time_budget_s)
    with torch.inference_mode():
        try:
            layer_sections(run, args, base, device, dtype)
        except Exception as err:  # the layer engine could not be built: the steps may still run
            traceback.print_exc()
            run.out["errors"].append(
                {"section": "attention,experts", "error": f"{type(err).__name__}: {err}"}
            )
            free_memory()
        # overhead before steps: the planner needs it, the steps only check the planner
        for name, fn in (
            ("overhead", overhead_section),
            ("steps", steps_section),
            ("overlap", overlap_section),
        ):
            run.mark(f"section {name}: building its engine")
            try:
                section(name, lambda f=fn: f(run, args, base, device, dtype), run.out)
            except GpuStalled as err:
                stalled(run, args, name, err, t0)
            save(run.out, args.json)
    finish(run, args, t0)
    return run.out


if __name__ == "__main__":
    main()
