"""ExpertPlex's deployment optimizer (arXiv 2607.18002, section 6) and the two layouts it is compared with.

Architectures over N GPUs of one kind, for requests of `prompt_len` prompt and `output_len` output tokens:
- shared: n_p prefill-attention GPUs, n_d decode-attention GPUs (each holds the dense weights and runs its own
  sequences) and ONE expert pool of n_x GPUs holding every expert once, serving both phases; decode goes first
  and preempts prefill within one tile (a per-layer wait of `preempt_us`, 25 us after the paper's section 7.6).
- pd-replicas: prefill/decode disaggregation by instances of g GPUs, each instance holding all the weights.
- colocated: N / g instances of g GPUs, each serving both phases by time-sharing (a fraction f of the time on
  prefill stretches a decode step to T_d / (1 - f), which must stay within the SLO).

Goodput (equation 1), in requests/s: min(B_p / T_p, B_d / (T_d O)) with B_p sequences per prefill pass of T_p,
B_d decode rows per step of T_d, O output tokens. Kernel times (equation 2): t(x, s) = alpha + beta x + gamma x s
+ delta x s^2, fitted by non-negative least squares (relative error) to points: attention with x sequences and s
their length (decode: the `attention` rows of a profile, else the roofline; prefill: the `prefill_attention`
rows of a rollout-profile/3, else the roofline), MoE with x = x_moe = sum_e ceil(m_e / M_t) tiles (equation 3;
M_t = 16 for decode and 128 for prefill, rollout/kernels/tiling.py's BLOCK_M_DECODE / BLOCK_M_PREFILL; the kernel's
32-row decode tiles from S = 16 E / K tokens on are not modelled),
from the profile's `experts` rows of that phase (all rows when it has none of it) or the roofline converted to
expected tiles, and s unused. The points are the passes' in-step times (rollout/plan/profile.py's in_step: a
rollout-profile/4 scales each pass timed alone by what a layer measured to add inside a step). A pass of b rows
also pays the step's fixed cost O(b) (embedding, LM head, sampling, the host copy) where the profile has
`overhead` rows, a prefill pass of n s tokens its own O_p(n s) where it has prefill overhead rows (else O); the
roofline has none.
One GPU checks the model (`python -m rollout.plan --arch shared --validate P`): a colocated instance of one GPU
predicts a decode step of L layers as L (T_attn_d(b, C) + T_moe_d(x_moe(b))) + O(b) and a prefill pass of n
prompts of s tokens as L (T_attn_p(n, s) + T_moe_p(x_moe(n s))) + O_p(n s), against P's measured `steps`.

Assumptions (where this departs from or goes beyond the paper):
- Uniform routing (expected tiles); a pool splits its work evenly over its GPUs (x / n per GPU).
- Shared: decode runs MegaScale-Infer's ping-pong between the decode and expert pools (m in 1..3, searched) and
  takes a share phi = m L t_moe_d / T_d of the expert GPUs; prefill's MoE runs in the rest (its time divided by
  1 - phi), and prefill passes pipeline between the prefill and expert pools (a pass every L max(stage) ms).
  Instances (pd-replicas, colocated) run attention and MoE on the same GPUs, one after the other.
- Colocated time-sharing is ideal (no interference beyond the time split): the paper's measured blocking of
  decode by long prefill kernels (section 7.3) is not in a roofline and would lower colocation further.
- Pools (n_p, n_d, n_x; instance counts) are fixed at deployment; the decode batch B_d is a runtime knob chosen
  per workload (scanned: every B_d up to 256, then 2% steps), the prefill pass has `prefill_tokens` tokens.
- Memory: dense weights and the KV of the sequences a GPU holds (decode: prompt + output positions, prefill: the
  prompt) within `mem_util` of the GPU; KV heads split over an instance's g GPUs (TP), experts over the pool.

Legend: s sequence length, x work count (sequences or tiles), L layers, O output tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from rollout.kernels.tiling import BLOCK_M_DECODE as TILE_M_DECODE
from rollout.kernels.tiling import BLOCK_M_PREFILL as TILE_M_PREFILL
from rollout.plan.hardware import GB, GpuSpec, ModelShape, powers_of_two
from rollout.plan.perf import comm_ms, expected_tiles, pingpong_iteration_ms, roofline_ms
from rollout.plan.profile import (
    ExpertPoint,
    FittedOverhead,
    Profile,
    StepPoint,
    fit_overhead,
    in_step,
    relative_nnls,
)
from rollout.plan.search import Search, Workload, dispatch_bytes_per_token

PREEMPT_US = 25.0
ARCHS = ("shared", "pd-replicas", "colocated")


# ---------------------------------------------------------------------------------------- equation 2
@dataclass(frozen=True)
class KernelFit:
    """t(x, s) = alpha + beta x + gamma x s + delta x s^2 (ms)."""

    alpha: float
    beta: float
    gamma: float
    delta: float

    def ms(self, x: float, s: float) -> float:
        return self.alpha + x * (self.beta + self.gamma * s + self.delta * s * s)


def fit_kernel(points: Iterable[tuple[float, float, float]]) -> KernelFit:
    """Least squares (non-negative, relative error) of equation 2 to (x, s, ms) points."""
    rows = np.array(list(points), dtype=float)
    x, s, y = rows[:, 0], rows[:, 1], rows[:, 2]
    a = np.stack([np.ones_like(x), x, x * s, x * s * s], axis=1)
    c = relative_nnls(a, y)
    return KernelFit(float(c[0]), float(c[1]), float(c[2]), float(c[3]))


@dataclass(frozen=True)
class Kernels:
    decode_attention: KernelFit  # x decode rows, s context
    prefill_attention: KernelFit  # x prompts, s prompt length
    moe_decode: KernelFit  # x tiles of TILE_M_DECODE rows
    moe_prefill: KernelFit  # x tiles of TILE_M_PREFILL rows
    source: str
    overhead: FittedOverhead | None = None  # O(b), a decode step's fixed cost
    prefill_overhead: FittedOverhead | None = None  # O_p(t), a t-token prefill step's (else O)

    def fixed_ms(self, tokens: float, phase: str = "decode") -> float:
        fit = self.prefill_overhead if phase == "prefill" and self.prefill_overhead else self.overhead
        return fit.ms(tokens) if fit is not None else 0.0


@functools.lru_cache(maxsize=65536)
def moe_tiles(model: ModelShape, tokens: float, tile_m: int) -> float:
    """Expected x_moe of one layer for `tokens` tokens."""
    return expected_tiles(round(tokens), model.num_experts, model.top_k, tile_m)


def prefill_attention_ms(model: ModelShape, gpu: GpuSpec, seqs: float, length: float) -> float:
    """Roofline of one layer's causal prefill attention: weights + K/V writes; 2 s (weights) + 2 s^2 (q width)
    FLOPs per sequence (QK^T and PV over the causal half)."""
    tokens = seqs * length
    kv = tokens * 2 * model.num_kv_heads * model.head_dim * model.kv_bytes
    flops = (
        2 * tokens * model.attention_params_per_layer
        + 2 * seqs * length**2 * model.num_heads * model.head_dim
    )
    weights = model.attention_params_per_layer * model.weight_bytes
    return roofline_ms(weights + kv, flops, gpu.peak_flops, gpu.mem_bandwidth)


def phase_points(points: tuple[ExpertPoint, ...], phase: str, max_tokens: float) -> list[tuple[int, float]]:
    """(tokens, ms) of the expert passes of `phase` with at most `max_tokens` tokens; every pass when the
    profile has none of that phase (schema /1, /2, or an expert path whose cost does not depend on the phase).

    The cap keeps each phase's line on the passes it runs: a decode pass never holds more rows than a decode
    batch, and past that a tile's cost falls (an expert's second tile finds its weights in L2: on an H100 the
    persistent kernel ran 8192 decode rows in 4,096 tiles at 1.5 us a tile, 32 rows in ~110 at 3.5 us), so a
    line fitted through 8k-row decode passes predicted 32-row decode steps 19-25% fast (bench/RESULTS.md)."""
    chosen = [p for p in points if p.phase == phase] or list(points)
    return [(p.tokens, p.ms) for p in chosen if p.tokens <= max_tokens] or [(p.tokens, p.ms) for p in chosen]


def build_kernels(s: Search, profile: Profile | None) -> Kernels:
    """Equation 2 fitted per kernel; points from the profile (in-step times) where its schema has them, else the
    times model."""
    m, times, gpu = s.model, s.times, s.cluster.gpu
    profile = in_step(profile) if profile else None
    grid_b, grid_c = (1, 4, 16, 64, 256), (256, 1024, 4096, 16384)
    if profile and profile.attention:
        dec = [(p.batch, p.context, p.ms) for p in profile.attention]
    else:
        dec = [(b, c, times.attention.ms(b, c, 1)) for b in grid_b for c in grid_c]
    if profile and profile.prefill_attention:
        pre = [(p.seqs, p.length, p.ms) for p in profile.prefill_attention]
    else:
        pre = [
            (n, c, prefill_attention_ms(m, gpu, n, c)) for n in (1, 2, 8, 32) for c in (128, 512, 2048, 8192)
        ]
    if profile and profile.experts:
        # decode passes up to the largest decode batch the profile measured attention for
        rows = max((p.batch for p in profile.attention), default=math.inf)
        moe_d = phase_points(profile.experts, "decode", rows)
        moe_p = phase_points(profile.experts, "prefill", math.inf)
    else:
        grid_t = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
        moe_d = moe_p = [(t, times.experts.ms(t, m.num_experts, 1)) for t in grid_t]
    overhead, prefill_overhead = (phase_overhead(profile, phase) for phase in ("decode", "prefill"))
    source = "profile rows" if profile else times.source
    if not (profile and profile.prefill_attention):
        source += "; prefill attention: roofline"
    return Kernels(
        decode_attention=fit_kernel(dec),
        prefill_attention=fit_kernel(pre),
        moe_decode=fit_kernel((moe_tiles(m, t, TILE_M_DECODE), 0.0, ms) for t, ms in moe_d),
        moe_prefill=fit_kernel((moe_tiles(m, t, TILE_M_PREFILL), 0.0, ms) for t, ms in moe_p),
        source=source + ("; step fixed cost: profile overhead" if overhead else "; no step fixed cost"),
        overhead=overhead,
        prefill_overhead=prefill_overhead,
    )


def phase_overhead(profile: Profile | None, phase: str) -> FittedOverhead | None:
    """O fitted on the profile's overhead rows of `phase` (rows without a phase are decode steps'), or None."""
    rows = tuple(p for p in profile.overhead if p.phase == phase) if profile else ()
    return fit_overhead(rows) if rows else None


# ------------------------------------------------------------------------------------ one GPU's passes
def decode_pass_ms(k: Kernels, m: ModelShape, rows: float, context: float, layers: int, g: int = 1) -> float:
    """L (T_attn_d(b / g, C) + T_moe_d(x_moe(b) / g)): a decode step's layers on an instance of g GPUs."""
    moe = k.moe_decode.ms(moe_tiles(m, rows, TILE_M_DECODE) / g, 0.0)
    return layers * (k.decode_attention.ms(rows / g, context) + moe)


def prefill_pass_ms(k: Kernels, m: ModelShape, seqs: float, length: float, layers: int, g: int = 1) -> float:
    """L (T_attn_p(n / g, s) + T_moe_p(x_moe(n s) / g)): a prefill pass's layers on an instance of g GPUs."""
    moe = k.moe_prefill.ms(moe_tiles(m, seqs * length, TILE_M_PREFILL) / g, 0.0)
    return layers * (k.prefill_attention.ms(seqs / g, length) + moe)


def predict_step_ms(k: Kernels, m: ModelShape, step: StepPoint) -> float:
    """A measured one-GPU engine step as the planner models it: its pass over its layers plus O(rows)."""
    if step.phase == "prefill":
        fixed = k.fixed_ms(step.batch * step.context, "prefill")
        return prefill_pass_ms(k, m, step.batch, step.context, step.num_layers) + fixed
    return decode_pass_ms(k, m, step.batch, step.context, step.num_layers) + k.fixed_ms(step.batch)


# ------------------------------------------------------------------------------------------ the layouts
@dataclass(frozen=True)
class Demand(Workload):
    """The workload with the decode SLO (per-token time) and the prefill tokens of one pass."""

    tpot_ms: float = 0.0
    prefill_tokens: int = 0

    @property
    def prefill_seqs(self) -> int:
        """Prompts per prefill pass of one prefill GPU (shared) or instance (the others)."""
        return max(1, self.prefill_tokens // self.prompt_len)


@dataclass(frozen=True)
class Layout:
    """shared: GPUs per pool (instance_gpus = 1); pd-replicas: instances of `instance_gpus` per phase;
    colocated: `num_decode` instances doing both phases."""

    arch: str
    num_prefill: int
    num_decode: int
    num_expert: int
    instance_gpus: int
    num_micro: int = 1  # shared: decode micro-batches of the ping-pong

    @property
    def gpus(self) -> int:
        if self.arch == "shared":
            return self.num_prefill + self.num_decode + self.num_expert
        return (self.num_prefill + self.num_decode) * self.instance_gpus


@dataclass(frozen=True)
class Outcome:
    layout: Layout
    decode_batch: int  # B_d over the whole decode side
    prefill_batch: int  # prompts per prefill pass over the whole prefill side
    t_decode_ms: float
    t_prefill_ms: float
    prefill_rate: float  # requests/s
    decode_rate: float  # requests/s
    goodput: float  # requests/s = min of the two (colocated: at the best time split)
    prefill_time_share: float  # colocated: f; shared: 1 - phi (expert pool left to prefill); else 1


@dataclass(frozen=True)
class Ctx:
    model: ModelShape
    kernels: Kernels
    demand: Demand
    num_gpus: int
    capacity: float
    bandwidth: float
    latency_us: float
    preempt_us: float = PREEMPT_US


def _pass_ms(c: Ctx, attn_ms: float, moe_ms: float, comm: float) -> float:
    return c.model.num_layers * (attn_ms + moe_ms + 2 * comm)


def _comm(c: Ctx, tokens: float, senders: int, receivers: int) -> float:
    nbytes = tokens * dispatch_bytes_per_token(c.model)
    return comm_ms(nbytes, senders * c.bandwidth, nbytes, receivers * c.bandwidth, c.latency_us)


def _instance_comm(c: Ctx, tokens: float, g: int) -> float:
    """All-to-all inside an instance of g GPUs: each sends (g - 1) / g of its tokens; 0 at g = 1."""
    if g == 1:
        return 0.0
    nbytes = tokens / g * (g - 1) / g * dispatch_bytes_per_token(c.model)
    return comm_ms(nbytes, c.bandwidth, nbytes, c.bandwidth, c.latency_us)


def goodput(prefill_rate: float, decode_rate: float) -> float:
    """Equation 1: min(B_p / T_p, B_d / (T_d O)), both already in requests/s."""
    return min(prefill_rate, decode_rate)


def shared_outcome(c: Ctx, lay: Layout, b_d: int) -> Outcome:
    """Decode: the ping-pong of section 4.1 between the decode pool and the expert pool (m = lay.num_micro);
    prefill: passes pipelined between the prefill pool and the expert pool, so a pass every max(stage) ms."""
    k, m, d = c.kernels, c.model, c.demand
    micro = b_d / lay.num_micro
    moe_d = k.moe_decode.ms(moe_tiles(m, micro, TILE_M_DECODE) / lay.num_expert, 0.0) + c.preempt_us * 1e-3
    attn_d = k.decode_attention.ms(micro / lay.num_decode, d.context_avg)
    comm_d = _comm(c, micro, lay.num_decode, lay.num_expert)
    t_d = pingpong_iteration_ms(attn_d, moe_d, comm_d, lay.num_micro, m.num_layers) + k.fixed_ms(
        b_d / lay.num_decode
    )
    share = 1.0 - m.num_layers * lay.num_micro * moe_d / t_d
    b_p = d.prefill_seqs * lay.num_prefill
    moe_p = k.moe_prefill.ms(moe_tiles(m, b_p * d.prompt_len, TILE_M_PREFILL) / lay.num_expert, 0.0) / share
    attn_p = k.prefill_attention.ms(d.prefill_seqs, d.prompt_len)
    comm_p = _comm(c, b_p * d.prompt_len, lay.num_prefill, lay.num_expert)
    period = m.num_layers * max(attn_p, moe_p, comm_p)
    out = _outcome(c, lay, (b_d, b_p), t_d, period, (1, 1), share)
    return replace(out, t_prefill_ms=_pass_ms(c, attn_p, moe_p, comm_p))


def _instance_times(c: Ctx, g: int, b_d: float, b_p: float) -> tuple[float, float]:
    """(T_d, T_p) of one instance of g GPUs holding all weights: work split over g, all-to-all inside, plus the
    step's fixed cost (whole on every GPU of the instance)."""
    k, m, d, L = c.kernels, c.model, c.demand, c.model.num_layers
    t_d = decode_pass_ms(k, m, b_d, d.context_avg, L, g) + _pass_ms(c, 0.0, 0.0, _instance_comm(c, b_d, g))
    comm_p = _instance_comm(c, b_p * d.prompt_len, g)
    t_p = prefill_pass_ms(k, m, b_p, d.prompt_len, L, g) + _pass_ms(c, 0.0, 0.0, comm_p)
    return t_d + k.fixed_ms(b_d), t_p + k.fixed_ms(b_p * d.prompt_len, "prefill")


def pd_outcome(c: Ctx, lay: Layout, b_d: int) -> Outcome:
    """b_d rows per decode instance; rates summed over the phase's instances."""
    b_p = c.demand.prefill_seqs * lay.instance_gpus
    t_d, t_p = _instance_times(c, lay.instance_gpus, b_d, b_p)
    return _outcome(c, lay, (b_d, b_p), t_d, t_p, (lay.num_decode, lay.num_prefill), 1.0)


def colocated_outcome(c: Ctx, lay: Layout, b_d: int) -> Outcome:
    """Time split f = D / (P + D) equalises the rates, unless the SLO needs f <= 1 - T_d / SLO."""
    b_p = c.demand.prefill_seqs * lay.instance_gpus
    t_d, t_p = _instance_times(c, lay.instance_gpus, b_d, b_p)
    p_rate, d_rate = 1e3 * b_p / t_p, 1e3 * b_d / (t_d * c.demand.output_len)
    f = min(d_rate / (p_rate + d_rate), max(0.0, 1.0 - t_d / c.demand.tpot_ms))
    n = lay.num_decode
    return Outcome(
        lay,
        b_d * n,
        b_p * n,
        t_d / (1 - f) if f < 1 else float("inf"),
        t_p,
        n * f * p_rate,
        n * (1 - f) * d_rate,
        n * goodput(f * p_rate, (1 - f) * d_rate),
        f,
    )


def _outcome(
    c: Ctx, lay: Layout, rows: tuple[int, int], t_d: float, t_p: float, copies: tuple[int, int], share: float
) -> Outcome:
    """rows = (B_d, B_p) of one decode / prefill unit; copies = how many units of each phase run."""
    b_d, b_p = rows
    p_rate = copies[1] * 1e3 * b_p / t_p
    d_rate = copies[0] * 1e3 * b_d / (t_d * c.demand.output_len)
    return Outcome(
        lay, b_d * copies[0], b_p * copies[1], t_d, t_p, p_rate, d_rate, goodput(p_rate, d_rate), share
    )


OUTCOMES = {"shared": shared_outcome, "pd-replicas": pd_outcome, "colocated": colocated_outcome}


# ------------------------------------------------------------------------------------------- memory
def decode_rows_limit(c: Ctx, lay: Layout) -> int:
    """Largest b_d the memory admits (per decode instance; shared: over the decode pool); 0 if nothing fits."""
    m, d = c.model, c.demand
    if lay.arch == "shared":
        if m.expert_bytes(m.num_experts) / lay.num_expert > c.capacity:
            return 0
        free = c.capacity - m.dense_bytes - d.prefill_seqs * d.prompt_len * m.kv_bytes_per_token
        if free <= 0:
            return 0
        return int(free // (d.context_max * m.kv_bytes_per_token)) * lay.num_decode
    g = lay.instance_gpus
    free = (c.capacity - m.total_bytes / g) * m.kv_shards(g)
    if lay.arch == "colocated":
        free -= d.prefill_seqs * g * d.prompt_len * m.kv_bytes_per_token
    return max(0, int(free // (d.context_max * m.kv_bytes_per_token)))


def batch_grid(limit: int) -> list[int]:
    """Every batch up to 256, then steps of 2%, up to `limit`."""
    grid, b = list(range(1, min(limit, 256) + 1)), 256.0
    while b * 1.02 <= limit:
        b *= 1.02
        grid.append(round(b))
    return sorted(set(grid) | ({limit} if limit > 0 else set()))


def best_outcome(c: Ctx, lay: Layout) -> Outcome | None:
    """The decode batch with the highest goodput whose decode step meets the SLO."""
    fn = OUTCOMES[lay.arch]
    best = None
    for b in batch_grid(decode_rows_limit(c, lay)):
        out = fn(c, lay, b)
        if out.t_decode_ms <= c.demand.tpot_ms and (best is None or out.goodput > best.goodput):
            best = out
    return best


# ------------------------------------------------------------------------------------------- searching
def layouts(arch: str, c: Ctx) -> list[Layout]:
    n, m = c.num_gpus, c.model
    if arch == "shared":
        return [
            Layout("shared", p, n - x - p, x, 1, k)
            for x in range(1, n - 1)
            for p in range(1, n - x)
            for k in (1, 2, 3)
            if m.expert_bytes(m.num_experts) / x <= c.capacity
        ]
    sizes = [g for g in powers_of_two(n) if m.total_bytes / g <= c.capacity]
    if arch == "colocated":
        return [Layout(arch, 0, n // g, 0, g) for g in sizes]
    return [Layout(arch, p, n // g - p, 0, g) for g in sizes for p in range(1, n // g)]


@dataclass(frozen=True)
class SharedResult:
    best: dict[str, Outcome | None]  # per architecture
    demand: Demand
    kernels: Kernels


def optimize(c: Ctx, archs: Iterable[str] = ARCHS) -> dict[str, Outcome | None]:
    out: dict[str, Outcome | None] = {}
    for arch in archs:
        found = [o for o in (best_outcome(c, lay) for lay in layouts(arch, c)) if o]
        out[arch] = max(found, key=lambda o: o.goodput) if found else None
    return out


def evaluate_fixed(c: Ctx, lay: Layout) -> float:
    """Goodput of a deployed layout under `c`'s demand (only the decode batch re-chosen); 0 if infeasible."""
    best = best_outcome(c, lay)
    return best.goodput if best else 0.0


def make_ctx(s: Search, kernels: Kernels, tpot_ms: float, prefill_tokens: int) -> Ctx:
    w, cl = s.workload, s.cluster
    demand = Demand(
        prompt_len=w.prompt_len,
        output_len=max(1, w.output_len),
        tpot_ms=tpot_ms,
        prefill_tokens=prefill_tokens,
    )
    return Ctx(
        s.model, kernels, demand, cl.num_gpus, cl.capacity, cl.link_bandwidth(cl.num_gpus), cl.link_latency_us
    )


def plan_shared(
    s: Search, tpot_ms: float, prefill_tokens: int, profile: Profile | None = None
) -> SharedResult:
    c = make_ctx(s, build_kernels(s, profile), tpot_ms, prefill_tokens)
    best = optimize(c)
    if all(o is None for o in best.values()):
        raise ValueError(
            f"--arch shared: no layout meets --tpot-ms {tpot_ms} within memory on {c.num_gpus} GPUs "
            f"({s.model.total_bytes / GB:.1f} GB of weights, {c.capacity / GB:.1f} GB usable per GPU)"
        )
    return SharedResult(best, c.demand, c.kernels)


def with_demand(c: Ctx, prompt_len: int, output_len: int) -> Ctx:
    return replace(c, demand=replace(c.demand, prompt_len=prompt_len, output_len=output_len))


# ------------------------------------------------------------------------------------------- reporting
def _pools(lay: Layout) -> str:
    if lay.arch == "shared":
        return (
            f"{lay.num_prefill} prefill + {lay.num_decode} decode + {lay.num_expert} expert GPUs, "
            f"decode m={lay.num_micro}"
        )
    if lay.arch == "colocated":
        return f"{lay.num_decode} instances x {lay.instance_gpus} GPUs"
    return f"{lay.num_prefill} prefill + {lay.num_decode} decode instances x {lay.instance_gpus} GPUs"


def format_shared(r: SharedResult) -> str:
    d, k = r.demand, r.kernels
    lines = [
        f"demand: prompt {d.prompt_len}, output {d.output_len}, TPOT SLO {d.tpot_ms} ms, "
        f"{d.prefill_tokens} tokens per prefill pass",
        f"kernels (t = alpha + beta x + gamma x s + delta x s^2): {k.source}",
        "| arch | pools | B_d | B_p | T_d ms | T_p ms | prefill req/s | decode req/s | goodput req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for arch, o in r.best.items():
        if o is None:
            lines.append(f"| {arch} | no layout fits | | | | | | | 0 |")
            continue
        lines.append(
            f"| {arch} | {_pools(o.layout)} | {o.decode_batch} | {o.prefill_batch} | {o.t_decode_ms:.2f} | "
            f"{o.t_prefill_ms:.1f} | {o.prefill_rate:.2f} | {o.decode_rate:.2f} | {o.goodput:.2f} |"
        )
    win = max((o for o in r.best.values() if o), key=lambda o: o.goodput)
    lines.append(f"chosen: {win.layout.arch} ({_pools(win.layout)}), goodput {win.goodput:.2f} req/s")
    return "\n".join(lines)


def shared_rows(r: SharedResult) -> dict[str, Any]:
    return {
        "demand": asdict(r.demand),
        "kernels": {k: asdict(v) if isinstance(v, KernelFit) else v for k, v in asdict(r.kernels).items()},
        "architectures": {a: asdict(o) if o else None for a, o in r.best.items()},
    }


def drift_goodputs(
    c: Ctx, deployed: dict[str, Outcome | None], demands: Iterable[tuple[int, int]]
) -> dict[str, list[float]]:
    """Goodput of each deployed architecture under other (prompt, output) demands, pools unchanged."""
    pairs = list(demands)
    return {
        a: [evaluate_fixed(with_demand(c, p, o), out.layout) if out else 0.0 for p, o in pairs]
        for a, out in deployed.items()
    }


def format_drift(pairs: list[tuple[int, int]], table: dict[str, list[float]]) -> str:
    head = "| arch (pools fixed) | " + " | ".join(f"{p}:{o}" for p, o in pairs) + " | worst |"
    lines = ["goodput req/s when the demand drifts (prompt:output):", head, "|---" * (len(pairs) + 2) + "|"]
    for arch, values in table.items():
        lines.append(f"| {arch} | " + " | ".join(f"{v:.2f}" for v in values) + f" | {min(values):.2f} |")
    return "\n".join(lines)
