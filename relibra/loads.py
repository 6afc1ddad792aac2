"""Load tensors D[m, l, s, e]: (token, top-k choice) pairs of micro-batch m, MoE layer l, source rank s, expert e.

Built from
(a) routed experts recorded by the rollout engine ([T, L, K] per sample) plus the deterministic assignment of
    samples to (data-parallel rank, micro-batch): `loads_from_routed_experts`;
(b) vLLM-style routing logs (one JSON line per (forward pass, layer) with `topk_ids` [T][K]):
    `read_vllm_routing_log`, `loads_from_token_stream`, `loads_from_vllm_logs`.

How a token stream is cut (our documented convention, the logs have no trainer layout): the non-idle forward
passes of a file are concatenated in order; the stream is cut into consecutive micro-batches of
`microbatch_tokens` tokens (an incomplete tail is dropped); each micro-batch is dealt to the S source ranks as
S contiguous slices (np.array_split sizes, so ranks differ by at most one token). One file is one training step;
steps keep the smallest micro-batch count of the files. Idle passes (content repeated byte for byte inside the
file, the 4-token keep-alive batches of the recording) are skipped.

With data parallelism wider than EP, ranks dp and dp + EP are different EP groups that share one placement: their
pairs are summed into source rank dp % EP (the plan balances the sum).

File format (`save_loads`/`load_loads`): `.npz` with `loads` int [num_steps, num_microbatches, num_layers,
num_source_ranks, num_experts] and `topk` (scalar int); a float array is read only when every value is a
finite whole number (nothing is truncated). Validation: every count >= 0; for every (step, micro-batch,
source) the pairs summed over experts are tokens x topk with the same token count in every layer; no expert
gets more pairs than there are tokens.

Legend: N steps, M micro-batches, L layers, S source ranks, E experts, T tokens, K top-k, B samples.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "LoadTrace",
    "load_loads",
    "loads_from_routed_experts",
    "loads_from_token_stream",
    "loads_from_vllm_logs",
    "read_vllm_routing_log",
    "save_loads",
    "tokens_NMS",
    "validate_loads",
]


@dataclass(frozen=True)
class LoadTrace:
    """The load tensors of several training steps: loads_NMLSE int [N, M, L, S, E] and the router's top-k."""

    loads_NMLSE: np.ndarray
    topk: int

    def __post_init__(self) -> None:
        validate_loads(self.loads_NMLSE, self.topk)

    @property
    def num_steps(self) -> int:
        return self.loads_NMLSE.shape[0]

    @property
    def num_layers(self) -> int:
        return self.loads_NMLSE.shape[2]

    @property
    def num_source_ranks(self) -> int:
        return self.loads_NMLSE.shape[3]

    @property
    def num_experts(self) -> int:
        return self.loads_NMLSE.shape[4]


def tokens_NMS(loads_NMLSE: np.ndarray, topk: int) -> np.ndarray:
    """Tokens of every (step, micro-batch, source rank): pairs of layer 0 divided by top-k."""
    return loads_NMLSE[:, :, 0].sum(axis=-1) // topk


def validate_loads(loads_NMLSE: np.ndarray, topk: int) -> None:
    """Raise ValueError naming what is wrong unless `loads_NMLSE` is a consistent load tensor (module docstring)."""
    loads = np.asarray(loads_NMLSE)
    if loads.ndim != 5:
        raise ValueError(
            f"loads must have 5 dims [num_steps, num_microbatches, num_layers, num_source_ranks, num_experts], "
            f"got shape {loads.shape}"
        )
    if not np.issubdtype(loads.dtype, np.integer):
        raise ValueError(f"loads must be an integer array, got dtype {loads.dtype}")
    if int(topk) < 1 or int(topk) != topk:
        raise ValueError(f"topk must be a positive integer, got {topk!r}")
    if min(loads.shape) == 0:
        raise ValueError(f"loads must not be empty, got shape {loads.shape}")
    if (loads < 0).any():
        raise ValueError("loads must be non-negative counts")
    pairs_NMLS = loads.sum(axis=-1)
    if (pairs_NMLS % topk).any():
        n, m, layer, s = np.argwhere(pairs_NMLS % topk)[0]
        raise ValueError(
            f"loads: pairs of step {n}, micro-batch {m}, layer {layer}, source {s} are {pairs_NMLS[n, m, layer, s]}, "
            f"not a multiple of topk={topk} (sum over experts must be tokens x topk)"
        )
    if (pairs_NMLS != pairs_NMLS[:, :, :1]).any():
        n, m, layer, s = np.argwhere(pairs_NMLS != pairs_NMLS[:, :, :1])[0]
        raise ValueError(
            f"loads: step {n}, micro-batch {m}, source {s} has {pairs_NMLS[n, m, 0, s] // topk} tokens in layer 0 "
            f"but {pairs_NMLS[n, m, layer, s] // topk} in layer {layer}; every token passes every MoE layer"
        )
    if (loads > (pairs_NMLS // topk)[..., None]).any():
        raise ValueError(
            "loads: an expert has more pairs than there are tokens (a token picks an expert once)"
        )


def save_loads(path: str | Path, trace: LoadTrace) -> None:
    """Write `trace` as `.npz` with `loads` [N, M, L, S, E] and `topk`."""
    np.savez_compressed(path, loads=trace.loads_NMLSE, topk=np.int64(trace.topk))


def load_loads(path: str | Path) -> LoadTrace:
    """Read and validate a `.npz` load file; raises ValueError if `loads` or `topk` is missing or inconsistent."""
    with np.load(path) as f:
        missing = {"loads", "topk"} - set(f.files)
        if missing:
            raise ValueError(f"{path}: load file lacks {sorted(missing)} (has {sorted(f.files)})")
        loads, topk = f["loads"], f["topk"]
    if np.ndim(topk) != 0:
        raise ValueError(f"{path}: topk must be a scalar, got shape {np.shape(topk)}")
    loads = _integer_counts(loads, f"{path}: loads")
    return LoadTrace(loads, int(_integer_counts(topk, f"{path}: topk")))


def _integer_counts(values: np.ndarray, what: str) -> np.ndarray:
    """`values` as int64, refusing what a cast would change: NaN, Inf, fractions, values past int64 (a cast
    truncates 2.7 to 2 and turns NaN into a huge negative count). Floats holding whole numbers pass
    unchanged."""
    values = np.asarray(values)
    if np.issubdtype(values.dtype, np.integer):
        return values.astype(np.int64, copy=False)
    if not np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"{what} must be finite integers, got dtype {values.dtype}")
    for bad, kind in (
        (~np.isfinite(values), "NaN or Inf"),
        ((values != np.round(values)) | (np.abs(values) >= 2**62), "not whole numbers"),
    ):
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            at = f" at index {list(first)}" if first else ""
            raise ValueError(
                f"{what} must be finite integers: {int(bad.sum())} value(s) {kind}, the first "
                f"{float(values[first])}{at}; write them as integers"
            )
    return values.astype(np.int64)


def _count(index_X: np.ndarray, size: int) -> np.ndarray:
    return np.bincount(index_X.reshape(-1), minlength=size)


def loads_from_routed_experts(
    routed_experts: Sequence[np.ndarray],
    microbatch_B: Sequence[int],
    dp_rank_B: Sequence[int],
    num_microbatches: int,
    num_source_ranks: int,
    num_experts: int,
) -> np.ndarray:
    """D[m, l, s, e] of one step from the rollout's routed experts and the sample -> (dp rank, micro-batch) map.

    routed_experts[b]: int [T_b, L, K] experts of sample b's tokens that the trainer replays. Sample b goes to
    micro-batch microbatch_B[b] on data-parallel rank dp_rank_B[b]; its source rank is dp_rank_B[b] % S.
    Returns int64 [M, L, S, E].
    """
    if not (len(routed_experts) == len(microbatch_B) == len(dp_rank_B)):
        raise ValueError(
            f"routed_experts, microbatch_B and dp_rank_B must have one entry per sample, got "
            f"{len(routed_experts)}, {len(microbatch_B)}, {len(dp_rank_B)}"
        )
    if not routed_experts:
        raise ValueError("routed_experts is empty")
    L = np.asarray(routed_experts[0]).shape[1]
    M, S, E = num_microbatches, num_source_ranks, num_experts
    total = np.zeros(M * L * S * E, dtype=np.int64)
    for b, ids in enumerate(routed_experts):
        ids_TLK = np.asarray(ids)
        if ids_TLK.ndim != 3 or ids_TLK.shape[1] != L:
            raise ValueError(f"routed_experts[{b}] must be int [T, {L}, K], got shape {ids_TLK.shape}")
        if ids_TLK.size and (ids_TLK.min() < 0 or ids_TLK.max() >= E):
            raise ValueError(f"routed_experts[{b}] holds expert ids outside [0, {E})")
        m, s = int(microbatch_B[b]), int(dp_rank_B[b]) % S
        if not 0 <= m < M:
            raise ValueError(f"microbatch_B[{b}]={m} is outside [0, {M})")
        base = ((m * L + np.arange(L)) * S + s) * E
        total += _count(base[None, :, None] + ids_TLK, M * L * S * E)
    return total.reshape(M, L, S, E)


def read_vllm_routing_log(path: str | Path, num_layers: int = 48) -> list[np.ndarray]:
    """Forward passes of a vLLM routing log as int [T, L, K] arrays, idle passes skipped (module docstring).

    The file holds one JSON object per (pass, layer), `num_layers` consecutive lines per pass, each with
    `topk_ids` [T][K].
    """
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if len(lines) % num_layers:
        raise ValueError(f"{path}: {len(lines)} lines is not a multiple of num_layers={num_layers}")
    chunks = ["\n".join(lines[i : i + num_layers]) for i in range(0, len(lines), num_layers)]
    repeats = {c: chunks.count(c) for c in set(chunks)}
    passes = []
    for c in chunks:
        if repeats[c] > 1:
            continue
        layers = [np.asarray(json.loads(line)["topk_ids"], dtype=np.int64) for line in c.splitlines()]
        if len({a.shape for a in layers}) != 1 or layers[0].ndim != 2:
            raise ValueError(f"{path}: the layers of one pass must hold topk_ids of the same shape [T, K]")
        passes.append(np.stack(layers, axis=1))
    return passes


def loads_from_token_stream(
    topk_ids_TLK: np.ndarray,
    microbatch_tokens: int,
    num_source_ranks: int,
    num_experts: int,
    num_microbatches: int | None = None,
) -> np.ndarray:
    """Cut a token stream into micro-batches and source ranks (module docstring); returns int64 [M, L, S, E].

    M = num_microbatches or as many full micro-batches as the stream holds (the tail is dropped).
    """
    ids = np.asarray(topk_ids_TLK)
    T, L, _ = ids.shape
    full = T // microbatch_tokens
    M = full if num_microbatches is None else num_microbatches
    if M < 1 or full < M:
        raise ValueError(
            f"the stream holds {full} full micro-batches of {microbatch_tokens} tokens, asked for {M}"
        )
    S, E = num_source_ranks, num_experts
    if ids.size and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"topk_ids_TLK holds expert ids outside [0, {E})")
    sizes = np.array([len(a) for a in np.array_split(np.arange(microbatch_tokens), S)])
    source_T = np.tile(np.repeat(np.arange(S), sizes), M)
    micro_T = np.repeat(np.arange(M), microbatch_tokens)
    used = ids[: M * microbatch_tokens]
    base_TL = ((micro_T[:, None] * L + np.arange(L)[None]) * S + source_T[:, None]) * E
    return _count(base_TL[:, :, None] + used, M * L * S * E).reshape(M, L, S, E)


def loads_from_vllm_logs(
    paths: Sequence[str | Path],
    microbatch_tokens: int,
    num_source_ranks: int,
    num_experts: int = 128,
    num_layers: int = 48,
) -> LoadTrace:
    """One step per log file, M = the smallest number of full micro-batches among the files (module docstring)."""
    if not paths:
        raise ValueError("paths is empty: give at least one routing log")
    streams = []
    for path in paths:
        passes = read_vllm_routing_log(path, num_layers)
        if not passes:
            raise ValueError(f"{path}: no non-idle forward pass")
        streams.append(np.concatenate(passes, axis=0))
    topk = {s.shape[2] for s in streams}
    if len(topk) != 1:
        raise ValueError(f"the logs disagree on top-k: {sorted(topk)}")
    M = min(len(s) // microbatch_tokens for s in streams)
    if M < 1:
        raise ValueError(f"a log holds fewer than microbatch_tokens={microbatch_tokens} tokens")
    steps = [loads_from_token_stream(s, microbatch_tokens, num_source_ranks, num_experts, M) for s in streams]
    return LoadTrace(np.stack(steps), topk.pop())
