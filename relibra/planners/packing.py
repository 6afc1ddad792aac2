"""Balanced packing: n weighted items into m packs of exactly n / m items each, heaviest first (vectorised over rows).

Used by EPLB (groups -> nodes, physical experts -> GPUs) and by the greedy-LPT reorder ablation (experts ->
GPUs). Rule: take items in descending weight; put each into the lightest pack that still has room (ties: lowest
pack index). Like LPT, it is a heuristic: its max pack load is close to, not always equal to, the optimum.

Legend: X independent rows (layers, or layer x node), N items per row.
"""

from __future__ import annotations

import numpy as np

__all__ = ["balanced_packing"]


def balanced_packing(weight_XN: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack every row's N items into `num_packs` packs of N / num_packs items.

    Returns (pack_XN, rank_XN): the pack of every item and its position inside the pack (in insertion order).
    """
    weight = np.asarray(weight_XN, dtype=np.float64)
    if weight.ndim != 2:
        raise ValueError(f"weight_XN must be 2-D [rows, items], got shape {weight.shape}")
    X, N = weight.shape
    if num_packs < 1 or N % num_packs:
        raise ValueError(f"the {N} items of a row must split evenly into num_packs={num_packs} packs")
    capacity = N // num_packs
    order = np.argsort(-weight, axis=1, kind="stable")
    pack = np.empty((X, N), dtype=np.int64)
    rank = np.empty((X, N), dtype=np.int64)
    load = np.zeros((X, num_packs))
    count = np.zeros((X, num_packs), dtype=np.int64)
    rows = np.arange(X)
    for i in range(N):
        item = order[:, i]
        chosen = np.argmin(np.where(count < capacity, load, np.inf), axis=1)
        pack[rows, item] = chosen
        rank[rows, item] = count[rows, chosen]
        load[rows, chosen] += weight[rows, item]
        count[rows, chosen] += 1
    return pack, rank
