"""Attention of a flat step of tokens over the paged KV cache: Triton kernels on CUDA, an exact SDPA reference.

Token t (query q_t, head n, kv head m = n // G) of block-table row r = seq_T[t] at position p = pos_T[t] attends
causally to the keys of positions 0..p of its sequence, read through the block table (position j lives at flat
cache row table[r, j // block_size] * block_size + j % block_size):

    out[t, n] = sum_j softmax_j(scale * q[t, n] . k[j, m]) v[j, m]        j = 0..p

Decode tokens (flat [0, num_decode), one query of its own sequence each) run flash-decoding: grid (token, kv
head, split); split s of S walks keys [s c, min((s+1) c, p+1)) with c = ceil(ceil((p+1) / S) / BLOCK_N) BLOCK_N,
computed in the kernel from pos_T so the grid stays static under CUDA-graph capture, and keeps a running max
m_s, sum l_s and unnormalised accumulator a_s (online softmax in base 2: scores are scaled by scale * log2(e)
once, and exp2 replaces exp). A second kernel merges the splits:

    M = max_s m_s        out = sum_s 2^(m_s - M) a_s / sum_s 2^(m_s - M) l_s

where an empty split (m_s = -inf, l_s = 0, a_s = 0) weighs 0. One program reads its share of the keys of one kv
head once, for all G query heads of that head (G query rows of one dot product): decode is bound by the K/V bytes.

Prefill tokens (flat [num_decode, T)) come in tiles of at most `prefill_tile_tokens` consecutive tokens of one
sequence with consecutive positions; program (tile, kv head) folds the tile's tokens x G heads into BLOCK_M query
rows (row i: token i // G, head m G + i % G) and walks keys 0..(last position of the tile) with the causal mask
j <= position of the row's token. Tokens [num_decode, T) that no tile covers (a captured step's padding) get
zeros, so that what flows on from them does not depend on stale memory.

The reference (`paged_attention_reference`) gathers each sequence's keys through the block table and calls
`torch.nn.functional.scaled_dot_product_attention` (fp32 accumulation): decode tokens in one call with a padding
mask, prefill tokens in runs of one sequence with consecutive positions, one call each with a causal mask offset
by the run's first position. It ignores the tiles and is the engine's CPU path and the kernels' test oracle.

Legend: T flat tokens, N query heads, M kv heads, G = N / M, D head dim, X flat cache rows (num_blocks *
block_size), R block-table rows, B blocks per row, Q prefill tiles, S splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.kernels import interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = tl = None

__all__ = [
    "AttentionBatch",
    "decode_splits",
    "paged_attention",
    "paged_attention_reference",
    "paged_attention_triton",
    "prefill_tile_tokens",
    "prefill_tiles",
]

LOG2E = math.log2(math.e)
PREFILL_ROWS = 128  # query rows (tokens x G heads) of one prefill program: one 128-row dot operand
# Launch settings of the decode kernel (memory-bound: 4 warps, loads of later key tiles in flight while one is
# reduced) and of the prefill kernel (a [128, 128] fp32 accumulator wants 8 warps' registers).
DECODE_LAUNCH = {"num_warps": 4, "num_stages": 3}
PREFILL_LAUNCH = {"num_stages": 2}
# The engine's keys per loop step (None: one cache block's, 16 at the paged engine's blocks of 16): a step's dot has
# this many columns; larger tiles span cache blocks (one block-table entry per key). Measured on an H100
# (bench/rollout_kernels.py --batches 32,128 --keys 8192, bench/RESULTS.md): decode at 64 keys reads 91% / 95% of
# the HBM bandwidth at 32 / 128 rows against 56% / 68% at one block's 16; prefill at 128 keys runs at 293 TFLOP/s
# against 229 (the [128 x D] x [D x 16] dot starves the tensor cores).
DECODE_KEY_TILE: int | None = 64
PREFILL_KEY_TILE: int | None = 128
DECODE_WAVES = 2  # decode programs (rows x kv heads x splits) per SM that decode_splits aims for


@dataclass(frozen=True)
class AttentionBatch:
    """Where each flat token of a step attends: everything the kernels read, as device tensors of static shape.

    Tokens [0, num_decode) are decode tokens (one each of distinct sequences), the rest prefill tokens covered by
    the tiles (tile_len_Q = 0: a padding tile). num_splits is the decode kernel's split-K factor (>= 1)."""

    seq_T: torch.Tensor  # int32 [T]: block-table row of each token
    pos_T: torch.Tensor  # int32 [T]: position of each token in its sequence
    num_decode: int
    tile_start_Q: torch.Tensor  # int32 [Q]: flat index of each prefill tile's first token
    tile_len_Q: torch.Tensor  # int32 [Q]: tokens in the tile, at most prefill_tile_tokens(...)
    num_splits: int


def prefill_tile_tokens(num_q_heads: int, num_kv_heads: int) -> int:
    """Tokens per prefill tile: the largest power of two <= max(1, 128 // G), so that tile x G ~ 128 query rows."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not split into groups over {num_kv_heads} kv heads")
    per_tile = max(1, PREFILL_ROWS // (num_q_heads // num_kv_heads))
    return 1 << (per_tile.bit_length() - 1)


def prefill_tiles(pieces: list[tuple[int, int]], tile: int) -> tuple[list[int], list[int]]:
    """Cut prefill pieces (flat start, length), each of one sequence with rising positions, into tiles of at most
    `tile` tokens: (tile starts, tile lengths), in the pieces' order."""
    starts: list[int] = []
    lengths: list[int] = []
    for start, length in pieces:
        for offset in range(0, length, tile):
            starts.append(start + offset)
            lengths.append(min(tile, length - offset))
    return starts, lengths


def decode_splits(
    num_decode: int, num_kv_heads: int, num_sms: int, max_splits: int = 16, waves: int | None = None
) -> int:
    """Split-K factor of the decode kernel: programs = num_decode * M * splits should fill `waves` waves of the
    SMs (DECODE_WAVES by default), splits = min(max_splits, ceil(waves num_sms / (num_decode M))); 1 once
    num_decode * M alone does. More splits cost a merge pass and empty splits on short contexts, hence the cap;
    fewer leave each program a long chain of dependent block-table and key loads on long contexts."""
    waves = DECODE_WAVES if waves is None else waves
    programs = num_decode * num_kv_heads
    if programs <= 0 or programs >= waves * num_sms:
        return 1
    return max(1, min(max_splits, -(-waves * num_sms // programs)))


def paged_attention(
    q_TND: torch.Tensor,
    k_XMD: torch.Tensor,
    v_XMD: torch.Tensor,
    block_table_RB: torch.Tensor,
    batch: AttentionBatch,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """out_TND (contiguous, q's dtype): the Triton kernels on CUDA when Triton is importable (with this module's
    DECODE_KEY_TILE / PREFILL_KEY_TILE, read at each call), else the reference."""
    if q_TND.is_cuda and triton is not None:
        tiles = {"decode_key_tile": DECODE_KEY_TILE, "prefill_key_tile": PREFILL_KEY_TILE}
        return paged_attention_triton(q_TND, k_XMD, v_XMD, block_table_RB, batch, block_size, scale, **tiles)
    return paged_attention_reference(q_TND, k_XMD, v_XMD, block_table_RB, batch, block_size, scale)


# ------------------------------------------------------------------------------------------------ reference
def _cache_rows(table_RB: torch.Tensor, seq_S: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache rows [S, length] of positions 0..length-1 of block-table rows seq_S (int64). Columns past a
    row's table width are clamped: the caller masks those positions."""
    pos_P = torch.arange(length, device=table_RB.device)
    col_P = (pos_P // block_size).clamp(max=table_RB.shape[1] - 1)
    return table_RB[seq_S[:, None], col_P[None, :]] * block_size + pos_P % block_size


def _sdpa_over_cache(
    q_SNLD: torch.Tensor,
    k_XMD: torch.Tensor,
    v_XMD: torch.Tensor,
    rows_SK: torch.Tensor,
    keep_SLK: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """SDPA of queries [S, N, L, D] over the cache rows [S, K] with a boolean mask [S, L, K] (True = attend).
    Keys no query keeps are zeroed first: they may be stale memory (NaN), and 0-weight x NaN would still be NaN.
    The N // M query heads of a KV head share it through SDPA's GQA mode: no copy of K/V per query head (that
    copy was most of a CPU decode step's attention at a few hundred positions)."""
    used_SK1 = keep_SLK.any(dim=1)[..., None, None]
    k_SMKD = torch.where(used_SK1, k_XMD[rows_SK], 0).transpose(1, 2)
    v_SMKD = torch.where(used_SK1, v_XMD[rows_SK], 0).transpose(1, 2)
    return F.scaled_dot_product_attention(
        q_SNLD, k_SMKD, v_SMKD, attn_mask=keep_SLK[:, None], scale=scale, enable_gqa=True
    )


def paged_attention_reference(
    q_TND: torch.Tensor,
    k_XMD: torch.Tensor,
    v_XMD: torch.Tensor,
    block_table_RB: torch.Tensor,
    batch: AttentionBatch,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """The exact path (plain torch, host-synchronising): decode tokens in one SDPA call padded to the longest
    context, prefill tokens in runs (same row, positions +1 each) of one call each. Every token of [0, T) is
    computed, whatever the tiles say."""
    t, n, d = q_TND.shape
    table_RB = block_table_RB.long()
    seq_T, pos_T = batch.seq_T.long(), batch.pos_T.long()
    out_TND = torch.empty((t, n, d), dtype=q_TND.dtype, device=q_TND.device)
    nd = batch.num_decode
    if nd:
        pos_S = pos_T[:nd]
        length = int(pos_S.max()) + 1
        keep_S1K = (torch.arange(length, device=q_TND.device)[None, :] <= pos_S[:, None])[:, None, :]
        rows_SK = _cache_rows(table_RB, seq_T[:nd], length, block_size)
        q_SN1D = q_TND[:nd].unsqueeze(2)
        out_TND[:nd] = _sdpa_over_cache(q_SN1D, k_XMD, v_XMD, rows_SK, keep_S1K, scale).squeeze(2)
    seqs, positions = seq_T.tolist(), pos_T.tolist()
    start = nd
    for i in range(nd + 1, t + 1):
        if i < t and seqs[i] == seqs[i - 1] and positions[i] == positions[i - 1] + 1:
            continue
        first, length = positions[start], positions[i - 1] + 1
        pos_L = torch.arange(first, length, device=q_TND.device)
        keep_1LK = (torch.arange(length, device=q_TND.device)[None, :] <= pos_L[:, None])[None]
        rows_1K = _cache_rows(table_RB, seq_T[start : start + 1], length, block_size)
        q_1NLD = q_TND[start:i].transpose(0, 1)[None]
        out_1NLD = _sdpa_over_cache(q_1NLD, k_XMD, v_XMD, rows_1K, keep_1LK, scale)
        out_TND[start:i] = out_1NLD[0].transpose(0, 1)
        start = i
    return out_TND


# ------------------------------------------------------------------------------------------------- kernels
if triton is not None:

    @triton.jit
    def dot_fp32(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """a @ b accumulated in fp32; UPCAST (the interpreter: its dot multiplies the raw bits of bf16) first
        widens the operands, which changes no value: the products of bf16 or fp16 numbers are exact in fp32."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _key_rows(table_row, start, offs_n, hi, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Flat cache rows of keys start + offs_n (start a multiple of BLOCK_N): one block-table entry when the
        tile lies in one cache block (BLOCK_N divides BLOCK_SIZE), else one per key (a tile over several blocks;
        keys >= hi read the null block's entry 0, and their loads are masked)."""
        if BLOCK_SIZE % BLOCK_N == 0:
            block = tl.load(table_row + start // BLOCK_SIZE).to(tl.int64)
            return block * BLOCK_SIZE + (start % BLOCK_SIZE) + offs_n
        else:
            key_N = start + offs_n
            block_N = tl.load(table_row + key_N // BLOCK_SIZE, mask=key_N < hi, other=0).to(tl.int64)
            return block_N * BLOCK_SIZE + key_N % BLOCK_SIZE

    @triton.jit
    def _decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        seq_ptr,
        pos_ptr,
        out_ptr,
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        num_heads,
        stride_qt,
        stride_qn,
        stride_qd,
        stride_kx,
        stride_km,
        stride_vx,
        stride_vm,
        stride_tr,
        stride_ot,
        stride_on,
        qk_scale,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        t = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        head_G = kv_head * G + offs_g
        gd_ok = (offs_g < G)[:, None] & (offs_d < D)[None, :]
        d_ok = offs_d < D

        seq = tl.load(seq_ptr + t).to(tl.int64)
        num_keys = tl.load(pos_ptr + t) + 1
        q_GD = tl.load(
            q_ptr + t * stride_qt + head_G[:, None] * stride_qn + offs_d[None, :] * stride_qd,
            mask=gd_ok,
            other=0.0,
        )
        if NUM_SPLITS == 1:
            lo = 0
            hi = num_keys
        else:
            # chunks are whole BLOCK_N tiles: a tile starts at a multiple of BLOCK_N (see _key_rows)
            chunk = tl.cdiv(tl.cdiv(num_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, num_keys)

        max_G = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        sum_G = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc_GD = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        table_row = table_ptr + seq * stride_tr
        k_head = k_ptr + kv_head * stride_km
        v_head = v_ptr + kv_head * stride_vm
        for start in range(lo, hi, BLOCK_N):
            row_N = _key_rows(table_row, start, offs_n, hi, BLOCK_SIZE, BLOCK_N)
            key_ok = start + offs_n < hi
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k_ND = tl.load(k_head + row_N[:, None] * stride_kx + offs_d[None, :], mask=kv_mask, other=0.0)
            v_ND = tl.load(v_head + row_N[:, None] * stride_vx + offs_d[None, :], mask=kv_mask, other=0.0)
            s_GN = dot_fp32(q_GD, tl.trans(k_ND), PRECISION, UPCAST) * qk_scale
            s_GN = tl.where(key_ok[None, :], s_GN, float("-inf"))
            # each tile holds >= 1 valid key, so new_max is finite and the rescale never sees -inf - -inf
            new_max = tl.maximum(max_G, tl.max(s_GN, 1))
            alpha = tl.exp2(max_G - new_max)
            p_GN = tl.exp2(s_GN - new_max[:, None])
            sum_G = sum_G * alpha + tl.sum(p_GN, 1)
            acc_GD = acc_GD * alpha[:, None] + dot_fp32(p_GN.to(v_ND.dtype), v_ND, PRECISION, UPCAST)
            max_G = new_max

        if NUM_SPLITS == 1:
            out_GD = acc_GD / sum_G[:, None]
            out_ptrs = out_ptr + t * stride_ot + head_G[:, None] * stride_on + offs_d[None, :]
            tl.store(out_ptrs, out_GD.to(out_ptr.dtype.element_ty), mask=gd_ok)
        else:
            # partials [T, N, S, D] and [T, N, S]: an empty split stores max -inf, sum 0, acc 0
            part_G = (t * num_heads + head_G) * NUM_SPLITS + split
            tl.store(part_acc_ptr + part_G[:, None] * D + offs_d[None, :], acc_GD, mask=gd_ok)
            tl.store(part_max_ptr + part_G, max_G, mask=offs_g < G)
            tl.store(part_sum_ptr + part_G, sum_G, mask=offs_g < G)

    @triton.jit
    def _combine_kernel(
        part_acc_ptr,
        part_max_ptr,
        part_sum_ptr,
        out_ptr,
        num_heads,
        stride_ot,
        stride_on,
        D: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < NUM_SPLITS
        d_ok = offs_d < D
        part_S = (t * num_heads + head) * NUM_SPLITS + offs_s
        max_S = tl.load(part_max_ptr + part_S, mask=s_ok, other=float("-inf"))
        sum_S = tl.load(part_sum_ptr + part_S, mask=s_ok, other=0.0)
        acc_SD = tl.load(
            part_acc_ptr + part_S[:, None] * D + offs_d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        top = tl.max(max_S, 0)
        # empty splits weigh 0 explicitly: were every split empty, max_S - top would be -inf - -inf = NaN
        weight_S = tl.where(max_S > float("-inf"), tl.exp2(max_S - top), 0.0)
        num_D = tl.sum(acc_SD * weight_S[:, None], 0)
        den = tl.sum(sum_S * weight_S, 0)
        out_D = tl.where(den > 0, num_D / den, 0.0)
        tl.store(
            out_ptr + t * stride_ot + head * stride_on + offs_d, out_D.to(out_ptr.dtype.element_ty), mask=d_ok
        )

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,
        seq_ptr,
        pos_ptr,
        tile_start_ptr,
        tile_len_ptr,
        out_ptr,
        stride_qt,
        stride_qn,
        stride_qd,
        stride_kx,
        stride_km,
        stride_vx,
        stride_vm,
        stride_tr,
        stride_ot,
        stride_on,
        qk_scale,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_tokens = tl.load(tile_len_ptr + tile)
        if num_tokens == 0:
            return
        first = tl.load(tile_start_ptr + tile)
        seq = tl.load(seq_ptr + first).to(tl.int64)
        first_pos = tl.load(pos_ptr + first)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        token_M = offs_m // G
        head_M = kv_head * G + offs_m % G
        d_ok = offs_d < D
        md_ok = (token_M < num_tokens)[:, None] & d_ok[None, :]
        qpos_M = first_pos + token_M
        q_MD = tl.load(
            q_ptr
            + (first + token_M)[:, None] * stride_qt
            + head_M[:, None] * stride_qn
            + offs_d[None, :] * stride_qd,
            mask=md_ok,
            other=0.0,
        )

        hi = first_pos + num_tokens
        max_M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        sum_M = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_MD = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table_row = table_ptr + seq * stride_tr
        k_head = k_ptr + kv_head * stride_km
        v_head = v_ptr + kv_head * stride_vm
        for start in range(0, hi, BLOCK_N):
            row_N = _key_rows(table_row, start, offs_n, hi, BLOCK_SIZE, BLOCK_N)
            key_N = start + offs_n
            kv_mask = (key_N < hi)[:, None] & d_ok[None, :]
            k_ND = tl.load(k_head + row_N[:, None] * stride_kx + offs_d[None, :], mask=kv_mask, other=0.0)
            v_ND = tl.load(v_head + row_N[:, None] * stride_vx + offs_d[None, :], mask=kv_mask, other=0.0)
            s_MN = dot_fp32(q_MD, tl.trans(k_ND), PRECISION, UPCAST) * qk_scale
            # key 0 is in the first tile and kept by every row, so every row's max is finite from then on
            s_MN = tl.where(key_N[None, :] <= qpos_M[:, None], s_MN, float("-inf"))
            new_max = tl.maximum(max_M, tl.max(s_MN, 1))
            alpha = tl.exp2(max_M - new_max)
            p_MN = tl.exp2(s_MN - new_max[:, None])
            sum_M = sum_M * alpha + tl.sum(p_MN, 1)
            acc_MD = acc_MD * alpha[:, None] + dot_fp32(p_MN.to(v_ND.dtype), v_ND, PRECISION, UPCAST)
            max_M = new_max

        out_MD = acc_MD / sum_M[:, None]
        out_ptrs = (
            out_ptr + (first + token_M)[:, None] * stride_ot + head_M[:, None] * stride_on + offs_d[None, :]
        )
        tl.store(out_ptrs, out_MD.to(out_ptr.dtype.element_ty), mask=md_ok)


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _key_tile(block_size: int, key_tile: int | None) -> int:
    """BLOCK_N, the keys of one loop step: `key_tile` (a power of two in [16, 256]; it may span cache blocks),
    or by default the largest of 64 / 32 / 16 dividing block_size (one cache block per step)."""
    if block_size <= 0 or block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
    if key_tile is None:
        return next(n for n in (64, 32, 16) if block_size % n == 0)
    if key_tile not in (16, 32, 64, 128, 256):
        raise ValueError(f"key tiles must be a power of two in [16, 256], got {key_tile}")
    return key_tile


def paged_attention_triton(
    q_TND: torch.Tensor,
    k_XMD: torch.Tensor,
    v_XMD: torch.Tensor,
    block_table_RB: torch.Tensor,
    batch: AttentionBatch,
    block_size: int,
    scale: float,
    *,
    decode_key_tile: int | None = None,
    prefill_key_tile: int | None = None,
) -> torch.Tensor:
    """The Triton kernels (CUDA tensors; CPU tensors under TRITON_INTERPRET=1). No host synchronisation: grids
    come from shapes and Python ints only, lengths are read on the device. decode_key_tile / prefill_key_tile:
    keys per loop step of each kernel (None: one cache block's, see _key_tile)."""
    if triton is None:
        raise RuntimeError("paged_attention_triton needs Triton")
    t, n, d = q_TND.shape
    m = k_XMD.shape[1]
    if n % m:
        raise ValueError(f"{n} query heads do not split into groups over {m} kv heads")
    if k_XMD.stride(-1) != 1 or v_XMD.stride(-1) != 1 or block_table_RB.stride(-1) != 1:
        raise ValueError("K/V caches and the block table need a contiguous last dimension")
    vectors = (batch.seq_T, batch.pos_T, batch.tile_start_Q, batch.tile_len_Q)
    if any(v.dim() != 1 or (v.numel() > 1 and v.stride(0) != 1) for v in vectors):
        raise ValueError(
            "AttentionBatch: seq_T, pos_T, tile_start_Q and tile_len_Q must be contiguous vectors"
        )
    g = n // m
    decode_n, prefill_n = _key_tile(block_size, decode_key_tile), _key_tile(block_size, prefill_key_tile)
    block_d = max(16, _next_pow2(d))
    # the interpreter's dot is wrong for bf16: widen its operands there
    upcast = interpreted(_decode_kernel)
    # fp32 operands would otherwise go through TF32 (10-bit mantissa): 1e-3 errors instead of 1e-6
    precision = "ieee" if upcast or q_TND.dtype == torch.float32 else "tf32"
    qk_scale = scale * LOG2E
    out_TND = torch.empty((t, n, d), dtype=q_TND.dtype, device=q_TND.device)
    nd = batch.num_decode
    if t > nd:
        out_TND[nd:].zero_()
    q_strides = q_TND.stride()
    kv_strides = (
        k_XMD.stride(0),
        k_XMD.stride(1),
        v_XMD.stride(0),
        v_XMD.stride(1),
        block_table_RB.stride(0),
    )
    out_strides = out_TND.stride()[:2]

    if nd:
        splits = batch.num_splits
        if splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {splits}")
        if splits == 1:
            part_acc = part_max = part_sum = out_TND  # never touched: the kernel writes out_TND itself
        else:
            part_acc = torch.empty((nd, n, splits, d), dtype=torch.float32, device=q_TND.device)
            part_max = torch.empty((nd, n, splits), dtype=torch.float32, device=q_TND.device)
            part_sum = torch.empty((nd, n, splits), dtype=torch.float32, device=q_TND.device)
        _decode_kernel[(nd, m, splits)](
            q_TND,
            k_XMD,
            v_XMD,
            block_table_RB,
            batch.seq_T,
            batch.pos_T,
            out_TND,
            part_acc,
            part_max,
            part_sum,
            n,
            *q_strides,
            *kv_strides,
            *out_strides,
            qk_scale,
            G=g,
            D=d,
            BLOCK_SIZE=block_size,
            NUM_SPLITS=splits,
            BLOCK_G=max(16, _next_pow2(g)),
            BLOCK_D=block_d,
            BLOCK_N=decode_n,
            PRECISION=precision,
            UPCAST=upcast,
            **DECODE_LAUNCH,
        )
        if splits > 1:
            _combine_kernel[(nd, n)](
                part_acc,
                part_max,
                part_sum,
                out_TND,
                n,
                *out_strides,
                D=d,
                NUM_SPLITS=splits,
                BLOCK_S=_next_pow2(splits),
                BLOCK_D=_next_pow2(d),
                num_warps=1,
            )

    num_tiles = batch.tile_start_Q.shape[0]
    if num_tiles:
        block_m = max(16, _next_pow2(prefill_tile_tokens(n, m) * g))
        _prefill_kernel[(num_tiles, m)](
            q_TND,
            k_XMD,
            v_XMD,
            block_table_RB,
            batch.seq_T,
            batch.pos_T,
            batch.tile_start_Q,
            batch.tile_len_Q,
            out_TND,
            *q_strides,
            *kv_strides,
            *out_strides,
            qk_scale,
            G=g,
            D=d,
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            BLOCK_N=prefill_n,
            PRECISION=precision,
            UPCAST=upcast,
            num_warps=8 if block_m * block_d >= 128 * 128 else 4,
            **PREFILL_LAUNCH,
        )
    return out_TND
