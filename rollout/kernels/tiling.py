"""The persistent MoE kernel's tile heights, and the rule that cuts a mixed step's tokens into them.

Torch-free: the engine (rollout.model) and its step cost model (rollout.step_cost) read the same rule.

A decode tile holds at most BLOCK_M_DECODE pairs of one expert, a prefill tile BLOCK_M_PREFILL. Cut by phase (the
decoding rows in decode tiles, the prefill segment in prefill tiles), every expert that both phases route to has
its weights read twice from memory, and a small segment's prefill tiles run 128-row MMAs that are mostly empty.
The engine therefore puts all of a mixed step's tokens into tiles of one height, where each expert's tiles are
adjacent in the tile order: its weights are read once and its later tiles find them in L2.
- A small prefill segment goes into decode tiles with the rows, while its expected pairs per expert fill one
  decode tile (16: 256 tokens of a 128-expert top-8 model). Measured on an H100 (Qwen3-30B-A3B experts, bf16,
  graph-timed; `bench/rollout_expertplex.py --sections mixed`, bench/RESULTS.md): beside 32 or 128 decode rows,
  16-256 prefill tokens took the layer's experts 1.00-1.23x the decode rows' time alone in decode tiles, against
  1.59-1.98x cut by phase; 2,048 tokens took 3.90x in decode tiles, where 16-row tiles are too short for it.
- A larger segment takes the rows into prefill tiles with it: the pass is then a prefill pass of rows + segment
  tokens, which costs less than the same segment's prefill pass plus a decode pass of the rows (the phase cut,
  2.32x the rows alone at 128 + 2,048 tokens; a 2,048-token prefill pass alone took 1.45x a 128-row decode pass).
A pass of one phase keeps its own tiles. Rows come out bitwise the same in either height (`same_bits` in that
section; tested in tests/rollout/test_persistent_moe.py), so the cut changes no token.

Decode tiles grow with the pass: from S tokens in decode tiles on (16 pairs per expert on average) they hold
BLOCK_M_DECODE_WIDE pairs. At S tokens 16-row tiles split about half the experts in two (E[ceil(m / 16)] = 1.43
tiles per expert for m ~ Binomial(S, K / E)) where 32-row tiles need one, and a split expert's second tile
reads its weights again, at best from L2. Measured on an H100 (256 rows of Qwen3-30B-A3B's experts, bf16,
graph-timed, `--sections sweep`): 463 us in 32-row tiles, 490 in 16-row tiles, the fastest launch of each.
"""

from __future__ import annotations

BLOCK_M_DECODE = 16  # the smallest tl.dot operand: decode groups hold few pairs each
BLOCK_M_DECODE_WIDE = 32  # decode tiles of passes with S tokens or more in them
BLOCK_M_PREFILL = 128
# the mean pairs per expert up to which a mixed step's prefill segment is cut into decode tiles
SMALL_PREFILL_PAIRS = BLOCK_M_DECODE


def max_small_prefill(top_k: int, num_experts: int) -> int:
    """S: the most prefill tokens a mixed step cuts into decode tiles: the largest power of two whose mean pairs
    per expert, S K / E, are at most SMALL_PREFILL_PAIRS. A power of two, because a CUDA-graph step pads its
    prefill tokens to one (rollout.runner): p <= S exactly when the padded count is, so the graph, the eager step
    and the step cost model cut the same way."""
    most = SMALL_PREFILL_PAIRS * num_experts // top_k
    return 1 << (most.bit_length() - 1) if most else 0


def prefill_in_decode_tiles(prefill_tokens: int, decode_rows: int, top_k: int, num_experts: int) -> bool:
    """Whether a step's prefill segment of `prefill_tokens` tokens is cut into decode tiles beside its
    `decode_rows` decoding rows (never without decoding rows: a prefill pass alone keeps prefill tiles)."""
    return decode_rows > 0 and prefill_tokens <= max_small_prefill(top_k, num_experts)


def kernel_num_decode(num_tokens: int, num_decode: int, top_k: int, num_experts: int) -> int:
    """The tokens the kernel tiles as decode rows (its `num_decode`): a pass of one phase keeps its own tiles; a
    mixed step's tokens go all into decode tiles when its prefill segment (tokens [num_decode, num_tokens)) is
    small, else all into prefill tiles (0), so each expert's weights are read once either way."""
    if num_decode in (0, num_tokens):
        return num_decode
    small = prefill_in_decode_tiles(num_tokens - num_decode, num_decode, top_k, num_experts)
    return num_tokens if small else 0


def decode_block_m(decode_tokens: int, top_k: int, num_experts: int) -> int:
    """The height of a pass's decode tiles when `decode_tokens` tokens go into them: BLOCK_M_DECODE below S
    tokens, BLOCK_M_DECODE_WIDE from S on (S a power of two, so a CUDA-graph step and its eager run agree)."""
    wide = decode_tokens >= max_small_prefill(top_k, num_experts)
    return BLOCK_M_DECODE_WIDE if wide else BLOCK_M_DECODE
