"""Paged KV cache: fixed-size blocks of positions, a block table per sequence, memory that follows real lengths.

K and V live in two tensors `[L, X, M, D]` with X = num_blocks * block_size flat rows (all layers together; the
heads of one position adjacent, so writing a token's K/V is one `index_copy_` into a layer's `[X, M, D]` view).
Position p of the sequence in block-table row r sits at flat row `table[r, p // block_size] * block_size +
p % block_size`. Block 0 is never handed out: padding tokens of a captured step write and read it, and the
table's last row (all zeros) is the row those padding tokens belong to.

The host owns the table (`BlockTable`: allocation, release, a free list); the device keeps a copy refreshed
before a step when the host changed it. A slot cache (one `max_model_len` region per sequence, reserved up
front) is the special case block_size = max_model_len: the engine runs it that way to compare the two.

Legend: L layers, X flat cache rows, M kv heads, D head dim, R block-table rows (sequences + the padding row),
B blocks per sequence at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.model_spec import MoeModelSpec

NULL_BLOCK = 0


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int  # including the null block
    block_size: int
    max_model_len: int
    max_seqs: int
    budget_bytes: int
    bytes_per_token: int

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def num_positions(self) -> int:
        """Positions the usable blocks hold (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size


def plan_cache(
    spec: MoeModelSpec,
    element_size: int,
    *,
    max_model_len: int,
    block_size: int,
    max_seqs: int,
    budget_bytes: int,
    source: str,
) -> CachePlan:
    """Usable blocks = budget // (block_size * bytes per token), capped at what max_seqs full-length sequences can
    use, plus the null block (outside the budget); fewer than one full-length sequence is an error that names
    the settings to change."""
    per_token = spec.kv_bytes_per_token(element_size)
    plan = CachePlan(0, block_size, max_model_len, max_seqs, budget_bytes, per_token)
    fit = budget_bytes // (per_token * block_size)
    need = plan.blocks_per_seq
    if fit < need:
        raise ValueError(
            f"KV cache: {source} gives {budget_bytes / 2**20:.1f} MiB, which cannot hold one sequence of "
            f"rollout.max_model_len={max_model_len} tokens ({need * block_size * per_token / 2**20:.1f} MiB in "
            f"blocks of {block_size} at {per_token} bytes/token); raise rollout.kv_cache_fraction or "
            "rollout.kv_cache_tokens, or lower rollout.max_model_len"
        )
    return CachePlan(
        min(fit, max_seqs * plan.blocks_per_seq) + 1,
        block_size,
        max_model_len,
        max_seqs,
        budget_bytes,
        per_token,
    )


def available_bytes(device: torch.device) -> int:
    """Free memory of the device: CUDA's free memory, or MemAvailable of the host for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(
        "cannot read MemAvailable from /proc/meminfo to size the KV cache; set rollout.kv_cache_tokens"
    )


class BlockTable:
    """Which blocks each sequence row holds (host side) and the free blocks: allocation is all-or-nothing, so a
    failed `grow` leaves the row as it was and the caller can preempt and retry."""

    def __init__(self, plan: CachePlan) -> None:
        self.plan = plan
        self.table_RB = np.zeros((plan.max_seqs + 1, plan.blocks_per_seq), dtype=np.int32)
        self.num_held_R = np.zeros(plan.max_seqs + 1, dtype=np.int64)
        # Popped from the end: low block ids first, so a fresh engine fills memory from the start.
        self._free = list(range(plan.num_blocks - 1, NULL_BLOCK, -1))
        self._free_rows = list(range(plan.max_seqs - 1, -1, -1))
        self.version = 0  # bumped on every change, so the device copy is refreshed only when needed

    @property
    def padding_row(self) -> int:
        return self.plan.max_seqs

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.plan.num_blocks - 1 - len(self._free)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.plan.block_size)

    def open_row(self) -> int:
        """A free sequence row, holding no blocks yet."""
        if not self._free_rows:
            raise RuntimeError("no free sequence row (the scheduler admits at most max_batch_size sequences)")
        return self._free_rows.pop()

    def grow(self, row: int, num_positions: int) -> bool:
        """Give `row` blocks for positions [0, num_positions); False (nothing changed) when blocks run out."""
        need = self.blocks_for(num_positions) - int(self.num_held_R[row])
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        held = int(self.num_held_R[row])
        for j in range(held, held + need):
            self.table_RB[row, j] = self._free.pop()
        self.num_held_R[row] = held + need
        self.version += 1
        return True

    def outgrown(self, rows_R: np.ndarray, num_positions_R: np.ndarray) -> np.ndarray:
        """Which rows need more blocks than they hold for positions [0, num_positions_R) (bool [R]): only those
        need `grow`, so a step checks all its decoding rows at once."""
        return self.blocks_for(num_positions_R) > self.num_held_R[rows_R]

    def release(self, row: int) -> None:
        """Return the row's blocks (most recently taken first back on top) and the row itself."""
        held = int(self.num_held_R[row])
        self._free.extend(int(b) for b in self.table_RB[row, :held][::-1])
        self.table_RB[row, :held] = NULL_BLOCK
        self.num_held_R[row] = 0
        self._free_rows.append(row)
        self.version += 1

    def cache_rows(self, rows_T: np.ndarray, positions_T: np.ndarray) -> np.ndarray:
        """Flat cache rows (int64) of position positions_T[t] of block-table row rows_T[t]."""
        bs = self.plan.block_size
        return self.table_RB[rows_T, positions_T // bs].astype(np.int64) * bs + positions_T % bs


class KVCache:
    """K and V of every block and layer (zero-initialised: masked positions must hold finite values) and the
    device copy of the block table."""

    def __init__(self, spec: MoeModelSpec, plan: CachePlan, device: torch.device, dtype: torch.dtype) -> None:
        shape = (spec.num_layers, plan.num_blocks * plan.block_size, spec.num_kv_heads, spec.head_dim)
        self.k_LXMD = torch.zeros(shape, device=device, dtype=dtype)
        self.v_LXMD = torch.zeros(shape, device=device, dtype=dtype)
        self.plan = plan
        self.table = BlockTable(plan)
        self.table_RB = torch.zeros(self.table.table_RB.shape, dtype=torch.int32, device=device)
        # CUDA: the table is staged in pinned memory so its copy to the device is asynchronous. Two buffers taken
        # in turn: a step may stage a new table while the previous step's copy is still queued behind the step
        # before it (the runner's overlapped launches); the copy before that has run by then (StepRunner.launch).
        self._pinned_2RB = (
            [torch.zeros_like(self.table_RB, device="cpu").pin_memory() for _ in range(2)]
            if device.type == "cuda"
            else None
        )
        self._synced_version = -1
        self._num_copies = 0

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    def reset(self) -> None:
        """Every row and block free again (a generate call that raised may have left some held)."""
        self.table = BlockTable(self.plan)
        self._synced_version = -1

    def sync_table(self) -> None:
        """Copy the host block table to the device if it changed since the last copy (stream-ordered)."""
        if self._synced_version == self.table.version:
            return
        src_RB = torch.from_numpy(self.table.table_RB)
        if self._pinned_2RB is not None:
            src_RB = self._pinned_2RB[self._num_copies % 2].copy_(src_RB)
        self.table_RB.copy_(src_RB, non_blocking=True)
        self._synced_version = self.table.version
        self._num_copies += 1

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [X, M, D] views."""
        return self.k_LXMD[layer], self.v_LXMD[layer]

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_LXMD, self.v_LXMD]

    def num_bytes(self) -> int:
        return 2 * self.k_LXMD.numel() * self.k_LXMD.element_size()
