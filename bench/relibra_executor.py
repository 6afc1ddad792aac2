"""GPU check of ReLibra's executor (one device): per MoE layer, what rerouting, replica copies and computing over
home + replica slots cost next to the static path, at Qwen3-30B-A3B expert shapes.

    python bench/relibra_executor.py [--json bench/out/relibra_executor.json] [--ep 16] [--tokens-per-rank 4096]
    python bench/relibra_executor.py --tiny          # CPU smoke run with tiny shapes

Loads: the synthetic RL-like generator (relibra.synthetic) for EP source ranks, 128 experts, top-8. Plans: the
`static` planner (rank g owns experts [gH, (g+1)H)) and the `relibra` planner (reorder + R=2 replica slots per
rank, 8 GPUs per node), validated. For a few (micro-batch, layer) pairs it times, on the one device:
- reroute: the executor's logical -> physical mapping (relibra.executor.reroute.reroute_routing) of the busiest
  source rank's N tokens (routing consistent with the loads), next to the home-only column permutation;
- replica copy: the device-to-device copy of the rank's replica weights (bf16 W1 [2F, D] + W2 [D, F] per replica)
  plus the concatenation home + replica slots that the executor's weight provider does for every layer once
  R > 0 (a lower bound of the NVLink push, which one device cannot measure);
- expert compute (forward + backward, `tppo.engine.experts.grouped_swiglu` on torch._grouped_mm) of the rank
  the layer waits for (the most pairs), static (H slots) vs ReLibra (H + R slots with the planned quotas).
Times are medians of CUDA-event timings after warm-up (host clock on CPU). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from rollout_decode import median_ms

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel
from relibra.executor.reroute import permute_routing, reroute_routing
from relibra.executor.tables import reroute_tables
from relibra.plan import Plan, PlannerState, Topology
from relibra.planners import PlanContext, run_planner
from relibra.synthetic import SyntheticLoads, generate_loads
from relibra.validate import validate_plan
from tppo.engine.experts import grouped_swiglu

ROOT = Path(__file__).resolve().parents[1]


def routing_from_loads(load_E: np.ndarray, num_tokens: int, topk: int) -> np.ndarray:
    """int [N, K] top-k ids whose per-expert counts are load_E (each count <= N, sum = N K): pair i of the
    expert-sorted list goes to token i mod N, so a token never gets one expert twice."""
    pairs = np.repeat(np.arange(len(load_E)), load_E)
    if len(pairs) != num_tokens * topk or load_E.max(initial=0) > num_tokens:
        raise ValueError("load_E must add up to N K with every count <= N")
    ids = np.empty((num_tokens, topk), dtype=np.int64)
    ids[np.arange(len(pairs)) % num_tokens, np.arange(len(pairs)) // num_tokens] = pairs
    return ids


def _expert_step(counts, hidden, ffn, dtype, device):
    """A closure running forward + backward of grouped SwiGLU experts over slots with `counts` tokens."""
    g = torch.Generator(device="cpu").manual_seed(0)
    n = int(sum(counts))
    x = torch.randn(n, hidden, generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(n, generator=g).to(device, torch.float32).requires_grad_()
    w1 = (torch.randn(len(counts), 2 * ffn, hidden, generator=g) * 0.02).to(device, dtype).requires_grad_()
    w2 = (torch.randn(len(counts), hidden, ffn, generator=g) * 0.02).to(device, dtype).requires_grad_()
    grad = torch.randn(n, hidden, generator=g).to(device, dtype)
    tokens = torch.tensor(counts, dtype=torch.int64)

    def run():
        y = grouped_swiglu(x, tokens, probs, w1, w2)
        y.backward(grad)

    return run


def _copy_step(num_rep, num_home, hidden, ffn, dtype, device):
    """Copy `num_rep` experts' weights from an owner's buffer into the replica buffer, then cat home + replicas."""
    home1 = torch.randn(num_home, 2 * ffn, hidden, device=device).to(dtype)
    home2 = torch.randn(num_home, hidden, ffn, device=device).to(dtype)
    owner1, owner2 = home1.clone(), home2.clone()
    rep1 = torch.empty(max(num_rep, 1), 2 * ffn, hidden, device=device, dtype=dtype)
    rep2 = torch.empty(max(num_rep, 1), hidden, ffn, device=device, dtype=dtype)

    def run():
        rep1[:num_rep].copy_(owner1[:num_rep])
        rep2[:num_rep].copy_(owner2[:num_rep])
        torch.cat([home1, rep1])
        torch.cat([home2, rep2])

    return run


def _plans(args, topo: Topology):
    trace = generate_loads(
        SyntheticLoads(
            num_steps=1,
            num_microbatches=args.microbatches,
            num_layers=args.layers,
            num_source_ranks=topo.num_gpus,
            num_experts=topo.num_experts,
            topk=args.topk,
            tokens_per_rank=args.tokens_per_rank,
            seed=args.seed,
        )
    )
    loads = trace.loads_NMLSE[0]
    cfg = replace(
        RelibraConfig(),
        gpus_per_node=topo.gpus_per_node,
        replica_slots=topo.num_replica_slots,
        min_replica_tokens=args.min_replica_tokens,
        planner_processes=1,
    )
    ctx = PlanContext(topo=topo, config=cfg, cost=CostModel.from_yaml(cfg.cost_model), topk=args.topk)
    static_topo = Topology(topo.num_gpus, topo.gpus_per_node, topo.num_experts, 0)
    static_ctx = PlanContext(topo=static_topo, config=cfg, cost=ctx.cost, topk=args.topk)
    static, _ = run_planner("static", loads, static_ctx, PlannerState())
    relibra, _ = run_planner("relibra", loads, ctx, PlannerState())
    validate_plan(relibra, loads, topo)
    return loads, static, relibra


def _layer_row(args, topo, loads, static: Plan, plan: Plan, m: int, layer: int, device, dtype) -> dict:
    H, J, G = topo.num_home_slots, topo.num_slots, topo.num_gpus
    timer = lambda fn: median_ms(device, fn, args.warmup, args.repeats)  # noqa: E731
    static_served = static.served_MLGJ()[m, layer]  # [G, H]
    served = plan.served_MLGJ()[m, layer]  # [G, J]
    g_static = int(static_served.sum(1).argmax())
    g_plan = int(served.sum(1).argmax())
    t_static = timer(_expert_step(static_served[g_static].tolist(), args.hidden, args.ffn, dtype, device))
    t_plan = timer(_expert_step(served[g_plan].tolist(), args.hidden, args.ffn, dtype, device))
    num_rep = int((plan.slots_MLGJ[m, layer, g_plan, H:] >= 0).sum())
    # The executor concatenates home + replica slots whenever R > 0, even when no replica is filled.
    t_copy = timer(_copy_step(num_rep, H, args.hidden, args.ffn, dtype, device))
    # Reroute of the busiest source rank's tokens (its pairs follow the plan's quotas exactly).
    s = int(loads[m, layer].sum(1).argmax())
    ids = torch.as_tensor(
        routing_from_loads(loads[m, layer, s], args.tokens_per_rank, args.topk), device=device
    )
    n = ids.shape[0]
    probs = torch.zeros(n, topo.num_experts, device=device).scatter_(
        1, ids, torch.rand(n, args.topk, device=device)
    )
    routing = torch.zeros(n, topo.num_experts, dtype=torch.bool, device=device).scatter_(1, ids, True)
    inst, cum = reroute_tables(plan, topo, s, [layer])
    inst_t, cum_t = torch.as_tensor(inst[m, 0], device=device), torch.as_tensor(cum[m, 0], device=device)
    t_reroute = timer(lambda: reroute_routing(probs, routing, inst_t, cum_t, G * J))
    perm = torch.randperm(topo.num_experts, device=device)
    t_permute = timer(lambda: permute_routing(probs, routing, perm))
    overhead = t_reroute + t_copy
    return {
        "microbatch": m,
        "layer": layer,
        "static_max_pairs": int(static_served[g_static].sum()),
        "relibra_max_pairs": int(served[g_plan].sum()),
        "replicas_on_slowest": num_rep,
        "static_expert_ms": t_static,
        "relibra_expert_ms": t_plan,
        "reroute_ms": t_reroute,
        "permute_ms": t_permute,
        "replica_copy_ms": t_copy,
        "overhead_ms": overhead,
        "net_speedup": t_static / max(t_plan + overhead, 1e-9),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=str(ROOT / "bench" / "out" / "relibra_executor.json"))
    p.add_argument("--tiny", action="store_true", help="CPU-sized shapes (smoke run)")
    p.add_argument("--ep", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--replica-slots", type=int, default=2)
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--min-replica-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.tiny:
        args.ep, args.gpus_per_node, args.experts, args.topk = 4, 4, 16, 2
        args.hidden, args.ffn, args.tokens_per_rank, args.min_replica_tokens = 64, 32, 256, 8
        args.warmup, args.repeats = 1, 3
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    topo = Topology(args.ep, args.gpus_per_node, args.experts, args.replica_slots)
    t0 = time.perf_counter()
    loads, static, plan = _plans(args, topo)
    plan_s = time.perf_counter() - t0
    rows = [
        _layer_row(args, topo, loads, static, plan, m, layer, device, dtype)
        for m in range(args.microbatches)
        for layer in range(args.layers)
    ]
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0] if k not in ("microbatch", "layer")}
    out = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "args": vars(args),
        "planning_s": plan_s,
        "rows": rows,
        "mean": mean,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(
        f"device {out['device']} {dtype}; EP {args.ep}, E {args.experts}, top-{args.topk}, D {args.hidden}, "
        f"F {args.ffn}, R {args.replica_slots}, {args.tokens_per_rank} tokens/rank; times in ms per layer"
    )
    head = (
        "m",
        "l",
        "pairs st",
        "pairs rl",
        "reps",
        "static",
        "relibra",
        "reroute",
        "permute",
        "copy",
        "net x",
    )
    print(" ".join(f"{h:>9}" for h in head))
    for r in [*rows, {"microbatch": "mean", "layer": "", **mean}]:
        vals = (
            r["microbatch"],
            r["layer"],
            r["static_max_pairs"],
            r["relibra_max_pairs"],
            r["replicas_on_slowest"],
            r["static_expert_ms"],
            r["relibra_expert_ms"],
            r["reroute_ms"],
            r["permute_ms"],
            r["replica_copy_ms"],
            r["net_speedup"],
        )
        print(" ".join(f"{v:>9.3f}" if isinstance(v, float) else f"{v!s:>9}" for v in vals))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
