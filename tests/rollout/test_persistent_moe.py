"""Persistent MoE kernels: the torch reference against a per-pair Python loop and against the model's expert path;
the tile table against counts computed with numpy; the Triton kernels against the reference, run by Triton's
interpreter on CPU tensors in a subprocess (TRITON_INTERPRET=1 must be set before triton is imported), and
compiled on CUDA (the same cases, a bf16 step of realistic shape, a captured CUDA graph).

Preemption: a flag set before the launch leaves exactly the prefill tiles undone and a resume completes them bit
for bit; a flag that the launch itself raises (a view of its own done mask) stops phase A, then phase B, midway;
a flag cleared between the phases (the private per-phase launches) must not let phase B read rows phase A never
wrote (those rows are NaN here).

Run as a script (what the interpreter tests do) it prints one JSON line: per case, the largest difference between
the kernels and the reference and the preemption facts the tests check.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rollout_testlib import interpreter_results

from rollout.kernels.persistent_moe import (  # private helpers: the per-phase launches and the combine
    LAUNCH,
    WIDE_DECODE_LAUNCH,
    MoeRun,
    OutOfResources,
    _combine,
    _interpreted,
    _launch_down,
    _launch_fitting,
    _launch_gate_up,
    _undone_tiles,
    build_tiles,
    launch_options,
    max_tiles,
    moe_reference,
    persistent_moe,
    persistent_moe_run,
    tile_counts,
    tma_runs_on,
)

REPO = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None

# ------------------------------------------------------------------------------------------------ inputs
BASE = dict(T=16, H=40, F=24, E=6, K=2, num_decode=6, routing="topk", dtype="float32", blocks={})
SMALL_BLOCKS = dict(block_n=16, block_k=16)  # several masked column blocks and reduction steps at H, F <= 64
ROW_INPUTS = ("h_TH", "weights_TK", "ids_TK", "residual_TH")  # a step's inputs with one row per token


def make_inputs(spec: dict, device: str = "cpu", seed: int = 0) -> dict:
    """h, router weights, ids, expert weights and residual of a step. Routings: topk (distinct experts per token,
    softmax weights), hot (expert 1 in every token's first slot), idle (experts 1 and E - 2 only: the rest get no
    pair), dup (ids drawn with replacement: repeats within a token too)."""
    s = {**BASE, **spec}
    t, h, f, e, k = s["T"], s["H"], s["F"], s["E"], s["K"]
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, s["dtype"])
    if s.get("strided_h"):
        h_TH = torch.randn(t, h + 8, generator=gen)[:, 3 : 3 + h]  # rows of a wider tensor: stride(0) = H + 8
    else:
        h_TH = torch.randn(t, h, generator=gen)
    logits_TE = torch.randn(t, e, generator=gen)
    routing = s["routing"]
    if routing == "topk":
        weights_TK, ids_TK = torch.topk(torch.softmax(logits_TE, -1), k, dim=-1)
    elif routing == "hot":
        logits_TE[:, 1] = 100.0
        weights_TK, ids_TK = torch.topk(torch.softmax(logits_TE, -1), k, dim=-1)
    elif routing == "idle":
        ids_TK = torch.tensor([1, e - 2])[torch.randint(0, 2, (t, k), generator=gen)]
        weights_TK = torch.rand(t, k, generator=gen)
    elif routing == "dup":
        ids_TK = torch.randint(0, e, (t, k), generator=gen)
        weights_TK = torch.rand(t, k, generator=gen)
    else:
        raise ValueError(routing)
    if s.get("int32_ids"):
        ids_TK = ids_TK.int()
    inputs = dict(
        h_TH=h_TH,
        weights_TK=weights_TK.float(),
        ids_TK=ids_TK,
        gate_up_EFH=torch.randn(e, 2 * f, h, generator=gen) * h**-0.5,
        down_EHF=torch.randn(e, h, f, generator=gen) * f**-0.5,
        residual_TH=torch.randn(t, h, generator=gen),
    )
    if s.get("strided_h"):  # column-major router weights and residual too (the combine reads them by strides)
        inputs["weights_TK"] = inputs["weights_TK"].t().contiguous().t()
        inputs["residual_TH"] = inputs["residual_TH"].t().contiguous().t()
    return {
        name: x.to(device=device, dtype=dtype)
        if x.is_floating_point() and name != "weights_TK"
        else x.to(device)
        for name, x in inputs.items()
    }


def spec_of(spec: dict) -> tuple[dict, int, dict]:
    s = {**BASE, **spec}
    return s, s["num_decode"], s["blocks"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, |want|) (relative where bf16's rounding step grows with the value); 0 if empty."""
    if got.numel() == 0:
        return 0.0
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).abs() / want.abs().clamp(min=1)).max().item()


def fp32_reference(inputs: dict) -> torch.Tensor:
    """The reference on fp32 copies of the inputs: for bf16 an oracle that rounds only once, at the end."""
    return moe_reference(**{name: x.float() if x.is_floating_point() else x for name, x in inputs.items()})


# ------------------------------------------------------------------------------- the reference and the model
def loop_reference(inputs: dict) -> torch.Tensor:
    """out_t = r_t + sum_k w_tk down_e(silu(gate_e h_t) * up_e h_t), one pair at a time in float64."""
    h_TH, res_TH = inputs["h_TH"].double(), inputs["residual_TH"].double()
    gate_up, down = inputs["gate_up_EFH"].double(), inputs["down_EHF"].double()
    f = down.shape[2]
    out_TH = res_TH.clone()
    for t in range(h_TH.shape[0]):
        for k in range(inputs["ids_TK"].shape[1]):
            e = int(inputs["ids_TK"][t, k])
            gate_F, up_F = gate_up[e, :f] @ h_TH[t], gate_up[e, f:] @ h_TH[t]
            act_F = gate_F / (1 + torch.exp(-gate_F)) * up_F
            out_TH[t] += float(inputs["weights_TK"][t, k]) * (down[e] @ act_F)
    return out_TH


@pytest.mark.parametrize("routing", ["topk", "hot", "idle", "dup"])
def test_reference_equals_per_pair_loop(routing):
    inputs = make_inputs(dict(T=9, num_decode=4, routing=routing, K=3))
    out_TH = moe_reference(**inputs)
    assert out_TH.dtype == torch.float32 and out_TH.shape == inputs["h_TH"].shape
    torch.testing.assert_close(out_TH.double(), loop_reference(inputs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("capacity", [None, 2], ids=["grouped", "padded"])
def test_reference_equals_the_models_expert_path(capacity):
    """MoeDecoder.experts (grouped GEMMs, or the padded path with 2 rows per expert and overflow) in fp32."""
    from rollout.model import MoeDecoder, padded_combine, padded_rows, swiglu

    inputs = make_inputs(dict(T=11, E=5, K=2))
    e = inputs["gate_up_EFH"].shape[0]
    decoder = MoeDecoder.__new__(MoeDecoder)  # only the expert path's attributes: no cache, no other weights
    decoder.spec = SimpleNamespace(num_experts=e)
    decoder.persistent = False
    decoder.sort_dtype = torch.int16
    decoder.experts_E = torch.arange(e, dtype=torch.int16)
    decoder.capacity_for = lambda pairs, experts: capacity
    decoder._swiglu, decoder._padded_rows, decoder._padded_combine = swiglu, padded_rows, padded_combine
    layer = SimpleNamespace(gate_up_EFH=inputs["gate_up_EFH"], down_EHF=inputs["down_EHF"])
    model_TH = decoder.experts(
        layer, inputs["h_TH"], inputs["weights_TK"], inputs["ids_TK"], inputs["residual_TH"]
    )
    torch.testing.assert_close(moe_reference(**inputs), model_TH, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------- tile table
def expected_tiles(ids: np.ndarray, num_decode: int, e: int, block_m: tuple[int, int]) -> tuple[list, list]:
    """Per phase the pair counts per expert (np.bincount) and sum_e ceil(m_e / M_p)."""
    counts, tiles = [], []
    for phase, rows in enumerate((ids[:num_decode], ids[num_decode:])):
        m_E = np.bincount(rows.reshape(-1), minlength=e)
        counts.append(m_E.tolist())
        tiles.append(int(sum(math.ceil(m / block_m[phase]) for m in m_E)))
    return counts, tiles


TABLE_CASES = {
    "mixed-topk": (dict(T=24, num_decode=9, E=8, K=3), (16, 64)),
    "mixed-small-prefill-block": (dict(T=24, num_decode=9, E=4, K=3), (16, 16)),
    "hot-decode": (dict(T=24, num_decode=20, E=4, routing="hot"), (16, 64)),
    "hot-prefill": (dict(T=24, num_decode=2, E=4, routing="hot"), (16, 16)),
    "idle": (dict(T=24, num_decode=12, E=8, routing="idle"), (16, 32)),
    "decode-only": (dict(T=24, num_decode=24, E=3, K=3, routing="dup"), (16, 64)),
    "prefill-only": (dict(T=24, num_decode=0, E=3, K=3, routing="dup"), (16, 16)),
    "one-token": (dict(T=1, num_decode=1), (16, 64)),
}


@pytest.mark.parametrize("name", list(TABLE_CASES))
def test_tile_table(name):
    spec, block_m = TABLE_CASES[name]
    s, nd, _ = spec_of(spec)
    ids_TK = make_inputs(spec)["ids_TK"]
    k, e = ids_TK.shape[1], s["E"]
    tiles = build_tiles(ids_TK, nd, e, *block_m)
    counts, (dec, pre) = expected_tiles(ids_TK.numpy(), nd, e, block_m)
    assert tiles.counts_2E.tolist() == counts
    assert tile_counts(tiles).tolist() == [dec, pre] and tiles.ends_2.tolist() == [dec, dec + pre]
    q = max_tiles(s["T"], k, e, nd, *block_m)
    assert tiles.rows_Q.shape == (q,) and dec + pre <= q
    assert (tiles.rows_Q[dec + pre :] == 0).all()

    order = tiles.order_R.tolist()
    covered = []
    for i in range(dec + pre):
        rows, start, expert = int(tiles.rows_Q[i]), int(tiles.start_Q[i]), int(tiles.expert_Q[i])
        decode = i < dec
        assert 1 <= rows <= block_m[0 if decode else 1]
        pairs = order[start : start + rows]
        assert pairs == sorted(pairs)  # stable: token order within a tile
        assert all(int(ids_TK.reshape(-1)[p]) == expert for p in pairs)
        assert all((p // k < nd) == decode for p in pairs)  # decode tiles hold decode pairs, and come first
        covered += pairs
    assert sorted(covered) == list(range(s["T"] * k))  # every pair exactly once


def test_max_tiles_is_the_worst_case():
    # 4 experts with 17 pairs each: 2 tiles of 16 rows each, the bound (68 + 4 * 15) // 16 = 8 is attained
    ids_TK = torch.arange(4).repeat_interleave(17).view(68, 1)
    tiles = build_tiles(ids_TK, 0, 4, 16, 16)
    assert max_tiles(68, 1, 4, 0, 16, 16) == 8 == int(tiles.ends_2[1])
    assert max_tiles(3, 2, 64, 1, 16, 64) == 2 + 4  # fewer pairs than experts: one tile per pair at most
    assert max_tiles(0, 8, 64, 0, 16, 64) == 0


# ------------------------------------------------------------------------------------------- input checks
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x: {"weights_TK": x["weights_TK"].double()}, "weights_TK"),
        (lambda x: {"ids_TK": x["ids_TK"][:, :1]}, "ids_TK"),
        (lambda x: {"ids_TK": x["ids_TK"].float()}, "ids_TK"),
        (lambda x: {"h_TH": x["h_TH"].t().contiguous().t()}, "h_TH"),
        (lambda x: {"residual_TH": x["residual_TH"][:-1]}, "residual_TH"),
        (
            lambda x: {"gate_up_EFH": x["gate_up_EFH"].transpose(1, 2).contiguous().transpose(1, 2)},
            "gate_up_EFH",
        ),
        (lambda x: {"gate_up_EFH": x["gate_up_EFH"][:, :-1]}, "gate_up_EFH"),
        (lambda x: {"down_EHF": x["down_EHF"][:-1]}, "down_EHF"),
        (lambda x: {"down_EHF": x["down_EHF"].double()}, "down_EHF"),
        (lambda x: {"num_decode": 17}, "num_decode"),
        (lambda x: {"num_decode": -1}, "num_decode"),
        (lambda x: {"preempt_flag": torch.ones(1, dtype=torch.int64)}, "preempt_flag"),
        (lambda x: {"preempt_flag": torch.ones(2, dtype=torch.int32)}, "preempt_flag"),
        (lambda x: {"num_programs": 0}, "num_programs"),
        (lambda x: {"block_m_prefill": 48}, "block_m_prefill"),
        (lambda x: {"block_n": 8}, "block_n"),
        (lambda x: {"num_warps": 3}, "num_warps"),
        (lambda x: {"num_stages": 0}, "num_stages"),
    ],
)
def test_bad_inputs_are_refused_before_any_launch(change, match):
    inputs = {**make_inputs({}), "num_decode": 6}
    with pytest.raises(ValueError, match=match) as err:
        persistent_moe(**{**inputs, **change(inputs)})
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_resume_of_an_untracked_run_is_refused():
    inputs = make_inputs({})
    tiles = build_tiles(inputs["ids_TK"], 6, 6)
    untracked = MoeRun(None, tiles, torch.empty(32, 24), torch.empty(32, 40), None, None, None, 64, 64, False)
    with pytest.raises(ValueError, match="resume"):
        persistent_moe_run(**inputs, num_decode=6, resume=untracked)
    with pytest.raises(ValueError, match="resume"):
        persistent_moe_run(**inputs, num_decode=5, resume=untracked._replace(done_a_W=1, done_b_W=1))


class SharedMemoryLimitedKernel:
    """A launchable (kernel[grid](*args, **options)) that needs `fixed` bytes of shared memory plus `per_stage`
    per pipeline stage beyond the first, and fails the way Triton does (OutOfResources when the compiled kernel
    is loaded, before it runs) over `limit` bytes; it records the depth of every attempt."""

    def __init__(self, per_stage: int, limit: int, fixed: int = 0) -> None:
        self.per_stage, self.limit, self.fixed, self.tried, self.ran = per_stage, limit, fixed, [], []

    def __getitem__(self, grid):
        def launch(*args, num_stages: int, **options):
            self.tried.append(num_stages)
            need = self.fixed + (num_stages - 1) * self.per_stage
            if need > self.limit:
                raise OutOfResources(need, self.limit, "shared memory")
            self.ran.append((grid, num_stages, options))

        return launch


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_launch_lowers_the_pipeline_depth_to_what_fits_and_remembers_it():
    """fp32 tiles at the bf16 defaults: 3 x 96 KiB buffers at 4 stages do not fit an H100's 227 KiB (the failure
    the GPU run showed); the launch runs once at the deepest fitting depth, and the next launch starts there."""
    kernel = SharedMemoryLimitedKernel(per_stage=98304, limit=232448)
    x = torch.zeros(2, 3)
    _launch_fitting(kernel, 7, x, options={"num_stages": 4, "num_warps": 8})
    assert kernel.tried == [4, 3] and kernel.ran == [((7,), 3, {"num_warps": 8})]
    _launch_fitting(kernel, 7, x, options={"num_stages": 4, "num_warps": 8})
    assert kernel.tried == [4, 3, 3]
    _launch_fitting(kernel, 7, x.double(), options={"num_stages": 4, "num_warps": 8})  # another dtype: fresh
    assert kernel.tried == [4, 3, 3, 4, 3]
    too_big = SharedMemoryLimitedKernel(per_stage=98304, limit=232448, fixed=300000)  # fits at no depth
    with pytest.raises(OutOfResources):
        _launch_fitting(too_big, 1, x, options={"num_stages": 3})
    assert too_big.tried == [3, 2, 1] and not too_big.ran


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_cpu_tensors_without_the_interpreter_are_refused():
    if _interpreted():
        pytest.skip("this process runs the kernels interpreted")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        persistent_moe(**make_inputs({}), num_decode=6)


# ---------------------------------------------------------------------------------- kernel cases (any device)
# Tiny shapes: the interpreter runs every program's ops one by one through numpy.
KERNEL_CASES = {
    "decode-only": dict(T=12, num_decode=12, blocks=SMALL_BLOCKS),
    "prefill-only": dict(T=20, num_decode=0, H=48, F=32, E=8, blocks=dict(block_n=16, block_k=32)),
    "mixed": dict(T=24, num_decode=9, E=8, K=3, blocks=SMALL_BLOCKS),
    "mixed-default-blocks": dict(T=24, num_decode=9, E=8, K=3),
    "idle-experts": dict(T=16, num_decode=6, E=8, routing="idle", blocks=SMALL_BLOCKS),
    "hot-expert-decode": dict(T=24, num_decode=20, E=4, routing="hot", blocks=SMALL_BLOCKS),
    "hot-expert-prefill": dict(
        T=24, num_decode=4, E=4, routing="hot", blocks=dict(SMALL_BLOCKS, block_m_prefill=16)
    ),
    "repeated-experts": dict(T=16, num_decode=8, E=3, K=3, blocks=SMALL_BLOCKS),
    "duplicates-within-a-token": dict(T=16, num_decode=5, E=4, K=3, routing="dup", blocks=SMALL_BLOCKS),
    "one-token-decode": dict(T=1, num_decode=1, blocks=SMALL_BLOCKS),
    "one-token-prefill": dict(T=1, num_decode=0),
    "odd-h37-f21-small-blocks": dict(T=20, num_decode=7, H=37, F=21, blocks=SMALL_BLOCKS),
    "odd-h50-f60-one-block": dict(T=20, num_decode=7, H=50, F=60),
    "strided-inputs-int32-ids": dict(T=20, num_decode=7, strided_h=True, int32_ids=True, blocks=SMALL_BLOCKS),
    "bf16-mixed": dict(T=24, num_decode=9, E=8, K=3, dtype="bfloat16", blocks=SMALL_BLOCKS),
    # S = 16 E / K = 32 tokens: the default height of 48 decode tokens is 32 rows, the hot expert's pairs in two
    "hot-expert-wide-decode": dict(T=48, num_decode=48, E=4, routing="hot"),
}
GRIDS = (None, 1, 5)  # the default grid, one program walking every tile, an odd count


def kernel_case(spec: dict, device: str, tma: bool = False) -> dict:
    """Max error against the reference over the grids, and whether every grid gives the same bits; with tma,
    also the largest difference from the per-thread-load path."""
    _, nd, blocks = spec_of(spec)
    inputs = make_inputs(spec, device)
    want_TH = fp32_reference(inputs)
    outs = [persistent_moe(**inputs, num_decode=nd, num_programs=p, tma=tma, **blocks) for p in GRIDS]
    out = {
        "max_err": max(rel_err(out.float(), want_TH) for out in outs),
        "grid_invariant": all(torch.equal(outs[0], out) for out in outs[1:]),
        "dtype_ok": all(out.dtype == inputs["h_TH"].dtype and out.shape == want_TH.shape for out in outs),
    }
    if tma:
        loads_TH = persistent_moe(**inputs, num_decode=nd, **blocks)
        out["vs_loads"] = rel_err(outs[0].float(), loads_TH.float())
    return out


def tma_fits(spec: dict) -> bool:
    """Whether a case's weights have 16-byte aligned rows (H and F elements), as TMA descriptors need."""
    s = {**BASE, **spec}
    size = getattr(torch, s["dtype"]).itemsize
    return (s["H"] * size) % 16 == 0 and (s["F"] * size) % 16 == 0


PREEMPT_CASES = {
    "mixed": dict(T=24, num_decode=6, E=4, blocks=dict(SMALL_BLOCKS, block_m_prefill=16)),
    "mixed-default-blocks": dict(T=24, num_decode=9, E=8, K=3),
    "prefill-only": dict(T=20, num_decode=0, E=4, blocks=dict(SMALL_BLOCKS, block_m_prefill=16)),
    "decode-only": dict(T=12, num_decode=12, blocks=SMALL_BLOCKS),
}


def _items(run: MoeRun) -> tuple[int, int]:
    """Column blocks of phases A and B, from the done masks' lengths."""
    q = run.tiles.rows_Q.shape[0]
    return run.done_a_W.shape[0] // q, run.done_b_W.shape[0] // q


def preempt_before_launch(spec: dict, device: str) -> dict:
    """The flag set before the launch: decode tokens only, the prefill tiles all undone; the flag still set on
    resume changes nothing; a resume without it (another grid) equals one launch without a flag."""
    _, nd, blocks = spec_of(spec)
    inputs = make_inputs(spec, device)
    want_TH = fp32_reference(inputs)
    full_TH = persistent_moe(**inputs, num_decode=nd, **blocks)
    flag = torch.ones(1, dtype=torch.int32, device=device)
    run = persistent_moe_run(**inputs, num_decode=nd, preempt_flag=flag, **blocks)
    dec, pre = tile_counts(run.tiles).tolist()
    nb_a, nb_b = _items(run)
    out = {
        "decode_err": rel_err(run.out_TH[:nd], want_TH[:nd]),
        "undone": int(run.undone),
        "prefill_tiles": pre,
        "decode_items_done": bool(run.done_a_W[: dec * nb_a].all() and run.done_b_W[: dec * nb_b].all()),
        "prefill_items_done": int(run.done_a_W[dec * nb_a :].sum() + run.done_b_W[dec * nb_b :].sum()),
    }
    # a resume updates the run's buffers and masks in place: read them before each next launch
    again = persistent_moe_run(**inputs, num_decode=nd, preempt_flag=flag, resume=run, **blocks)
    out["reflagged_unchanged"] = torch.equal(again.out_TH[:nd], run.out_TH[:nd]) and int(again.undone) == pre
    done = persistent_moe_run(**inputs, num_decode=nd, resume=again, num_programs=3)
    out["resumed_equals_full"] = torch.equal(done.out_TH, full_TH)
    out["resumed_undone"] = int(done.undone)
    out["resumed_err"] = rel_err(done.out_TH, want_TH)
    zero = persistent_moe_run(**inputs, num_decode=nd, preempt_flag=flag.zero_(), **blocks)
    out["zero_flag_equals_full"] = torch.equal(zero.out_TH, full_TH) and int(zero.undone) == 0
    return out


def preempt_mid_launch(spec: dict, device: str) -> dict:
    """A flag the launch raises itself, a view of its own done mask, with one program walking the tiles in
    order: phase A stops after the first two prefill tiles (phase B then sees the flag and does none); resumed
    with a flag in phase B's mask, A completes and B stops after two tiles; a last resume completes the run."""
    _, nd, blocks = spec_of(spec)
    inputs = make_inputs(spec, device)
    want_TH = fp32_reference(inputs)
    full_TH = persistent_moe(**inputs, num_decode=nd, **blocks)
    flag = torch.ones(1, dtype=torch.int32, device=device)
    run = persistent_moe_run(**inputs, num_decode=nd, preempt_flag=flag, **blocks)
    dec, pre = tile_counts(run.tiles).tolist()
    nb_a, nb_b = _items(run)
    out = {"prefill_tiles": pre}
    last_a = (dec + 2) * nb_a - 1  # the last column block of the second prefill tile
    run = persistent_moe_run(
        **inputs, num_decode=nd, resume=run, preempt_flag=run.done_a_W[last_a : last_a + 1], num_programs=1
    )
    out["a_stop_prefill_items_a"] = int(run.done_a_W[dec * nb_a :].sum()) / nb_a
    out["a_stop_undone"] = int(run.undone)
    out["a_stop_decode_err"] = rel_err(run.out_TH[:nd], want_TH[:nd])
    last_b = (dec + 2) * nb_b - 1
    run = persistent_moe_run(
        **inputs, num_decode=nd, resume=run, preempt_flag=run.done_b_W[last_b : last_b + 1], num_programs=1
    )
    out["b_stop_prefill_items_a"] = int(run.done_a_W[dec * nb_a :].sum()) / nb_a
    out["b_stop_undone"] = int(run.undone)
    complete_Q = run.done_b_W.view(-1, nb_b).cpu().numpy().min(1) > 0
    out["b_stop_undone_from_masks"] = int((~complete_Q[dec : dec + pre]).sum())
    run = persistent_moe_run(**inputs, num_decode=nd, resume=run, num_programs=2)
    out["resumed_equals_full"] = torch.equal(run.out_TH, full_TH)
    out["resumed_undone"] = int(run.undone)
    return out


@contextlib.contextmanager
def flag_raised_at_read(flag: torch.Tensor, read: int):
    """Under the interpreter: `flag` set to 1 just before the kernels' `read`-th flag read (1-based), by wrapping
    the interpreter's atomic read-modify-write (the flag read is the kernels' only atomic). A launch of one
    program then sees the flag rise at a chosen point of its walk, between items or between slices of one."""
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_atomic_rmw
    reads = [0]

    def counting(self, *args, **kwargs):
        reads[0] += 1
        if reads[0] == read:
            flag.fill_(1)
        return original(self, *args, **kwargs)

    InterpreterBuilder.create_atomic_rmw = counting
    try:
        yield reads
    finally:
        InterpreterBuilder.create_atomic_rmw = original


def preempt_mid_item(spec: dict, device: str, slices: int = 3) -> dict:
    """One program resumes a run whose prefill is all undone and whose act rows were set to NaN, the flag rising
    at its k-th read. It reads before each prefill item and between the `slices` slices of the item's reduction,
    so a rise at read k leaves (k - 1) // slices prefill A items done and, when k - 1 is not a multiple of
    `slices`, gives up the next one mid-reduction. Per k: the done count, whether exactly the done items' act
    blocks were stored (no NaN left there, nothing else written), and a last resume against one launch."""
    _, nd, blocks = spec_of(spec)
    inputs = make_inputs(spec, device)
    full_TH = persistent_moe(**inputs, num_decode=nd, **blocks)
    out = {"reads_per_item": slices, "by_read": {}}
    for k in range(1, 2 * slices + 2):
        run = persistent_moe_run(
            **inputs, num_decode=nd, preempt_flag=torch.ones(1, dtype=torch.int32), **blocks
        )
        run.act_RF.fill_(float("nan"))  # the decode items are done: their act rows are not read again
        dec, pre = tile_counts(run.tiles).tolist()
        nb_a, _ = _items(run)
        flag = torch.zeros(1, dtype=torch.int32)
        with flag_raised_at_read(flag, k):
            run = persistent_moe_run(
                **inputs, num_decode=nd, resume=run, preempt_flag=flag, num_programs=1, preempt_slices=slices
            )
        done_W = run.done_a_W[dec * nb_a : (dec + pre) * nb_a].numpy() > 0
        stored_RF = torch.zeros(run.act_RF.shape, dtype=torch.bool)
        bn = run.block_n
        for i in np.flatnonzero(done_W):
            q, n = dec + i // nb_a, i % nb_a
            rows = slice(int(run.tiles.start_Q[q]), int(run.tiles.start_Q[q] + run.tiles.rows_Q[q]))
            stored_RF[rows, n * bn : (n + 1) * bn] = True
        written_RF = ~torch.isnan(run.act_RF)
        written_RF[: int(run.tiles.start_Q[dec])] = False  # the decode rows: NaN-filled, never rewritten
        resumed = persistent_moe_run(**inputs, num_decode=nd, resume=run, num_programs=2)
        out["by_read"][k] = {
            "done": int(done_W.sum()),
            "done_is_a_prefix": bool(done_W[: int(done_W.sum())].all()),
            "stored_exactly_done": bool(torch.equal(written_RF, stored_RF)),
            "resumed_equals_full": bool(torch.equal(resumed.out_TH, full_TH)),
        }
    return out


def preempt_heeding_programs(spec: dict, device: str, programs: int = 3) -> dict:
    """The flag raised before a launch of `programs` programs of which only program 0 heeds it: program 0 takes
    no prefill item, the others all of theirs (items w = pid, pid + P, ...), in both phases (B only over tiles
    whose A items are all done); the masks, the undone count and the resumed output, against that closed
    form."""
    _, nd, blocks = spec_of(spec)
    inputs = make_inputs(spec, device)
    want_TH = fp32_reference(inputs)
    full_TH = persistent_moe(**inputs, num_decode=nd, **blocks)
    flag = torch.ones(1, dtype=torch.int32, device=device)
    run = persistent_moe_run(
        **inputs, num_decode=nd, preempt_flag=flag, num_programs=programs, heeding=1, **blocks
    )
    dec, pre = tile_counts(run.tiles).tolist()
    nb_a, nb_b = _items(run)
    tiles = dec + pre

    def expected(nb: int, tile_ready) -> np.ndarray:
        w = np.arange(tiles * nb)
        return (w < dec * nb) | ((w % programs != 0) & tile_ready[w // nb])

    done_a = expected(nb_a, np.ones(tiles, dtype=bool))
    done_b = expected(nb_b, done_a.reshape(tiles, nb_a).all(1))
    undone = int((~done_b.reshape(tiles, nb_b).all(1))[dec:].sum())
    out = {
        "prefill_tiles": pre,
        "done_a_matches": bool((run.done_a_W[: tiles * nb_a].cpu().numpy() > 0).tolist() == done_a.tolist()),
        "done_b_matches": bool((run.done_b_W[: tiles * nb_b].cpu().numpy() > 0).tolist() == done_b.tolist()),
        "undone": int(run.undone),
        "undone_expected": undone,
        "prefill_items_done": int(done_a[dec * nb_a :].sum()),
        "decode_err": rel_err(run.out_TH[:nd], want_TH[:nd]),
    }
    done = persistent_moe_run(**inputs, num_decode=nd, resume=run)
    out["resumed_equals_full"] = torch.equal(done.out_TH, full_TH)
    return out


def check_preempt_heeding(result: dict) -> None:
    assert result["done_a_matches"] and result["done_b_matches"], result
    assert result["undone"] == result["undone_expected"] > 0, result
    assert result["prefill_items_done"] > 0 and result["decode_err"] <= 1e-5, result
    assert result["resumed_equals_full"], result


def flag_cleared_between_phases(spec: dict, device: str) -> dict:
    """Phase A (one program) stops after two prefill tiles; phase B then runs with the flag down (0): it must do
    those two tiles and no other, since the act rows of the rest are unwritten (NaN here)."""
    s, nd, blocks = spec_of(spec)
    inputs = make_inputs(spec, device)
    full_TH = persistent_moe(**inputs, num_decode=nd, **blocks)
    flag = torch.ones(1, dtype=torch.int32, device=device)
    run = persistent_moe_run(**inputs, num_decode=nd, preempt_flag=flag, **blocks)
    dec, pre = tile_counts(run.tiles).tolist()
    nb_a, _ = _items(run)
    run.act_RF[nd * s["K"] :] = float("nan")  # the prefill pairs' rows: phase A has written none yet
    run.y_RH[nd * s["K"] :] = 0.0  # uninitialised until written: y_finite then sees only what phase B wrote
    last_a = (dec + 2) * nb_a - 1
    _launch_gate_up(run, inputs["h_TH"], inputs["gate_up_EFH"], run.done_a_W[last_a : last_a + 1], 1)
    _launch_down(run, inputs["down_EHF"], flag.zero_(), 4)
    out = {
        "prefill_tiles": pre,
        "undone": int(_undone_tiles(run)),
        "y_finite": bool(torch.isfinite(run.y_RH).all()),
    }
    run = persistent_moe_run(**inputs, num_decode=nd, resume=run)
    out["resumed_equals_full"] = torch.equal(run.out_TH, full_TH)
    return out


def combine_case(device: str) -> dict:
    """The combine alone (7 tokens over more than one grid stride), into a NaN-filled output: with undone = 0
    every row, with undone > 0 only the first num_decode rows, each residual + sum_k w y; the rest keep NaN."""
    g = torch.Generator().manual_seed(0)
    t, k, h, nd = 7, 3, 40, 3
    y_RH, w_TK, res_TH = (
        torch.randn(*shape, generator=g).to(device) for shape in ((t * k, h), (t, k), (t, h))
    )
    want_TH = res_TH + (w_TK[:, :, None] * y_RH.view(t, k, h)).sum(1)
    out = {}
    for undone in (0, 2):
        flag = torch.tensor(undone, dtype=torch.int32, device=device)
        nan_TH = torch.full((t, h), float("nan"), device=device)
        got_TH = _combine(res_TH, w_TK, y_RH, flag, nd, out_TH=nan_TH)
        out[f"undone{undone}_decode_err"] = rel_err(got_TH[:nd], want_TH[:nd])
        out[f"undone{undone}_prefill_err"] = rel_err(got_TH[nd:], want_TH[nd:]) if undone == 0 else None
        out[f"undone{undone}_prefill_nan"] = bool(got_TH[nd:].isnan().all())
    return out


def check_combine(result: dict) -> None:
    assert result["undone0_decode_err"] <= 1e-6 and result["undone0_prefill_err"] <= 1e-6, result
    assert not result["undone0_prefill_nan"], result
    assert result["undone2_decode_err"] <= 1e-6 and result["undone2_prefill_nan"], result


# the tables of test_tile_table (checked against numpy there) and Qwen3-30B-A3B's 128 experts top-8
KERNEL_TABLE_CASES = {
    **TABLE_CASES,
    "qwen3-decode": (dict(T=128, num_decode=128, E=128, K=8), (16, 128)),
    "qwen3-mixed": (dict(T=300, num_decode=40, E=128, K=8), (16, 128)),
    "qwen3-hot-prefill": (dict(T=200, num_decode=0, E=128, K=8, routing="hot"), (16, 128)),
    "qwen3-one-token-prefill": (dict(T=1, num_decode=0, E=128, K=8), (16, 128)),
}


def table_case(spec: dict, block_m: tuple[int, int], device: str) -> dict:
    """The tile table from the Triton kernel against the torch ops, field by field."""
    s, nd, _ = spec_of(spec)
    ids_TK = make_inputs(spec, device)["ids_TK"]
    by_kernel, by_torch = (build_tiles(ids_TK, nd, s["E"], *block_m, kernel=k) for k in (True, False))
    fields = ("order_R", "counts_2E", "expert_Q", "start_Q", "rows_Q", "ends_2")
    return {
        "same": {f: torch.equal(getattr(by_kernel, f), getattr(by_torch, f)) for f in fields},
        "tiles": int(by_torch.ends_2[1]),
    }


# TMA changes how the weight tiles load, nothing else: a case per phase layout, a multi-tile expert, one token and
# the production dtype (each aligned case costs seconds under the interpreter).
TMA_CASES = ("decode-only", "prefill-only", "mixed", "hot-expert-prefill", "one-token-decode", "bf16-mixed")


def kernel_results(device: str) -> dict[str, dict]:
    results = {f"kernel/{name}": kernel_case(spec, device) for name, spec in KERNEL_CASES.items()}
    results["heights"] = default_heights(KERNEL_CASES["hot-expert-wide-decode"], device)
    return results


def table_results(device: str) -> dict[str, dict]:
    results = {f"table/{name}": table_case(spec, m, device) for name, (spec, m) in KERNEL_TABLE_CASES.items()}
    results["combine"] = combine_case(device)
    return results


def tma_results(device: str) -> dict[str, dict]:
    """The TMA cases, where TMA runs (none elsewhere)."""
    if not tma_runs_on(device):
        return {}
    results = {f"kernel-tma/{name}": kernel_case(KERNEL_CASES[name], device, tma=True) for name in TMA_CASES}
    mixed = PREEMPT_CASES["mixed"]
    tma_spec = dict(mixed, blocks=dict(mixed["blocks"], tma=True))  # a resume keeps the launch's tma
    results["preempt-before/mixed-tma"] = preempt_before_launch(tma_spec, device)
    results["preempt-mid/mixed-tma"] = preempt_mid_launch(tma_spec, device)
    return results


def preempt_results(device: str) -> dict[str, dict]:
    results = {
        f"preempt-before/{name}": preempt_before_launch(spec, device) for name, spec in PREEMPT_CASES.items()
    }
    for name in ("mixed", "mixed-default-blocks"):
        results[f"preempt-heeding/{name}"] = preempt_heeding_programs(PREEMPT_CASES[name], device)
        results[f"preempt-mid/{name}"] = preempt_mid_launch(PREEMPT_CASES[name], device)
        results[f"flag-cleared/{name}"] = flag_cleared_between_phases(PREEMPT_CASES[name], device)
    if device == "cpu":  # the flag is raised by a hook in the interpreter
        results["preempt-mid-item"] = preempt_mid_item(PREEMPT_CASES["mixed"], device)
    return results


# The cases in groups: the GPU test runs one group per test, so that processes can compile them side by side (a
# fresh machine's Triton compiles took 258 s for all of them in one process).
GROUPS = {"kernels": kernel_results, "tables": table_results, "tma": tma_results, "preempt": preempt_results}


def default_heights(spec: dict, device: str) -> dict:
    """The decode tiles' default height of a decode pass of S or more tokens (wide) and of fewer (the pass's first
    S - 1 tokens), and of a phase cut with fewer than S decode tokens; the wide pass's rows against the same pass
    in 16-row tiles."""
    _, nd, _ = spec_of(spec)
    inputs = make_inputs(spec, device)
    narrow = {name: x[: nd // 2] if name in ROW_INPUTS else x for name, x in inputs.items()}
    wide = persistent_moe_run(**inputs, num_decode=nd)
    return {
        "wide": wide.tiles.block_m_decode,
        "wide_tiles": int(wide.tiles.ends_2[0]),
        "narrow": persistent_moe_run(**narrow, num_decode=nd // 2).tiles.block_m_decode,
        "phase_cut": persistent_moe_run(**inputs, num_decode=nd // 2).tiles.block_m_decode,
        "vs_16_rows": rel_err(
            wide.out_TH.float(), persistent_moe(**inputs, num_decode=nd, block_m_decode=16).float()
        ),
    }


# ----------------------------------------------------------------------------------------------- checks
def check_kernel(result: dict, spec: dict) -> None:
    tol = 2e-2 if spec.get("dtype") == "bfloat16" else 1e-5
    assert result["max_err"] <= tol, result
    assert result["grid_invariant"] and result["dtype_ok"], result


def check_preempt_before(result: dict) -> None:
    assert result["decode_err"] <= 1e-5, result
    assert result["undone"] == result["prefill_tiles"], result
    assert result["decode_items_done"] and result["prefill_items_done"] == 0, result
    assert result["reflagged_unchanged"], result
    assert result["resumed_equals_full"] and result["resumed_undone"] == 0, result
    assert result["resumed_err"] <= 1e-5 and result["zero_flag_equals_full"], result


def check_preempt_mid(result: dict, exact: bool) -> None:
    pre = result["prefill_tiles"]
    assert pre >= 3, result  # the case must have prefill tiles left after the two that run
    assert result["a_stop_decode_err"] <= 1e-5, result
    assert result["b_stop_undone"] == result["b_stop_undone_from_masks"], result
    assert result["resumed_equals_full"] and result["resumed_undone"] == 0, result
    if exact:  # the interpreter: one program, in order, sees its own writes at once
        assert result["a_stop_prefill_items_a"] == 2 and result["a_stop_undone"] == pre, result
        assert result["b_stop_prefill_items_a"] == pre and result["b_stop_undone"] == pre - 2, result
    else:
        assert 0 <= result["b_stop_undone"] <= pre, result


def check_flag_cleared(result: dict, exact: bool) -> None:
    assert result["y_finite"], result  # no B item read an act row that A did not write
    if exact:
        assert result["undone"] == result["prefill_tiles"] - 2, result
    else:  # phase A did at least the two tiles before the flag rose, B exactly those A completed
        assert 0 <= result["undone"] <= result["prefill_tiles"] - 2, result
    assert result["resumed_equals_full"], result


# ------------------------------------------------------------------------------- Triton, interpreted on CPU
@pytest.fixture(scope="module")
def interpreted_groups() -> dict[str, dict[str, dict]]:
    return interpreter_results(__file__)


@pytest.fixture(scope="module")
def interpreted(interpreted_groups) -> dict[str, dict]:
    return {key: result for results in interpreted_groups.values() for key, result in results.items()}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_interpreted_kernels_equal_reference(interpreted, name):
    check_kernel(interpreted[f"kernel/{name}"], KERNEL_CASES[name])


@pytest.mark.parametrize("name", list(PREEMPT_CASES))
def test_interpreted_preempt_before_launch_then_resume(interpreted, name):
    check_preempt_before(interpreted[f"preempt-before/{name}"])


@pytest.mark.parametrize("name", ["mixed", "mixed-default-blocks"])
def test_interpreted_preempt_mid_launch_then_resume(interpreted, name):
    check_preempt_heeding(interpreted[f"preempt-heeding/{name}"])
    check_preempt_mid(interpreted[f"preempt-mid/{name}"], exact=True)
    check_flag_cleared(interpreted[f"flag-cleared/{name}"], exact=True)


def test_interpreted_preempt_within_an_item_gives_it_up_unstored(interpreted):
    result = interpreted["preempt-mid-item"]
    slices = result["reads_per_item"]
    for k, got in result["by_read"].items():
        assert got["done"] == (int(k) - 1) // slices, (k, got)  # the item read mid-way is given up
        assert got["done_is_a_prefix"] and got["stored_exactly_done"], (k, got)
        assert got["resumed_equals_full"], (k, got)


def test_interpreted_combine_leaves_a_preempted_runs_prefill_rows(interpreted):
    check_combine(interpreted["combine"])


def check_table(results: dict) -> None:
    for name in KERNEL_TABLE_CASES:
        result = results[f"table/{name}"]
        assert all(result["same"].values()) and result["tiles"] > 0, (name, result)


def test_interpreted_tile_table_kernel_equals_the_torch_ops(interpreted):
    check_table(interpreted)


def check_heights(result: dict, exact: bool) -> None:
    assert result["wide"] == 32 and result["narrow"] == result["phase_cut"] == 16, result
    # the hot expert's 48 pairs in two tiles, the other three experts' 48 pairs in one each
    assert result["wide_tiles"] == 5, result
    assert result["vs_16_rows"] <= (1e-6 if exact else 0.0), result


def test_interpreted_decode_tiles_widen_from_s_tokens(interpreted):
    check_heights(interpreted["heights"], exact=True)


def test_a_pass_all_in_wide_decode_tiles_takes_their_launch_options():
    assert launch_options(256, 256, 32) == WIDE_DECODE_LAUNCH != LAUNCH
    assert (
        launch_options(256, 256, 16) == launch_options(256, 200, 32) == launch_options(256, 0, 16) == LAUNCH
    )


def check_tma(results: dict, exact: bool) -> None:
    """The TMA cases through TMA descriptors: the reference's tolerance, grid invariance, and the per-thread
    path's values (bitwise under the interpreter, whose dot is one numpy product either way); preemption and
    resume as without TMA."""
    for name in TMA_CASES:
        result = results[f"kernel-tma/{name}"]
        check_kernel(result, KERNEL_CASES[name])
        assert result["vs_loads"] <= (0.0 if exact else 2e-2), (name, result)
    check_preempt_before(results["preempt-before/mixed-tma"])
    check_preempt_mid(results["preempt-mid/mixed-tma"], exact=exact)


def test_interpreted_tma_descriptors_equal_the_loads_path(interpreted):
    assert all(tma_fits(KERNEL_CASES[name]) for name in TMA_CASES)
    check_tma(interpreted, exact=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable")
def test_tma_refuses_unaligned_weights():
    spec = KERNEL_CASES["odd-h37-f21-small-blocks"]
    inputs = make_inputs(spec)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        persistent_moe(**inputs, num_decode=spec["num_decode"], tma=True, **spec["blocks"])


# ------------------------------------------------------------------------------------------- compiled, CUDA
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="needs a CUDA device and Triton"
)


def check_kernels(results: dict, exact: bool) -> None:
    for name, spec in KERNEL_CASES.items():
        check_kernel(results[f"kernel/{name}"], spec)
    check_heights(results["heights"], exact=exact)


def check_tables(results: dict, exact: bool) -> None:
    check_table(results)
    check_combine(results["combine"])


def check_tma_where_it_ran(results: dict, exact: bool) -> None:
    if results:
        check_tma(results, exact=exact)


def check_preempts(results: dict, exact: bool) -> None:
    for name in PREEMPT_CASES:
        check_preempt_before(results[f"preempt-before/{name}"])
    for name in ("mixed", "mixed-default-blocks"):
        check_preempt_heeding(results[f"preempt-heeding/{name}"])
        check_preempt_mid(results[f"preempt-mid/{name}"], exact=exact)
        check_flag_cleared(results[f"flag-cleared/{name}"], exact=exact)


# what the GPU test asserts of each group (exact: the interpreter's one program, in order)
CHECKS = {
    "kernels": check_kernels,
    "tables": check_tables,
    "tma": check_tma_where_it_ran,
    "preempt": check_preempts,
}


def test_the_gpu_tests_checks_hold_for_the_interpreters_results(interpreted_groups):
    """Every group's checks as the GPU test makes them (not exact), each over its own group's results under the
    interpreter: a check that read a key its group does not write fails here, not first on a GPU."""
    assert set(CHECKS) == set(GROUPS) == set(interpreted_groups)
    for group, check in CHECKS.items():
        check(interpreted_groups[group], exact=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("group", GROUPS)
def test_compiled_cases_on_cuda(group):
    if group == "tma" and not tma_runs_on("cuda"):
        pytest.skip("TMA does not run on this GPU")
    CHECKS[group](GROUPS[group]("cuda"), exact=False)


REALISTIC = dict(T=256, num_decode=192, H=1024, F=768, E=64, K=8, dtype="bfloat16")


@pytest.mark.gpu
@needs_cuda
def test_compiled_bf16_step_of_realistic_shape():
    result = kernel_case(REALISTIC, "cuda")
    check_kernel(result, REALISTIC)


@pytest.mark.gpu
@needs_cuda
def test_captured_launch_reads_routing_and_flag_from_the_device():
    """One captured graph (tiles, both phases, the combine), replayed after new routing was copied into its input
    tensors: with the flag down it equals the reference, with the flag up the decode rows do, every prefill
    tile is reported undone and the prefill rows keep what the last replay wrote."""
    inputs = make_inputs(REALISTIC, "cuda")
    nd = REALISTIC["num_decode"]
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    call = lambda: persistent_moe_run(**inputs, num_decode=nd, preempt_flag=flag)  # noqa: E731
    call()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run = call()
    fresh = make_inputs(REALISTIC, "cuda", seed=1)
    inputs["ids_TK"].copy_(fresh["ids_TK"])
    inputs["weights_TK"].copy_(fresh["weights_TK"])
    graph.replay()
    want_TH = fp32_reference(inputs)
    assert rel_err(run.out_TH.float(), want_TH) <= 2e-2 and int(run.undone) == 0
    before_TH = run.out_TH.clone()
    run.out_TH[:nd] = float("nan")
    flag.fill_(1)
    graph.replay()
    pre = int(tile_counts(run.tiles)[1])
    assert pre > 0 and int(run.undone) == pre
    assert rel_err(run.out_TH[:nd].float(), want_TH[:nd]) <= 2e-2
    assert torch.equal(run.out_TH[nd:], before_TH[nd:])


@pytest.mark.gpu
@needs_cuda
def test_rows_are_batch_invariant():
    """A row's output is bitwise the same whatever shares the launch: decode rows alone, with more decode rows,
    and with a prefill phase behind them; prefill rows alone and behind a decode phase (each phase's tile shape
    is fixed, and a tile's rows do not mix in the MMA or the fp32 k-sum); and whichever tile height and launch
    options hold them (the engine cuts small prefill segments into decode tiles, and from S = 128 tokens here
    decode tiles are 32 rows at 4 warps: rollout.kernels.tiling)."""
    spec = dict(REALISTIC, T=320, num_decode=96)
    inputs = make_inputs(spec, "cuda")

    def launch(sl: slice, num_decode: int, **blocks) -> torch.Tensor:
        part = {name: x[sl] if name in ROW_INPUTS else x for name, x in inputs.items()}
        return persistent_moe(**part, num_decode=num_decode, **blocks)

    full_TH = launch(slice(None), 96)
    assert torch.equal(launch(slice(0, 16), 16), full_TH[:16])
    assert torch.equal(launch(slice(0, 96), 96), full_TH[:96])
    assert torch.equal(launch(slice(96, None), 0), full_TH[96:])
    assert torch.equal(launch(slice(40, None), 56), full_TH[40:])
    assert torch.equal(launch(slice(None), 320), full_TH)  # every row in (wide) decode tiles
    assert torch.equal(launch(slice(None), 320, block_m_decode=16), full_TH)  # ... in 16-row tiles
    assert torch.equal(launch(slice(96, None), 224), full_TH[96:])
    assert torch.equal(launch(slice(0, 96), 0), full_TH[:96])  # decode rows in prefill tiles


if __name__ == "__main__":
    print(json.dumps({group: results("cpu") for group, results in GROUPS.items()}))
