"""The routed experts of one engine step as persistent, tile-scheduled Triton kernels (ExpertPlex, first
increment): a tile table built on the device, decode tiles first, and a preemption flag that stops prefill work
between tiles so that a later launch can resume it.

Token t of the step (hidden h_t) is routed to K experts e = ids[t, k] with router weights w[t, k]; expert e holds
gate_up_e [2F, H] (rows [0, F) gate, [F, 2F) up) and down_e [H, F]:

    out_t = residual_t + sum_k w[t, k] y_(t,k)        y_(t,k) = down_e (silu(gate_e h_t) * up_e h_t)

Pairs. The R = T K routed pairs are numbered in token order, r = t K + k. Tokens [0, num_decode) are the decode
segment (phase 0), the rest the prefill segment (phase 1). One stable sort of the key phase * E + expert lists the
pairs decode-first, grouped by expert within a phase, in token order within a group (`TileTable.order_R`): group
g = phase E + e of m_g pairs occupies sorted positions [s_g, s_g + m_g), s_g = sum_{g' < g} m_g'.

Tiles. Phase p cuts each group into row tiles of at most M_p pairs (M_0 = block_m_decode, small: decode is bound
by reading the weights; M_1 = block_m_prefill, large: prefill reuses each weight tile over more rows):

    x_moe(p) = sum_e ceil(m_(p,e) / M_p)          tiles of phase p
    c_g = sum_{g' <= g} ceil(m_g' / M_(g' // E))  the inclusive prefix sum over the groups, decode groups first

and tile q (0 <= q < c_(2E-1)) belongs to the group g with c_(g-1) <= q < c_g; its local index j = q - c_(g-1)
gives rows [s_g + j M, s_g + min((j+1) M, m_g)) of expert g mod E. Decode tiles are q < x_moe(0), prefill tiles
the x_moe(1) after them. The table has a static capacity Q, the worst case over every routing with the step's
shape: a phase of P pairs has at most floor((P + min(E, P) (M_p - 1)) / M_p) tiles (`max_tiles`); entries past
c_(2E-1) are unused (rows 0). Everything is built on the device with no host synchronisation: the stable sort in
torch, then one Triton launch for the counts, prefix sums and entries (`build_tiles`).

Phases. The down projection needs all F columns of a pair's SwiGLU output, so the experts run as two persistent
launches over the same tiles: A computes act = silu(x gate_e^T) * (x up_e^T) for a tile's rows (x gathered from
h through order_R) into act_RF (sorted order), B computes act down_e^T into y_RH (token order). A work item is
(tile q, column block n) of F (phase A) or H (phase B) in BLOCK_N columns, numbered w = q NB + n, so decode items
come first in both. Each is a [M, BLOCK_N] fp32 accumulator over the reduction (H in A, F in B) in BLOCK_K steps;
loads and stores are in the input dtype. The grid is fixed (PROGRAMS_PER_SM programs per SM; `num_programs`),
sized without reading the device, and program i walks items w = i, i + P, i + 2P, ... while w < (total tiles) NB,
the total read from device memory. Nothing accumulates across programs: a third launch (the combine) computes
out_t = residual_t + sum_k w[t, k] y_(t,k) in fp32, k in order, rounded once, for its tokens and column block
(program i takes tokens i, i + P', ...), so results do not depend on the schedule; it reads y_RH once, where the same formula in torch ops moves a [T, K, H]
fp32 copy through memory four times (~2.6 GB at 8192 tokens: ~0.8 ms at an H100's bandwidth, by arithmetic).
Weight tiles are read with per-thread loads, or with `tma=True` through TMA descriptors (Hopper's bulk copies).

Preemption and resume. With `preempt_flag` (int32, one element in device memory), a program reads the flag
before each prefill item (one scalar atomic read, broadcast to all of its threads: they agree even while the
flag changes); once it has seen it nonzero it takes no more prefill items and leaves (decode items come first
and always run, unread), so the SMs go to the arriving pass's kernels at once.
Phase A's prefill items are the long ones (a reduction over H, twice: gate and up), so their reduction can run
in `preempt_slices` slices with the flag read between them: an item that sees it gives itself up, stores nothing
and stays undone, and the arriving pass waits for a slice rather than a whole item. Such a launch tracks its
work: every item done stores 1 in done_a_W / done_b_W, and a B item runs only if all NB column blocks of its
tile's A items are done (were the flag cleared between A and B, B still never reads an act row that A did not
write: it leaves that tile undone). `MoeRun.undone` (int32 on the device) counts the prefill tiles whose B
items are not all done. Passing that run as `resume` relaunches both phases over the same tiles and buffers,
skipping done items: a launch with the flag plus its resume give the same output, bit for bit, as one launch
without it (every item computes the same numbers whichever program runs it, whenever). A preempted run's
combine writes the decode rows only: its prefill rows are left as the output buffer held them until a resume
completes them. So a decode pass arriving on another stream does not wait behind a whole combine of the
prefill tokens (the GPU hands SMs to the higher-priority stream only as the running blocks end), nor does the
prefill pay it twice. With `heeding`, only the grid's first programs heed the flag: the others keep taking
prefill items while the arriving pass runs in the slots the first ones leave.

Everything is graph-capturable: grids and buffer sizes come from shapes and Python ints, counts are read on the
device, and a preempted run's done masks and buffers are device tensors a later captured launch can resume.

Legend: T tokens, H hidden, K top-k, R = T K pairs, E experts, F expert FFN width, G = 2E (phase, expert) groups,
Q tile-table capacity, W work items (Q x NB column blocks), M rows per tile (M_0 decode, M_1 prefill).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rollout.kernels import interpreted
from rollout.kernels.tiling import BLOCK_M_DECODE, BLOCK_M_DECODE_WIDE, BLOCK_M_PREFILL, decode_block_m

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - CPU builds of torch come without Triton
    triton = tl = None
    OutOfResources = RuntimeError
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton before 3.4, or none
    TensorDescriptor = None

__all__ = [
    "MoeRun",
    "TileTable",
    "build_tiles",
    "launch_options",
    "max_tiles",
    "moe_reference",
    "persistent_moe",
    "persistent_moe_run",
    "tile_counts",
    "tma_runs_on",
    "triton_runs_on",
]

# Defaults from bench/rollout_expertplex.py --sections sweep on an H100 (Qwen3-30B-A3B experts, bf16, graph-timed;
# bench/RESULTS.md): the best configuration for a mixed launch, whose two phases share block_n, block_k and the
# launch options (the tile heights are rollout.kernels.tiling's). Against one program per SM with 64-row prefill
# tiles, 64 x 64 blocks, 4 warps, 3 stages: a 128-row decode pass 638 -> 548 us, an 8192-token prefill pass
# 4586 -> 2747 us.
BLOCK_N = 128
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 4
# The grid, in programs per SM. At the default tiles one program is resident per SM (192 KB of shared memory and
# 255 registers x 256 threads; tests/rollout/test_kernels_compile.py reports both): the second starts when its
# SM's first one ends, and the sweep timed one and two per SM within 2% of each other.
PROGRAMS_PER_SM = 2
# Weight tiles through TMA descriptors (Hopper's bulk copies, what torch._grouped_mm's CUTLASS kernels use) instead
# of per-thread loads: off until an H100/H200 sweep (bench/rollout_expertplex.py --sweep-tma 0,1) shows it faster.
TMA = False
# Slices of a flagged launch's phase-A prefill item, the flag read between them. Two: on an H100 an arriving
# decode pass ran 1.06x its time alone at 2 and 4 slices, 1.10x at 1 (bench/RESULTS.md, #29 arrival; one
# call, stopped programs leaving at once); the rest of its wait is not the running items'. At 8 slices phase
# A spills 192 bytes a thread. `--arrival-slices` of bench/rollout_expertplex.py sweeps it.
PREEMPT_SLICES = 2
LAUNCH = {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}
# A pass all in wide decode tiles (rollout.kernels.tiling.decode_block_m): the H100 sweep's fastest launch of 32-row
# tiles at 256 rows, 463 us against 485 at LAUNCH's 8 warps (3 stages each; bench/RESULTS.md, #29).
WIDE_DECODE_LAUNCH = {"num_warps": 4, "num_stages": 3}
INTERPRETER_PROGRAMS = 4  # the default grid under TRITON_INTERPRET=1 (CPU tensors)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------------ reference
def moe_reference(
    h_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    residual_TH: torch.Tensor,
) -> torch.Tensor:
    """residual + sum_k w_tk down_e(silu(gate_e h_t) * up_e h_t), e = ids_tk, all in fp32 and rounded once to
    residual's dtype. Plain torch, one GEMM pair per expert in use (host-synchronising: a test oracle)."""
    t, k = ids_TK.shape
    e, f2, _ = gate_up_EFH.shape
    f = f2 // 2
    ids_R = ids_TK.reshape(-1).long()
    if ids_R.numel() and (int(ids_R.min()) < 0 or int(ids_R.max()) >= e):
        raise ValueError(f"ids_TK holds expert ids outside [0, {e})")
    token_R = torch.arange(t, device=h_TH.device).repeat_interleave(k)
    h32_TH = h_TH.float()
    y_RH = torch.zeros((t * k, h_TH.shape[1]), dtype=torch.float32, device=h_TH.device)
    for expert in ids_R.unique().tolist():
        sel_S = (ids_R == expert).nonzero().squeeze(1)
        gate_up_SF = h32_TH[token_R[sel_S]] @ gate_up_EFH[expert].float().t()
        act_SF = F.silu(gate_up_SF[:, :f]) * gate_up_SF[:, f:]
        y_RH[sel_S] = act_SF @ down_EHF[expert].float().t()
    mixed_TH = (weights_TK.float()[..., None] * y_RH.view(t, k, -1)).sum(1)
    return (residual_TH.float() + mixed_TH).to(residual_TH.dtype)


# ----------------------------------------------------------------------------------------------- tile table
class TileTable(NamedTuple):
    """The tiles of one step (device tensors of static shape; see the module docstring for the formulas)."""

    order_R: torch.Tensor  # int64 [R]: token-order pair index t K + k at each sorted position
    counts_2E: torch.Tensor  # int32 [2, E]: m_(p,e), pairs of expert e in phase p (0 decode, 1 prefill)
    expert_Q: torch.Tensor  # int32 [Q]: the tile's expert (0 for unused entries)
    start_Q: torch.Tensor  # int32 [Q]: the tile's first sorted position (0 for unused entries)
    rows_Q: torch.Tensor  # int32 [Q]: pairs in the tile, 1..M_p (0 for unused entries)
    ends_2: torch.Tensor  # int32 [2]: (x_moe(0), x_moe(0) + x_moe(1)): end of the decode tiles, of all tiles
    num_decode: int
    top_k: int
    block_m_decode: int
    block_m_prefill: int


def max_tiles(
    num_tokens: int, top_k: int, num_experts: int, num_decode: int, block_m_decode: int, block_m_prefill: int
) -> int:
    """Q, the most tiles any routing of the step can need: sum_e ceil(m_e / M) <= (P + n (M - 1)) / M for P pairs
    spread over n <= min(E, P) experts in use, per phase."""

    def bound(pairs: int, block_m: int) -> int:
        return (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m

    return bound(num_decode * top_k, block_m_decode) + bound(
        (num_tokens - num_decode) * top_k, block_m_prefill
    )


def _check_block(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (a tl.dot operand), got {value!r}")


def _check_num_decode(num_decode: int, num_tokens: int) -> None:
    if not isinstance(num_decode, int) or not 0 <= num_decode <= num_tokens:
        raise ValueError(
            f"num_decode must be an int in [0, {num_tokens}] (the step's tokens), got {num_decode!r}"
        )


def launch_options(num_tokens: int, num_decode: int, block_m_decode: int) -> dict:
    """Triton's launch options of a pass: WIDE_DECODE_LAUNCH where all its tiles are decode tiles of at least
    BLOCK_M_DECODE_WIDE rows, else LAUNCH (which prefill tiles need: at 4 warps a prefill pass ran 2x slower)."""
    wide = num_decode == num_tokens and block_m_decode >= BLOCK_M_DECODE_WIDE
    return WIDE_DECODE_LAUNCH if wide else LAUNCH


def build_tiles(
    ids_TK: torch.Tensor,
    num_decode: int,
    num_experts: int,
    block_m_decode: int = BLOCK_M_DECODE,
    block_m_prefill: int = BLOCK_M_PREFILL,
    *,
    kernel: bool | None = None,
) -> TileTable:
    """The tile table of a step whose first `num_decode` tokens decode: per phase p and expert e the pair count
    m_(p,e), x_moe(p) = sum_e ceil(m_(p,e) / M_p) tiles, decode tiles first, each tile's (expert, first sorted
    position, rows) from the prefix sums c_g. No host synchronisation; Q = `max_tiles(...)`. After the stable
    sort, one Triton launch (`_tile_table_kernel`) builds the table where Triton runs on the device (kernel=None)
    or kernel=True, else ~30 small torch ops (`_table_by_torch`, the same table: tested); on a GPU each of those
    is a kernel of a few microseconds, a tenth of a decode pass. Expert ids must lie in [0, num_experts) (not
    checked: that would read the device)."""
    if ids_TK.dim() != 2 or ids_TK.dtype.is_floating_point or ids_TK.dtype == torch.bool:
        raise ValueError(
            f"ids_TK must be a [T, K] tensor of integer expert ids, got {ids_TK.dtype} {tuple(ids_TK.shape)}"
        )
    t, k = ids_TK.shape
    _check_num_decode(num_decode, t)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    _check_block("block_m_decode", block_m_decode)
    _check_block("block_m_prefill", block_m_prefill)
    e, g, device = num_experts, 2 * num_experts, ids_TK.device
    q = max_tiles(t, k, e, num_decode, block_m_decode, block_m_prefill)
    # Keys phase * E + expert on the narrowest dtype that holds them: fewer radix passes, the same stable order.
    key_dtype = torch.int16 if g <= 2**15 else torch.int32
    key_R = ids_TK.reshape(-1).to(key_dtype, copy=True)
    key_R[num_decode * k :] += e
    sorted_R, order_R = torch.sort(key_R, stable=True)
    blocks = (block_m_decode, block_m_prefill)
    use_kernel = (triton_runs_on(device) if kernel is None else kernel) and key_R.numel() > 0
    table = (_table_by_kernel if use_kernel else _table_by_torch)(sorted_R, e, q, blocks)
    return TileTable(order_R, *table, num_decode, k, block_m_decode, block_m_prefill)


def _table_by_torch(
    sorted_R: torch.Tensor, e: int, q: int, blocks: tuple[int, int]
) -> tuple[torch.Tensor, ...]:
    """(counts_2E, expert_Q, start_Q, rows_Q, ends_2) from the sorted keys, in torch ops."""
    block_m_decode, block_m_prefill = blocks
    g, device = 2 * e, sorted_R.device
    ends_G = torch.searchsorted(
        sorted_R, torch.arange(g, device=device, dtype=sorted_R.dtype), right=True, out_int32=True
    )
    counts_G = torch.diff(ends_G, prepend=ends_G.new_zeros(1))
    block_G = torch.full((g,), block_m_prefill, dtype=torch.int32, device=device)
    block_G[:e] = block_m_decode
    tiles_G = (counts_G + block_G - 1) // block_G
    tile_ends_G = torch.cumsum(tiles_G, 0, dtype=torch.int32)
    q_Q = torch.arange(q, device=device, dtype=torch.int32)
    group_Q = torch.searchsorted(tile_ends_G, q_Q, right=True)  # the group g with c_(g-1) <= q < c_g, or G
    used_Q = group_Q < g
    group_Q = group_Q.clamp(max=g - 1)
    block_Q = block_G[group_Q]
    local_Q = q_Q - (tile_ends_G - tiles_G)[group_Q]
    start_Q = (ends_G - counts_G)[group_Q] + local_Q * block_Q
    rows_Q = torch.minimum(counts_G[group_Q] - local_Q * block_Q, block_Q)
    zero = torch.zeros((), dtype=torch.int32, device=device)
    return (
        counts_G.view(2, e),
        torch.where(used_Q, group_Q % e, 0).to(torch.int32),
        torch.where(used_Q, start_Q, zero),
        torch.where(used_Q, rows_Q, zero),
        torch.stack((tile_ends_G[e - 1], tile_ends_G[g - 1])),
    )


TABLE_BLOCK_Q = 32  # tiles per program of the table kernel ([32, 2E] comparisons in registers)


def _table_by_kernel(
    sorted_R: torch.Tensor, e: int, q: int, blocks: tuple[int, int]
) -> tuple[torch.Tensor, ...]:
    """(counts_2E, expert_Q, start_Q, rows_Q, ends_2) from the sorted keys, in one launch of
    `_tile_table_kernel` (R >= 1)."""
    r, device = sorted_R.numel(), sorted_R.device
    counts_2E = torch.empty((2, e), dtype=torch.int32, device=device)
    expert_Q, start_Q, rows_Q = (torch.empty(q, dtype=torch.int32, device=device) for _ in range(3))
    ends_2 = torch.empty(2, dtype=torch.int32, device=device)
    _tile_table_kernel[(triton.cdiv(q, TABLE_BLOCK_Q),)](
        sorted_R, r, e, q, *blocks, counts_2E, expert_Q, start_Q, rows_Q, ends_2,
        BLOCK_G=triton.next_power_of_2(2 * e), BLOCK_Q=TABLE_BLOCK_Q, STEPS=r.bit_length(),
    )  # fmt: skip
    return counts_2E, expert_Q, start_Q, rows_Q, ends_2


def tile_counts(tiles: TileTable) -> torch.Tensor:
    """int32 [2] on the device: (x_moe(decode), x_moe(prefill)), the tiles of each phase."""
    return torch.stack((tiles.ends_2[0], tiles.ends_2[1] - tiles.ends_2[0]))


# ------------------------------------------------------------------------------------------------- kernels
if triton is not None:
    from rollout.paged_attention import dot_fp32  # a @ b in fp32, also right under the interpreter

    @triton.jit
    def _upper_bound(sorted_ptr, R, value_G, STEPS: tl.constexpr):
        """Per lane, #{r < R : sorted[r] <= value} (sorted ascending): a binary search of STEPS = bit_length(R)
        halvings, each lane's [lo, hi) shrinking to one point."""
        lo = tl.zeros_like(value_G)
        hi = lo + R
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            right = tl.load(sorted_ptr + mid, mask=active, other=0) <= value_G
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
        return lo

    @triton.jit
    def _tile_table_kernel(
        sorted_ptr,
        R,
        E,
        Q,
        BLOCK_M_DECODE,
        BLOCK_M_PREFILL,
        counts_ptr,
        expert_ptr,
        start_ptr,
        rows_ptr,
        ends_ptr,
        BLOCK_G: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        """The tile table from the sorted keys (module docstring): every program finds the groups' sorted
        ranges [s_g, s_g + m_g) by binary search and their tile prefix sums c_g, then fills BLOCK_Q entries q
        (group g: c_(g-1) <= q < c_g; unused entries 0); program 0 also stores m and (c_(E-1), c_(2E-1))."""
        g_G = tl.arange(0, BLOCK_G)
        g_ok = g_G < 2 * E
        start_G = _upper_bound(sorted_ptr, R, g_G - 1, STEPS)
        count_G = tl.where(g_ok, _upper_bound(sorted_ptr, R, g_G, STEPS) - start_G, 0)
        block_G = tl.where(g_G < E, BLOCK_M_DECODE, BLOCK_M_PREFILL)
        tiles_G = (count_G + block_G - 1) // block_G
        tile_end_G = tl.cumsum(tiles_G, 0)
        tile_start_G = tile_end_G - tiles_G
        if tl.program_id(0) == 0:
            tl.store(counts_ptr + g_G, count_G, mask=g_ok)
            tl.store(ends_ptr, tl.sum(tl.where(g_G == E - 1, tile_end_G, 0), 0))
            tl.store(ends_ptr + 1, tl.sum(tl.where(g_G == 2 * E - 1, tile_end_G, 0), 0))
        q_Q = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        # at most one group holds q (groups without tiles hold none): sums over the row pick its values
        in_QG = (tile_start_G[None, :] <= q_Q[:, None]) & (q_Q[:, None] < tile_end_G[None, :])
        used_Q = tl.sum(in_QG.to(tl.int32), 1) > 0
        group_Q = tl.sum(tl.where(in_QG, g_G[None, :], 0), 1)
        block_Q = tl.where(group_Q < E, BLOCK_M_DECODE, BLOCK_M_PREFILL)
        local_Q = q_Q - tl.sum(tl.where(in_QG, tile_start_G[None, :], 0), 1)
        first_Q = tl.sum(tl.where(in_QG, start_G[None, :], 0), 1) + local_Q * block_Q
        rows_Q = tl.minimum(tl.sum(tl.where(in_QG, count_G[None, :], 0), 1) - local_Q * block_Q, block_Q)
        q_ok = q_Q < Q
        tl.store(expert_ptr + q_Q, tl.where(used_Q, group_Q % E, 0), mask=q_ok)
        tl.store(start_ptr + q_Q, tl.where(used_Q, first_Q, 0), mask=q_ok)
        tl.store(rows_ptr + q_Q, tl.where(used_Q, rows_Q, 0), mask=q_ok)

    @triton.jit
    def _item_runs(w, dec_items, stopped, done_ptr, TRACK: tl.constexpr):
        """Whether item w runs: a decode item always, a prefill item unless the program has seen the flag; under
        TRACK not if an earlier launch did it (a program that has just stopped reads no done mask)."""
        run = (w < dec_items) | (stopped == 0)
        if TRACK:
            run = run & (tl.load(done_ptr + w, mask=run, other=1) == 0)
        return run

    @triton.jit
    def _seen_flag(w, dec_items, stopped, flag_ptr, heeds, HAS_FLAG: tl.constexpr):
        """The program's sticky stop bit, updated from the flag read before item w (prefill items, until it is
        set; only in a program that `heeds` it: the others run on through a preemption). The read is a scalar atomic x + 0 (relaxed): one thread reads the flag where every SM sees the same
        value (Triton lowers it to a single-thread relaxed load) and broadcasts it through shared memory, so all
        threads of the program agree even while the flag changes; a plain load by every thread could split them
        around a write, and a split program deadlocks in its dot."""
        if HAS_FLAG:  # noqa: SIM102 - a constexpr test, then a runtime one (Triton mixes no `and` of the two)
            if (w >= dec_items) & (stopped == 0) & heeds:
                stopped = _flag_up(flag_ptr)
        return stopped

    @triton.jit
    def _flag_up(flag_ptr):
        """1 if the flag is nonzero, else 0 (int32), read as `_seen_flag` says."""
        return (tl.atomic_add(flag_ptr, 0, sem="relaxed") != 0).to(tl.int32)

    @triton.jit
    def _gate_up_tile(
        h_ptr,
        gate_up_ptr,
        act_ptr,
        order_ptr,
        expert,
        start,
        rows,
        col_block,
        H,
        F,
        TOP_K,
        stride_ht,
        stride_ge,
        stride_gf,
        stride_ar,
        flag_ptr,
        heeds,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SLICES: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """act[start + i, n] = silu(gate_e . h_t) * (up_e . h_t) for the tile's rows i and columns n of the block;
        returns 1 if it gave the item up (nothing stored), else 0. With SLICES > 1 the reduction over H runs in
        SLICES slices of whole BLOCK_K steps, and where `heeds`, the flag is read before each slice after the
        first: once it is up the rest is skipped and nothing is stored. The slices add in the same order as one
        loop, so a finished item's bits do not depend on SLICES. TMA: gate_up_ptr is a descriptor of gate_up as
        [E 2F, H] in [BLOCK_N, BLOCK_K] blocks."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < rows
        n_ok = offs_n < F
        pair_M = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
        x_rows = h_ptr + (pair_M // TOP_K)[:, None] * stride_ht
        if TMA:
            gate_row = expert * (2 * F) + col_block * BLOCK_N
        else:
            gate_cols = (
                gate_up_ptr + expert.to(tl.int64) * stride_ge + offs_n.to(tl.int64)[None, :] * stride_gf
            )
            up_cols = gate_cols + F * stride_gf
        gate_MN = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up_MN = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        gave_up = tl.program_id(0) * 0
        slice_k = tl.cdiv(tl.cdiv(H, BLOCK_K), SLICES) * BLOCK_K
        for s in tl.static_range(SLICES):
            if SLICES == 1:  # the unflagged launches (the engine's): the one loop over H, as without slices
                k_lo = 0
                k_hi = H
            else:
                k_lo = s * slice_k
                if s > 0:  # noqa: SIM102 - a constexpr test, then a runtime one
                    if heeds & (gave_up == 0) & (k_lo < H):
                        gave_up = _flag_up(flag_ptr)
                k_hi = tl.where(gave_up == 0, tl.minimum(k_lo + slice_k, H), k_lo)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k_K = k0 + offs_k
                k_ok = k_K < H
                x_MK = tl.load(x_rows + k_K[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                if TMA:
                    gate_KN = tl.trans(gate_up_ptr.load([gate_row, k0]))
                    up_KN = tl.trans(gate_up_ptr.load([gate_row + F, k0]))
                else:
                    kn_ok = k_ok[:, None] & n_ok[None, :]
                    gate_KN = tl.load(gate_cols + k_K[:, None], mask=kn_ok, other=0.0)
                    up_KN = tl.load(up_cols + k_K[:, None], mask=kn_ok, other=0.0)
                gate_MN += dot_fp32(x_MK, gate_KN, PRECISION, UPCAST)
                up_MN += dot_fp32(x_MK, up_KN, PRECISION, UPCAST)
        act_MN = gate_MN * tl.sigmoid(gate_MN) * up_MN
        act_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_ar
        if gave_up == 0:
            tl.store(
                act_rows + offs_n[None, :],
                act_MN.to(act_ptr.dtype.element_ty),
                mask=m_ok[:, None] & n_ok[None, :],
            )
        return gave_up

    @triton.jit
    def _down_tile(
        act_ptr,
        down_ptr,
        y_ptr,
        order_ptr,
        expert,
        start,
        rows,
        col_block,
        H,
        F,
        stride_ar,
        stride_de,
        stride_dh,
        stride_yr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """y[pair, n] = down_e[n] . act[start + i] for the tile's rows i (pair = order[start + i]) and columns n.
        TMA: down_ptr is a descriptor of down as [E H, F] in [BLOCK_N, BLOCK_K] blocks."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_ok = offs_m < rows
        n_ok = offs_n < H
        act_rows = act_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_ar
        if TMA:
            down_row = expert * H + col_block * BLOCK_N
        else:
            down_cols = down_ptr + expert.to(tl.int64) * stride_de + offs_n.to(tl.int64)[None, :] * stride_dh
        acc_MN = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            k_K = k0 + offs_k
            k_ok = k_K < F
            act_MK = tl.load(act_rows + k_K[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if TMA:
                down_KN = tl.trans(down_ptr.load([down_row, k0]))
            else:
                down_KN = tl.load(down_cols + k_K[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_MN += dot_fp32(act_MK, down_KN, PRECISION, UPCAST)
        pair_M = tl.load(order_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
        y_rows = y_ptr + pair_M[:, None] * stride_yr
        tl.store(
            y_rows + offs_n[None, :], acc_MN.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :]
        )

    @triton.jit
    def _gate_up_kernel(
        h_ptr,
        gate_up_ptr,
        act_ptr,
        order_ptr,
        expert_ptr,
        start_ptr,
        rows_ptr,
        ends_ptr,
        flag_ptr,
        heeding,
        done_ptr,
        H,
        F,
        TOP_K,
        stride_ht,
        stride_ge,
        stride_gf,
        stride_ar,
        BLOCK_M_DECODE: tl.constexpr,
        BLOCK_M_PREFILL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SLICES: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        TRACK: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """Phase A, persistent: items w = q NB + n (tile q, block n of F's columns) from program_id step grid. A
        prefill item runs its reduction in SLICES slices (1 without a flag) and gives itself up, undone, when a
        heeding program sees the flag between two of them."""
        pid = tl.program_id(0)
        heeds = pid < heeding
        num_col_blocks = tl.cdiv(F, BLOCK_N)
        dec_items = tl.load(ends_ptr) * num_col_blocks
        num_items = tl.load(ends_ptr + 1) * num_col_blocks
        stopped = pid * 0
        if HAS_FLAG:  # a heeding program that has seen the flag leaves at once (see `_down_kernel`)
            w = pid
            while (w < num_items) & (stopped == 0):
                stopped = _gate_up_item(
                    w, stopped, dec_items, num_col_blocks, h_ptr, gate_up_ptr, act_ptr, order_ptr, expert_ptr,
                    start_ptr, rows_ptr, flag_ptr, heeds, done_ptr, H, F, TOP_K,
                    stride_ht, stride_ge, stride_gf, stride_ar,
                    BLOCK_M_DECODE, BLOCK_M_PREFILL, BLOCK_N, BLOCK_K, SLICES, HAS_FLAG, TRACK, PRECISION, UPCAST, TMA,
                )  # fmt: skip
                w += tl.num_programs(0)
        else:
            for w in range(pid, num_items, tl.num_programs(0)):
                _gate_up_item(
                    w, stopped, dec_items, num_col_blocks, h_ptr, gate_up_ptr, act_ptr, order_ptr, expert_ptr,
                    start_ptr, rows_ptr, flag_ptr, heeds, done_ptr, H, F, TOP_K,
                    stride_ht, stride_ge, stride_gf, stride_ar,
                    BLOCK_M_DECODE, BLOCK_M_PREFILL, BLOCK_N, BLOCK_K, SLICES, HAS_FLAG, TRACK, PRECISION, UPCAST, TMA,
                )  # fmt: skip

    @triton.jit
    def _gate_up_item(
        w,
        stopped,
        dec_items,
        num_col_blocks,
        h_ptr,
        gate_up_ptr,
        act_ptr,
        order_ptr,
        expert_ptr,
        start_ptr,
        rows_ptr,
        flag_ptr,
        heeds,
        done_ptr,
        H,
        F,
        TOP_K,
        stride_ht,
        stride_ge,
        stride_gf,
        stride_ar,
        BLOCK_M_DECODE: tl.constexpr,
        BLOCK_M_PREFILL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SLICES: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        TRACK: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """Phase-A item w of a program whose stop bit is `stopped`; returns the bit after it (set when the flag
        is seen before the item or while its reduction runs)."""
        stopped = _seen_flag(w, dec_items, stopped, flag_ptr, heeds, HAS_FLAG)
        run = _item_runs(w, dec_items, stopped, done_ptr, TRACK)
        if run:
            q = w // num_col_blocks
            col_block = w % num_col_blocks
            expert = tl.load(expert_ptr + q)
            start = tl.load(start_ptr + q)
            rows = tl.load(rows_ptr + q)
            gave_up = stopped * 0
            if w < dec_items:
                _gate_up_tile(
                    h_ptr, gate_up_ptr, act_ptr, order_ptr, expert, start, rows, col_block, H, F, TOP_K,
                    stride_ht, stride_ge, stride_gf, stride_ar, flag_ptr, heeds,
                    BLOCK_M_DECODE, BLOCK_N, BLOCK_K, 1, PRECISION, UPCAST, TMA,
                )  # fmt: skip
            else:
                gave_up = _gate_up_tile(
                    h_ptr, gate_up_ptr, act_ptr, order_ptr, expert, start, rows, col_block, H, F, TOP_K,
                    stride_ht, stride_ge, stride_gf, stride_ar, flag_ptr, heeds,
                    BLOCK_M_PREFILL, BLOCK_N, BLOCK_K, SLICES, PRECISION, UPCAST, TMA,
                )  # fmt: skip
            stopped = stopped | gave_up
            if TRACK:
                tl.store(done_ptr + w, 1 - gave_up)
        return stopped

    @triton.jit
    def _down_kernel(
        act_ptr,
        down_ptr,
        y_ptr,
        order_ptr,
        expert_ptr,
        start_ptr,
        rows_ptr,
        ends_ptr,
        flag_ptr,
        heeding,
        done_ptr,
        done_a_ptr,
        H,
        F,
        stride_ar,
        stride_de,
        stride_dh,
        stride_yr,
        BLOCK_M_DECODE: tl.constexpr,
        BLOCK_M_PREFILL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_NB_A: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        TRACK: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """Phase B, persistent: items w = q NB + n (tile q, block n of H's columns). With a flag, an item runs
        only once all of its tile's phase-A items are done."""
        pid = tl.program_id(0)
        num_col_blocks = tl.cdiv(H, BLOCK_N)
        dec_items = tl.load(ends_ptr) * num_col_blocks
        num_items = tl.load(ends_ptr + 1) * num_col_blocks
        heeds = pid < heeding
        stopped = pid * 0
        if HAS_FLAG:
            # Once a heeding program has seen the flag it leaves: its remaining items are all prefill items (decode
            # items come first) that it would only step over, and a preempted pass's later kernels, queued on the
            # same stream, take the SMs before the pass that preempted it can (stream priority does not reorder
            # them: an H100 arrival's timeline shows the decode pass's first kernel starting after them).
            w = pid
            while (w < num_items) & (stopped == 0):
                stopped = _down_item(
                    w, stopped, dec_items, num_col_blocks, act_ptr, down_ptr, y_ptr, order_ptr, expert_ptr,
                    start_ptr, rows_ptr, flag_ptr, heeds, done_ptr, done_a_ptr, H, F,
                    stride_ar, stride_de, stride_dh, stride_yr,
                    BLOCK_M_DECODE, BLOCK_M_PREFILL, BLOCK_N, BLOCK_K, BLOCK_NB_A, HAS_FLAG, TRACK, PRECISION,
                    UPCAST, TMA,
                )  # fmt: skip
                w += tl.num_programs(0)
        else:
            for w in range(pid, num_items, tl.num_programs(0)):
                _down_item(
                    w, stopped, dec_items, num_col_blocks, act_ptr, down_ptr, y_ptr, order_ptr, expert_ptr,
                    start_ptr, rows_ptr, flag_ptr, heeds, done_ptr, done_a_ptr, H, F,
                    stride_ar, stride_de, stride_dh, stride_yr,
                    BLOCK_M_DECODE, BLOCK_M_PREFILL, BLOCK_N, BLOCK_K, BLOCK_NB_A, HAS_FLAG, TRACK, PRECISION,
                    UPCAST, TMA,
                )  # fmt: skip

    @triton.jit
    def _down_item(
        w,
        stopped,
        dec_items,
        num_col_blocks,
        act_ptr,
        down_ptr,
        y_ptr,
        order_ptr,
        expert_ptr,
        start_ptr,
        rows_ptr,
        flag_ptr,
        heeds,
        done_ptr,
        done_a_ptr,
        H,
        F,
        stride_ar,
        stride_de,
        stride_dh,
        stride_yr,
        BLOCK_M_DECODE: tl.constexpr,
        BLOCK_M_PREFILL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_NB_A: tl.constexpr,
        HAS_FLAG: tl.constexpr,
        TRACK: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """Phase-B item w of a program whose stop bit is `stopped`; returns the bit after the flag read before
        it. With a flag the item runs only once all of its tile's phase-A items are done."""
        stopped = _seen_flag(w, dec_items, stopped, flag_ptr, heeds, HAS_FLAG)
        q = w // num_col_blocks
        run = _item_runs(w, dec_items, stopped, done_ptr, TRACK)
        if HAS_FLAG:
            num_col_blocks_a = tl.cdiv(F, BLOCK_N)
            offs_a = tl.arange(0, BLOCK_NB_A)
            done_a = tl.load(
                done_a_ptr + q * num_col_blocks_a + offs_a,
                mask=offs_a < tl.where(run, num_col_blocks_a, 0),
                other=1,
            )
            run = run & (tl.min(done_a, 0) != 0)
        if run:
            col_block = w % num_col_blocks
            expert = tl.load(expert_ptr + q)
            start = tl.load(start_ptr + q)
            rows = tl.load(rows_ptr + q)
            if w < dec_items:
                _down_tile(
                    act_ptr, down_ptr, y_ptr, order_ptr, expert, start, rows, col_block, H, F,
                    stride_ar, stride_de, stride_dh, stride_yr,
                    BLOCK_M_DECODE, BLOCK_N, BLOCK_K, PRECISION, UPCAST, TMA,
                )  # fmt: skip
            else:
                _down_tile(
                    act_ptr, down_ptr, y_ptr, order_ptr, expert, start, rows, col_block, H, F,
                    stride_ar, stride_de, stride_dh, stride_yr,
                    BLOCK_M_PREFILL, BLOCK_N, BLOCK_K, PRECISION, UPCAST, TMA,
                )  # fmt: skip
            if TRACK:
                tl.store(done_ptr + w, 1)
        return stopped

    @triton.jit
    def _combine_kernel(
        y_ptr,
        w_ptr,
        res_ptr,
        out_ptr,
        undone_ptr,
        T,
        num_decode,
        H,
        TOP_K,
        stride_yr,
        stride_wt,
        stride_wk,
        stride_rt,
        stride_rh,
        stride_ot,
        BLOCK_H: tl.constexpr,
        SKIP: tl.constexpr,
    ):
        """out[t, n] = residual[t, n] + sum_k w[t, k] y[t K + k, n] for the program's tokens t (program_id(0) on,
        one grid stride apart) and column block: the products and their sum in fp32, k = 0, 1, ... in order,
        rounded once to out's dtype. With SKIP, tokens from num_decode on only when *undone_ptr is 0."""
        if SKIP:  # compiled branch-free: T or num_decode may be specialised to a constant (1)
            end = T - (tl.load(undone_ptr) != 0).to(tl.int32) * (T - num_decode)
        else:
            end = T
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        for t in range(tl.program_id(0).to(tl.int64), end, tl.num_programs(0)):  # an int64 loop: t K H
            mixed_H = tl.zeros([BLOCK_H], dtype=tl.float32)
            for k in range(TOP_K):
                w = tl.load(w_ptr + t * stride_wt + k * stride_wk)
                y_H = tl.load(y_ptr + (t * TOP_K + k) * stride_yr + offs_h, mask=h_ok, other=0.0)
                mixed_H += w * y_H.to(tl.float32)
            res_H = tl.load(res_ptr + t * stride_rt + offs_h * stride_rh, mask=h_ok, other=0.0).to(tl.float32)
            out_H = (res_H + mixed_H).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + t * stride_ot + offs_h, out_H, mask=h_ok)


# ------------------------------------------------------------------------------------------------- wrapper
class MoeRun(NamedTuple):
    """One launch's output and everything a resume needs (device tensors)."""

    out_TH: torch.Tensor  # residual + the k-sum, residual's dtype (prefill rows unwritten while undone)
    tiles: TileTable
    act_RF: torch.Tensor  # SwiGLU outputs in sorted order, the input dtype (rows of undone tiles undefined)
    y_RH: torch.Tensor  # per-pair expert outputs in token order, the input dtype (unset where not computed)
    done_a_W: torch.Tensor | None  # int32 [Q NB_A]: 1 where the phase-A item is done; None if not tracked
    done_b_W: torch.Tensor | None  # int32 [Q NB_B], likewise for phase B
    undone: torch.Tensor  # int32 scalar: prefill tiles whose output is not complete (0 if not tracked)
    block_n: int
    block_k: int
    tma: bool  # weight tiles through TMA descriptors (a resume keeps the launch's choice, as its blocks)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _interpreted() -> bool:
    return triton is not None and interpreted(_gate_up_kernel)


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the kernels can run on tensors of `device`: a CUDA device with Triton importable, or the CPU when
    this process imported Triton with TRITON_INTERPRET=1 (the interpreter)."""
    device = torch.device(device)
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreted())


def _check_inputs(
    h_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    residual_TH: torch.Tensor,
    preempt_flag: torch.Tensor | None,
    num_programs: int | None,
) -> None:
    if h_TH.dim() != 2 or h_TH.dtype not in FLOAT_DTYPES:
        raise ValueError(f"h_TH must be a [T, H] fp32/bf16/fp16 tensor, got {h_TH.dtype} {tuple(h_TH.shape)}")
    t, h = h_TH.shape
    if h_TH.stride(1) != 1:
        raise ValueError(f"h_TH needs a contiguous last dimension (stride 1), got strides {h_TH.stride()}")
    if residual_TH.shape != h_TH.shape or residual_TH.dtype != h_TH.dtype:
        raise ValueError(
            f"residual_TH must match h_TH ({h_TH.dtype} {tuple(h_TH.shape)}), got {residual_TH.dtype} "
            f"{tuple(residual_TH.shape)}"
        )
    if weights_TK.dim() != 2 or weights_TK.shape[0] != t or weights_TK.dtype != torch.float32:
        raise ValueError(
            f"weights_TK must be a [{t}, K] fp32 tensor, got {weights_TK.dtype} {tuple(weights_TK.shape)}"
        )
    if ids_TK.shape != weights_TK.shape or ids_TK.dtype.is_floating_point or ids_TK.dtype == torch.bool:
        raise ValueError(
            f"ids_TK must be an integer tensor of weights_TK's shape {tuple(weights_TK.shape)}, got {ids_TK.dtype} "
            f"{tuple(ids_TK.shape)}"
        )
    if gate_up_EFH.dim() != 3 or gate_up_EFH.shape[2] != h or gate_up_EFH.shape[1] % 2:
        raise ValueError(f"gate_up_EFH must be [E, 2F, {h}], got {tuple(gate_up_EFH.shape)}")
    e, f = gate_up_EFH.shape[0], gate_up_EFH.shape[1] // 2
    if down_EHF.shape != (e, h, f):
        raise ValueError(
            f"down_EHF must be [{e}, {h}, {f}] (gate_up_EFH's E, H, F), got {tuple(down_EHF.shape)}"
        )
    for name, w in (("gate_up_EFH", gate_up_EFH), ("down_EHF", down_EHF)):
        if w.dtype != h_TH.dtype:
            raise ValueError(f"{name} must have h_TH's dtype {h_TH.dtype}, got {w.dtype}")
        if w.stride(2) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension (stride 1), got strides {w.stride()}")
    tensors = {"weights_TK": weights_TK, "ids_TK": ids_TK, "gate_up_EFH": gate_up_EFH, "down_EHF": down_EHF}
    tensors["residual_TH"] = residual_TH
    if preempt_flag is not None:
        if preempt_flag.dtype != torch.int32 or preempt_flag.numel() != 1:
            raise ValueError(
                f"preempt_flag must be a one-element int32 tensor, got {preempt_flag.dtype} {tuple(preempt_flag.shape)}"
            )
        tensors["preempt_flag"] = preempt_flag
    for name, x in tensors.items():
        if x.device != h_TH.device:
            raise ValueError(f"{name} is on {x.device}, h_TH on {h_TH.device}")
    if num_programs is not None and (not isinstance(num_programs, int) or num_programs < 1):
        raise ValueError(f"num_programs must be a positive int or None, got {num_programs!r}")


def _undone_tiles(run: MoeRun) -> torch.Tensor:
    """Prefill tiles not all of whose phase-B items are done (int32 scalar on the device)."""
    tiles, done_b_W = run.tiles, run.done_b_W
    q = tiles.rows_Q.shape[0]
    if done_b_W is None or q == 0:
        return torch.zeros((), dtype=torch.int32, device=tiles.ends_2.device)
    complete_Q = done_b_W.view(q, -1).amin(1) > 0
    q_Q = torch.arange(q, device=done_b_W.device)
    prefill_Q = (q_Q >= tiles.ends_2[0]) & (q_Q < tiles.ends_2[1])
    return (prefill_Q & ~complete_Q).sum(dtype=torch.int32)


def _launch_options(run: MoeRun, x: torch.Tensor, preempt_flag: torch.Tensor | None, launch: dict) -> dict:
    upcast = _interpreted()
    return dict(
        BLOCK_M_DECODE=run.tiles.block_m_decode,
        BLOCK_M_PREFILL=run.tiles.block_m_prefill,
        BLOCK_N=run.block_n,
        BLOCK_K=run.block_k,
        HAS_FLAG=preempt_flag is not None,
        TRACK=run.done_a_W is not None,
        # the interpreter's dot is wrong for bf16: widen its operands there; fp32 operands would otherwise go
        # through TF32 (10-bit mantissa)
        PRECISION="ieee" if upcast or x.dtype == torch.float32 else "tf32",
        UPCAST=upcast,
        TMA=run.tma,
        **launch,
    )


# (kernel, options, activations' dtype, device) -> the pipeline depth that compiled within the SM's shared memory
_FITTING_STAGES: dict[tuple, int] = {}


def _launch_fitting(kernel, programs: int, *args, options: dict) -> None:
    """kernel[(programs,)](*args, **options) at the largest num_stages <= the requested one whose buffers fit
    the SM's shared memory. The defaults are sized for bf16 tiles; fp32 operands need twice the bytes per stage,
    and Triton finds that out only when it loads the compiled kernel, before anything runs on the device, so
    a smaller depth can be tried. The depth that fits is remembered for the next launch of the same shapes."""
    key = (kernel, tuple(sorted(options.items())), args[0].dtype, args[0].device)
    stages = _FITTING_STAGES.get(key, options["num_stages"])
    while True:
        try:
            kernel[(programs,)](*args, **{**options, "num_stages": stages})
        except OutOfResources:
            if stages == 1:
                raise
            stages -= 1
            continue
        _FITTING_STAGES[key] = stages
        return


def _table_args(run: MoeRun, preempt_flag: torch.Tensor | None, programs: int, heeding: int | None) -> tuple:
    """The kernels' table, flag and heeding arguments (every program heeds the flag when heeding is None)."""
    t = run.tiles
    flag = preempt_flag if preempt_flag is not None else t.ends_2  # never read without HAS_FLAG
    heeds = programs if heeding is None else heeding
    return t.order_R, t.expert_Q, t.start_Q, t.rows_Q, t.ends_2, flag, heeds


def _launch_gate_up(
    run: MoeRun,
    h_TH: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    preempt_flag: torch.Tensor | None,
    programs: int,
    launch: dict = LAUNCH,
    heeding: int | None = None,
    slices: int = 1,
) -> None:
    """Phase A over the run's tiles: act_RF (and done_a_W when tracked); programs below `heeding` (all when
    None) heed the flag, also between the `slices` slices of a prefill item's reduction."""
    h, f = h_TH.shape[1], run.act_RF.shape[1]
    items = run.tiles.rows_Q.shape[0] * triton.cdiv(f, run.block_n)
    if not items:
        return
    done = run.done_a_W if run.done_a_W is not None else run.tiles.ends_2
    _launch_fitting(
        _gate_up_kernel,
        min(programs, items),
        h_TH,
        _weight_operand(gate_up_EFH, run),
        run.act_RF,
        *_table_args(run, preempt_flag, programs, heeding),
        done,
        h,
        f,
        run.tiles.top_k,
        h_TH.stride(0),
        gate_up_EFH.stride(0),
        gate_up_EFH.stride(1),
        run.act_RF.stride(0),
        options=dict(
            _launch_options(run, h_TH, preempt_flag, launch), SLICES=slices if preempt_flag is not None else 1
        ),
    )


def _launch_down(
    run: MoeRun,
    down_EHF: torch.Tensor,
    preempt_flag: torch.Tensor | None,
    programs: int,
    launch: dict = LAUNCH,
    heeding: int | None = None,
) -> None:
    """Phase B over the run's tiles: y_RH (and done_b_W when tracked). With a flag, a tile's items wait for all
    of its phase-A items; programs below `heeding` (all when None) heed it."""
    h, f = run.y_RH.shape[1], run.act_RF.shape[1]
    items = run.tiles.rows_Q.shape[0] * triton.cdiv(h, run.block_n)
    if not items:
        return
    tracked = run.done_a_W is not None
    if preempt_flag is not None and not tracked:
        raise ValueError("preempt_flag needs a tracked run (done masks)")
    _launch_fitting(
        _down_kernel,
        min(programs, items),
        run.act_RF,
        _weight_operand(down_EHF, run),
        run.y_RH,
        *_table_args(run, preempt_flag, programs, heeding),
        run.done_b_W if tracked else run.tiles.ends_2,
        run.done_a_W if tracked else run.tiles.ends_2,
        h,
        f,
        run.act_RF.stride(0),
        down_EHF.stride(0),
        down_EHF.stride(1),
        run.y_RH.stride(0),
        options=dict(
            _launch_options(run, run.act_RF, preempt_flag, launch),
            BLOCK_NB_A=triton.next_power_of_2(triton.cdiv(f, run.block_n)),
        ),
    )


def _weight_operand(w_EXY: torch.Tensor, run: MoeRun):
    """The weights as a kernel reads them: the tensor, or under TMA a descriptor of it as [E X, Y] in [block_n,
    block_k] blocks (a block past an expert's X rows reads the next expert's or zeros: columns no store keeps)."""
    if not run.tma:
        return w_EXY
    e, x, y = w_EXY.shape
    return TensorDescriptor.from_tensor(w_EXY.view(e * x, y), [run.block_n, run.block_k])


def tma_runs_on(device: torch.device | str) -> bool:
    """Whether tma=True can run on `device`: Triton's host descriptors (Triton >= 3.4), and on CUDA a GPU with TMA
    (compute capability >= 9.0; the interpreter emulates it on the CPU)."""
    device = torch.device(device)
    cuda_ok = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (9, 0)
    return TensorDescriptor is not None and cuda_ok


def _check_tma(gate_up_EFH: torch.Tensor, down_EHF: torch.Tensor) -> None:
    """tma=True needs `tma_runs_on` the weights' device and contiguous weights whose rows are 16-byte aligned."""
    device = gate_up_EFH.device
    if not tma_runs_on(device):
        raise ValueError(
            f"tma=True needs triton.tools.tensor_descriptor (Triton >= 3.4) and, on CUDA, a GPU with TMA (compute "
            f"capability >= 9.0); {device} with Triton {getattr(triton, '__version__', 'absent')} has not both"
        )
    for name, w in (("gate_up_EFH", gate_up_EFH), ("down_EHF", down_EHF)):
        if not w.is_contiguous() or w.data_ptr() % 16 or (w.shape[2] * w.element_size()) % 16:
            raise ValueError(
                f"tma=True needs {name} contiguous with 16-byte aligned rows, got shape {tuple(w.shape)}, "
                f"strides {w.stride()}, {w.dtype}"
            )


COMBINE_BLOCK_H = 1024  # columns per combine program: 8 x 2 KB rows of y in flight at K = 8, bf16
COMBINE_PROGRAMS_PER_SM = 8  # token programs of the combine per SM (each walks its tokens a grid apart)


def _combine(
    residual_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    y_RH: torch.Tensor,
    undone: torch.Tensor | None = None,
    num_decode: int = 0,
    out_TH: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + sum_k w_tk y_(t,k) (`_combine_kernel`: fp32, k in order, rounded once) into out_TH (a new
    tensor when None). With `undone` (an int32 scalar on the device), rows from num_decode on are written only
    where it is 0: a preempted run's prefill rows wait for its resume."""
    t, k = weights_TK.shape
    h = residual_TH.shape[1]
    if out_TH is None:
        out_TH = torch.empty((t, h), dtype=residual_TH.dtype, device=residual_TH.device)
    if t == 0:
        return out_TH
    block_h = min(COMBINE_BLOCK_H, triton.next_power_of_2(h))
    on_gpu = residual_TH.device.type == "cuda"
    sms = _num_sms(residual_TH.device.index or 0) if on_gpu else 0
    programs = min(t, COMBINE_PROGRAMS_PER_SM * sms if on_gpu else INTERPRETER_PROGRAMS)
    _combine_kernel[(programs, triton.cdiv(h, block_h))](
        y_RH,
        weights_TK,
        residual_TH,
        out_TH,
        undone if undone is not None else weights_TK,  # unread without SKIP
        t,
        num_decode,
        h,
        k,
        y_RH.stride(0),
        *weights_TK.stride(),
        *residual_TH.stride(),
        out_TH.stride(0),
        BLOCK_H=block_h,
        SKIP=undone is not None,
    )
    return out_TH


def _new_run(
    h_TH: torch.Tensor,
    ids_TK: torch.Tensor,
    num_experts: int,
    f: int,
    num_decode: int,
    track: bool,
    blocks: tuple[int, int, int, int],
    tma: bool,
) -> MoeRun:
    """The tiles and buffers of a fresh launch (done masks only when tracked)."""
    block_m_decode, block_m_prefill, block_n, block_k = blocks
    tiles = build_tiles(ids_TK, num_decode, num_experts, block_m_decode, block_m_prefill)
    r, h, q = tiles.order_R.shape[0], h_TH.shape[1], tiles.rows_Q.shape[0]
    act_RF = torch.empty((r, f), dtype=h_TH.dtype, device=h_TH.device)
    # a tracked run may leave prefill pairs undone: the combine then reads no prefill row (MoeRun.undone)
    y_RH = torch.empty((r, h), dtype=h_TH.dtype, device=h_TH.device)
    done_a_W = done_b_W = None
    if track:
        done_a_W = torch.zeros(q * triton.cdiv(f, block_n), dtype=torch.int32, device=h_TH.device)
        done_b_W = torch.zeros(q * triton.cdiv(h, block_n), dtype=torch.int32, device=h_TH.device)
    return MoeRun(None, tiles, act_RF, y_RH, done_a_W, done_b_W, None, block_n, block_k, tma)


def _check_resume(resume: MoeRun, h_TH: torch.Tensor, ids_TK: torch.Tensor, f: int, num_decode: int) -> None:
    if not isinstance(resume, MoeRun):
        raise ValueError(f"resume must be the MoeRun of an earlier launch, got {type(resume).__name__}")
    if resume.done_a_W is None or resume.done_b_W is None:
        raise ValueError(
            "resume: that run was launched without preempt_flag and is complete, nothing to resume"
        )
    t, k = ids_TK.shape
    if resume.tiles.num_decode != num_decode or resume.tiles.top_k != k:
        raise ValueError(
            f"resume: the run had num_decode={resume.tiles.num_decode}, K={resume.tiles.top_k}; "
            f"got num_decode={num_decode}, K={k}"
        )
    if resume.act_RF.shape != (t * k, f) or resume.y_RH.shape != (t * k, h_TH.shape[1]):
        raise ValueError(
            f"resume: the run's buffers {tuple(resume.act_RF.shape)}, {tuple(resume.y_RH.shape)} do not fit "
            f"T={t}, K={k}, F={f}, H={h_TH.shape[1]}"
        )
    if resume.act_RF.dtype != h_TH.dtype or resume.act_RF.device != h_TH.device:
        raise ValueError(
            f"resume: the run's buffers are {resume.act_RF.dtype} on {resume.act_RF.device}, not h_TH's"
        )


def persistent_moe_run(
    h_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    residual_TH: torch.Tensor,
    *,
    num_decode: int,
    preempt_flag: torch.Tensor | None = None,
    resume: MoeRun | None = None,
    num_programs: int | None = None,
    heeding: int | None = None,
    preempt_slices: int = PREEMPT_SLICES,
    block_m_decode: int | None = None,
    block_m_prefill: int = BLOCK_M_PREFILL,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tma: bool = TMA,
) -> MoeRun:
    """The experts of a step (first `num_decode` tokens decode) as the two persistent launches; CUDA tensors, or
    CPU tensors under TRITON_INTERPRET=1. No host synchronisation.

    preempt_flag: int32, one element on the device, read before every item; nonzero stops prefill items (decode
    items always run). Such a run is tracked (done masks), and `MoeRun.undone` counts the prefill tiles left.
    Raise it with a copy (from pinned host memory: the copy engine), not a kernel: a kernel writing it waits for
    an SM slot, and the running launch's programs hold them all until they end (on an H200 a decode pass that
    raised it with `fill_` waited 1.1 ms behind an 8k-token prefill, 0.42 ms with a copy; bench/RESULTS.md).
    resume: a tracked run of the same inputs and num_decode: its tiles and buffers are reused and only the items
    it left are launched (a flag may preempt again). The buffers and done masks are updated in place (the
    returned run shares them). Block sizes come from the run; num_programs may differ.
    num_programs: the persistent grid, by default PROGRAMS_PER_SM x the SM count (CUDA) or 4 (interpreter), capped
    at the items.
    heeding: how many of the grid's programs (the first ones) heed the flag, all when None. The others run their
    prefill items on through a preemption, beside the pass that raised it: a spatial split of the GPU where a
    whole stop would serialise the two passes.
    preempt_slices: with a flag, a phase-A prefill item's reduction runs in this many slices and a heeding
    program reads the flag between them, giving the item up (undone) once it is up: the arriving pass waits for
    a slice of the running items rather than whole items.
    block_m_decode: the decode tiles' height, by default `decode_block_m` of the pass's decode tokens.
    num_warps, num_stages: Triton's launch options of both kernels (the software pipeline's depth), by default
    `launch_options` of the pass.
    tma: load the weight tiles through TMA descriptors (sm_90+, contiguous weights with 16-byte aligned rows); a
    resume keeps the run's choice."""
    if triton is None:
        raise RuntimeError("persistent_moe needs Triton")
    _check_inputs(h_TH, weights_TK, ids_TK, gate_up_EFH, down_EHF, residual_TH, preempt_flag, num_programs)
    if heeding is not None and (preempt_flag is None or heeding < 0):
        raise ValueError(f"heeding={heeding}: a count of programs >= 0, for a launch with a preempt_flag")
    if not isinstance(preempt_slices, int) or preempt_slices < 1:
        raise ValueError(f"preempt_slices={preempt_slices!r}: a count of slices >= 1")
    _check_num_decode(num_decode, h_TH.shape[0])
    (t, k), e, f = ids_TK.shape, gate_up_EFH.shape[0], gate_up_EFH.shape[1] // 2
    if resume is not None:
        _check_resume(resume, h_TH, ids_TK, f, num_decode)
        block_m_decode = resume.tiles.block_m_decode
    else:
        if block_m_decode is None:
            block_m_decode = decode_block_m(num_decode, k, e)
        blocks = (block_m_decode, block_m_prefill, block_n, block_k)
        for name, value in zip(("block_m_decode", "block_m_prefill", "block_n", "block_k"), blocks):
            _check_block(name, value)
    defaults = launch_options(t, num_decode, block_m_decode)
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    if num_warps not in (1, 2, 4, 8, 16) or num_stages < 1:
        raise ValueError(
            f"num_warps must be a power of two <= 16 and num_stages >= 1, got {num_warps}, {num_stages}"
        )
    if resume.tma if resume is not None else tma:
        _check_tma(gate_up_EFH, down_EHF)
    if h_TH.device.type == "cpu" and not _interpreted():
        raise ValueError(
            "h_TH is on the CPU: the kernels run there only under TRITON_INTERPRET=1, set before import"
        )
    if resume is None:
        run = _new_run(h_TH, ids_TK, e, f, num_decode, preempt_flag is not None, blocks, bool(tma))
    else:
        run = resume
    if num_programs is None:
        on_cpu = h_TH.device.type == "cpu"
        num_programs = INTERPRETER_PROGRAMS if on_cpu else PROGRAMS_PER_SM * _num_sms(h_TH.device.index or 0)
    launch = {"num_warps": num_warps, "num_stages": num_stages}
    return _launch_run(
        run, h_TH, weights_TK, residual_TH, num_decode, gate_up_EFH, down_EHF,
        preempt_flag, num_programs, launch, heeding, preempt_slices,
    )  # fmt: skip


def _launch_run(
    run: MoeRun,
    h_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    residual_TH: torch.Tensor,
    num_decode: int,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    preempt_flag: torch.Tensor | None,
    programs: int,
    launch: dict,
    heeding: int | None,
    slices: int,
) -> MoeRun:
    """The launches of `persistent_moe_run` over checked inputs: phase A, phase B, the combine."""
    _launch_gate_up(run, h_TH, gate_up_EFH, preempt_flag, programs, launch, heeding, slices)
    _launch_down(run, down_EHF, preempt_flag, programs, launch, heeding)
    undone = _undone_tiles(run)
    skip = undone if run.done_b_W is not None else None  # a tracked run may stop before its prefill rows
    return run._replace(out_TH=_combine(residual_TH, weights_TK, run.y_RH, skip, num_decode), undone=undone)


def persistent_moe(
    h_TH: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    gate_up_EFH: torch.Tensor,
    down_EHF: torch.Tensor,
    residual_TH: torch.Tensor,
    *,
    num_decode: int,
    preempt_flag: torch.Tensor | None = None,
    num_programs: int | None = None,
    block_m_decode: int | None = None,
    block_m_prefill: int = BLOCK_M_PREFILL,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tma: bool = TMA,
) -> torch.Tensor:
    """out_TH = residual + sum_k w_tk y_(t,k) (residual's dtype): `persistent_moe_run(...).out_TH`. With a flag
    set, prefill rows are not written; call `persistent_moe_run` to keep the run and resume it."""
    return persistent_moe_run(
        h_TH,
        weights_TK,
        ids_TK,
        gate_up_EFH,
        down_EHF,
        residual_TH,
        num_decode=num_decode,
        preempt_flag=preempt_flag,
        num_programs=num_programs,
        block_m_decode=block_m_decode,
        block_m_prefill=block_m_prefill,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        tma=tma,
    ).out_TH
