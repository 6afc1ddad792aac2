"""Pure formulas of the performance model: MegaScale-Infer's sections 2.3 and 4.1 and equations 6-8, the roofline,
the expert-weight bytes a micro-batch touches, and ExpertPlex's tile count (its equation 3).

Legend: b batch (rows), t tokens of a micro-batch, C context (cached positions), E experts, K top-k, L layers,
m micro-batches, F peak FLOP/s, B memory bandwidth; times in ms unless a name says otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


# ---------------------------------------------------------------------------------------- section 2.3
def compute_bound_batch(peak_flops: float, mem_bandwidth: float) -> float:
    """Rows a bf16 GEMM needs to be compute-bound: b* = F / B.

    A [b, k] x [k, n] GEMM does 2 b k n FLOPs and reads 2 k n weight bytes, so its intensity is b FLOP/byte;
    it stops being memory-bound once b >= F / B (156 on an A100: 312 TFLOP/s over 2 TB/s)."""
    return peak_flops / mem_bandwidth


def tokens_per_expert(batch: float, top_k: int, num_experts: int) -> float:
    """Rows one expert's GEMM sees under balanced routing: b K / E."""
    return batch * top_k / num_experts


def gemm_mfu(rows: float, peak_flops: float, mem_bandwidth: float) -> float:
    """Model FLOP utilisation of a weight-bound GEMM with `rows` rows: min(1, rows / (F / B))."""
    return min(1.0, rows / compute_bound_batch(peak_flops, mem_bandwidth))


# ----------------------------------------------------------------------------------------- the roofline
def roofline_ms(num_bytes: float, flops: float, peak_flops: float, mem_bandwidth: float) -> float:
    """Time of a kernel bounded by memory or compute: max(bytes / B, FLOPs / F), in ms."""
    return 1e3 * max(num_bytes / mem_bandwidth, flops / peak_flops)


def distinct_experts(tokens: float, num_experts: int, top_k: int) -> float:
    """Expected experts a micro-batch of t tokens touches: E (1 - (1 - K/E)^t).

    Each expert is picked by a token with probability K/E (uniform routing, tokens independent). For
    fine-grained MoE (E = 128, K = 8) 64 tokens already touch 98% of the experts, so the expert time follows
    the weight bytes touched, not the token count."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def hit_probability(num_local: int, num_experts: int, top_k: int) -> float:
    """Probability that a token routes to at least one of `num_local` experts: 1 - C(E - E_w, K) / C(E, K)."""
    if num_local >= num_experts:
        return 1.0
    return 1.0 - math.comb(num_experts - num_local, top_k) / math.comb(num_experts, top_k)


# ---------------------------------------------------------------------------------------- section 4.1
def pingpong_iteration_ms(t_a: float, t_e: float, t_c: float, num_micro: int, num_layers: int) -> float:
    """One decode iteration of the ping-pong pipeline over L layers with m micro-batches.

    A micro-batch's round trip through one layer is R = T_a + T_e + 2 T_c (attention, dispatch, experts,
    combine); the attention side serves the m micro-batches back to back, so a layer's period is
    P = max(m T_f, R) with T_f = max(T_a, T_e), and

        T_total = R + (L - 1) P + (m - 1) T_f.

    When m T_f >= R (MegaScale-Infer's conditions hold) this is the paper's
    T_total = (T_a + T_e + 2 T_c) + T_f (m L - 1); with m = 1 it is L R (no overlap)."""
    t_f = max(t_a, t_e)
    round_trip = t_a + t_e + 2 * t_c
    period = max(num_micro * t_f, round_trip)
    return round_trip + (num_layers - 1) * period + (num_micro - 1) * t_f


def paper_iteration_ms(t_a: float, t_e: float, t_c: float, num_micro: int, num_layers: int) -> float:
    """MegaScale-Infer's iteration time, valid when its conditions hold: (T_a + T_e + 2 T_c) + T_f (m L - 1)."""
    return (t_a + t_e + 2 * t_c) + max(t_a, t_e) * (num_micro * num_layers - 1)


def min_micro_batches(t_f: float, t_c: float) -> int:
    """Fewest micro-batches that keep the pipeline full: the smallest m with m T_f >= 2 (T_f + T_c).

    With 0 < T_c < T_f / 2 this is 3, with T_f / 2 <= T_c < T_f it is 4 (MegaScale-Infer section 4.1); with
    no communication at all, 2."""
    return max(1, math.ceil(2 * (t_f + t_c) / t_f - 1e-12))


@dataclass(frozen=True)
class PingPongCheck:
    """MegaScale-Infer's three conditions: T_a ~ T_e, T_c < T_f, m T_f >= 2 (T_f + T_c)."""

    balance: float  # min(T_a, T_e) / max(T_a, T_e); 1 is perfectly balanced
    comm_hidden: bool
    pipeline_full: bool


def pingpong_check(t_a: float, t_e: float, t_c: float, num_micro: int) -> PingPongCheck:
    t_f = max(t_a, t_e)
    return PingPongCheck(
        balance=min(t_a, t_e) / t_f if t_f > 0 else 1.0,
        comm_hidden=bool(t_c < t_f),
        pipeline_full=bool(num_micro * t_f >= 2 * (t_f + t_c)),
    )


# ---------------------------------------------------------------------------------------- equations 6-8
def transfer_ms(num_bytes: float, bandwidth: float, latency_us: float) -> float:
    """One message: latency + bytes / W. Equivalent to the paper's bytes / (W Util(bytes)) with the bandwidth
    utilisation Util = bytes / (bytes + latency W), which falls for small messages."""
    return latency_us * 1e-3 + 1e3 * num_bytes / bandwidth


def comm_ms(send_bytes: float, send_bw: float, recv_bytes: float, recv_bw: float, latency_us: float) -> float:
    """Equation 6: T_c = max(sender bytes / its bandwidth, receiver bytes / its bandwidth) (+ latency)."""
    return max(transfer_ms(send_bytes, send_bw, latency_us), transfer_ms(recv_bytes, recv_bw, latency_us))


def meets_latency(iteration_ms: float, target_ms: float | None) -> bool:
    """Equation 7: the per-token latency (one decode iteration) stays within the target."""
    return target_ms is None or iteration_ms <= target_ms


def kv_fits(seqs: int, context: int, kv_bytes_per_token: float, weights: float, capacity: float) -> bool:
    """Equation 8: weights + seqs C (KV bytes per token) <= the usable memory of one GPU (bytes per GPU in)."""
    return weights + seqs * context * kv_bytes_per_token <= capacity


def max_kv_seqs(context: int, kv_bytes_per_token: float, weights: float, capacity: float) -> int:
    """Largest number of sequences equation 8 admits (0 when the weights alone do not fit)."""
    free = capacity - weights
    return max(0, int(free // (context * kv_bytes_per_token))) if free > 0 else 0


# ------------------------------------------------------------------------------------ ExpertPlex section 6
def tiles(loads_E: Sequence[int] | np.ndarray, tile_m: int) -> int:
    """Equation 3: the MoE work in tiles, x_moe = sum_e ceil(m_e / M_t), m_e tokens routed to expert e."""
    loads = np.asarray(loads_E, dtype=np.int64)
    return int(np.sum(-(-loads // tile_m)))


def expected_tiles(tokens: float, num_experts: int, top_k: int, tile_m: int) -> float:
    """E[x_moe] under uniform routing: E * E[ceil(m_e / M_t)] with m_e ~ Binomial(t, K/E).

    The sum runs over the binomial's mass within 12 standard deviations of its mean (the rest is < 1e-30)."""
    if tokens <= 0:
        return 0.0
    n, p = round(tokens), top_k / num_experts
    if p >= 1.0:
        return num_experts * math.ceil(n / tile_m)
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    lo, hi = max(0, int(mean - 12 * sd) - 1), min(n, int(mean + 12 * sd) + 2)
    k = np.arange(lo, hi + 1)
    log_pmf = np.array([_log_binom_pmf(n, int(i), p) for i in k])
    return num_experts * float(np.sum(np.exp(log_pmf) * np.ceil(k / tile_m)))


def _log_binom_pmf(n: int, k: int, p: float) -> float:
    log_comb = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return log_comb + k * math.log(p) + (n - k) * math.log1p(-p)
