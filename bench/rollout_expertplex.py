"""The persistent MoE kernel (ExpertPlex, issue #29) against the engine's grouped and padded expert paths, and the
paper's section 7.3 experiment: a decode pass that arrives while a long prefill pass runs on the same GPU.

    python bench/rollout_expertplex.py --json bench/out/rollout_expertplex.json   # one GPU, bf16
    python bench/rollout_expertplex.py --tiny     # CPU smoke run: toy shapes, the Triton interpreter

Shapes: one MoE layer of Qwen3-30B-A3B (hidden 2048, 128 experts top-8, expert FFN 768), random bf16 weights,
router weights from a softmax over random logits. `--tiny`: hidden 64, 8 experts top-2, FFN 32, fp32.

Section `paths`: one layer's experts for decode-only passes (`--decode-tokens`) and prefill-only passes
(`--prefill-tokens`): grouped (two torch._grouped_mm over the pairs sorted by expert), padded (dense bmm over a
fixed number of rows per expert plus grouped GEMMs over the overflow, where its rule applies) and persistent
(rollout.kernels.persistent_moe). Time = median over `--repeats` of CUDA-event time of one CUDA graph replay
of the pass (as the engine runs it) after `--warmup` replays (wall time on the CPU); the largest difference to
the fp32 reference (`moe_reference`) is reported too.

Section `mixed`: a mixed step's experts, D decode rows and P prefill tokens in one pass, for every `--mixed`
D:P, against the D decode rows alone (what a mixed step adds to a decode step's MoE time): the persistent
kernel cut by phase (decode tiles of 16 rows, prefill tiles of 128: an expert both phases use is read by two
tiles; the cut of a preemptible prefill, whose decode tiles run first), the same pass with all D + P tokens in
decode tiles (num_decode = D + P: the engine's cut for P up to rollout.kernels.tiling's S = 16 E / K tokens), the
same pass with all of them in prefill tiles (num_decode = 0: the engine's cut for P over S; each expert's pairs
read its weights once, in 128-row tiles), `same_bits` recording whether rows come out bitwise as in the phase
cut, and the grouped and padded paths (one pass over the pairs per expert, whatever their phase).

Section `sweep`: the persistent kernel's launch parameters for one decode pass (`--sweep-decode` tokens) and one
prefill pass (`--sweep-prefill`): programs per SM (`--sweep-programs`: the persistent grid is that many times the
SM count; more than one resident program per SM hides more memory latency), blocks (`--sweep-decode-blocks`,
`--sweep-prefill-blocks`: block_m of the pass's phase, block_n, block_k), warps, pipeline stages and weight loads
(`--sweep-tma`: TMA descriptors or per-thread loads; the paths section then adds a persistent_tma row). Every
configuration and the grouped path are timed as one CUDA graph of the whole call (tile table, both launches,
combine: as the engine replays a step), so the host's launches are not timed; decode rows report the fraction of
the copy bandwidth that reading the experts the pass routes to takes, prefill rows the fraction of the grouped
path's throughput. Configurations that fail to compile (shared memory) are listed with their error.

Section `arrival` (CUDA only; section 7.3 of the paper): a prefill pass of `--arrival-prefill` tokens starts on a
low-priority stream; a decode pass of `--arrival-decode` tokens is launched `--arrival-delay-us` later on a
high-priority stream. Every pass is a CUDA graph replay, alone or together (the GPU's scheduling is measured,
not the host's launches). Reported: the decode pass's latency (its launch to its end) and the prefill pass's
time, each over its time alone:
- streams: both passes on the grouped path; the GPU's stream priorities are the only scheduling.
- persistent: the prefill pass is a persistent launch with a preemption flag; the decode pass raises the flag
  on its stream (a copy from pinned memory: a kernel would wait for an SM the prefill's programs hold) and runs,
  then the resume lowers the flag and relaunches the prefill's left tiles (`persistent_moe_run(resume=...)`).
  One row per `--arrival-slices` n: the prefill's phase-A items read the flag between n slices of their
  reduction and give themselves up when it is up, so the decode pass waits for a slice of the items in flight
  (one per resident program), not whole items.
- coresident: both passes persistent, each launched with `--arrival-programs-per-sm` programs per SM (1: half the
  default grid) and no flag, so the GPU can place the decode pass's programs beside the running prefill
  programs on the same SMs: decode reads weights (memory-bound) while prefill multiplies (compute-bound), the
  overlap ExpertPlex's kernel gets from one launch.
- split: as persistent, but only the first `--arrival-heeding` of the prefill's programs (a fraction of the
  default grid; 0.5: one of the two per SM) heed the flag, and the decode pass runs on that many programs in the
  slots they leave while the others go on with prefill items: the GPU split in space, where a whole stop runs the
  two passes one after the other (the prefill then slows by at least the decode pass's time over its own).
Slowdowns are over each pass alone at the default grid. Beside them, the persistent decode pass alone after
raising a flag (`decode_flag_raised_us`): the part of its latency that the flag's copy costs. Each mode
also records one more arrival under the profiler (`timeline`: every kernel and copy of both streams, with its
start and end), printed for the persistent rows: what the decode pass waits for.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is imported: before rollout's imports

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollout_decode import QWEN3_30B_A3B, TINY, add_bandwidth_arg, int_list, median_ms, resolve_bandwidth

from rollout import RolloutEngine
from rollout.config import RolloutConfig
from rollout.kernels.persistent_moe import (
    PREEMPT_SLICES,
    PROGRAMS_PER_SM,
    MoeRun,
    moe_reference,
    persistent_moe_run,
    tma_runs_on,
)
from rollout.model import no_padding, padded_capacity

TINY_MOE = dict(TINY, num_hidden_layers=1, hidden_size=64, num_experts=8, num_experts_per_tok=2)
TINY_ARGS = dict(
    device="cpu",
    dtype="float32",
    decode_tokens=[4],
    prefill_tokens=[24],
    repeats=2,
    warmup=1,
    sections=["paths", "mixed", "sweep"],
    mixed=[(4, 2), (4, 12)],
    sweep_decode=4,
    sweep_prefill=24,
    sweep_programs=[1, 2],
    sweep_decode_blocks=[(16, 16, 16)],
    sweep_prefill_blocks=[(16, 16, 16)],
    sweep_warps=[4],
    sweep_stages=[2],
    sweep_tma=[0, 1],
)


class Layer:
    """One MoE layer of an engine with random weights, and the step inputs of a pass of T tokens."""

    def __init__(self, cfg: dict, device: torch.device, dtype: torch.dtype) -> None:
        config = RolloutConfig(
            max_model_len=64, max_batch_size=1, kv_cache_tokens=64, cuda_graphs=False, expert_kernel="grouped"
        )  # the model's own paths (grouped, padded); the persistent kernel is launched directly
        self.engine = RolloutEngine.from_config(dict(cfg, num_hidden_layers=1), device, dtype, config)
        self.layer = self.engine.weights.layers[0]
        self.spec = self.engine.spec
        self.device, self.dtype = device, dtype

    def inputs(self, num_tokens: int, seed: int) -> dict:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        h_TH = torch.randn(num_tokens, self.spec.hidden_size, generator=gen).to(self.device, self.dtype)
        logits_TE = torch.randn(num_tokens, self.spec.num_experts, generator=gen).to(self.device)
        weights_TK, ids_TK = torch.topk(torch.softmax(logits_TE, -1), self.spec.top_k, dim=-1)
        residual_TH = torch.randn(num_tokens, self.spec.hidden_size, generator=gen).to(
            self.device, self.dtype
        )
        return dict(h_TH=h_TH, weights_TK=weights_TK, ids_TK=ids_TK, residual_TH=residual_TH)

    def run(self, path: str, x: dict, num_decode: int) -> torch.Tensor:
        if path in ("persistent", "persistent_tma"):
            return self.persistent(x, num_decode, tma=path == "persistent_tma").out_TH
        model = self.engine.model
        model.capacity_for = padded_capacity if path == "padded" else no_padding
        return model.experts(
            self.layer, x["h_TH"], x["weights_TK"], x["ids_TK"], x["residual_TH"], num_decode
        )

    def persistent(self, x: dict, num_decode: int, **launch) -> MoeRun:
        """The persistent kernel's run of the pass (`launch`: preempt_flag, resume)."""
        return persistent_moe_run(
            x["h_TH"], x["weights_TK"], x["ids_TK"], self.layer.gate_up_EFH, self.layer.down_EHF,
            x["residual_TH"], num_decode=num_decode, **launch,
        )  # fmt: skip

    def reference(self, x: dict) -> torch.Tensor:
        return moe_reference(
            x["h_TH"].float(), x["weights_TK"], x["ids_TK"], self.layer.gate_up_EFH.float(),
            self.layer.down_EHF.float(), x["residual_TH"].float(),
        )  # fmt: skip


def timed_us(fn, device: torch.device, repeats: int, warmup: int) -> float:
    return 1e3 * median_ms(device, fn, warmup, repeats)


# --------------------------------------------------------------------------------------------- sections
def section_paths(layer: Layer, args) -> list[dict]:
    rows = []
    passes = [("decode", t, t) for t in args.decode_tokens] + [("prefill", t, 0) for t in args.prefill_tokens]
    for phase, tokens, num_decode in passes:
        x = layer.inputs(tokens, seed=tokens)
        ref = layer.reference(x)
        for path in ("grouped", "padded", "persistent", *(["persistent_tma"] if 1 in args.sweep_tma else [])):
            if (
                path == "padded"
                and padded_capacity(tokens * layer.spec.top_k, layer.spec.num_experts) is None
            ):
                continue  # its rule sends this pass to the grouped path
            row = {"phase": phase, "tokens": tokens, "path": path}
            time_pass(layer, row, path, x, num_decode, ref, args)
            rows.append(row)
    return rows


def time_pass(layer: Layer, row: dict, path: str, x: dict, num_decode: int, ref, args) -> torch.Tensor | None:
    """Run the pass once (its largest difference to `ref` into row["max_abs_diff"]), then time it as one CUDA
    graph (row["us"]); an error goes into row["error"] instead. Returns the output (None on error)."""
    out = None
    try:
        out = layer.run(path, x, num_decode)
        row["max_abs_diff"] = float((out.float() - ref).abs().max())
        run = functools.partial(layer.run, path, x, num_decode)
        row["us"] = graph_us(run, layer.device, args.repeats, args.warmup)
    except Exception as err:
        traceback.print_exc()
        row["error"] = f"{type(err).__name__}: {err}"
    print(row, flush=True)
    return out


MIXED_VARIANTS = (  # (name, path, the kernel's cut: how many of the D + P tokens it tiles as decode rows)
    ("decode alone", "persistent", "all"),
    ("persistent", "persistent", "phase"),
    ("persistent, decode tiles", "persistent", "all"),
    ("persistent, prefill tiles", "persistent", "none"),
    ("grouped", "grouped", "phase"),
    ("padded", "padded", "phase"),
)


def section_mixed(layer: Layer, args) -> list[dict]:
    """Every --mixed D:P pass through every MIXED_VARIANTS entry, graph-timed, with its time over the D decode
    rows alone (the first variant). The one-height variants also record whether their rows came out bitwise
    equal to the phase-split launch's (`same_bits`): whether a row's result depends on the height of its tile."""
    rows = []
    for num_decode, num_prefill in args.mixed:
        x = layer.inputs(num_decode + num_prefill, seed=num_decode * 7919 + num_prefill)
        ref = layer.reference(x)
        alone_us, outs = None, {}
        for name, path, cut in MIXED_VARIANTS:
            part = {k: v[:num_decode] for k, v in x.items()} if name == "decode alone" else x
            decode = {"all": part["h_TH"].shape[0], "phase": num_decode, "none": 0}[cut]
            row = {"decode": num_decode, "prefill": num_prefill, "variant": name}
            want = ref[:num_decode] if name == "decode alone" else ref
            out = outs[name] = time_pass(layer, row, path, part, decode, want, args)
            if name.startswith("persistent,") and out is not None and outs.get("persistent") is not None:
                row["same_bits"] = bool(torch.equal(out, outs["persistent"]))
            if "us" in row:
                alone_us = alone_us or row["us"]
                row["over_decode_alone"] = row["us"] / alone_us
            rows.append(row)
    return rows


def graphed(fn, device: torch.device, eager: bool):
    """fn as the engine runs it: one CUDA graph replay (warmed up on a side stream first, so torch.compile and
    Triton compile outside the capture, as the runner does); fn itself off CUDA or when `eager`.

    The graph is captured on that side stream, not on torch's default capture stream: cuBLAS workspaces are
    keyed by (handle, stream), so every graph captured on one stream embeds the same workspace address, and two
    such graphs replayed at once on two streams (the overlap study) race on it (pytorch/pytorch#193402; torch
    2.11 also frees that workspace when any graph captured on the stream is destroyed)."""
    if device.type != "cuda" or eager:
        return fn
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    return graph.replay


def graph_us(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Microseconds of fn() replayed as one CUDA graph (fn itself off CUDA)."""
    return timed_us(graphed(fn, device, eager=False), device, repeats, warmup)


def routed_expert_bytes(layer: Layer, ids_TK: torch.Tensor) -> int:
    """Bytes of the gate_up and down weights of the experts the pass routes at least one token to."""
    used = int(torch.unique(ids_TK).numel())
    per_expert = layer.layer.gate_up_EFH[0].numel() + layer.layer.down_EHF[0].numel()
    return used * per_expert * layer.layer.gate_up_EFH.element_size()


def sweep_configs(args, phase: str) -> list[dict]:
    return [
        dict(programs=p, block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=st, tma=bool(tma))
        for p in args.sweep_programs
        for m, n, k in getattr(args, f"sweep_{phase}_blocks")
        for w in args.sweep_warps
        for st in args.sweep_stages
        for tma in args.sweep_tma
    ]


def section_sweep(layer: Layer, args) -> list[dict]:
    """Every launch configuration of the persistent kernel on one decode and one prefill pass (graph-timed)."""
    sms = (
        torch.cuda.get_device_properties(layer.device).multi_processor_count
        if layer.device.type == "cuda"
        else 4
    )
    bandwidth = resolve_bandwidth(args, layer.device) if layer.device.type == "cuda" else None
    rows = []
    for phase, tokens in (("decode", args.sweep_decode), ("prefill", args.sweep_prefill)):
        x = layer.inputs(tokens, seed=tokens)
        num_decode = tokens if phase == "decode" else 0
        ref = layer.reference(x)
        grouped_us = graph_us(
            functools.partial(layer.run, "grouped", x, num_decode), layer.device, args.repeats, 2
        )
        moved = routed_expert_bytes(layer, x["ids_TK"])
        base = {"phase": phase, "tokens": tokens, "grouped_us": grouped_us, "expert_bytes": moved}
        for cfg in sweep_configs(args, phase):
            row = {**base, **cfg}
            block_m = {"block_m_decode" if phase == "decode" else "block_m_prefill": cfg["block_m"]}
            launch = dict(
                num_programs=cfg["programs"] * sms, block_n=cfg["block_n"], block_k=cfg["block_k"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], tma=cfg["tma"], **block_m,
            )  # fmt: skip
            try:
                out = layer.persistent(x, num_decode, **launch).out_TH
                row["max_abs_diff"] = float((out.float() - ref).abs().max())
                run = functools.partial(layer.persistent, x, num_decode, **launch)
                row["us"] = graph_us(run, layer.device, args.repeats, 2)
                row["vs_grouped"] = grouped_us / row["us"]
                if bandwidth:
                    row["bandwidth_fraction"] = moved / (row["us"] * 1e-6) / bandwidth
            except Exception as err:  # a configuration that does not compile (shared memory) is a result too
                row["error"] = f"{type(err).__name__}: {str(err)[:200]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def section_arrival(layer: Layer, args) -> dict:
    """Section 7.3: decode latency and prefill time when a decode pass arrives during a prefill pass. Every pass
    is a CUDA graph replay (as the engine runs them), so the GPU's scheduling is measured, not the host's
    launches: a 128-token persistent pass launched op by op is host-bound (~1.4 ms for ~0.55 ms of GPU work)."""
    if layer.device.type != "cuda":
        return {"skipped": "needs CUDA streams"}
    prefill = layer.inputs(args.arrival_prefill, seed=1)
    decode = layer.inputs(args.arrival_decode, seed=2)
    nd = args.arrival_decode
    programs = (
        args.arrival_programs_per_sm * torch.cuda.get_device_properties(layer.device).multi_processor_count
    )
    unread = torch.zeros(1, dtype=torch.int32, device=layer.device)  # a flag no prefill reads
    passes = {
        "decode_us": lambda: layer.run("grouped", decode, nd),
        "prefill_us": lambda: layer.run("grouped", prefill, 0),
        "decode_persistent_us": lambda: layer.run("persistent", decode, nd),
        # the persistent mode's decode pass with nothing to preempt: what raising the flag costs it
        "decode_flag_raised_us": lambda: (set_flag(unread, True), layer.run("persistent", decode, nd)),
        "prefill_persistent_us": lambda: layer.run("persistent", prefill, 0),
        "decode_coresident_us": lambda: layer.persistent(decode, nd, num_programs=programs).out_TH,
        "prefill_coresident_us": lambda: layer.persistent(prefill, 0, num_programs=programs).out_TH,
    }
    alone = {name: graph_us(fn, layer.device, args.repeats, args.warmup) for name, fn in passes.items()}
    out = {"alone": alone}
    streams = (torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1))  # low, high
    for name, mode, slices in arrival_modes(args):
        graphs = arrival_graphs(layer, prefill, decode, mode, slices, programs, args)
        samples = [arrival_once(graphs, streams, args) for _ in range(args.repeats)]
        med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        suffix = "" if mode == "streams" else "_persistent"
        out[name] = {
            **med,
            "decode_slowdown": med["decode_us"] / alone[f"decode{suffix}_us"],
            "prefill_slowdown": med["prefill_us"] / alone[f"prefill{suffix}_us"],
        }
        print(name, out[name], flush=True)
        out[name]["timeline"] = traced_arrival(graphs, streams, args)
    return out


def traced_arrival(graphs: dict, streams: tuple, args) -> list[dict]:
    """One more arrival under the profiler: its GPU activities in time order (`gpu_timeline`), where the
    medians above say only how long each pass took, not what the decode pass waited for."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        arrival_once(graphs, streams, args)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    return gpu_timeline(events)


GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_timeline(events: list[dict]) -> list[dict]:
    """The GPU activities (kernels, copies, memsets) of a chrome trace, in start order: name (cut to 60
    characters), stream, start_us and end_us from the first one's start."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_ACTIVITIES), key=lambda e: e["ts"])
    if not gpu:
        return []
    t0 = gpu[0]["ts"]
    return [
        {
            "name": e["name"][:60],
            "stream": e.get("args", {}).get("stream"),
            "start_us": round(e["ts"] - t0, 1),
            "end_us": round(e["ts"] + e.get("dur", 0) - t0, 1),
        }
        for e in gpu
    ]


def arrival_modes(args) -> list[tuple[str, str, int]]:
    """(row name, mode, preempt_slices) of the arrival section: the persistent mode once per `--arrival-slices`,
    the split mode at the kernel's default slices."""
    persistent = [(f"persistent/s{n}", "persistent", n) for n in args.arrival_slices]
    return [
        ("streams", "streams", 1),
        *persistent,
        ("coresident", "coresident", 1),
        ("split", "split", PREEMPT_SLICES),
    ]


def arrival_graphs(
    layer: Layer, prefill: dict, decode: dict, mode: str, slices: int, programs: int, args
) -> dict:
    """The replays of one arrival: prefill (a persistent launch with a preemption flag read between `slices`
    slices of its phase-A items, or the grouped path, or a persistent launch of `programs` programs), decode
    (flag raised, then the pass; or the pass alone), and for the persistent mode the resume (flag lowered, then
    the prefill's left tiles over the buffers the prefill graph captured). Each graph has its own capture stream
    (`graphed`)."""
    nd = args.arrival_decode
    if mode in ("streams", "coresident"):
        run = (
            (lambda x, n: layer.run("grouped", x, n))
            if mode == "streams"
            else (lambda x, n: layer.persistent(x, n, num_programs=programs).out_TH)
        )
        return {
            "prefill": graphed(lambda: run(prefill, 0), layer.device, eager=False),
            "decode": graphed(lambda: run(decode, nd), layer.device, eager=False),
        }
    flag = torch.zeros(1, dtype=torch.int32, device=layer.device)
    captured: list[MoeRun] = []
    heeding, decode_grid = None, {}
    if mode == "split":
        sms = torch.cuda.get_device_properties(layer.device).multi_processor_count
        heeding = max(1, round(args.arrival_heeding * PROGRAMS_PER_SM * sms))
        decode_grid = {"num_programs": heeding}

    def prefill_pass() -> None:
        captured.append(
            layer.persistent(prefill, 0, preempt_flag=flag, heeding=heeding, preempt_slices=slices)
        )

    def decode_pass() -> None:
        set_flag(flag, True)
        layer.persistent(decode, nd, **decode_grid)

    def resume_pass() -> None:
        set_flag(flag, False)  # the resume's, not the decode pass's: its output is done without it
        layer.persistent(prefill, 0, resume=run)

    graphs = {"prefill": graphed(prefill_pass, layer.device, eager=False)}
    run = captured[-1]  # the capture's run: its buffers and done masks are the ones the replays write
    graphs["prefill"]()  # fills them (flag down: the whole pass), so the resume's warm-up reads a real table
    torch.cuda.synchronize()
    graphs["decode"] = graphed(decode_pass, layer.device, eager=False)
    graphs["resume"] = graphed(resume_pass, layer.device, eager=False)
    return graphs


@functools.cache
def _pinned_flag_values() -> dict[bool, torch.Tensor]:
    return {up: torch.tensor([int(up)], dtype=torch.int32).pin_memory() for up in (True, False)}


def set_flag(flag: torch.Tensor, up: bool) -> None:
    """Raise or lower `flag` in stream order. The copy engine writes it, from pinned host memory: a kernel
    writing it would wait for an SM slot, and the running persistent programs hold them all until they end."""
    flag.copy_(_pinned_flag_values()[up], non_blocking=True)


def arrival_once(graphs: dict, streams: tuple, args) -> dict[str, float]:
    """Microseconds: decode_us (the decode pass's latency) and prefill_us (the prefill pass to its end) of one
    arrival, and where the prefill's time went: first_us (its replay up to the preemption: phase A stops, phase
    B does the tiles A finished), then, in the persistent mode, resume_us (the left tiles, after the decode).
    The prefill replay starts on the low-priority stream, the decode replay `--arrival-delay-us` later on the
    high-priority one; the resume follows both on the low one."""
    low, high = streams
    events = {k: torch.cuda.Event(enable_timing=True) for k in ("p0", "p_first", "r0", "p1", "d0", "d1")}
    torch.cuda.synchronize()
    with torch.cuda.stream(low):
        events["p0"].record()
        graphs["prefill"]()
        events["p_first"].record()
    time.sleep(args.arrival_delay_us * 1e-6)
    with torch.cuda.stream(high):
        events["d0"].record()
        graphs["decode"]()
        events["d1"].record()
    low.wait_stream(high)
    with torch.cuda.stream(low):
        events["r0"].record()
        if "resume" in graphs:
            graphs["resume"]()
        events["p1"].record()
    torch.cuda.synchronize()
    us = {
        "decode_us": ("d0", "d1"),
        "prefill_us": ("p0", "p1"),
        "first_us": ("p0", "p_first"),
        "resume_us": ("r0", "p1"),
    }
    return {name: events[a].elapsed_time(events[b]) * 1e3 for name, (a, b) in us.items()}


# --------------------------------------------------------------------------------------------- CLI
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy shapes on the CPU under the Triton interpreter")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decode-tokens", type=int_list, default=[32, 128, 256])
    ap.add_argument("--prefill-tokens", type=int_list, default=[2048, 8192])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--arrival-prefill", type=int, default=8192)
    ap.add_argument("--arrival-decode", type=int, default=128)
    ap.add_argument("--arrival-delay-us", type=float, default=10.0)
    ap.add_argument(
        "--arrival-programs-per-sm",
        type=int,
        default=1,
        help="each pass's grid in the coresident arrival mode",
    )
    ap.add_argument(
        "--arrival-heeding",
        type=float,
        default=0.5,
        help="split arrival mode: the fraction of the prefill's default grid that yields to the decode pass",
    )
    ap.add_argument(
        "--arrival-slices",
        type=int_list,
        default=[1, 2, 4],
        help="persistent arrival mode: slices of a prefill item's reduction between flag reads, one row each",
    )
    ap.add_argument("--sections", type=lambda s: s.split(","), default=["paths", "mixed", "sweep", "arrival"])
    ap.add_argument(
        "--mixed",
        type=lambda s: [tuple(int(v) for v in item.split(":")) for item in s.split(",")],
        default=[(32, 16), (32, 64), (128, 16), (128, 64), (128, 256), (128, 2048)],
        help="decode:prefill token pairs of the mixed section",
    )
    ap.add_argument("--sweep-decode", type=int, default=128)
    ap.add_argument("--sweep-prefill", type=int, default=8192)
    # the default grid: around session 29's H100 winners, with and without TMA (112 configurations)
    ap.add_argument("--sweep-programs", type=int_list, default=[1, 2])
    blocks = lambda s: [tuple(int(v) for v in b.split(":")) for b in s.split(",")]  # noqa: E731
    ap.add_argument(
        "--sweep-decode-blocks", type=blocks,
        default=[(16, 64, 128), (16, 128, 64), (16, 128, 128), (32, 128, 64)],
        help="block_m_decode:block_n:block_k,... of the decode pass",
    )  # fmt: skip
    ap.add_argument(
        "--sweep-prefill-blocks", type=blocks, default=[(128, 128, 64), (128, 256, 64), (128, 128, 128)],
        help="block_m_prefill:block_n:block_k,... of the prefill pass",
    )  # fmt: skip
    ap.add_argument("--sweep-warps", type=int_list, default=[4, 8])
    ap.add_argument("--sweep-stages", type=int_list, default=[3, 4])
    ap.add_argument(
        "--sweep-tma", type=int_list, default=[0, 1] if torch.cuda.is_available() and tma_runs_on("cuda") else [0],
        help="weight tiles through TMA descriptors (1) or per-thread loads (0); also adds the paths' persistent_tma",
    )  # fmt: skip
    add_bandwidth_arg(ap)
    ap.add_argument("--json", default="bench/out/rollout_expertplex.json")
    if ap.parse_known_args()[0].tiny:
        ap.set_defaults(**TINY_ARGS)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    layer = Layer(TINY_MOE if args.tiny else QWEN3_30B_A3B, device, dtype)
    results: dict = {
        "args": vars(args),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    # the long sweep last, and the JSON rewritten after every section: a call cut by its time limit keeps the rest
    sections = (
        ("paths", section_paths),
        ("mixed", section_mixed),
        ("arrival", section_arrival),
        ("sweep", section_sweep),
    )
    for name, fn in sections:
        if name in args.sections:
            try:
                results[name] = fn(layer, args)
            except Exception as err:
                traceback.print_exc()
                results[name] = {"error": f"{type(err).__name__}: {err}"}
            Path(args.json).write_text(json.dumps(results, indent=2))
    print_tables(results)


def print_tables(results: dict) -> None:
    print("\n| phase | tokens | path | us | max abs diff vs fp32 reference |\n|---|---|---|---|---|")
    for r in results.get("paths", []) if isinstance(results.get("paths"), list) else []:
        us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:80]
        diff = f"{r['max_abs_diff']:.2g}" if "max_abs_diff" in r else "-"
        print(f"| {r['phase']} | {r['tokens']} | {r['path']} | {us} | {diff} |")
    mixed = results.get("mixed", [])
    if isinstance(mixed, list) and mixed:
        print("\n| decode rows | prefill tokens | variant | us | x decode alone |\n|---|---|---|---|---|")
        for r in mixed:
            us = (
                f"{r['us']:.1f} | {r['over_decode_alone']:.2f}"
                if "us" in r
                else r.get("error", "")[:80] + " | -"
            )
            bits = {True: " (same bits)", False: " (other bits)"}.get(r.get("same_bits"), "")
            print(f"| {r['decode']} | {r['prefill']} | {r['variant']}{bits} | {us} |")
    sweep = results.get("sweep", [])
    for phase in ("decode", "prefill") if isinstance(sweep, list) else ():
        done = sorted((r for r in sweep if r["phase"] == phase and "us" in r), key=lambda r: r["us"])
        failed = sum(r["phase"] == phase and "error" in r for r in sweep)
        print(f"\nsweep, {phase}: {len(done)} configurations timed, {failed} failed; fastest 5 (graph-timed)")
        print(
            "| programs/SM | block m:n:k | warps | stages | TMA | us | x grouped | bandwidth |\n"
            "|---|---|---|---|---|---|---|---|"
        )
        for r in done[:5]:
            bw = f"{100 * r['bandwidth_fraction']:.0f}%" if "bandwidth_fraction" in r else "-"
            print(
                f"| {r['programs']} | {r['block_m']}:{r['block_n']}:{r['block_k']} | {r['num_warps']} | "
                f"{r['num_stages']} | {'yes' if r.get('tma') else 'no'} | {r['us']:.1f} | {r['vs_grouped']:.2f} | {bw} |"
            )
    arrival = results.get("arrival", {})
    if "streams" in arrival:
        print(
            "\n| scheduling | decode latency us (x alone) | prefill us (x alone) | prefill: first launch, resume us |"
        )
        print("|---|---|---|---|")
        for mode, a in ((m, a) for m, a in arrival.items() if m != "alone"):
            print(
                f"| {mode} | {a['decode_us']:.0f} ({a['decode_slowdown']:.2f}x) | "
                f"{a['prefill_us']:.0f} ({a['prefill_slowdown']:.2f}x) | {a['first_us']:.0f}, {a['resume_us']:.0f} |"
            )
        alone = arrival["alone"]
        print(
            f"decode pass alone, persistent: {alone['decode_persistent_us']:.0f} us; after raising the flag: "
            f"{alone['decode_flag_raised_us']:.0f} us"
        )
        for mode, a in (
            (m, a) for m, a in arrival.items() if m.startswith("persistent") and a.get("timeline")
        ):
            print(
                f"\ntimeline of one {mode} arrival (us from the first GPU activity; stream: name start-end)"
            )
            for e in a["timeline"]:
                print(f"  {e['stream']}: {e['name']} {e['start_us']:.1f}-{e['end_us']:.1f}")
    elif arrival:
        print(f"\narrival: {arrival}")


if __name__ == "__main__":
    main()
