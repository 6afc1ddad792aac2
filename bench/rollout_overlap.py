"""Overlapped engine steps against steps waited for: the wall time of the same generate call.

    python3 bench/rollout_overlap.py --json bench/out/rollout_overlap.json     # CUDA
    python3 bench/rollout_overlap.py --tiny                                      # CPU smoke run of the code paths

One engine (random weights at Qwen3-30B-A3B's widths with `--layers` layers, or the toy model of --tiny),
temperature 1, ignore_eos, B requests of `--prompt-len` random tokens and `--new-tokens` new ones, for each B of
`--batches`. The same generate call runs with `rollout.overlap_steps` on and off, alternated `--repeats` times
after a warm-up call of each (which captures the CUDA graphs). Both schedule the same steps, so the difference
is the host's work between steps that overlap hides (the last column checks that every run, overlapped or not,
drew the same tokens). Reported per B, medians over the repeats: wall seconds and
tokens/s of each, their ratio, and the device's time of the overlapped run's steps (events around each step),
the wall time that overlap could reach if it hid every host second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_decode import QWEN3_30B_A3B, TINY, int_list, model_config, sync

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig

TINY_ARGS = dict(
    layers=2, batches=[1, 8], prompt_len=16, new_tokens=24, repeats=2, device="cpu", dtype="float32"
)


def measure(engine: RolloutEngine, batch: int, args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, engine.spec.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
    params = [
        SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=i)
        for i in range(batch)
    ]
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for repeat in range(args.repeats + 1):
        for overlap in (True, False) if repeat % 2 else (False, True):
            engine.config.overlap_steps = overlap
            sync(engine.device)
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            sync(engine.device)
            wall = time.perf_counter() - t0
            st = engine.last_stats
            if repeat:  # the first round captures the graphs
                tokens = [tuple(o.token_ids) for o in outs]
                runs[overlap].append(
                    dict(wall_s=wall, steps_s=st.prefill_s + st.decode_s, steps=st.num_steps, tokens=tokens)
                )
    every = [r["tokens"] for rs in runs.values() for r in rs]
    row = {"batch": batch, "same_tokens": all(t == every[0] for t in every), "steps": runs[True][0]["steps"]}
    for overlap, name in ((True, "overlapped"), (False, "waited")):
        wall = statistics.median(r["wall_s"] for r in runs[overlap])
        row[f"{name}_s"] = wall
        row[f"{name}_tok_s"] = batch * args.new_tokens / wall
    row["speedup"] = row["waited_s"] / row["overlapped_s"]
    row["device_steps_s"] = statistics.median(r["steps_s"] for r in runs[True])
    row["host_ms_per_step_hidden"] = 1e3 * (row["waited_s"] - row["overlapped_s"]) / row["steps"]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="toy model on the CPU (smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", type=int_list, default=[1, 32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="bench/out/rollout_overlap.json")
    if ap.parse_known_args(argv)[0].tiny:
        ap.set_defaults(**TINY_ARGS)
    args = ap.parse_args(argv)
    cfg = model_config(TINY if args.tiny else QWEN3_30B_A3B, args.layers)
    config = RolloutConfig(
        max_model_len=args.prompt_len + args.new_tokens,
        max_batch_size=max(args.batches),
        kv_cache_tokens=max(args.batches) * (args.prompt_len + args.new_tokens),
    )
    engine = RolloutEngine.from_config(cfg, device=args.device, dtype=args.dtype, config=config, seed=0)
    rows = [measure(engine, b, args) for b in args.batches]
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"args": vars(args), "device": device, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\n{device}, {args.layers} layers, prompts {args.prompt_len}, {args.new_tokens} new tokens")
    print(
        "| batch | steps | waited s (tok/s) | overlapped s (tok/s) | speedup | device s of the steps | "
        "host ms hidden / step | same tokens |\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['batch']} | {r['steps']} | {r['waited_s']:.3f} ({r['waited_tok_s']:.0f}) | "
            f"{r['overlapped_s']:.3f} ({r['overlapped_tok_s']:.0f}) | {r['speedup']:.3f}x | "
            f"{r['device_steps_s']:.3f} | {r['host_ms_per_step_hidden']:.3f} | {r['same_tokens']} |"
        )
    return result


if __name__ == "__main__":
    main()
