"""Configuration of ReLibra load balancing for a run (planner choice, slot budget, annealing schedule)."""

from __future__ import annotations

from dataclasses import dataclass

from relibra.cost_model import NIC_ROUTINGS
from tppo.base.fields import spec


@dataclass
class RelibraConfig:
    """Which planner places experts each step, and its knobs (specs/relibra.md)."""

    enabled: bool = True
    planner: str = spec("relibra", help="a registered planner name (relibra.planners)")
    gpus_per_node: int = spec(
        8, ge=1, help="EP ranks per node (an EP group smaller than this sits in one node)"
    )
    replica_slots: int = spec(2, ge=0, help="R: spare expert slots per EP rank")
    state_buffer_mb: int = spec(
        1024,
        ge=1,
        help="receive buffers per rank of the optimizer state that a reorder moves during the step (MiB)",
    )
    min_replica_tokens: int = spec(256, ge=0, help="no replica below this many (token, expert) pairs")
    imbalance_tolerance: float = spec(0.005, ge=0, help="eps of the replication greedy")
    anneal_iters: int = spec(2000, ge=0, help="simulated-annealing swaps tried per layer and step")
    anneal_t0: float = spec(0.05, ge=0)
    anneal_cooling: float = spec(0.995, gt=0, le=1)
    smooth_beta: float = spec(20.0, gt=0, help="log-sum-exp sharpness of the smoothed max")
    history_decay: float = spec(0.9, ge=0, lt=1, help="moving average of eplb_history")
    cost_model: str | None = spec(
        None,
        help="cost-model YAML (None: the packaged Hopper defaults); in training its GEMM times and transfer "
        "sizes are rescaled to the trained model's expert shape",
    )
    nic_routing: str | None = spec(
        None,
        choices=NIC_ROUTINGS,
        help="the NIC a cross-node pair leaves through: direct (NCCL with NCCL_PXN_DISABLE=1) or pxn (NCCL's "
        "default on rail-optimised nodes); None: the cost model's (direct)",
    )
    microbatch_tokens: int = spec(256, ge=1, help="tokens per micro-batch when cutting token-order logs")
    # Knobs of the planners in relibra.planners (added with the planners; defaults are ours).
    seed: int = spec(0, ge=0, help="seeds the planners' random streams (plans are deterministic)")
    anneal_candidates: int = spec(32, ge=1, help="swaps evaluated per annealing move (best one proposed)")
    reorder_node_weight: float = spec(1.0, ge=0, help="alpha: smoothed max node load / gpus per node")
    reorder_gpu_weight: float = spec(0.25, ge=0, help="alpha': smoothed max GPU load")
    reorder_comm_weight: float = spec(1.0, ge=0, help="beta: smoothed max cross-node dispatch time")
    reorder_migration_weight: float = spec(
        1.0, ge=0, help="gamma: the time a step waits for the migration of moved experts"
    )
    refine_rounds: int = spec(
        64, ge=0, help="rounds of the exact swap descent on the placement floor after annealing (0: off)"
    )
    refine_candidates: int = spec(
        384,
        ge=0,
        help="swaps priced exactly per layer in each descent round, spread over the node pairs (0: off; more: a "
        "better placement, slower)",
    )
    planner_processes: int = spec(
        2,
        ge=1,
        help="processes that plan chunks of layers in parallel: this one and planner_processes - 1 worker processes",
    )
    eplb_num_groups: int = spec(0, ge=0, help="EPLB expert groups; 0 = one group per expert")
