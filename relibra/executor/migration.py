"""The optimizer state of an expert migration, moved behind a training step in chunks of layers.

Why: a reorder moves every expert whose owner changed, ~14 bytes per parameter under mixed precision, and the
planner may move a third of the experts every step. The step's forward needs only the bf16 weights (2 bytes,
moved before the step by the executor); the fp32 master weight and the Adam moments (12 bytes) are read only by
the optimizer step. So they travel while the step computes, over a process group of their own (NCCL runs one
communicator's work in order: on the EP group they would hold up the step's first dispatch).

How: the moved layers are cut into chunks, in layer order, whose receive buffers on the rank that receives most
stay within half of `budget_bytes` (a chunk holds at least one layer). Every rank computes the same chunks from
the placements of all ranks, so all post the same transfers in the same order. Two chunks are in flight at a
time; `progress()`, called from the executor's hooks during the step, lands the oldest chunk once its transfers
completed, without waiting for anything, and posts the next; `finish()`, the engine's optimizer-state hook, lands
the rest and waits where it must (what the step then waits for is the migration's exposed part).

Between `begin` and `finish` the source rows must not change: nothing but the optimizer step writes optimizer
state, and the engine runs `finish` before it (and before offload and checkpoints).

Legend: G EP ranks, J slot rows of a stacked expert tensor, X jobs (moved layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from relibra.executor.comm import SlotTransfer, post_slot_moves
from relibra.executor.tables import MigrationMoves

__all__ = ["StateJob", "StateMigration", "state_chunks"]

TensorsOf = Callable[[torch.nn.Parameter], dict[str, torch.Tensor]]
LandInto = Callable[[torch.nn.Parameter, dict[str, SlotTransfer]], None]


@dataclass(frozen=True)
class StateJob:
    """One moved layer: its stacked expert parameters (whose optimizer state moves) and this rank's moves."""

    params: tuple[torch.nn.Parameter, ...]
    moves: MigrationMoves


@dataclass
class _Chunk:
    jobs: list[StateJob]
    transfers: list[tuple[torch.nn.Parameter, dict[str, SlotTransfer]]] = field(default_factory=list)

    def completed(self) -> bool:
        return all(r.is_completed() for _, ts in self.transfers for t in ts.values() for r in t.requests)


def state_chunks(recv_bytes_XG: np.ndarray, budget_bytes: float) -> list[list[int]]:
    """Consecutive jobs grouped so that every chunk's receive bytes, max over ranks, fit in `budget_bytes / 2`
    (two chunks are in flight at once); a job larger than that is a chunk of its own."""
    chunks: list[list[int]] = []
    acc = np.zeros(recv_bytes_XG.shape[1])
    for x, row in enumerate(recv_bytes_XG):
        if chunks and (acc + row).max() <= budget_bytes / 2:
            chunks[-1].append(x)
            acc += row
        else:
            chunks.append([x])
            acc = row.astype(float)
    return chunks


class StateMigration:
    """Moves optimizer state rows behind a step (module docstring). `tensors_of(param)`: the state tensors that
    migrate with `param`, viewed with its shape; `land_into(param, transfers)`: writes landed rows back."""

    def __init__(self, group, budget_bytes: int, tensors_of: TensorsOf, land_into: LandInto) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the migration buffer budget must be positive, got {budget_bytes} bytes")
        self.group, self.budget_bytes = group, budget_bytes
        self.tensors_of, self.land_into = tensors_of, land_into
        self._queue: list[_Chunk] = []  # posted chunks first (at most two), then the ones still to post
        self._posted = 0
        self.num_chunks = 0
        self.waited_chunks = 0  # chunks `finish` found unfinished: the exposed part of the last migration

    @property
    def in_flight(self) -> bool:
        return bool(self._queue)

    def row_bytes(self, params: tuple[torch.nn.Parameter, ...]) -> int:
        """Bytes of one slot row of the migrating state of `params` (0 before the optimizer created any)."""
        return sum(t[0].numel() * t.element_size() for p in params for t in self.tensors_of(p).values())

    def begin(self, jobs: list[StateJob], recv_slots_XG: np.ndarray, row_bytes: int) -> int:
        """Post the first chunks of `jobs` (recv_slots_XG[x, g]: slot rows rank g receives in job x); returns the
        bytes this rank will send. Lands a migration still in flight first."""
        self.finish()
        self.num_chunks = self.waited_chunks = 0
        if row_bytes == 0 or not jobs:
            return 0
        chunks = state_chunks(np.asarray(recv_slots_XG) * float(row_bytes), self.budget_bytes)
        self._queue = [_Chunk([jobs[x] for x in chunk]) for chunk in chunks]
        self._posted, self.num_chunks = 0, len(chunks)
        self._post_ahead()
        return row_bytes * sum(len(job.moves.sends) for job in jobs)

    def progress(self) -> None:
        """Land every leading chunk whose transfers completed and post the next ones; never waits."""
        while self._queue and self._queue[0].completed():  # the head of the queue is always posted
            self._land_first()

    def finish(self) -> None:
        """Land everything still in flight, waiting for the transfers that have not completed."""
        while self._queue:
            if not self._queue[0].completed():
                self.waited_chunks += 1
            self._land_first()

    def _land_first(self) -> None:
        chunk = self._queue.pop(0)
        self._posted -= 1
        for param, transfers in chunk.transfers:
            self.land_into(param, transfers)
        self._post_ahead()

    def _post_ahead(self) -> None:
        while self._posted < min(2, len(self._queue)):
            chunk = self._queue[self._posted]
            for job in chunk.jobs:
                for param in job.params:
                    tensors = self.tensors_of(param)
                    chunk.transfers.append(
                        (param, {k: post_slot_moves(v, job.moves, self.group) for k, v in tensors.items()})
                    )
            self._posted += 1
