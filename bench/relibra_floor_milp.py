"""How far relibra's placement is from the best placement: the placement floor as an exact MILP (HiGHS), per layer.

    python bench/relibra_floor_milp.py [--ep 32] [--seed 0] [--step 1] [--layers 0,1] [--time-limit 120]
        [--json bench/out/relibra_floor_milp.json]

`relibra.cost_model.placement_floor_us` is the MoE time (migration excluded) that no in-node replicas can beat on a
placement; it depends only on which NODE owns each expert. For one (step, layer) of the generator's loads, with
x[e, z] = 1 when node z owns expert e (E/Z experts per node), t_m and u_m the compute and NIC terms of micro-batch m,
and the notation of `placement_floor_us` (direct routing):

    min  sum_m  c t_m + k u_m   (+ the all-to-all latencies, a constant)
    s.t. t_m >= NL_mz / Q,  u_m >= Recv_mz / Q,  u_m >= Send_ms   for every node z and source rank s,

c = a (1 + f_bwd), k = 4 bytes per pair / B_nic; NL, Recv and Send are linear in x. HiGHS returns the best placement
it found (primal) and a proven lower bound (dual) within the time limit. The table compares them with the floor of
the placement relibra chose for that step (warm: planned from the previous steps, as in training), all divided by
the layer's ideal MoE time (`relibra.cost_model.ideal_step_cost`). A dual bound near 1.0 proves nothing: the LP
relaxation spreads every expert evenly over the nodes, which is perfectly balanced.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from relibra.config import RelibraConfig
from relibra.cost_model import NUM_ALLTOALLS, CostModel, ideal_step_cost, placement_floor_us
from relibra.plan import PlannerState, Topology
from relibra.planners import PlanContext, run_planner
from relibra.synthetic import SyntheticLoads, generate_loads

ROOT = Path(__file__).resolve().parents[1]


def floor_milp(loads_MSE: np.ndarray, topo: Topology, cost: CostModel, time_limit_s: float):
    """Solve the module docstring's MILP for one layer; returns (primal_us, dual_us, node_E or None, message)."""
    M, S, E = loads_MSE.shape
    Z, Q = topo.num_nodes, topo.node_size
    W_ME = loads_MSE.sum(axis=1)
    A_MZE = loads_MSE.reshape(M, Z, Q, E).sum(axis=2)
    nx = E * Z  # x[e, z] at e * Z + z; then t_m, then u_m
    t_col, u_col = nx + np.arange(M), nx + M + np.arange(M)
    c = cost.gemm_us_per_token * (1.0 + cost.backward_factor)
    k = NUM_ALLTOALLS * cost.pair_bytes / (cost.nic_gb_per_s * 1e3)
    col_EZ = np.arange(nx).reshape(E, Z)

    def block(coef_RE: np.ndarray, node_R: np.ndarray, slack_col_R: np.ndarray) -> sp.csr_matrix:
        """Rows sum_e coef[r, e] x[e, node[r]] - var[slack_col[r]]."""
        R = coef_RE.shape[0]
        rows = np.repeat(np.arange(R), E + 1)
        cols = np.concatenate([col_EZ[:, node_R].T, slack_col_R[:, None]], axis=1).reshape(-1)
        vals = np.concatenate([coef_RE, -np.ones((R, 1))], axis=1).reshape(-1)
        return sp.csr_matrix((vals, (rows, cols)), shape=(R, nx + 2 * M))

    m_Z = np.repeat(np.arange(M), Z)
    z_M = np.tile(np.arange(Z), M)
    node_load = block(np.repeat(W_ME, Z, axis=0) / Q, z_M, t_col[m_Z])
    recv = block((np.repeat(W_ME, Z, axis=0) - A_MZE.reshape(M * Z, E)) / Q, z_M, u_col[m_Z])
    # Send_ms = sum_e L[m, s, e] (1 - x[e, node(s)]) <= u_m
    send = block(
        -loads_MSE.reshape(M * S, E).astype(np.float64),
        np.tile(np.arange(S) // Q, M),
        u_col[np.repeat(np.arange(M), S)],
    )
    ineq = LinearConstraint(
        sp.vstack([node_load, recv, send]),
        -np.inf,
        np.concatenate([np.zeros(2 * M * Z), -loads_MSE.sum(axis=2).reshape(-1).astype(np.float64)]),
    )
    one_node = sp.csr_matrix(
        (np.ones(nx), (np.repeat(np.arange(E), Z), np.arange(nx))), shape=(E, nx + 2 * M)
    )
    per_node = sp.csr_matrix((np.ones(nx), (np.tile(np.arange(Z), E), np.arange(nx))), shape=(Z, nx + 2 * M))
    size = E // Z
    eq = LinearConstraint(
        sp.vstack([one_node, per_node]),
        np.r_[np.ones(E), np.full(Z, size)],
        np.r_[np.ones(E), np.full(Z, size)],
    )
    objective = np.concatenate([np.zeros(nx), np.full(M, c), np.full(M, k)])
    latency = NUM_ALLTOALLS * cost.alltoall_latency_us * float((W_ME.sum(axis=1) > 0).sum())
    res = milp(
        objective,
        constraints=[eq, ineq],
        integrality=np.r_[np.ones(nx), np.zeros(2 * M)],
        bounds=Bounds(np.zeros(nx + 2 * M), np.r_[np.ones(nx), np.full(2 * M, np.inf)]),
        options={"time_limit": time_limit_s, "disp": False},
    )
    node_E = None if res.x is None else np.round(res.x[:nx]).reshape(E, Z).argmax(axis=1)
    primal = np.inf if res.fun is None else res.fun + latency
    return primal, res.mip_dual_bound + latency, node_E, res.message


def _home_from_nodes(node_E: np.ndarray, topo: Topology) -> np.ndarray:
    """Any placement with these node owners (the floor ignores which GPU of the node)."""
    per_gpu = topo.num_experts // topo.num_gpus
    home = np.empty_like(node_E)
    for z in range(topo.num_nodes):
        experts = np.flatnonzero(node_E == z)
        home[experts] = z * topo.node_size + np.arange(experts.size) // per_gpu
    return home


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--step", type=int, default=1, help="which step of the trace (planned warm from the earlier ones)"
    )
    p.add_argument("--layers", default="0", help="comma-separated layers")
    p.add_argument("--time-limit", type=float, default=120.0, help="HiGHS seconds per layer")
    p.add_argument("--json", default=str(ROOT / "bench" / "out" / "relibra_floor_milp.json"))
    args = p.parse_args()
    if args.ep % 8 or args.ep < 16:
        p.error(f"--ep {args.ep}: needs at least two nodes of 8 GPUs (a multiple of 8, >= 16)")
    cost = CostModel.from_yaml(nic_routing="direct")
    topo = Topology(args.ep, 8, 128, 2)
    params = SyntheticLoads(num_steps=args.step + 1, num_source_ranks=args.ep, seed=args.seed)
    trace = generate_loads(params)
    layers = [int(x) for x in args.layers.split(",")]
    if not 0 <= min(layers) <= max(layers) < trace.num_layers:
        p.error(f"--layers must lie in [0, {trace.num_layers})")
    ctx = PlanContext(topo, RelibraConfig(), cost, trace.topk)
    state = PlannerState()
    for n in range(args.step + 1):
        plan, state = run_planner("relibra", trace.loads_NMLSE[n], ctx, state)
    loads = trace.loads_NMLSE[args.step]
    rows = []
    for layer in layers:
        one = loads[:, layer : layer + 1]
        ideal = ideal_step_cost(one, trace.topk, topo, cost).moe_us
        relibra = placement_floor_us(one, plan.home_LE[layer : layer + 1], topo, cost)
        start = time.perf_counter()
        primal, dual, node_E, message = floor_milp(one[:, 0], topo, cost, args.time_limit)
        seconds = time.perf_counter() - start
        if node_E is not None:  # the formulation must price its placement exactly as the floor does
            repriced = placement_floor_us(one, _home_from_nodes(node_E, topo)[None], topo, cost)
            if not np.isclose(primal, repriced, rtol=1e-9):
                raise AssertionError(f"layer {layer}: MILP objective {primal} != placement floor {repriced}")
        rows.append(
            {
                "layer": layer,
                "relibra_floor_vs_ideal": relibra / ideal,
                "milp_best_vs_ideal": primal / ideal,
                "milp_lower_bound_vs_ideal": dual / ideal,
                "seconds": seconds,
                "status": message,
            }
        )
        r = rows[-1]
        print(
            f"layer {layer:3d}: relibra floor {r['relibra_floor_vs_ideal']:.4f}  MILP best {r['milp_best_vs_ideal']:.4f}"
            f"  MILP lower bound {r['milp_lower_bound_vs_ideal']:.4f}  ({seconds:.0f} s: {message})",
            flush=True,
        )
    out = {
        "args": vars(args),
        "numpy": np.__version__,
        "generator": dataclasses.asdict(params),
        "layers": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
