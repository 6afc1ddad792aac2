"""The policy update's cost under two micro-batch layouts of the same long-tailed samples (`parallel.micro_batch_size`
sequences in sample order vs `parallel.micro_batch_tokens`: sequences of similar lengths within a padded-token
budget).

    python bench/trainer_microbatches.py --json bench/out/trainer_microbatches.json    # GPU if there is one
    python bench/trainer_microbatches.py --tiny                                        # CPU smoke run

Model: countdown_xl's policy (the default tiny Qwen3-MoE shape, vocab 1,204, positions 1,280) with random
weights, on one trainer rank (the engine in this process; Megatron's optimizer on a GPU, torch's AdamW on the
CPU). Samples: `--samples` sequences of a 4-token prompt and a response whose length is log-uniform in [8,
--max-length] (countdown's law), random tokens and advantages, from `--seed`. Each layout is timed over the same
samples: one policy update (forward, backward, optimizer step) and one forward pass (what the critic's values
and the reference cost), median of `--reps` after one warm-up each, layouts interleaved so drift hits all alike
(CUDA events on a GPU). Reported per layout: micro-batches, padded positions (rows x longest row, summed),
padding fraction, update and forward milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from rollout_decode import median_ms

from tppo.algo.batching import Placement, padding_fraction, place_samples, policy_batch, split_for_ranks
from tppo.algo.config import AlgoConfig
from tppo.algo.objectives import policy_objective
from tppo.algo.pool import Sample
from tppo.engine.config import ModelConfig, OptimConfig, ParallelConfig
from tppo.engine.engine import MegatronEngine

PROMPT_TOKENS = 4
TINY = dict(samples=8, max_length=64, budgets=[96], reps=2)


def make_samples(num: int, max_length: int, vocab: int, rng: np.random.Generator) -> list[Sample]:
    """Prompts of PROMPT_TOKENS tokens, responses of log-uniform length in [8, max_length], one window each."""
    samples = []
    for i in range(num):
        n = int(np.exp(rng.uniform(np.log(8), np.log(max_length))))
        s = Sample(
            uid=str(i),
            group_id=i,
            prompt_uid=str(i),
            prompt_ids=rng.integers(1, vocab, PROMPT_TOKENS),
            max_response_length=max_length,
        )
        s.max_new_tokens = n
        s.add_window(rng.integers(1, vocab, n), rng.normal(-2.0, 0.5, n))
        samples.append(s)
    return samples


def layouts(samples: list[Sample], micro_batch_size: int, budgets: list[int]) -> dict[str, Placement]:
    out = {f"{micro_batch_size} rows in sample order": place_samples(samples, 1, micro_batch_size)}
    for budget in budgets:
        out[f"<= {budget} padded tokens"] = place_samples(samples, 1, len(samples), budget)
    return out


def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    model = ModelConfig(vocab_size=args.vocab, max_position_embeddings=args.max_length + 80)
    engine = MegatronEngine(model, ParallelConfig(), OptimConfig(lr=1e-6), seed=args.seed)
    device = engine.groups.device
    samples = make_samples(args.samples, args.max_length, args.vocab, rng)
    advantages = [rng.normal(size=len(s.response_ids)) for s in samples]
    cases = {}
    for name, placement in layouts(samples, args.micro_batch_size, args.budgets).items():
        rank = split_for_ranks(samples, placement)[0]
        batches = [
            [policy_batch(ss, ff, [advantages[int(x.uid)] for x in ss], routing=False) for ss, ff in rank]
        ]
        cases[name] = (batches, policy_objective(AlgoConfig(), batches))
    ms: dict[str, dict[str, list[float]]] = {n: {"update": [], "forward": []} for n in cases}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, (batches, objective) in cases.items():
            # one call each, layouts interleaved: drift over the run hits every layout alike
            update = median_ms(device, lambda b=batches, o=objective: engine.train_step(b[0], o), 0, 1)
            forward = median_ms(device, lambda b=batches: engine.forward(b[0]), 0, 1)
            if rep:
                ms[name]["update"].append(update)
                ms[name]["forward"].append(forward)
    rows = []
    for name, (batches, _) in cases.items():
        rows.append(
            {
                "layout": name,
                "microbatches": len(batches[0]),
                "padded_positions": sum(b.shape[0] * b.shape[1] for b in batches[0]),
                "padding_fraction": padding_fraction(batches),
                "update_ms": statistics.median(ms[name]["update"]),
                "forward_ms": statistics.median(ms[name]["forward"]),
            }
        )
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return {"args": vars(args), "device": name, "rows": rows}


def print_table(results: dict) -> None:
    rows = results["rows"]
    base = rows[0]
    print(f"\n{results['device']}, {results['args']['samples']} samples, responses log-uniform in [8, "
          f"{results['args']['max_length']}]")  # fmt: skip
    print(
        "| layout | micro-batches | padded positions | padding | update ms | forward ms | update vs first |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['microbatches']} | {r['padded_positions']} | {r['padding_fraction']:.0%} | "
            f"{r['update_ms']:.1f} | {r['forward_ms']:.1f} | {r['update_ms'] / base['update_ms']:.2f}x |"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a few short samples (CPU smoke run)")
    ap.add_argument("--samples", type=int, default=32, help="sequences of the update (countdown_xl's batch)")
    ap.add_argument("--max-length", type=int, default=1200, help="longest response")
    ap.add_argument("--vocab", type=int, default=1204)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="rows of the fixed layout")
    ap.add_argument("--budgets", type=lambda t: [int(x) for x in t.split(",")], default=[2048, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench/out/trainer_microbatches.json")
    if ap.parse_known_args(argv)[0].tiny:  # toy defaults; flags given on the command line still win
        ap.set_defaults(**TINY)
    args = ap.parse_args(argv)
    results = run(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print_table(results)


if __name__ == "__main__":
    main()
