"""ReLibra simulator benchmark: the issue's Targets table on the real Qwen3-30B-A3B routing and on the generator.

    python bench/relibra_sim.py [--json bench/out/relibra_sim.json] [--gen-steps 3] [--tokens-per-rank 4096]
        [--seed 0] [--nic-routing direct|pxn] [--ep 16,32] [--replica-slots 2] [--generator FIELD=VALUE ...]

For each dataset (real routing logs cut into 256-token micro-batches; synthetic RL-like loads with 32 micro-batches
of `--tokens-per-rank` tokens per source rank, 48 layers, 128 experts) at EP 16 and 32, 8 GPUs per node and 2
replica slots (`--replica-slots`), every planner is run step by step (validated) and simulated with the packaged
Hopper cost model.
Then it checks the targets: relibra within 5% of ideal (next to the lower bound that no plan with in-node copies
can beat, `relibra.cost_model.moe_lower_bound_us`), >= 1.1x faster than eplb_oracle (the better of its
hierarchical and global policies) and >= 1.3x faster than static on the MoE part, mean skew <= 1.08 (also for
`relibra_thorough`, relibra whose placement descent prices 1536 swaps per layer and round, planning in seconds), all
over every step and, as `warm`, over the steps after the first (which starts from Megatron's static placement and
pays a one-time migration out of it); and it times
the relibra planner on one step of 32 micro-batches x 48 layers x 128 experts at EP 32 (wall and CPU seconds,
in 1 and 2 processes unless `--timing-processes` says otherwise, with the machine's load average), cold (from a
fresh state, Megatron's static placement) and warm (from the previous step's state, as in training). Prints
tables; writes everything to --json.
`--nic-routing pxn` simulates NCCL's default routing on rail-optimised nodes instead of the planners' direct one
(relibra.cost_model; default JSON bench/out/relibra_sim_pxn.json).
`--generator FIELD=VALUE` (repeatable) sets any other field of `relibra.synthetic.SyntheticLoads`, e.g.
`--generator response_scale=0` for responses without quirks of their own; `--ep 32` runs one EP size (the planning
time needs EP 32 in the list). The generator's draw depends on NumPy's random streams, which NumPy keeps only within
one version (its multinomial changed in 2.5): the JSON records the NumPy that made it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np

from relibra.config import RelibraConfig
from relibra.cost_model import NIC_ROUTINGS, CostModel, moe_lower_bound_us
from relibra.loads import LoadTrace, loads_from_vllm_logs
from relibra.plan import PlannerState, Topology
from relibra.planners import PlanContext, run_planner
from relibra.planners.parallel import shutdown_workers, start_workers
from relibra.simulate import DEFAULT_PLANS, format_table, simulate_trace
from relibra.synthetic import SyntheticLoads, generate_loads
from tppo.base.fields import check_fields, with_assignments

ROOT = Path(__file__).resolve().parents[1]
ROUTING = ROOT / ".." / "shared" / "data" / "routing" / "qwen3-30b-a3b-vllm"
LOGS = ("ep_states.jsonl", "token_distri_8.jsonl", "token_distri_16.jsonl")
PLANS = (*DEFAULT_PLANS[:4], "eplb_history_global", *DEFAULT_PLANS[4:])
THOROUGH_NAME = "relibra_thorough"


def _thorough(cfg: RelibraConfig) -> RelibraConfig:
    """relibra with a planning budget of seconds rather than one: the placement descent prices 1536 swaps per layer
    and round (16 experts per node and node pair at EP 32)."""
    return dataclasses.replace(cfg, refine_candidates=1536, refine_rounds=400)


def _targets(rows: dict, name: str = "relibra") -> dict:
    ideal = rows["ideal"]["moe_us"]
    relibra = rows[name]["moe_us"]
    warm = rows[name]["warm_moe_vs_ideal"]
    eplb = min(rows[p]["moe_us"] for p in ("eplb_oracle", "eplb_oracle_global"))
    return {
        "relibra_vs_ideal": relibra / ideal,
        "warm_relibra_vs_ideal": warm,
        "speedup_vs_eplb_oracle": eplb / relibra,
        "speedup_vs_static": rows["static"]["moe_us"] / relibra,
        "relibra_mean_skew": rows[name]["mean_skew"],
        "met": {
            "within_5pct_of_ideal": relibra / ideal <= 1.05,
            "1.1x_vs_eplb_oracle": eplb / relibra >= 1.1,
            "1.3x_vs_static": rows["static"]["moe_us"] / relibra >= 1.3,
            "mean_skew_le_1.08": rows[name]["mean_skew"] <= 1.08,
        },
    }


def _run(label: str, trace: LoadTrace, ep: int, cfg: RelibraConfig, cost: CostModel) -> dict:
    topo = Topology(ep, 8, trace.num_experts, cfg.replica_slots)
    start = time.perf_counter()
    rows = simulate_trace(trace, topo, cfg, cost, PLANS, validate=True)
    (thorough,) = simulate_trace(trace, topo, _thorough(cfg), cost, ["relibra"], validate=True)
    rows.insert(-1, dataclasses.replace(thorough, plan=THOROUGH_NAME))
    print(
        f"\n== {label}: EP {ep}, loads {list(trace.loads_NMLSE.shape)} ({time.perf_counter() - start:.0f} s)"
    )
    print(format_table(rows, trace.num_steps))
    by_name = {r.plan: dataclasses.asdict(r) for r in rows}
    targets = _targets(by_name)
    targets["thorough"] = _targets(by_name, THOROUGH_NAME)
    bound = sum(
        moe_lower_bound_us(trace.loads_NMLSE[n], trace.topk, topo, cost) for n in range(trace.num_steps)
    )
    targets["lower_bound_vs_ideal"] = bound / by_name["ideal"]["moe_us"]
    met = ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in targets["met"].items())
    print(
        f"relibra/ideal {targets['relibra_vs_ideal']:.3f} (warm {targets['warm_relibra_vs_ideal']:.3f}), "
        f"vs eplb_oracle {targets['speedup_vs_eplb_oracle']:.2f}x, vs static {targets['speedup_vs_static']:.2f}x, mean skew {targets['relibra_mean_skew']:.3f} -> {met}"
    )
    t = targets["thorough"]
    print(
        f"{THOROUGH_NAME} (planning {by_name[THOROUGH_NAME]['planner_s_per_step']:.1f} s per step): relibra/ideal "
        f"{t['relibra_vs_ideal']:.3f} (warm {t['warm_relibra_vs_ideal']:.3f}), "
        f"vs eplb_oracle {t['speedup_vs_eplb_oracle']:.2f}x, vs static "
        f"{t['speedup_vs_static']:.2f}x, mean skew {t['relibra_mean_skew']:.3f}"
    )
    print(
        f"lower bound of any plan with in-node copies (relibra.cost_model.moe_lower_bound_us): "
        f"{targets['lower_bound_vs_ideal']:.3f} x ideal"
    )
    return {
        "label": label,
        "ep": ep,
        "shape_NMLSE": list(trace.loads_NMLSE.shape),
        "rows": by_name,
        **targets,
    }


def _planning_time(
    trace: LoadTrace, cost: CostModel, cfg: RelibraConfig, repeats: int, processes=(1, 2)
) -> list[dict]:
    """Wall and CPU seconds of planning one step, cold (from Megatron's static placement, a fresh state) and warm
    (from the state the previous step of the trace left: a training run's usual case), for each count of processes
    (this one and workers; the CPU seconds are this process's). The workers start before the timing, as a run
    starts them when it builds its planner; their start is timed apart."""
    topo = Topology(32, 8, trace.num_experts, cfg.replica_slots)
    out = []
    for count in processes:
        ctx = PlanContext(topo, dataclasses.replace(cfg, planner_processes=count), cost, trace.topk)
        shutdown_workers()  # the simulations above started them: time a fresh start
        start = time.perf_counter()
        start_workers(count)
        row: dict = {"processes": count, "worker_start_s": time.perf_counter() - start}
        states = [PlannerState()]
        for n in range(trace.num_steps - 1):
            states.append(run_planner("relibra", trace.loads_NMLSE[n], ctx, states[-1])[1])
        for kind, steps in (
            ("cold", [0] * repeats),
            ("warm", [1 + r % (trace.num_steps - 1) for r in range(repeats)]),
        ):
            wall, cpu = [], []
            for n in steps:
                state = states[n] if kind == "warm" else PlannerState()
                w0, c0 = time.perf_counter(), time.process_time()
                run_planner("relibra", trace.loads_NMLSE[n], ctx, state)
                wall.append(time.perf_counter() - w0)
                cpu.append(time.process_time() - c0)
            row |= {
                f"{kind}_wall_s_median": float(np.median(wall)), f"{kind}_wall_s_min": float(np.min(wall)),
                f"{kind}_cpu_s_median": float(np.median(cpu)),
            }  # fmt: skip
        row["load_average_1min"] = os.getloadavg()[0]
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="default: bench/out/relibra_sim[_pxn].json")
    p.add_argument("--gen-steps", type=int, default=3)
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--timing-repeats", type=int, default=6)
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic loads")
    p.add_argument(
        "--timing-processes",
        default="1,2",
        help="planner process counts to time (comma-separated; default 1,2)",
    )
    p.add_argument(
        "--nic-routing", choices=NIC_ROUTINGS, help="override the cost model's nic_routing (default: direct)"
    )
    p.add_argument("--ep", default="16,32", help="EP sizes to run (comma-separated; default 16,32)")
    p.add_argument("--replica-slots", type=int, default=2, help="R: spare expert slots per GPU (default 2)")
    p.add_argument(
        "--generator",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set a field of relibra.synthetic.SyntheticLoads (repeatable), e.g. response_scale=0",
    )
    args = p.parse_args()
    reserved = {
        "num_source_ranks": "--ep",
        "seed": "--seed",
        "num_steps": "--gen-steps",
        "tokens_per_rank": "--tokens-per-rank",
    }
    try:
        generator = with_assignments(SyntheticLoads(), args.generator, "--generator", reserved)
        eps = tuple(int(x) for x in args.ep.split(","))
        cfg = RelibraConfig(replica_slots=args.replica_slots)
        check_fields(cfg)
    except ValueError as err:
        p.error(str(err))
    cost = CostModel.from_yaml(nic_routing=args.nic_routing)
    suffix = "" if cost.nic_routing == "direct" else f"_{cost.nic_routing}"
    args.json = args.json or str(ROOT / "bench" / "out" / f"relibra_sim{suffix}.json")
    results: dict = {
        "numpy": np.__version__,
        "cost_model": dataclasses.asdict(cost),
        "config": dataclasses.asdict(cfg),
        "runs": [],
    }
    if ROUTING.is_dir():
        for ep in eps:
            trace = loads_from_vllm_logs(
                [ROUTING / f for f in LOGS], microbatch_tokens=256, num_source_ranks=ep
            )
            results["runs"].append(
                _run("real Qwen3-30B-A3B routing, 256-token micro-batches", trace, ep, cfg, cost)
            )
    else:
        print(f"real routing logs not found at {ROUTING}: skipping the real-data rows")
    gen32 = None
    for ep in eps:
        params = dataclasses.replace(
            generator,
            num_steps=args.gen_steps,
            num_source_ranks=ep,
            tokens_per_rank=args.tokens_per_rank,
            seed=args.seed,
        )
        start = time.perf_counter()
        trace = generate_loads(params)
        print(f"\n(generated {list(trace.loads_NMLSE.shape)} in {time.perf_counter() - start:.0f} s)")
        run = _run("synthetic RL-like loads", trace, ep, cfg, cost)
        run["generator"] = dataclasses.asdict(params)
        results["runs"].append(run)
        gen32 = trace if ep == 32 else gen32
    if gen32 is None:
        print("\nno EP 32 in --ep: planning time not measured")
    else:
        _report_planning_time(results, gen32, cost, cfg, args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.json}")


def _report_planning_time(results: dict, gen32: LoadTrace, cost: CostModel, cfg: RelibraConfig, args) -> None:
    counts = tuple(int(x) for x in args.timing_processes.split(","))
    timing = _planning_time(gen32, cost, cfg, args.timing_repeats, counts)
    results["planning_time_ep32_M32_L48_E128"] = timing
    print(
        "\n== relibra planning time, one step: 32 micro-batches x 48 layers x 128 experts, EP 32 (target < 1 s)"
    )
    for t in timing:
        print(
            f"processes {t['processes']} (workers started in {t['worker_start_s']:.2f} s): "
            + ", ".join(
                f"{k} wall median {t[f'{k}_wall_s_median']:.3f} s (min {t[f'{k}_wall_s_min']:.3f}, "
                f"CPU {t[f'{k}_cpu_s_median']:.3f} s)"
                for k in ("cold", "warm")
            )
            + f", load average {t['load_average_1min']:.2f}"
        )


if __name__ == "__main__":
    main()
