"""Slot-based KV cache: one fixed-length slot per in-flight sequence, sized once from a memory budget.

K and V live in two tensors `[L, S, P, N, D]` (all layers together, so moving a sequence between slots is two
copies; the heads of one position adjacent, so writing a token's K/V is one `index_copy_` into the flattened
`[S * P, N, D]` view of a layer). Decode rows are slots: row i of a decode batch reads and writes slot i, so
attention reads the cache in place (no gather), through `[B, N, P, D]` transposed views. A slot holds at most `max_model_len` positions; the number of slots is the budget divided by
that, capped at `max_batch_size`. Departure from paged caches (vLLM): memory is reserved per slot at the maximum
length; in exchange decode attention is one dense SDPA call over `[B, N, P, D]` views, which plain PyTorch runs
fast and CUDA graphs capture.

Legend: L layers, S slots, P positions (max_model_len), N kv heads, D head dim, B rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.model_spec import MoeModelSpec


@dataclass(frozen=True)
class CachePlan:
    num_slots: int
    max_model_len: int
    budget_bytes: int
    bytes_per_token: int


def plan_cache(
    spec: MoeModelSpec,
    element_size: int,
    *,
    max_model_len: int,
    max_batch_size: int,
    budget_bytes: int,
    source: str,
) -> CachePlan:
    """Slots = min(max_batch_size, budget // (max_model_len * bytes per token)); fewer than one is an error now."""
    per_token = spec.kv_bytes_per_token(element_size)
    fit = budget_bytes // (per_token * max_model_len)
    if fit < 1:
        raise ValueError(
            f"KV cache: {source} gives {budget_bytes / 2**20:.1f} MiB, which cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens ({per_token * max_model_len / 2**20:.1f} MiB at {per_token} "
            f"bytes/token); raise kv_cache_fraction / kv_cache_tokens or lower max_model_len"
        )
    return CachePlan(min(max_batch_size, fit), max_model_len, budget_bytes, per_token)


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
        "cannot read MemAvailable from /proc/meminfo to size the KV cache; set kv_cache_tokens"
    )


class KVCache:
    """K and V of every slot and layer, zero-initialised (masked positions must hold finite values: 0 * NaN)."""

    def __init__(self, spec: MoeModelSpec, plan: CachePlan, device: torch.device, dtype: torch.dtype) -> None:
        shape = (spec.num_layers, plan.num_slots, plan.max_model_len, spec.num_kv_heads, spec.head_dim)
        self.k_LSPND = torch.zeros(shape, device=device, dtype=dtype)
        self.v_LSPND = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots = plan.num_slots
        self.max_model_len = plan.max_model_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction of decode rows)."""
        self.k_LSPND[:, dst, :length].copy_(self.k_LSPND[:, src, :length])
        self.v_LSPND[:, dst, :length].copy_(self.v_LSPND[:, src, :length])

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [S * P, N, D] views: row slot * max_model_len + position."""
        k, v = self.k_LSPND[layer], self.v_LSPND[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def keys_values(self, layer: int, rows: int, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first `rows` slots and `num_keys` positions as [B, N, S, D] views (no copy)."""
        return (
            self.k_LSPND[layer, :rows, :num_keys].transpose(1, 2),
            self.v_LSPND[layer, :rows, :num_keys].transpose(1, 2),
        )

    def num_bytes(self) -> int:
        return 2 * self.k_LSPND.numel() * self.k_LSPND.element_size()
