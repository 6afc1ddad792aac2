"""The deployment search: MegaScale-Infer's Algorithm 1 (section 4.2) for the disaggregated layout and the same
profile evaluated for the replicas layout, so the planner picks the layout too.

Disaggregated: `num_attn` attention workers of `attn_tp` GPUs (data-parallel, each with its own KV cache) and
`num_expert` expert workers of `expert_tp` GPUs (each holds E / num_expert experts of every layer), m micro-batches
of `micro_batch` rows per attention worker. Departures from the paper, which puts one expert on each expert node:
the number of expert workers is searched too (any divisor of E whose experts fit), because 128 small experts
over 8 GPUs cannot take one GPU each; T_e is the time of a worker holding E_w experts for all n_a b_a tokens of a
micro-batch, so the paper's n_a = k1 E / (k3 K) becomes n_a = k1 / k3' with k3' the slope of that worker's time
in the micro-batch's tokens (the same balance T_a = T_e without the intercepts; with one expert per worker,
k3' = k3 K / E and the two agree). n_a is tried rounded down and up, within the GPU budget.

Replicas: the GPUs form N / g replicas of g GPUs (TP for attention, EP for experts), each with all weights and its
own KV cache; a step is L (T_a + T_e + 2 T_c) with T_c a ring all-reduce over NVLink (0 at g = 1).

Both add the step's fixed cost once per step, so a step of b rows (replicas; disaggregated: b = m b_a rows of
one attention worker) takes

    replicas:       T_step = L (T_a + T_e + 2 T_c) + O(b)
    disaggregated:  T_step = pingpong_iteration_ms(T_a, T_e, T_c, m, L) + O(m b_a)   (m = 1: L (T_a + T_e + 2 T_c))

with O(b) = o0 + o1 b fitted to the profile's "overhead" rows (embedding, LM head, sampling, host copies, the
sync; rollout/plan/profile.py), or the LM head's roofline where there are none. T_step is what equation 7 tests
against the latency target and what divides the batch in the throughput. The objective is tokens/s per GPU
over all N GPUs (a plan using fewer GPUs is copied N // used times; GPUs are all one kind, so per GPU = per
cost).

Why the binary search is exact: every time here is nondecreasing in the batch b and T(b) / b is nonincreasing
(each term is affine with a non-negative intercept, concave with T(0) >= 0, or a max or sum of such), so a
larger feasible batch never lowers tokens/s and the largest b meeting equations 7 and 8 is the best for its
structure. `brute_force` checks this by scanning every b.

Legend: b_a rows of one attention worker's micro-batch, t tokens at the experts, g a TP degree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import numpy as np

from rollout.plan.hardware import GB, GpuSpec, ModelShape, divisors, powers_of_two
from rollout.plan.perf import (
    comm_ms,
    hit_probability,
    max_kv_seqs,
    meets_latency,
    pingpong_check,
    pingpong_iteration_ms,
    transfer_ms,
)
from rollout.plan.profile import LayerTimes

DISPATCH_MODES = ("all", "routed")


@dataclass(frozen=True)
class Workload:
    """Decode rows of `prompt_len + output_len` positions at most; attention is timed at the mean context."""

    prompt_len: int
    output_len: int
    latency_ms: float | None = None

    @property
    def context_avg(self) -> float:
        return self.prompt_len + self.output_len / 2

    @property
    def context_max(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class Cluster:
    """GPUs and links. Bandwidths in GB/s per GPU; `dispatch` "routed" sends a token only to the expert workers
    holding one of its experts (the paper and rollout/disagg.py), "all" to every expert worker."""

    num_gpus: int
    gpu: GpuSpec
    gpus_per_node: int = 8
    nvlink_GBps: float | None = None
    nic_GBps: float = 50.0
    link_latency_us: float = 10.0
    mem_util: float = 0.9
    dispatch: str = "routed"

    @property
    def capacity(self) -> float:
        """Usable bytes of one GPU (the rest: activations, allocator slack)."""
        return self.gpu.memory_bytes * self.mem_util

    @property
    def intra_bandwidth(self) -> float:
        return (self.nvlink_GBps if self.nvlink_GBps is not None else self.gpu.nvlink_bandwidth / GB) * GB

    def link_bandwidth(self, gpus_used: int) -> float:
        """Per-GPU bytes/s between workers: NVLink inside one node, the NIC across nodes."""
        return self.intra_bandwidth if gpus_used <= self.gpus_per_node else self.nic_GBps * GB


@dataclass(frozen=True)
class Shape:
    """The structural choices of one plan; replicas have num_attn = num_expert = 1 on the same `attn_tp` GPUs."""

    layout: str
    attn_tp: int
    num_attn: int
    expert_tp: int
    num_expert: int
    num_micro: int

    @property
    def gpus(self) -> int:
        if self.layout == "replicas":
            return self.attn_tp
        return self.attn_tp * self.num_attn + self.expert_tp * self.num_expert


@dataclass(frozen=True)
class Plan:
    shape: Shape
    micro_batch: int  # rows of one attention worker's micro-batch (replicas: rows of a replica)
    batch: int  # rows decoded per step by one group: m n_a b_a (replicas: b)
    t_a_ms: float
    t_e_ms: float
    t_c_ms: float
    step_ms: float
    tokens_per_s_per_gpu: float
    copies: int
    sync_expert_bytes: float  # weights one GPU of an expert worker receives at a weight sync
    sync_attention_bytes: float  # ... one GPU of an attention worker
    balance: float
    pipeline_full: bool


@dataclass(frozen=True)
class Search:
    """Everything a plan is evaluated against."""

    model: ModelShape
    times: LayerTimes
    workload: Workload
    cluster: Cluster


# ---------------------------------------------------------------------------------- disaggregated layout
def dispatch_bytes_per_token(model: ModelShape) -> float:
    """What one token costs on the wire one way: bf16 hidden out and fp32 partial sums back (the larger), plus
    its K router weights (fp32) and ids (int32)."""
    return model.hidden_size * max(model.act_bytes, 4) + 8 * model.top_k


def disagg_comm_ms(s: Search, shape: Shape, b_a: int) -> float:
    """Equation 6 for one micro-batch and one direction: the attention worker sends b_a tokens to each expert
    worker (scaled by the hit probability when routed), an expert worker receives from all n_a."""
    m, c = s.model, s.cluster
    frac = 1.0
    if c.dispatch == "routed":
        frac = hit_probability(m.num_experts // shape.num_expert, m.num_experts, m.top_k)
    per_token = dispatch_bytes_per_token(m) * frac
    bw = c.link_bandwidth(shape.gpus)
    send = b_a * shape.num_expert * per_token
    recv = b_a * shape.num_attn * per_token
    return comm_ms(send, shape.attn_tp * bw, recv, shape.expert_tp * bw, c.link_latency_us)


def disagg_stage_ms(s: Search, shape: Shape, b_a: int) -> tuple[float, float, float]:
    """(T_a, T_e, T_c) of one layer and one micro-batch."""
    t_a = s.times.attention.ms(b_a, s.workload.context_avg, shape.attn_tp)
    local = s.model.num_experts // shape.num_expert
    t_e = s.times.experts.ms(b_a * shape.num_attn, local, shape.expert_tp)
    return t_a, t_e, disagg_comm_ms(s, shape, b_a)


def disagg_kv_limit(s: Search, shape: Shape) -> int:
    """Largest b_a equation 8 admits on an attention GPU (m b_a rows of context_max each); 0 if the expert
    worker's share of the experts does not fit its GPUs."""
    m = s.model
    if m.expert_bytes(m.num_experts // shape.num_expert) / shape.expert_tp > s.cluster.capacity:
        return 0
    return attention_kv_rows(s, shape.attn_tp, shape.num_micro)


def disagg_plan(s: Search, shape: Shape, b_a: int) -> Plan:
    t_a, t_e, t_c = disagg_stage_ms(s, shape, b_a)
    batch = shape.num_micro * shape.num_attn * b_a
    step = pingpong_iteration_ms(t_a, t_e, t_c, shape.num_micro, s.model.num_layers)
    step += s.times.fixed_ms(s.model, shape.num_micro * b_a, shape.attn_tp)
    check = pingpong_check(t_a, t_e, t_c, shape.num_micro)
    m = s.model
    return _finish(
        s,
        shape,
        b_a,
        batch,
        (t_a, t_e, t_c),
        step,
        m.expert_bytes(m.num_experts // shape.num_expert) / shape.expert_tp,
        m.dense_bytes / shape.attn_tp,
        check.balance,
        check.pipeline_full,
    )


def _finish(
    s: Search,
    shape: Shape,
    micro: int,
    batch: int,
    t: tuple[float, float, float],
    step: float,
    sync_e: float,
    sync_a: float,
    balance: float,
    full: bool,
) -> Plan:
    copies = s.cluster.num_gpus // shape.gpus
    per_gpu = batch / (step * 1e-3) * copies / s.cluster.num_gpus
    return Plan(shape, micro, batch, t[0], t[1], t[2], step, per_gpu, copies, sync_e, sync_a, balance, full)


def linear_slope(fn: Callable[[float], float], xs: np.ndarray) -> tuple[float, float]:
    """Least-squares line fn(x) ~ k x + c over xs: the paper's profiled linear fits (k1, k2) / (k3, k4)."""
    k, c = np.polyfit(xs, np.array([fn(float(x)) for x in xs]), 1)
    return float(k), float(c)


def attention_kv_rows(s: Search, attn_tp: int, num_micro: int) -> int:
    """Equation 8's bound on b_a for an attention worker, whatever the expert side."""
    m = s.model
    per_seq = m.kv_bytes_per_token / m.kv_shards(attn_tp)
    seqs = max_kv_seqs(s.workload.context_max, per_seq, m.dense_bytes / attn_tp, s.cluster.capacity)
    return seqs // num_micro


def attention_worker_counts(s: Search, shape: Shape, budget: int) -> list[int]:
    """n_a balancing T_a = T_e from the linear fits T_a = k1 b_a + k2 and T_e = k3' t + k4 (t = n_a b_a tokens
    at an expert worker): k1 b_a = k3' n_a b_a, so n_a = k1 / k3', rounded both ways and clipped to [1, budget].
    The lines are fitted over the operating range (b_a up to equation 8's bound, t up to budget times it),
    because the roofline is far from linear over a wider one."""
    if budget < 1:
        return []
    ctx, local = s.workload.context_avg, s.model.num_experts // shape.num_expert
    b_hi = max(2, attention_kv_rows(s, shape.attn_tp, shape.num_micro))
    rows = np.linspace(1, b_hi, 16)
    k1, _ = linear_slope(lambda b: s.times.attention.ms(b, ctx, shape.attn_tp), rows)
    k3, _ = linear_slope(lambda t: s.times.experts.ms(t, local, shape.expert_tp), rows * budget)
    if k3 <= 0:
        return [budget]
    ideal = k1 / k3
    return sorted({min(budget, max(1, n)) for n in (math.floor(ideal), math.ceil(ideal))})


def disagg_shapes(s: Search, micro_choices: Iterable[int], exhaustive: bool = False) -> list[Shape]:
    """Algorithm 1's loops: expert TP, expert workers, attention TP, m, and n_a from the fits (every n_a within
    the GPU budget when `exhaustive`)."""
    c, m = s.cluster, s.model
    tps = powers_of_two(min(c.gpus_per_node, c.num_gpus))
    out = []
    for expert_tp in tps:
        for num_expert in divisors(m.num_experts):
            if m.expert_bytes(m.num_experts // num_expert) / expert_tp > c.capacity:
                continue
            for attn_tp in [t for t in tps if t <= m.num_heads]:
                budget = (c.num_gpus - num_expert * expert_tp) // attn_tp
                for k in micro_choices:
                    base = Shape("disaggregated", attn_tp, 1, expert_tp, num_expert, k)
                    counts = range(1, budget + 1) if exhaustive else attention_worker_counts(s, base, budget)
                    out += [replace(base, num_attn=n) for n in counts]
    return out


# --------------------------------------------------------------------------------------- replicas layout
def replica_comm_ms(s: Search, tp: int, b: int) -> float:
    """Ring all-reduce of b hidden states over g GPUs on NVLink: 2 (g - 1) / g of the bytes; 0 at g = 1."""
    if tp == 1:
        return 0.0
    nbytes = 2 * (tp - 1) / tp * b * s.model.hidden_size * s.model.act_bytes
    return transfer_ms(nbytes, s.cluster.intra_bandwidth, s.cluster.link_latency_us)


def replica_kv_limit(s: Search, shape: Shape) -> int:
    m, tp = s.model, shape.attn_tp
    per_seq = m.kv_bytes_per_token / m.kv_shards(tp)
    return max_kv_seqs(s.workload.context_max, per_seq, m.total_bytes / tp, s.cluster.capacity)


def replica_plan(s: Search, shape: Shape, b: int) -> Plan:
    tp, m = shape.attn_tp, s.model
    t_a = s.times.attention.ms(b, s.workload.context_avg, tp)
    t_e = s.times.experts.ms(b, m.num_experts, tp)
    t_c = replica_comm_ms(s, tp, b)
    step = m.num_layers * (t_a + t_e + 2 * t_c) + s.times.fixed_ms(m, b, tp)
    return _finish(
        s,
        shape,
        b,
        b,
        (t_a, t_e, t_c),
        step,
        m.expert_bytes(m.num_experts) / tp,
        m.dense_bytes / tp,
        1.0,
        True,
    )


def replica_shapes(s: Search) -> list[Shape]:
    c = s.cluster
    tps = [t for t in powers_of_two(min(c.gpus_per_node, c.num_gpus)) if c.num_gpus % t == 0]
    return [Shape("replicas", t, 1, t, 1, 1) for t in tps]


# --------------------------------------------------------------------------------------------- searching
def evaluate(s: Search, shape: Shape, b: int) -> Plan:
    return replica_plan(s, shape, b) if shape.layout == "replicas" else disagg_plan(s, shape, b)


def kv_limit(s: Search, shape: Shape) -> int:
    return replica_kv_limit(s, shape) if shape.layout == "replicas" else disagg_kv_limit(s, shape)


def largest_true(ok: Callable[[int], bool], hi: int) -> int:
    """Largest b in [1, hi] with ok(b), for ok true up to some b and false after; 0 when ok(1) is false."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def best_for_shape(s: Search, shape: Shape) -> Plan | None:
    """Binary search of the largest batch meeting equation 8 (the bound) and equation 7 (the test)."""
    hi = kv_limit(s, shape)
    b = largest_true(lambda x: meets_latency(evaluate(s, shape, x).step_ms, s.workload.latency_ms), hi)
    return evaluate(s, shape, b) if b > 0 else None


def candidate_shapes(
    s: Search, layouts: Iterable[str], micro_choices: Iterable[int], exhaustive: bool = False
) -> list[Shape]:
    shapes: list[Shape] = []
    for layout in layouts:
        shapes += (
            replica_shapes(s) if layout == "replicas" else disagg_shapes(s, tuple(micro_choices), exhaustive)
        )
    return shapes


def search_plans(
    s: Search,
    layouts: Iterable[str] = ("replicas", "disaggregated"),
    micro_choices: Iterable[int] = (3, 4),
    exhaustive: bool = False,
) -> list[Plan]:
    """Algorithm 1 (and the replicas layout): the best plan of every structure, best first."""
    shapes = candidate_shapes(s, layouts, micro_choices, exhaustive)
    plans = [p for p in (best_for_shape(s, sh) for sh in shapes) if p]
    if not plans:
        raise ValueError(explain_infeasible(s, shapes))
    return sorted(plans, key=lambda p: (-p.tokens_per_s_per_gpu, p.shape.gpus, p.step_ms))


def brute_force(
    s: Search,
    layouts: Iterable[str] = ("replicas", "disaggregated"),
    micro_choices: Iterable[int] = (3, 4),
    exhaustive: bool = False,
) -> Plan | None:
    """Every structure and every batch up to the KV bound, no binary search: the reference for tests."""
    best: Plan | None = None
    for shape in candidate_shapes(s, layouts, micro_choices, exhaustive):
        for b in range(1, kv_limit(s, shape) + 1):
            p = evaluate(s, shape, b)
            if meets_latency(p.step_ms, s.workload.latency_ms) and (
                best is None or p.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu
            ):
                best = p
    return best


def explain_infeasible(s: Search, shapes: list[Shape]) -> str:
    """Why no plan exists: the weights, the KV of one row, or the latency target."""
    m, c = s.model, s.cluster
    fits = [sh for sh in shapes if kv_limit(s, sh) >= 1]
    if not fits:
        return (
            f"no plan fits memory: {m.name} needs {m.total_bytes / GB:.1f} GB of weights and "
            f"{m.kv_bytes_per_token * s.workload.context_max / GB:.2f} GB of KV per row at context "
            f"{s.workload.context_max}; {c.num_gpus} GPUs x {c.capacity / GB:.1f} GB usable"
        )
    fastest = min((evaluate(s, sh, 1) for sh in fits), key=lambda p: p.step_ms)
    return (
        f"no plan meets --latency-ms {s.workload.latency_ms}: the fastest, {describe(fastest.shape)} at batch 1, "
        f"takes {fastest.step_ms:.2f} ms per token"
    )


def describe(shape: Shape) -> str:
    if shape.layout == "replicas":
        return f"replicas of {shape.attn_tp} GPU(s)"
    return (
        f"{shape.num_attn} attention x TP{shape.attn_tp} + {shape.num_expert} expert x TP{shape.expert_tp}, "
        f"m={shape.num_micro}"
    )


def with_latency(s: Search, latency_ms: float | None) -> Search:
    return replace(s, workload=replace(s.workload, latency_ms=latency_ms))
