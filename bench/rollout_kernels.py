"""Kernel-level alternatives for one decode step of a Qwen3-30B-A3B-shaped layer (what the engine should use).

    python bench/rollout_kernels.py --json bench/out/rollout_kernels.json   # H200
    python bench/rollout_kernels.py --tiny                                  # CPU smoke run of every variant

Each variant is captured `--inner` times in one CUDA graph (so launch overhead is what a replayed decode graph
pays), replayed `--repeats` times, timed with CUDA events; the table shows the median per call in microseconds
and, for bandwidth-bound ops, the fraction of `--bandwidth` that its bytes imply. Variants:
- experts: gate_up and down grouped GEMMs of B tokens x top-k (uniform random routing), weights [E, 2F, H] read
  transposed (the engine's layout), weights stored [E, H, 2F], and a dense bmm with every expert padded to a
  fixed number of rows (what a capacity-padded path would cost).
- sort: stable sort of the B*K expert ids as int64 / int32 / int16 keys (+ searchsorted for the group offsets).
- attention: masked SDPA over [B, M, S, D] views of a contiguous cache vs FlashAttention-2 varlen with
  seqused_k, per q head or with the G q heads of a kv head folded into the query length, vs the engine's Triton
  paged decode kernel (the same keys in shuffled blocks of 16 positions, split-K as the engine picks it), and
  the kernel at one cache block's keys, the engine's key tile and each of `--key-tiles` keys per loop step
  (tiles spanning cache blocks), each with split-K sized for each of `--split-waves` waves of programs.
- prefill attention (once): one chunk of `--prefill-chunk` tokens of a sequence with `--prefill-context`
  positions cached before it, causal: FlashAttention-2 varlen over a contiguous cache (SDPA with the same mask
  off CUDA) vs the engine's Triton prefill kernel over shuffled blocks of 16 (CUDA, or `--tiny` under Triton's
  interpreter), at one cache block's keys, the engine's key tile and each of `--key-tiles`; reported with the
  attention TFLOP/s (4 x chunk x (context + chunk / 2) x heads x head_dim flops) and the largest difference to
  the first variant.
- sample: the sampler on [B, V] bf16 logits, with and without the top-k/top-p sort.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is imported: before rollout's imports

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_decode import add_bandwidth_arg, int_list, resolve_bandwidth

from rollout.kernels.persistent_moe import triton_runs_on
from rollout.sampling import counter_uniform_torch, sample

FULL = dict(hidden=2048, ffn=768, experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128, vocab=151936)
TINY = dict(hidden=64, ffn=32, experts=16, top_k=4, heads=4, kv_heads=2, head_dim=16, vocab=512)


def timed(fn, device: torch.device, inner: int, repeats: int) -> float:
    """Median microseconds per call of fn (graph-captured `inner` times on CUDA)."""
    if device.type != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return 1e6 * (time.perf_counter() - t0) / repeats
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / inner)
    return statistics.median(times)


def routed(c: dict, batch: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(batch)
    scores = torch.rand(batch, c["experts"], generator=gen)
    return scores.topk(c["top_k"], dim=-1).indices.to(device)


def bench_experts(c, batch, device, dtype, args) -> list[dict]:
    h, f, e = c["hidden"], c["ffn"], c["experts"]
    ids_TK = routed(c, batch, device)
    sorted_R, _ = torch.sort(ids_TK.reshape(-1), stable=True)
    offs_E = torch.searchsorted(sorted_R, torch.arange(e, device=device), right=True, out_int32=True)
    x_RH = torch.randn(batch * c["top_k"], h, device=device, dtype=dtype)
    gate_up_EFH = torch.randn(e, 2 * f, h, device=device, dtype=dtype) * 0.02
    down_EHF = torch.randn(e, h, f, device=device, dtype=dtype) * 0.02
    gate_up_EHF = gate_up_EFH.transpose(1, 2).contiguous()
    down_EFH = down_EHF.transpose(1, 2).contiguous()
    act_RF = torch.randn(batch * c["top_k"], f, device=device, dtype=dtype)
    element = torch.empty((), dtype=dtype).element_size()
    touched = len(torch.unique(ids_TK))
    variants = {
        "gate_up [E,2F,H]^T": (
            lambda: torch._grouped_mm(x_RH, gate_up_EFH.transpose(1, 2), offs=offs_E),
            2 * f,
        ),
        "gate_up [E,H,2F]": (lambda: torch._grouped_mm(x_RH, gate_up_EHF, offs=offs_E), 2 * f),
        "down [E,H,F]^T": (lambda: torch._grouped_mm(act_RF, down_EHF.transpose(1, 2), offs=offs_E), f),
        "down [E,F,H]": (lambda: torch._grouped_mm(act_RF, down_EFH, offs=offs_E), f),
    }
    for cap in (16, 32, 64):  # a dense padded alternative: every expert gets `cap` token rows (bmm)
        x_ECH = torch.randn(e, cap, h, device=device, dtype=dtype)
        a_ECF = torch.randn(e, cap, f, device=device, dtype=dtype)
        variants[f"gate_up bmm pad {cap}"] = (
            lambda x=x_ECH: torch.bmm(x, gate_up_EFH.transpose(1, 2)),
            2 * f,
        )
        variants[f"down bmm pad {cap}"] = (lambda a=a_ECF: torch.bmm(a, down_EHF.transpose(1, 2)), f)
    reference = {
        2 * f: variants["gate_up [E,2F,H]^T"][0]().float(),
        f: variants["down [E,H,F]^T"][0]().float(),
    }
    rows = []
    for name, (fn, width) in variants.items():
        row = {"section": "experts", "batch": batch, "variant": name}
        try:
            out = fn().float()
            if "bmm" not in name:
                row["max_abs_diff"] = float((out - reference[width]).abs().max())
            us = timed(fn, device, args.inner, args.repeats)
            row.update(us=us, bw_fraction=touched * width * h * element / (us * 1e-6) / args.bandwidth)
        except Exception as err:  # a variant this build cannot run is recorded, not fatal
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
    return rows


def bench_sort(c, batch, device, args) -> list[dict]:
    ids_R = routed(c, batch, device).reshape(-1)
    rows = []
    for dtype in (torch.int64, torch.int32, torch.int16):
        experts_E = torch.arange(c["experts"], device=device, dtype=dtype)

        def fn(dtype=dtype, experts_E=experts_E):
            sorted_R, _ = torch.sort(ids_R.to(dtype), stable=True)
            return torch.searchsorted(sorted_R, experts_E, right=True, out_int32=True)

        rows.append(
            {
                "section": "sort",
                "batch": batch,
                "variant": str(dtype),
                "us": timed(fn, device, args.inner, args.repeats),
            }
        )
    return rows


def bench_attention(c, batch, device, dtype, args) -> list[dict]:
    m, d, n = c["kv_heads"], c["head_dim"], c["heads"]
    max_len, keys = args.max_model_len, args.keys
    k_SPMD = torch.randn(batch, max_len, m, d, device=device, dtype=dtype)
    v_SPMD = torch.randn_like(k_SPMD)
    q_BND = torch.randn(batch, n, d, device=device, dtype=dtype)
    pos_B = torch.randint(keys // 2, keys, (batch,), device=device)
    mask = torch.zeros(batch, 1, 1, keys, device=device, dtype=dtype).masked_fill_(
        (torch.arange(keys, device=device)[None] > pos_B[:, None]).view(batch, 1, 1, keys), float("-inf")
    )
    starts = torch.arange(batch + 1, device=device, dtype=torch.int32)
    used = (pos_B + 1).to(torch.int32)
    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * int(used.sum()) * m * d * element

    def sdpa():
        return F.scaled_dot_product_attention(
            q_BND.view(batch, m, n // m, d),
            k_SPMD[:, :keys].transpose(1, 2),
            v_SPMD[:, :keys].transpose(1, 2),
            attn_mask=mask,
            scale=d**-0.5,
        )

    def flash_call(q_xMD, q_starts, max_q):
        """FlashAttention-2 varlen over the cache in place: query rows by q_starts, each row's keys by seqused_k."""
        return torch.ops.aten._flash_attention_forward(
            q_xMD,
            k_SPMD.view(-1, m, d),
            v_SPMD.view(-1, m, d),
            q_starts,
            starts * max_len,
            max_q,
            keys,
            0.0,
            False,
            False,
            scale=d**-0.5,
            seqused_k=used,
        )[0]

    g = n // m

    def flash():
        return flash_call(q_BND, starts, 1)

    def flash_folded():  # the engine's form: the G q heads of a kv head as G query rows
        q_XMD = q_BND.view(batch, m, g, d).transpose(1, 2).reshape(-1, m, d)
        out = flash_call(q_XMD, starts * g, g)
        return out.view(batch, g, m, d).transpose(1, 2).reshape(batch, n * d)

    variants = [
        ("sdpa masked", sdpa),
        ("flash varlen seqused_k", flash),
        ("flash varlen GQA folded", flash_folded),
    ]
    if triton_runs_on(device):
        from rollout.paged_attention import DECODE_KEY_TILE, DECODE_WAVES

        cache = shuffled_blocks(k_SPMD, v_SPMD, 16)
        for tile in dict.fromkeys([None, DECODE_KEY_TILE, *args.key_tiles]):
            for waves in args.split_waves:
                per_step = "block" if tile is None else tile
                engine = " (engine)" if (tile, waves) == (DECODE_KEY_TILE, DECODE_WAVES) else ""
                name = f"triton paged, {per_step} keys per step, {waves} waves{engine}"
                variants.append((name, paged_decode(cache, q_BND, pos_B, device, 16, tile, waves)))
    want = sdpa().reshape(batch, n, d).float()  # [B, M, G, D]: head m G + g, the engine's order
    rows = []
    for name, fn in variants:
        row = {"section": "attention", "batch": batch, "variant": name}
        try:
            if name.startswith("triton"):
                row["max_abs_diff"] = float((fn().float() - want).abs().max())
            us = timed(fn, device, args.inner, args.repeats)
            row.update(us=us, bw_fraction=kv_bytes / (us * 1e-6) / args.bandwidth)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
    return rows


def shuffled_blocks(k_SPMD, v_SPMD, block: int):
    """(K, V as flat cache rows, block table [S, ceil(P / block)]): each sequence's positions in blocks of
    `block`, block ids shuffled (a cache after many admissions and releases); block 0 is the engine's null
    block."""
    batch, max_len, m, d = k_SPMD.shape
    per_seq = -(-max_len // block)
    order = torch.randperm(batch * per_seq, device=k_SPMD.device) + 1
    table_RB = order.view(batch, per_seq).to(torch.int32)
    k_XMD = torch.zeros((batch * per_seq + 1) * block, m, d, device=k_SPMD.device, dtype=k_SPMD.dtype)
    v_XMD = torch.zeros_like(k_XMD)
    rows = (table_RB.long()[:, :, None] * block + torch.arange(block, device=k_SPMD.device)).reshape(
        batch, -1
    )[:, :max_len]
    k_XMD[rows.reshape(-1)] = k_SPMD.reshape(-1, m, d)
    v_XMD[rows.reshape(-1)] = v_SPMD.reshape(-1, m, d)
    return k_XMD, v_XMD, table_RB


def paged_decode(cache: tuple, q_BND, pos_B, device, block: int, key_tile: int | None, waves: int):
    """The engine's decode attention over `cache` (`shuffled_blocks`' K, V and block table, blocks of `block`
    positions) with `key_tile` keys per loop step (None: one block's) and split-K for `waves` waves of programs."""
    from rollout.paged_attention import AttentionBatch, decode_splits, paged_attention_triton

    k_XMD, v_XMD, table_RB = cache
    batch, m, d = q_BND.shape[0], k_XMD.shape[1], k_XMD.shape[2]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    attention = AttentionBatch(
        seq_T=torch.arange(batch, device=device, dtype=torch.int32),
        pos_T=pos_B.to(torch.int32),
        num_decode=batch,
        tile_start_Q=torch.zeros(0, device=device, dtype=torch.int32),
        tile_len_Q=torch.zeros(0, device=device, dtype=torch.int32),
        num_splits=decode_splits(batch, m, sms, waves=waves),
    )
    return lambda: paged_attention_triton(
        q_BND, k_XMD, v_XMD, table_RB, attention, block, d**-0.5, decode_key_tile=key_tile
    )


def bench_prefill_attention(c, device, dtype, args) -> list[dict]:
    """One causal chunk after a cached context: FlashAttention-2 over a contiguous cache vs the Triton prefill
    kernel over shuffled blocks of 16 (default key tile and --key-tiles)."""
    from rollout.paged_attention import (
        PREFILL_KEY_TILE,
        AttentionBatch,
        paged_attention_triton,
        prefill_tile_tokens,
        prefill_tiles,
    )

    n, m, d = c["heads"], c["kv_heads"], c["head_dim"]
    chunk, context = args.prefill_chunk, args.prefill_context
    total = context + chunk
    k_SPMD = torch.randn(1, total, m, d, device=device, dtype=dtype)
    v_SPMD = torch.randn_like(k_SPMD)
    q_TND = torch.randn(chunk, n, d, device=device, dtype=dtype)
    cu_q = torch.tensor([0, chunk], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, total], device=device, dtype=torch.int32)

    def flash():
        return torch.ops.aten._flash_attention_forward(
            q_TND, k_SPMD[0], v_SPMD[0], cu_q, cu_k, chunk, total, 0.0, True, False, scale=d**-0.5
        )[0]

    def sdpa():  # the same attention off CUDA: query i sees keys 0..context + i
        seen_TS = (
            torch.arange(total, device=device)[None] <= context + torch.arange(chunk, device=device)[:, None]
        )
        k_NSD, v_NSD = (x[0].repeat_interleave(n // m, 1).transpose(0, 1) for x in (k_SPMD, v_SPMD))
        out_NTD = F.scaled_dot_product_attention(
            q_TND.transpose(0, 1), k_NSD, v_NSD, attn_mask=seen_TS, scale=d**-0.5
        )
        return out_NTD.transpose(0, 1)

    block = 16
    k_XMD, v_XMD, table_RB = shuffled_blocks(k_SPMD, v_SPMD, block)
    starts, lengths = prefill_tiles([(0, chunk)], prefill_tile_tokens(n, m))
    ints = lambda xs: torch.tensor(xs, device=device, dtype=torch.int32)  # noqa: E731
    attention = AttentionBatch(
        seq_T=torch.zeros(chunk, device=device, dtype=torch.int32),
        pos_T=torch.arange(context, total, device=device, dtype=torch.int32),
        num_decode=0,
        tile_start_Q=ints(starts),
        tile_len_Q=ints(lengths),
        num_splits=1,
    )

    def paged(tile):
        return lambda: paged_attention_triton(
            q_TND, k_XMD, v_XMD, table_RB, attention, block, d**-0.5, prefill_key_tile=tile
        )

    first = ("flash varlen causal (contiguous)", flash) if device.type == "cuda" else ("sdpa masked", sdpa)
    want = first[1]().float()
    flops = 4 * chunk * (context + chunk / 2) * n * d
    variants = [first]
    for tile in dict.fromkeys([None, PREFILL_KEY_TILE, *args.key_tiles]):
        engine = " (engine)" if tile == PREFILL_KEY_TILE else ""
        variants.append((f"triton paged, {tile or 'block'} keys per step{engine}", paged(tile)))
    rows = []
    for name, fn in variants:
        row = {"section": "prefill attention", "batch": chunk, "context": context, "variant": name}
        try:
            row["max_abs_diff"] = float((fn().float() - want).abs().max())
            row["us"] = timed(fn, device, max(1, args.inner // 16), args.repeats)
            row["tflops"] = flops / (row["us"] * 1e-6) / 1e12
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        rows.append(row)
    return rows


def bench_sample(c, batch, device, dtype, args) -> list[dict]:
    logits_BV = torch.randn(batch, c["vocab"], device=device, dtype=dtype)
    temperature_B = torch.ones(batch, device=device)
    top_k_B = torch.full((batch,), 50, device=device, dtype=torch.long)
    top_p_B = torch.full((batch,), 0.9, device=device)
    seeds_B = torch.arange(batch, device=device)
    pos_B = torch.full((batch,), 100, device=device)
    rows = []
    for filtered in (False, True):

        def fn(filtered=filtered):
            u = counter_uniform_torch(seeds_B, pos_B + 1)
            return sample(logits_BV, temperature_B, top_k_B, top_p_B, u, filtered)

        us = timed(fn, device, max(1, args.inner // 8), args.repeats)
        rows.append({"section": "sample", "batch": batch, "variant": f"filtered={filtered}", "us": us})
    return rows


def run_section(fn, batch: int, *fn_args) -> list[dict]:
    """fn(*fn_args)'s rows, or one row naming its error (the other sections still run)."""
    try:
        return fn(*fn_args)
    except Exception as err:
        traceback.print_exc()
        return [{"batch": batch, "section": fn.__name__, "error": f"{type(err).__name__}: {err}"}]


def write_json(args, rows: list[dict]) -> None:
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "torch": torch.__version__, "rows": rows}, indent=2)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int_list, default=[1, 32, 256])
    ap.add_argument("--keys", type=int, default=192, help="attended length bucket")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--inner", type=int, default=48, help="calls per captured graph")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--key-tiles", type=int_list, default=[32, 64, 128], help="Triton attention keys per step"
    )
    ap.add_argument(
        "--split-waves", type=int_list, default=[2, 8], help="decode: split-K for this many waves of programs"
    )
    ap.add_argument("--prefill-chunk", type=int, default=2048, help="prefill attention: tokens of the chunk")
    ap.add_argument("--prefill-context", type=int, default=8192, help="... and positions cached before it")
    add_bandwidth_arg(ap)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", default="bench/out/rollout_kernels.json")
    if ap.parse_known_args()[0].tiny:  # the interpreter runs the Triton variants: a few tokens only
        ap.set_defaults(
            batches=[8], keys=48, max_model_len=64, prefill_chunk=20, prefill_context=40, key_tiles=[64]
        )
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    resolve_bandwidth(args, device)
    c = TINY if args.tiny else FULL
    rows: list[dict] = []
    sections = [(fn, batch, extra) for batch in args.batches for fn, extra in (
        (bench_experts, (dtype,)), (bench_sort, ()), (bench_attention, (dtype,)), (bench_sample, (dtype,))
    )]  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for fn, batch, extra in sections:
            rows += run_section(fn, batch, c, batch, device, *extra, args)
            write_json(args, rows)  # after every section: a call cut by its time limit keeps what ran
        if triton_runs_on(device):
            rows += run_section(bench_prefill_attention, 0, c, device, dtype, args)
            write_json(args, rows)
    print(
        "| section | batch | variant | us | of bandwidth (TFLOP/s) | max abs diff |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        bw = f"{100 * r['bw_fraction']:.0f}%" if "bw_fraction" in r else "-"
        bw = f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else bw
        us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80]
        diff = f"{r['max_abs_diff']:.2g}" if "max_abs_diff" in r else "-"
        print(f"| {r.get('section', '-')} | {r['batch']} | {r.get('variant', '-')} | {us} | {bw} | {diff} |")


if __name__ == "__main__":
    main()
