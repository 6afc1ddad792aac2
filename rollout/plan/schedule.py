"""Engine schedules on one GPU costed at its roofline by the planner's model: what the hardware allows any
engine that runs the same schedule (bench/tppo_vs_ppo.py: T-PPO's and PPO's steps; bench/rollout_long.py: the
slot cache's and the paged cache's schedules of one workload).

A schedule is a list of requests, each with its prompt (cached positions c_i), its new tokens n_i and the
engine step s_i at which it is prefilled; `decode_iterations` turns it into each decode step's rows and keys,
`RooflineCost` prices them."""

from __future__ import annotations

import argparse
import heapq
from dataclasses import dataclass, replace

import numpy as np

from rollout.plan import Cluster, GpuSpec, ModelShape, Search, Workload, analytic_times
from rollout.plan.perf import roofline_ms
from rollout.plan.search import Shape, replica_plan
from rollout.plan.shared import prefill_attention_ms

ONE_GPU = Shape("replicas", 1, 1, 1, 1, 1)


def decode_iterations(
    context_N: np.ndarray, new_N: np.ndarray, start_N: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The decode steps of a schedule whose row i is prefilled at step s_i (0 by default) from c_i positions
    and generates n_i tokens.

    A row's first token comes from its prefill, so row i decodes in steps j = s_i + 1 .. s_i + n_i - 1 with
    c_i + j - s_i positions cached. Returns, for j = 1 .. max(s + n) - 1,

        rows_J[j - 1] = #{i : s_i < j < s_i + n_i},    keys_J[j - 1] = sum over those i of (c_i + j - s_i)."""
    new_N = np.asarray(new_N, dtype=np.int64)
    start_N = np.zeros_like(new_N) if start_N is None else np.asarray(start_N, dtype=np.int64)
    end = int((start_N + new_N).max()) if len(new_N) else 0
    if end <= 1:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    first_N, stop_N = start_N + 1, start_N + new_N  # the row decodes in [first, stop)
    offset_N = np.asarray(context_N, dtype=float) - start_N  # keys = offset + j
    rows_J = np.cumsum(np.bincount(first_N, minlength=end + 1) - np.bincount(stop_N, minlength=end + 1))
    offset_J = np.cumsum(
        np.bincount(first_N, weights=offset_N, minlength=end + 1)
        - np.bincount(stop_N, weights=offset_N, minlength=end + 1)
    )
    rows_J, offset_J = rows_J[1:end], offset_J[1:end]
    return rows_J, offset_J + np.arange(1, end) * rows_J


def fifo_starts(new_N: np.ndarray, slots: int) -> np.ndarray:
    """Prefill steps of requests admitted in order into `slots` rows, each row freed when its request ends: a
    request holds its slot for its prefill step and n_i - 1 decode steps (`decode_iterations`), so it frees
    the slot at step s_i + n_i. The slot cache's schedule (every slot reserves max_model_len positions)."""
    if slots < 1:
        raise ValueError(f"slots={slots}: a schedule needs at least one slot")
    free = [0] * slots
    start_N = np.zeros(len(new_N), dtype=np.int64)
    for i, n in enumerate(new_N):
        start_N[i] = heapq.heappop(free)
        heapq.heappush(free, int(start_N[i] + n))
    return start_N


@dataclass(frozen=True)
class RooflineCost:
    """An engine step's time on one GPU by the deployment planner's roofline (rollout/plan), every kernel at
    its bound and no launch or host cost: an upper bound on speed that no engine beats.

    decode step of b rows with C cached positions on average: the planner's replica step
    L (T_a(b, C) + T_e(b)) + O(b), T_a reading the layer's attention weights and b C positions of K/V, T_e the
    weights of the experts b tokens touch (E (1 - (1 - K/E)^b) of them), O the LM head;
    prefill of rows with c_i positions, in chunks of `chunk` tokens: L (sum_i A(c_i) + sum_chunks T_e(chunk)),
    A the causal attention of c_i tokens (compute-bound)."""

    search: Search
    chunk: int

    def decode_ms(self, rows: int, keys: float) -> float:
        at = replace(self.search, workload=Workload(keys / rows, 0))
        return replica_plan(at, ONE_GPU, rows).step_ms

    def decode_s(self, rows_J: np.ndarray, keys_J: np.ndarray) -> float:
        return 1e-3 * sum(self.decode_ms(int(b), float(k)) for b, k in zip(rows_J, keys_J) if b)

    def prefill_s(self, context_N: np.ndarray) -> float:
        m, gpu, times = self.search.model, self.search.cluster.gpu, self.search.times
        total = int(np.sum(context_N))
        full, rest = divmod(total, self.chunk)
        experts = full * times.experts.ms(self.chunk, m.num_experts, 1)
        if rest:
            experts += times.experts.ms(rest, m.num_experts, 1)
        attention = sum(prefill_attention_ms(m, gpu, 1, int(c)) for c in context_N)
        return 1e-3 * m.num_layers * (attention + experts)


@dataclass(frozen=True)
class EveryExpert:
    """T_e when a step reads every expert's weights whatever its rows, as a dense model's decode does:
    max(E 3 h f bytes / B, 2 (3 h f) K t / F)."""

    model: ModelShape
    gpu: GpuSpec

    def ms(self, tokens: float, num_local: int, tp: int) -> float:
        m = self.model
        flops = 2 * m.expert_params * tokens * m.top_k * num_local / m.num_experts / tp
        weights = num_local * m.expert_params * m.weight_bytes / tp
        return roofline_ms(weights, flops, self.gpu.peak_flops, self.gpu.mem_bandwidth)


# What each variant of the bound makes free, to show which cost takes a schedule's gain.
BOUND_VARIANTS = {
    "roofline": "every kernel at its roofline",
    "free_kv": "the roofline with K/V reads free (no decode cost grows with context)",
    "row_free": "K/V free and every expert read at every step: a memory-bound decode step's cost is then "
    "independent of its rows",
}


def variant_list(text: str) -> list[str]:
    """Comma-separated names of BOUND_VARIANTS (a command-line option)."""
    names = text.split(",")
    unknown = [n for n in names if n not in BOUND_VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variants {unknown}; expected some of {list(BOUND_VARIANTS)}"
        )
    return names


def variant_cost(variant: str, model: ModelShape, gpu: GpuSpec, chunk: int) -> RooflineCost:
    """The roofline of `model` on one `gpu`, with what `variant` makes free."""
    if variant != "roofline":
        model = replace(model, kv_bytes=0)
    times = analytic_times(model, gpu)
    if variant == "row_free":
        times = replace(times, experts=EveryExpert(model, gpu))
    return RooflineCost(Search(model, times, Workload(1, 0), Cluster(1, gpu)), chunk)
