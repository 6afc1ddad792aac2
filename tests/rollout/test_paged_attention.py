"""Paged attention: the SDPA reference against a dense float64 softmax over per-sequence K/V scattered into
shuffled cache blocks; the Triton kernels against the reference, run by Triton's interpreter on CPU tensors in a
subprocess (TRITON_INTERPRET=1 must be set before triton is imported); on CUDA the compiled kernels in bf16 at a
realistic shape, and the decode call replayed from a captured CUDA graph after its lengths changed in place.

Cache rows that hold no key of a sequence (spare blocks, the tail of a sequence's last block) are NaN, so any read
of a masked key, or a masked key weighted by 0, shows up as NaN in the output.

Run as a script (what the interpreter tests do) it prints one JSON line: per case of INTERPRETED, the largest
difference between Triton and the reference over the tokens the step covers, and whether the uncovered ones
came out 0.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from rollout_testlib import interpreter_results

from rollout.paged_attention import (
    AttentionBatch,
    decode_splits,
    paged_attention,
    paged_attention_reference,
    paged_attention_triton,
    prefill_tile_tokens,
    prefill_tiles,
)

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Case:
    q_TND: torch.Tensor  # a strided view into a fused [T, (N + 2M) D] projection, as in the model
    k_XMD: torch.Tensor
    v_XMD: torch.Tensor
    table_RB: torch.Tensor
    batch: AttentionBatch
    block_size: int
    scale: float
    keys: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # float64 K, V [P, M, D] of each table row (the padding row last)
    covered_T: torch.Tensor  # bool: decode tokens and tokens of a tile (the rest are a step's padding)

    def run(self, fn) -> torch.Tensor:
        return fn(self.q_TND, self.k_XMD, self.v_XMD, self.table_RB, self.batch, self.block_size, self.scale)


def make_case(
    *,
    decode_lens: tuple[int, ...] = (),
    prefill: tuple[tuple[int, int], ...] = (),
    M: int = 2,
    G: int = 2,
    D: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_splits: int = 1,
    tile: int | None = None,
    pad_decode: int = 0,
    pad_prefill: int = 0,
    pad_tiles: int = 0,
    device: str = "cpu",
    seed: int = 0,
) -> Case:
    """A step over a shuffled paged cache. decode_lens: context lengths of decode sequences (the token sits at
    position len - 1); prefill: (context length n, chunk): a sequence whose positions n - chunk .. n - 1 are this
    step's tokens (the rest a cached prefix). Padding decode / prefill tokens sit at position 0 of the all-zero
    table row (the null block 0); padding tiles have length 0."""
    gen = torch.Generator().manual_seed(seed)
    n = M * G
    lens = list(decode_lens) + [length for length, _ in prefill]
    per_seq = [-(-length // block_size) for length in lens]
    num_blocks = 1 + sum(per_seq) + 2  # block 0 is the null block, two spare blocks stay unused (NaN)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table_RB = torch.zeros(len(lens) + 1, max(per_seq, default=0) + 1, dtype=torch.int32)
    k_XMD = torch.full((num_blocks * block_size, M, D), float("nan"), dtype=torch.float64)
    v_XMD = k_XMD.clone()
    k_XMD[:block_size] = torch.randn(block_size, M, D, generator=gen, dtype=torch.float64)
    v_XMD[:block_size] = torch.randn(block_size, M, D, generator=gen, dtype=torch.float64)
    keys = []
    for r, (length, count) in enumerate(zip(lens, per_seq)):
        blocks = torch.tensor([ids.pop() for _ in range(count)])
        table_RB[r, :count] = blocks
        rows = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
        k_PMD = torch.randn(length, M, D, generator=gen, dtype=torch.float64).to(dtype).double()
        v_PMD = torch.randn(length, M, D, generator=gen, dtype=torch.float64).to(dtype).double()
        k_XMD[rows], v_XMD[rows] = k_PMD, v_PMD
        keys.append((k_PMD, v_PMD))
    pad_row = len(lens)
    keys.append((k_XMD[:1].to(dtype).double(), v_XMD[:1].to(dtype).double()))

    seq = list(range(len(decode_lens))) + [pad_row] * pad_decode
    pos = [length - 1 for length in decode_lens] + [0] * pad_decode
    num_decode = len(seq)
    pieces = []
    for i, (length, chunk) in enumerate(prefill):
        pieces.append((len(seq), chunk))
        seq += [len(decode_lens) + i] * chunk
        pos += list(range(length - chunk, length))
    seq += [pad_row] * pad_prefill
    pos += [0] * pad_prefill
    starts, lengths = prefill_tiles(pieces, tile or prefill_tile_tokens(n, M))
    covered_T = torch.zeros(len(seq), dtype=torch.bool)
    covered_T[:num_decode] = True
    for start, length in zip(starts, lengths):
        covered_T[start : start + length] = True
    starts += [0] * pad_tiles
    lengths += [0] * pad_tiles

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    batch = AttentionBatch(ints(seq), ints(pos), num_decode, ints(starts), ints(lengths), num_splits)
    qkv_TC = torch.randn(len(seq), (n + 2 * M) * D, generator=gen).to(device, dtype)
    return Case(
        q_TND=qkv_TC[:, : n * D].view(len(seq), n, D),
        k_XMD=k_XMD.to(device, dtype),
        v_XMD=v_XMD.to(device, dtype),
        table_RB=table_RB.to(device),
        batch=batch,
        block_size=block_size,
        scale=0.9 * D**-0.5,
        keys=keys,
        covered_T=covered_T.to(device),
    )


def dense_attention(case: Case) -> torch.Tensor:
    """softmax_j(scale q_t . k_j) v_j over j = 0..pos_t in float64, one token at a time, from the contiguous
    per-sequence K/V (no block table)."""
    t, n, d = case.q_TND.shape
    g = n // case.k_XMD.shape[1]
    q_TND = case.q_TND.double().cpu()
    out_TND = torch.empty(t, n, d, dtype=torch.float64)
    for i, (r, p) in enumerate(zip(case.batch.seq_T.tolist(), case.batch.pos_T.tolist())):
        k_PMD, v_PMD = case.keys[r]
        k_PND = k_PMD[: p + 1].repeat_interleave(g, dim=1)
        v_PND = v_PMD[: p + 1].repeat_interleave(g, dim=1)
        w_NP = torch.softmax(torch.einsum("nd,pnd->np", q_TND[i], k_PND) * case.scale, dim=-1)
        out_TND[i] = torch.einsum("np,pnd->nd", w_NP, v_PND)
    return out_TND


# The block-table layouts of the tests: lengths 1, 15, 16, 17, 40, 100 cross block boundaries of 16 positions;
# a prefill piece starts at 0 (a new prompt), two continue a cached prefix (positions 30.., 30.. and 60..).
PAGED = dict(decode_lens=(1, 15, 16, 17, 40, 100), prefill=((17, 17), (40, 10), (100, 40)), block_size=16)
SLOT = dict(decode_lens=(1, 17, 100, 128), prefill=((40, 10), (128, 128)), block_size=128)
REFERENCE_CASES = {
    "paged16-g2-d16": dict(PAGED, G=2, D=16),
    "paged16-g4-d24": dict(PAGED, G=4, D=24),
    "slot128-g2-d16": dict(SLOT, G=2, D=16),
    "slot128-g4-d24-padding": dict(SLOT, G=4, D=24, pad_decode=2, pad_prefill=3),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_reference_equals_dense_softmax(name, dtype):
    case = make_case(**REFERENCE_CASES[name], dtype=dtype)
    out_TND = case.run(paged_attention_reference)
    assert out_TND.dtype == dtype and out_TND.is_contiguous()
    torch.testing.assert_close(
        out_TND.double(), dense_attention(case), atol=1e-5 if dtype == torch.float32 else 1e-12, rtol=0
    )


def test_reference_ignores_how_prefill_is_tiled_and_cpu_dispatches_to_it():
    outs = [
        make_case(**REFERENCE_CASES["paged16-g2-d16"], tile=tile).run(paged_attention_reference)
        for tile in (1, 3, None)
    ]
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    case = make_case(**REFERENCE_CASES["paged16-g2-d16"])
    assert torch.equal(case.run(paged_attention), case.run(paged_attention_reference))


def test_tiles_and_splits():
    assert prefill_tile_tokens(32, 4) == 16  # G = 8: 16 tokens x 8 heads = 128 query rows
    assert prefill_tile_tokens(12, 4) == 32  # G = 3: 128 // 3 = 42, rounded down to a power of two
    assert prefill_tile_tokens(4, 4) == 128
    assert prefill_tile_tokens(256, 1) == 1
    with pytest.raises(ValueError):
        prefill_tile_tokens(6, 4)
    assert prefill_tiles([(3, 5), (8, 16), (24, 1)], 4) == ([3, 7, 8, 12, 16, 20, 24], [4, 1, 4, 4, 4, 4, 1])
    assert prefill_tiles([], 4) == ([], [])
    assert decode_splits(128, 4, 132) == 1  # 512 programs: ~2 waves already
    assert decode_splits(1, 4, 132) == 16  # capped
    assert decode_splits(8, 4, 132) == 9  # ceil(264 / 32)
    assert decode_splits(0, 4, 132) == 1
    assert decode_splits(64, 4, 132, waves=8) == 5  # ceil(8 * 132 / 256)
    assert decode_splits(300, 4, 132, waves=8) == 1  # 1200 programs: over 8 waves alone


# ------------------------------------------------------------------------------- Triton, interpreted on CPU
# Tiny shapes: the interpreter runs every program's ops one by one through numpy.
INTERP_BASE = dict(decode_lens=(1, 16, 17, 40), prefill=((17, 17), (40, 10)), block_size=16)
INTERPRETED = {
    "fp32-g2-d16-splits1": dict(INTERP_BASE, G=2, D=16, num_splits=1),
    "fp32-g4-d24-splits3-tile4": dict(INTERP_BASE, G=4, D=24, num_splits=3, tile=4, pad_tiles=2),
    "fp32-g2-d16-splits4-tile1-padding": dict(
        INTERP_BASE, G=2, D=16, num_splits=4, tile=1, pad_decode=2, pad_prefill=3, pad_tiles=1
    ),
    "fp32-slot128-g4-d24-splits4-tile3": dict(
        SLOT, decode_lens=(1, 17, 100), G=4, D=24, num_splits=4, tile=3
    ),
    "fp32-paged16-g4-d24-splits3": dict(PAGED, G=4, D=24, num_splits=3),
    "bf16-g2-d16-splits1": dict(INTERP_BASE, G=2, D=16, dtype=torch.bfloat16, num_splits=1),
    "bf16-g4-d24-splits4-tile4-padding": dict(
        INTERP_BASE, G=4, D=24, dtype=torch.bfloat16, num_splits=4, tile=4, pad_decode=1, pad_tiles=2
    ),
    # key tiles over several cache blocks of 16 (one block-table entry per key), past the last key too
    "fp32-g4-d24-splits3-keys32-64": dict(INTERP_BASE, G=4, D=24, num_splits=3, key_tiles=(32, 64)),
    "bf16-g2-d16-splits1-keys64-32-padding": dict(
        INTERP_BASE,
        G=2,
        D=16,
        dtype=torch.bfloat16,
        num_splits=1,
        pad_decode=2,
        pad_tiles=1,
        key_tiles=(64, 32),
    ),
}


def key_tile_args(spec: dict) -> tuple[dict, dict]:
    """(make_case's arguments, paged_attention_triton's key-tile keywords) of a case."""
    spec = dict(spec)
    decode, prefill = spec.pop("key_tiles", (None, None))
    return spec, {"decode_key_tile": decode, "prefill_key_tile": prefill}


def _fp32_reference(case: Case) -> torch.Tensor:
    """The reference on fp32 copies of the bf16 inputs: an oracle that rounds only once, at the end."""
    return paged_attention_reference(
        case.q_TND.float(),
        case.k_XMD.float(),
        case.v_XMD.float(),
        case.table_RB,
        case.batch,
        case.block_size,
        case.scale,
    )


def run_interpreted() -> dict[str, dict]:
    """Per case: max |triton - reference| / max(1, |reference|) over the covered tokens (relative where bf16's
    rounding step grows with the value), whether the uncovered ones are 0, and the output's dtype and layout.
    The reference runs on fp32 copies of the inputs: for bf16 it then rounds once, at the end (the kernels also
    round the softmax weights to bf16 before the P V product, as flash attention does: ~1 ulp more)."""
    results = {}
    for name, spec in INTERPRETED.items():
        spec, tiles = key_tile_args(spec)
        case = make_case(**spec)
        got_TND = case.run(functools.partial(paged_attention_triton, **tiles))
        want_TND = _fp32_reference(case)
        got, want = got_TND[case.covered_T].float(), want_TND[case.covered_T].float()
        results[name] = {
            "max_err": ((got - want).abs() / want.abs().clamp(min=1)).max().item(),
            "uncovered_zero": bool((got_TND[~case.covered_T] == 0).all()),
            "dtype_ok": got_TND.dtype == case.q_TND.dtype and got_TND.is_contiguous(),
        }
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreter_results(__file__)


@pytest.mark.parametrize("name", list(INTERPRETED))
def test_interpreted_triton_equals_reference(interpreted, name):
    result = interpreted[name]
    tol = 2e-2 if INTERPRETED[name].get("dtype") == torch.bfloat16 else 1e-5
    assert result["max_err"] <= tol, result
    assert result["uncovered_zero"] and result["dtype_ok"], result


# ------------------------------------------------------------------------------------------- compiled, CUDA
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and Triton"
)
REALISTIC = dict(
    decode_lens=(1, 16, 17, 100, 777, 1024, 2047, 2999, 3000, 1500, 64, 333),
    prefill=((300, 300), (1500, 200), (3000, 37), (1, 1)),
    M=4,
    G=8,
    D=128,
    block_size=16,
    dtype=torch.bfloat16,
    pad_decode=2,
    pad_tiles=3,
    device="cuda",
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("key_tiles", [(None, None), (64, 128)], ids=["block-keys", "keys64-128"])
@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("block_size", [16, 4096], ids=["paged16", "slot4096"])
def test_compiled_kernels_equal_reference_on_cuda(splits, block_size, key_tiles):
    case = make_case(**{**REALISTIC, "block_size": block_size}, num_splits=splits)
    decode, prefill = key_tiles
    got_TND = case.run(
        functools.partial(paged_attention_triton, decode_key_tile=decode, prefill_key_tile=prefill)
    )
    assert got_TND.dtype == torch.bfloat16
    torch.testing.assert_close(got_TND.float(), _fp32_reference(case), atol=2e-2, rtol=0)


@pytest.mark.gpu
@needs_cuda
def test_captured_decode_reads_lengths_from_the_device():
    case = make_case(**{**REALISTIC, "prefill": (), "pad_tiles": 0}, num_splits=4)
    call = lambda: case.run(paged_attention_triton)  # noqa: E731
    call()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_TND = call()
    pos_T = case.batch.pos_T
    shorter_T = torch.minimum(pos_T, (pos_T * 7) // 10 + torch.arange(pos_T.shape[0], device="cuda") % 3)
    pos_T.copy_(shorter_T.to(torch.int32))
    graph.replay()
    want_TND = _fp32_reference(case)
    torch.testing.assert_close(out_TND.float(), want_TND, atol=2e-2, rtol=0)
    assert (out_TND.float() - case.run(paged_attention_triton).float()).abs().max() == 0


if __name__ == "__main__":
    print(json.dumps(run_interpreted()))


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_strided_metadata_is_refused_before_any_launch():
    """A column of a [Q, 2] table is a strided view: the kernels would read the other column's values."""
    tiles_Q2 = torch.tensor([[0, 3], [3, 2]], dtype=torch.int32)
    q_TND = torch.zeros(5, 4, 16)
    kv_XMD = torch.zeros(32, 2, 16)
    batch = AttentionBatch(
        seq_T=torch.zeros(5, dtype=torch.int32),
        pos_T=torch.arange(5, dtype=torch.int32),
        num_decode=0,
        tile_start_Q=tiles_Q2[:, 0],
        tile_len_Q=tiles_Q2[:, 1],
        num_splits=1,
    )
    with pytest.raises(ValueError, match="contiguous vectors"):
        paged_attention_triton(q_TND, kv_XMD, kv_XMD, torch.zeros(1, 2, dtype=torch.int32), batch, 16, 0.25)
