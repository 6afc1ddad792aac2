"""Configuration of ReLibra load balancing for a run (planner choice, slot budget, annealing schedule)."""

from __future__ import annotations

from dataclasses import dataclass

from tppo.fields import spec


@dataclass
class RelibraConfig:
    """Which planner places experts each step, and its knobs (specs/relibra.md)."""

    enabled: bool = True
    planner: str = spec("relibra", help="a registered planner name (relibra.planners)")
    gpus_per_node: int = spec(8, ge=1, help="EP ranks that share a fast intra-node link")
    replica_slots: int = spec(2, ge=0, help="R: spare expert slots per EP rank")
    min_replica_tokens: int = spec(256, ge=0, help="no replica below this many (token, expert) pairs")
    imbalance_tolerance: float = spec(0.02, ge=0, help="eps of the replication greedy")
    anneal_iters: int = spec(2000, ge=0, help="simulated-annealing swaps tried per layer and step")
    anneal_t0: float = spec(0.05, ge=0)
    anneal_cooling: float = spec(0.995, gt=0, le=1)
    smooth_beta: float = spec(20.0, gt=0, help="log-sum-exp sharpness of the smoothed max")
    history_decay: float = spec(0.9, ge=0, lt=1, help="moving average of eplb_history")
    cost_model: str | None = None
    microbatch_tokens: int = spec(256, ge=1, help="tokens per micro-batch when cutting token-order logs")
