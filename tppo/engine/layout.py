"""The one rule for the shapes a micro-batch runs through the routers, shared by the engine and the planner.

The engine pads every micro-batch before its forward: the token count is rounded up to the tensor-parallel size
under sequence parallelism, and with the allgather dispatcher every rank of an EP group runs the group's largest
(rows, tokens) shape. ReLibra counts its loads on the same grid (padding included: the experts compute it), so
the plan's quotas cover exactly the pairs each rank routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tppo.engine.batch import TrainBatch, replayed_ids


@dataclass(frozen=True)
class RouterLayout:
    """How a trainer runs micro-batches through its routers.

    ep: ranks per EP group (contiguous ranks); seq_multiple: sequence lengths are rounded up to it (sequence
    parallel); aligned: every rank of an EP group runs the group's largest (rows, tokens) shape (allgather).
    """

    ep: int
    seq_multiple: int = 1
    aligned: bool = False

    def padded(self, shape: tuple[int, int]) -> tuple[int, int]:
        """One rank's (rows, tokens) after rounding the tokens up to `seq_multiple`."""
        rows, tokens = shape
        q = self.seq_multiple
        return rows, -(-tokens // q) * q


def router_shapes(
    shapes: Sequence[Sequence[tuple[int, int]]], layout: RouterLayout
) -> list[list[tuple[int, int]]]:
    """The (rows, tokens) each rank's routers see for each micro-batch, given every rank's batch shapes
    (`shapes[r][m]`, all ranks of the role, contiguous EP groups): the driver's view of what each engine rank
    computes with its group's collective."""
    padded = [[layout.padded(s) for s in rank] for rank in shapes]
    if not layout.aligned:
        return padded
    out = []
    for r, rank_shapes in enumerate(padded):
        group = range(r - r % layout.ep, r - r % layout.ep + layout.ep)
        out.append([group_max([padded[g][m] for g in group]) for m in range(len(rank_shapes))])
    return out


def group_max(shapes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The shape every rank of an aligned EP group runs: the largest rows and the largest tokens."""
    return max(s[0] for s in shapes), max(s[1] for s in shapes)


def expert_counts_LE(batch: TrainBatch, shape: tuple[int, int], num_experts: int) -> np.ndarray:
    """[L, E]: the (token, top-k) pairs a micro-batch run as `shape` sends to each expert of each MoE layer,
    padding included (tppo.engine.batch.replayed_ids): exactly what the experts compute."""
    ids_NLK = replayed_ids(batch.routed_experts_BTLK, batch.valid_BT(), shape, num_experts).flatten(0, 1)
    num_layers = ids_NLK.shape[1]
    out = np.zeros((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        out[layer] = torch.bincount(ids_NLK[:, layer].reshape(-1), minlength=num_experts).numpy()
    return out
