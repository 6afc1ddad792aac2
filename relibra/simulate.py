"""Offline simulator: plan every step of a load file with several planners and compare their simulated step times.

    python -m relibra.simulate --loads FILE --ep N --gpus-per-node G --replica-slots R \\
        [--plans a,b,...] [--json OUT] [--dump-plans DIR] [--cost-model YAML] [--nic-routing direct|pxn]
        [--set key=value ...]

For each plan it prints one row: simulated MoE time relative to the ideal plan, mean and max skew (max/mean pairs
per GPU over all (step, micro-batch, layer)), cross-node bytes per step, migration bytes per step, planner wall
time per step, the MoE time broken into compute / all-to-all / replication / migration (the part of it the step
waits for: the cost model's `overlap_optimizer_state`), and the floor of the plan's
placements relative to ideal (`relibra.cost_model.placement_floor_us`: what no in-node replicas on those placements
can beat, migration excluded; so MoE/ideal splits into what the placement costs and what the replicas leave on
top; empty for EPLB-style plans, whose copies persist and may cross nodes). The same goes to `--json`, whose rows
also carry `warm_moe_vs_ideal`: MoE time / ideal over the steps after the first. Every plan is checked by
`relibra.validate` (unless --no-validate); the planner's wall time excludes that check and the cost evaluation.
`--dump-plans DIR` writes DIR/<plan>.npz with `home` int [N, L, E] and `served` int [N, M, L, G, E] (pairs of expert
e computed on GPU g) so a plan can be checked without the simulator; the ideal plan has no placement and is not
dumped.

A load file whose source ranks are a multiple of --ep is folded (source s counts as EP rank s % ep: data
parallelism wider than EP); any other mismatch is an error. Steps are planned in order, each planner carrying its
own state (previous placement, load history); the first step migrates from Megatron's static placement.

Legend: N steps, M micro-batches, L layers, S source ranks, E experts, G GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from relibra.config import RelibraConfig
from relibra.cost_model import (
    NIC_ROUTINGS,
    CostModel,
    StepCost,
    ideal_step_cost,
    placement_floor_us,
    step_cost,
)
from relibra.loads import LoadTrace, load_loads
from relibra.plan import IdealPlan, PlannerState, Topology, static_home_LE
from relibra.planners import PLANNERS, PlanContext, run_planner
from relibra.validate import validate_plan
from tppo.base.fields import check_fields, with_assignments

__all__ = ["DEFAULT_PLANS", "PlanSummary", "fold_sources", "format_table", "main", "simulate_trace"]

DEFAULT_PLANS = (
    "static",
    "eplb_history",
    "eplb_oracle",
    "eplb_oracle_global",
    "greedy_lpt",
    "reorder_only",
    "replicate_only",
    "relibra",
    "ideal",
)


@dataclass(frozen=True)
class PlanSummary:
    """One row of the table: totals over the steps (microseconds), per-step means where named so.

    warm_moe_vs_ideal: MoE time / ideal over the steps after the first (NaN with one step): the first step of a run
    starts cold, from Megatron's static placement, and pays a one-time migration out of it.
    """

    plan: str
    moe_vs_ideal: float
    warm_moe_vs_ideal: float
    floor_vs_ideal: float
    moe_us: float
    step_us: float
    compute_us: float
    alltoall_us: float
    replication_us: float
    migration_us: float
    mean_skew: float
    max_skew: float
    cross_node_gb_per_step: float
    migration_gb_per_step: float
    planner_s_per_step: float
    planner_s_max: float


def fold_sources(loads_NMLSE: np.ndarray, ep: int) -> np.ndarray:
    """Fold S source ranks onto `ep` EP ranks (s -> s % ep) when ep divides S; ValueError otherwise."""
    S = loads_NMLSE.shape[3]
    if ep == S:
        return loads_NMLSE
    if S % ep:
        raise ValueError(f"the load file has {S} source ranks; --ep={ep} must equal or divide it")
    N, M, L, _, E = loads_NMLSE.shape
    return loads_NMLSE.reshape(N, M, L, S // ep, ep, E).sum(axis=3)


def _ratio(x: float, y: float) -> float:
    return x / y if y > 0 else float("nan")


def _summary(
    name: str, costs: list[StepCost], floors: list[float], ideal: list[StepCost], times: list[float]
) -> PlanSummary:
    n = len(costs)
    skew = np.concatenate([c.skew_ML.reshape(-1) for c in costs])
    moe = sum(c.moe_us for c in costs)
    ideal_moe_us = sum(c.moe_us for c in ideal)
    return PlanSummary(
        plan=name,
        moe_vs_ideal=_ratio(moe, ideal_moe_us),
        warm_moe_vs_ideal=_ratio(sum(c.moe_us for c in costs[1:]), sum(c.moe_us for c in ideal[1:])),
        floor_vs_ideal=_ratio(sum(floors), ideal_moe_us) if floors else float("nan"),
        moe_us=moe,
        step_us=sum(c.step_us for c in costs),
        compute_us=sum(c.compute_us for c in costs),
        alltoall_us=sum(c.alltoall_us for c in costs),
        replication_us=sum(c.replication_us for c in costs),
        migration_us=sum(c.migration_us for c in costs),
        mean_skew=float(np.nanmean(skew)),
        max_skew=float(np.nanmax(skew)),
        cross_node_gb_per_step=sum(c.cross_node_bytes for c in costs) / n / 1e9,
        migration_gb_per_step=sum(c.migration_bytes for c in costs) / n / 1e9,
        planner_s_per_step=float(np.mean(times)),
        planner_s_max=float(np.max(times)),
    )


def simulate_trace(
    trace: LoadTrace,
    topo: Topology,
    config: RelibraConfig,
    cost: CostModel,
    plans: Sequence[str] = DEFAULT_PLANS,
    validate: bool = True,
    dump_dir: str | Path | None = None,
) -> list[PlanSummary]:
    """Plan and simulate every step with every named planner; returns one summary per planner, in order."""
    for name in plans:
        PLANNERS.get(name)  # unknown names fail before any work
    loads_all = trace.loads_NMLSE
    ctx = PlanContext(topo=topo, config=config, cost=cost, topk=trace.topk)
    ideal = [ideal_step_cost(loads_all[n], trace.topk, topo, cost) for n in range(trace.num_steps)]
    out = []
    for name in plans:
        state, prev = PlannerState(), static_home_LE(trace.num_layers, topo)
        costs, floors, times, homes, served = [], [], [], [], []
        for n in range(trace.num_steps):
            loads = loads_all[n]
            start = time.perf_counter()
            plan, state = run_planner(name, loads, ctx, state)
            times.append(time.perf_counter() - start)
            if validate:
                validate_plan(plan, loads, topo)
            if isinstance(plan, IdealPlan):
                costs.append(ideal[n])
                continue
            costs.append(step_cost(plan, loads, trace.topk, topo, cost, prev))
            if not plan.persistent_replicas:
                floors.append(placement_floor_us(loads, plan.home_LE, topo, cost))
            prev = plan.home_LE
            if dump_dir is not None:
                homes.append(plan.home_LE.astype(np.int32))
                served.append(plan.served_MLGE().astype(np.int32))
        if dump_dir is not None and homes:
            Path(dump_dir).mkdir(parents=True, exist_ok=True)
            np.savez_compressed(Path(dump_dir) / f"{name}.npz", home=np.stack(homes), served=np.stack(served))
        out.append(_summary(name, costs, floors, ideal, times))
    return out


def format_table(rows: Sequence[PlanSummary], num_steps: int) -> str:
    """A fixed-width table; times per step in milliseconds."""
    head = (
        f"{'plan':<20} {'MoE/ideal':>9} {'floor':>6} {'skew mean':>9} {'skew max':>8} {'xnode GB':>8} {'migr GB':>7} "
        f"{'plan s':>7} {'compute':>8} {'a2a':>8} {'repl':>7} {'migr':>7}"
    )
    lines = [head, "-" * len(head)]
    ms = 1e-3 / num_steps
    for r in rows:
        lines.append(
            f"{r.plan:<20} {r.moe_vs_ideal:>9.3f} {_blank_nan(r.floor_vs_ideal):>6} {r.mean_skew:>9.3f} {r.max_skew:>8.2f} "
            f"{r.cross_node_gb_per_step:>8.2f} {r.migration_gb_per_step:>7.2f} {r.planner_s_per_step:>7.3f} "
            f"{r.compute_us * ms:>8.1f} {r.alltoall_us * ms:>8.1f} {r.replication_us * ms:>7.1f} "
            f"{r.migration_us * ms:>7.1f}"
        )
    lines.append(
        "times: ms per step (MoE part); MoE/ideal: simulated MoE time over the ideal plan's; floor: the placement's "
        "floor over the ideal MoE time (no in-node replicas can beat it)"
    )
    return "\n".join(lines)


def _blank_nan(x: float) -> str:
    return "" if np.isnan(x) else f"{x:.3f}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m relibra.simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", required=True, help=".npz with loads [N, M, L, S, E] and topk")
    p.add_argument("--ep", type=int, required=True, help="expert-parallel ranks (GPUs)")
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--replica-slots", type=int, required=True, help="R: spare expert slots per GPU")
    p.add_argument(
        "--plans", default=",".join(DEFAULT_PLANS), help=f"comma list of {', '.join(PLANNERS.names())}"
    )
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--dump-plans", help="write DIR/<plan>.npz with home and served")
    p.add_argument("--cost-model", help="cost-model YAML (default: the packaged Hopper defaults)")
    p.add_argument(
        "--nic-routing",
        choices=NIC_ROUTINGS,
        help="override the cost model's nic_routing (relibra.cost_model)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a RelibraConfig field"
    )
    p.add_argument("--no-validate", action="store_true", help="skip the plan validator")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        trace = load_loads(args.loads)
        loads = fold_sources(trace.loads_NMLSE, args.ep)
        trace = LoadTrace(loads, trace.topk)
        config = with_assignments(
            RelibraConfig(gpus_per_node=args.gpus_per_node, replica_slots=args.replica_slots),
            args.set,
            "--set",
            reserved={"gpus_per_node": "--gpus-per-node", "replica_slots": "--replica-slots"},
        )
        check_fields(config)
        topo = Topology(args.ep, args.gpus_per_node, trace.num_experts, args.replica_slots)
        cost = CostModel.from_yaml(
            args.cost_model or config.cost_model, args.nic_routing or config.nic_routing
        )
        plans = [p.strip() for p in args.plans.split(",") if p.strip()]
        rows = simulate_trace(trace, topo, config, cost, plans, not args.no_validate, args.dump_plans)
    except (ValueError, KeyError, OSError) as err:
        if os.environ.get("RELIBRA_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(rows, trace.num_steps))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "loads": str(args.loads),
            "ep": args.ep,
            "gpus_per_node": args.gpus_per_node,
            "replica_slots": args.replica_slots,
            "num_steps": trace.num_steps,
            "shape_NMLSE": list(trace.loads_NMLSE.shape),
            "config": dataclasses.asdict(config),
            "cost_model": dataclasses.asdict(cost),
        }
        Path(args.json).write_text(
            json.dumps({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
