"""Where the roles run: nodes, devices, placement of ranks, Ray."""

from __future__ import annotations

from dataclasses import dataclass

from tppo.base.fields import spec


@dataclass
class ClusterConfig:
    """Where the roles run. Plumbing only; `ray_address` None starts a local Ray instance."""

    num_nodes: int = spec(1, ge=1)
    gpus_per_node: int = spec(0, ge=0, help="0: CPU-only (gloo)")
    cpus_per_node: int | None = None
    ray_address: str | None = None
    object_store_mb: int = spec(128, ge=64)
    placement: str = spec("colocated", choices=("colocated", "separate"))
    policy_ranks: int = spec(1, ge=1, help="trainer processes of the policy")
    critic_ranks: int = spec(1, ge=1)
    rollout_workers: int = spec(
        1, ge=1, help="rollout engines (the attention workers in the disaggregated layout), requests shared"
    )
    rollout_layout: str = spec(
        "replicas",
        choices=("replicas", "disaggregated"),
        help="replicas: every engine holds the whole model; disaggregated (MegaScale-Infer): the engines hold "
        "attention, KV and router, and cluster.expert_workers more processes hold the experts for all of them",
    )
    expert_workers: int = spec(1, ge=1, help="processes holding the experts in the disaggregated layout")
    offload: str = spec(
        "auto",
        choices=("auto", "on", "off"),
        help="time-share devices between roles (trainers offload while the rollout engine generates, the engine "
        "sleeps while they train); auto: on for colocated GPU runs. off when every role fits the GPU at once: it "
        "saves each step's offload, engine wake and CUDA-graph re-capture",
    )

    overlap_updates: str = spec(
        "auto",
        choices=("auto", "on", "off"),
        help="run the critic's update at the same time as the policy's (old log-probs, update, weight sync): they "
        "do not read each other. Needs roles that do not time-share devices (the critic offloads after its update "
        "to make room for the policy's); auto: on for GPU runs whose roles do not time-share (on 2 CPU cores the "
        "two trainers would only share them)",
    )

    @property
    def rollout_ranks(self) -> int:
        """Rollout processes: the engines, and in the disaggregated layout the expert workers."""
        experts = self.expert_workers if self.rollout_layout == "disaggregated" else 0
        return self.rollout_workers + experts

    @property
    def time_shared(self) -> bool:
        if self.offload == "auto":
            return bool(self.gpus_per_node) and self.placement == "colocated"
        return self.offload == "on"

    @property
    def overlapped_updates(self) -> bool:
        """Whether the critic's update runs while the policy's does (cluster.overlap_updates resolved)."""
        if self.overlap_updates == "auto":
            return bool(self.gpus_per_node) and not self.time_shared
        return self.overlap_updates == "on"
