"""The rollout engine's host time per step, without the model: its scheduler (admission, block growth,
preemption), the step's input arrays and the outputs' bookkeeping (routes recorded, tokens appended, requests
retired). On a GPU this time sits between two runner steps, with the device idle unless the step runs long
enough to hide it.

    python3 bench/rollout_host.py --rows 32,128,256 --json bench/out/rollout_host.json
    python3 bench/rollout_host.py --tiny        # CPU smoke run

The engine's step runner is replaced by `InstantRunner`, which returns tokens, log-probs and routes of the
step's shapes at once, so the generate call's wall time is the host's. The model's layer count, experts and
top-k are Qwen3-30B-A3B's (the routes recorded per token are 48 x 8), its widths tiny (no weights to speak of).
The runner's own staging of the inputs and fetch of the outputs is not counted (it is the runner's, and
`bench/rollout_decode.py`'s step time holds it). Requests: `--rows` of them per call, prompts of
`--prompt-len` tokens, `--new-tokens MIN,MAX` drawn uniformly, temperature 1, ignore_eos; the KV cache holds
them all (no preemption). Reported: steps, decode rows per step, host ms per step (best of `--repeats` calls),
and us per decode row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_decode import QWEN3_30B_A3B, int_list

from rollout import RolloutEngine, SamplingParams
from rollout.config import RolloutConfig
from rollout.runner import StepInputs, StepOutputs

NARROW = dict(  # Qwen3-30B-A3B's layers, experts and top-k; tiny widths
    QWEN3_30B_A3B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


class InstantRunner:
    """Stands in for the engine's step runner: uniform tokens, zero log-probs and fixed routes of the step's
    shapes, returned at once."""

    num_graphs = 0
    use_cuda_graphs = False

    def __init__(self, vocab_size: int, num_layers: int, top_k: int, max_tokens: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        # one buffer handed out in slices, as the real runner's host buffers are (the engine copies what it keeps)
        self.routes_TLK = np.ascontiguousarray(
            np.broadcast_to(np.arange(top_k), (max_tokens, num_layers, top_k))
        )
        self.rng = np.random.default_rng(seed)

    def run(self, x: StepInputs) -> StepOutputs:
        s = len(x.samples_S)
        tokens_S = self.rng.integers(0, self.vocab_size, s)
        return StepOutputs(tokens_S, np.zeros(s, np.float32), self.routes_TLK[: x.num_tokens])


def measure(rows: int, args: argparse.Namespace, cfg: dict) -> dict:
    """Host seconds per step of one generate call of `rows` requests (best of args.repeats)."""
    lo, hi = args.new_tokens
    config = RolloutConfig(
        max_model_len=args.prompt_len + hi,
        max_batch_size=rows,
        kv_cache_tokens=rows * (args.prompt_len + hi),
        cuda_graphs=False,
    )
    engine = RolloutEngine.from_config(cfg, device="cpu", dtype="float32", config=config, seed=0)
    spec = engine.spec
    engine.runner = InstantRunner(
        cfg["vocab_size"], spec.num_moe_layers, spec.top_k, config.max_step_tokens + rows
    )
    rng = np.random.default_rng(rows)
    prompts = [rng.integers(0, cfg["vocab_size"], args.prompt_len).tolist() for _ in range(rows)]
    params = [
        SamplingParams(max_new_tokens=int(n), temperature=1.0, seed=i, ignore_eos=True)
        for i, n in enumerate(rng.integers(lo, hi + 1, rows))
    ]
    best = float("inf")
    for _ in range(args.repeats):
        began = time.perf_counter()
        engine.generate(prompts, params)
        best = min(best, time.perf_counter() - began)
    st = engine.last_stats
    return {
        "rows": rows,
        "steps": st.num_steps,
        "decode_rows_per_step": st.num_decode_rows / max(1, st.num_decode_steps),
        "preemptions": st.num_preemptions,
        "host_s": best,
        "host_ms_per_step": 1e3 * best / st.num_steps,
        "host_us_per_decode_row": 1e6 * best / max(1, st.num_decode_rows),
    }


def int_pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int_list, default=[32, 128, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int_pair, default=(256, 1024), help="MIN,MAX new tokens a request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="2 layers, few rows and tokens (CPU smoke run)")
    ap.add_argument("--json", default="bench/out/rollout_host.json")
    args = ap.parse_args()
    cfg = dict(NARROW)
    if args.tiny:
        cfg.update(num_hidden_layers=2, max_position_embeddings=512)
        args.rows, args.prompt_len, args.new_tokens, args.repeats = [4, 16], 8, (8, 32), 1
    torch.set_num_threads(1)
    results = [measure(rows, args, cfg) for rows in args.rows]
    print("| requests | steps | decode rows / step | host ms / step | host us / decode row |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['rows']} | {r['steps']} | {r['decode_rows_per_step']:.1f} | {r['host_ms_per_step']:.3f} "
            f"| {r['host_us_per_decode_row']:.2f} |"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
