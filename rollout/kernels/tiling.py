"""The persistent MoE kernel's tile heights, and the rule that picks the height of a mixed step's prefill tokens.

Torch-free: the engine (rollout.model) and its step cost model (rollout.step_cost) read the same rule.

A decode tile holds at most BLOCK_M_DECODE pairs of one expert, a prefill tile BLOCK_M_PREFILL. In a mixed step
cut by phase, every expert that both phases route to has its weights read twice from memory, once by its decode
tiles and again by its prefill tile, whose MMA over 128 rows is mostly empty when the prefill segment is small.
Cut into decode tiles with the decoding rows, an expert's tiles are adjacent in the tile order, so its weights
are read once and its later tiles find them in L2. Measured on an H100 (Qwen3-30B-A3B experts, bf16,
graph-timed; `bench/rollout_expertplex.py --sections mixed`, bench/RESULTS.md): beside 32 or 128 decode rows,
16-256 prefill tokens took the layer's experts 1.59-1.98x the decode rows' time alone cut by phase, 1.00-1.23x
in decode tiles; 2,048 tokens 2.32x against 3.90x. A prefill pass alone keeps prefill tiles: it reads each
expert once either way, and 512 tokens took 0.50 ms in prefill tiles where 256 and 1,024 decode rows took 0.49
and 0.96 ms. So a mixed step's prefill segment goes into decode tiles while its expected pairs per expert fill
one decode tile (16: 256 tokens of a 128-expert top-8 model), the largest segment measured to gain at every
measured decode batch. Rows come out bitwise the same in either height (`same_bits` in that section; tested in
tests/rollout/test_persistent_moe.py), so the choice changes no token.
"""

from __future__ import annotations

BLOCK_M_DECODE = 16  # the smallest tl.dot operand: decode groups hold few pairs each
BLOCK_M_PREFILL = 128
# the mean pairs per expert up to which a mixed step's prefill segment is cut into decode tiles
SMALL_PREFILL_PAIRS = BLOCK_M_DECODE


def max_small_prefill(top_k: int, num_experts: int) -> int:
    """S: the most prefill tokens a mixed step cuts into decode tiles, those whose mean pairs per expert, S K / E,
    are at most SMALL_PREFILL_PAIRS."""
    return SMALL_PREFILL_PAIRS * num_experts // top_k


def prefill_in_decode_tiles(prefill_tokens: int, decode_rows: int, top_k: int, num_experts: int) -> bool:
    """Whether a step's prefill segment of `prefill_tokens` tokens is cut into decode tiles beside its
    `decode_rows` decoding rows (never without decoding rows: a prefill pass alone keeps prefill tiles)."""
    return decode_rows > 0 and prefill_tokens <= max_small_prefill(top_k, num_experts)


def kernel_num_decode(num_tokens: int, num_decode: int, top_k: int, num_experts: int) -> int:
    """The tokens the kernel tiles as decode rows (its `num_decode`): all of a mixed step's tokens when its
    prefill segment (tokens [num_decode, num_tokens)) is small, else the decoding rows alone."""
    if prefill_in_decode_tiles(num_tokens - num_decode, num_decode, top_k, num_experts):
        return num_tokens
    return num_decode
