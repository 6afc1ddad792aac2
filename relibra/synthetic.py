"""Generator of synthetic RL-like load tensors D[n, m, l, s, e] for tests and benchmarks.

The model of an RL training batch (parameters in `SyntheticLoads`):
- Every (micro-batch m, source rank s) holds `tokens_per_rank` tokens from `responses_per_rank` long responses
  (lengths drawn from a flat Dirichlet). Responses are laid out in (m, s) order, and `group_size` consecutive
  responses answer the same prompt (GRPO-style groups), so a micro-batch holds few prompts.
- Every prompt has a topic (one of `num_topics`); the router's preference of a response for the experts of layer l
  is softmax(pop[l] + topic[t, l] + r_scale z), with pop[l] ~ N(0, pop_scale^2) a layer-wide popularity,
  topic[t, l] ~ N(0, topic_scale^2) the topic's own hot experts and z ~ N(0, 1) the response's quirks.
- A response of T tokens routes T x K pairs drawn from a multinomial over its preference, with every expert's
  probability capped at 1 / K (water-filling) and counts clipped to T (a token picks an expert once; the excess
  is redrawn), so the result is a valid load tensor.
- Hot sets drift: between steps, pop and every topic follow an AR(1) walk x' = sqrt(1 - d^2) x + d z with
  d = `drift`.
Departure from real routers: tokens of a response are drawn independently given its preference (no
token-to-token correlation beyond the response's); the real Qwen3-30B-A3B logs in ../shared/data calibrate the
scales (see the test that compares the statistics).
Reproducibility: one seed gives the same loads with the same NumPy only. NumPy keeps its random streams within a
version (Generator.multinomial draws differently from 2.5 on), so results made from these loads say which NumPy
made them.

Legend: N steps, M micro-batches, L layers, S source ranks, E experts, K top-k, U responses, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.loads import LoadTrace

__all__ = ["SyntheticLoads", "cap_probabilities", "generate_loads"]


@dataclass(frozen=True)
class SyntheticLoads:
    """Parameters of the generator (module docstring)."""

    num_steps: int = 3
    num_microbatches: int = 32
    num_layers: int = 48
    num_source_ranks: int = 32
    num_experts: int = 128
    topk: int = 8
    tokens_per_rank: int = 4096
    responses_per_rank: int = 2
    group_size: int = 16
    num_topics: int = 64
    pop_scale: float = 0.7
    topic_scale: float = 1.3
    response_scale: float = 0.6
    drift: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_steps",
            "num_microbatches",
            "num_layers",
            "num_source_ranks",
            "num_experts",
            "topk",
            "tokens_per_rank",
            "responses_per_rank",
            "group_size",
            "num_topics",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SyntheticLoads.{name} must be >= 1, got {getattr(self, name)}")
        if self.topk > self.num_experts:
            raise ValueError(f"topk={self.topk} must be <= num_experts={self.num_experts}")
        if self.tokens_per_rank < self.responses_per_rank:
            raise ValueError("tokens_per_rank must be >= responses_per_rank (every response has a token)")
        if not 0 <= self.drift <= 1:
            raise ValueError(f"drift must be in [0, 1], got {self.drift}")
        for name in ("pop_scale", "topic_scale", "response_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"SyntheticLoads.{name} must be >= 0")


def cap_probabilities(p_XE: np.ndarray, cap: float, num_rounds: int = 50) -> np.ndarray:
    """Water-filling: clip every row's probabilities at `cap` and hand the excess to the others, proportionally."""
    p = np.asarray(p_XE, dtype=np.float64).copy()
    for _ in range(num_rounds):
        over = p > cap
        if not over.any():
            break
        excess = np.where(over, p - cap, 0.0).sum(axis=-1, keepdims=True)
        p = np.minimum(p, cap)
        room = np.where(p < cap, p, 0.0)
        p += excess * room / np.maximum(room.sum(axis=-1, keepdims=True), 1e-300)
    return p


def _draw_counts(rng: np.random.Generator, tokens_U: np.ndarray, p_ULE: np.ndarray, topk: int) -> np.ndarray:
    """Pairs per (response, layer, expert): multinomial of tokens x K, every count clipped to the tokens."""
    n = np.broadcast_to(tokens_U[:, None] * topk, p_ULE.shape[:2])
    counts = rng.multinomial(n, p_ULE)
    limit = tokens_U[:, None, None]
    for _ in range(20):
        over = np.maximum(counts - limit, 0)
        if not over.any():
            return counts
        counts -= over
        room = np.where(counts < limit, p_ULE, 0.0)
        room /= np.maximum(room.sum(axis=-1, keepdims=True), 1e-300)
        counts += rng.multinomial(over.sum(axis=-1), room)
    # Deterministic fallback: pour what is left into the experts with room, in order.
    over = np.maximum(counts - limit, 0).sum(axis=-1)
    counts = np.minimum(counts, limit)
    room = np.cumsum(limit - counts, axis=-1)
    add = np.minimum(limit - counts, np.maximum(over[..., None] - (room - (limit - counts)), 0))
    return counts + add


def _ar1(rng: np.random.Generator, x: np.ndarray, scale: float, drift: float) -> np.ndarray:
    return np.sqrt(1.0 - drift**2) * x + drift * scale * rng.standard_normal(x.shape)


def generate_loads(params: SyntheticLoads = SyntheticLoads()) -> LoadTrace:
    """Draw N steps of loads [N, M, L, S, E] following the model in the module docstring."""
    p = params
    rng = np.random.default_rng(p.seed)
    M, L, S, E, K = p.num_microbatches, p.num_layers, p.num_source_ranks, p.num_experts, p.topk
    pop_LE = p.pop_scale * rng.standard_normal((L, E))
    topic_XLE = p.topic_scale * rng.standard_normal((p.num_topics, L, E))
    num_resp = M * S * p.responses_per_rank
    cell_U = np.repeat(np.arange(M * S), p.responses_per_rank)  # (m, s) cell of every response
    steps = []
    for _ in range(p.num_steps):
        share = rng.dirichlet(np.ones(p.responses_per_rank), size=M * S)
        tokens = rng.multinomial(p.tokens_per_rank - p.responses_per_rank, share) + 1  # [M*S, r]
        tokens_U = tokens.reshape(-1)
        topic_of_prompt = rng.integers(0, p.num_topics, size=-(-num_resp // p.group_size))
        topic_U = topic_of_prompt[np.arange(num_resp) // p.group_size]
        logits = pop_LE[None] + topic_XLE[topic_U] + p.response_scale * rng.standard_normal((num_resp, L, E))
        prob = np.exp(logits - logits.max(axis=-1, keepdims=True))
        prob = cap_probabilities(prob / prob.sum(axis=-1, keepdims=True), 1.0 / K)
        counts_ULE = _draw_counts(rng, tokens_U, prob, K)
        loads = np.zeros((M * S, L, E), dtype=np.int64)
        np.add.at(loads, cell_U, counts_ULE)
        steps.append(loads.reshape(M, S, L, E).transpose(0, 2, 1, 3))
        pop_LE = _ar1(rng, pop_LE, p.pop_scale, p.drift)
        topic_XLE = _ar1(rng, topic_XLE, p.topic_scale, p.drift)
    return LoadTrace(np.stack(steps), K)
