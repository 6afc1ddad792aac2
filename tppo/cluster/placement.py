"""Where every rank of every role runs: one Ray placement group for the run, a bundle per device slot.

Colocated (`cluster.placement=colocated`): n = max(ranks of any role) bundles; rank i
of every role sits on bundle i, and the roles that share a bundle split its GPU evenly in Ray's books (the
memory itself is time-shared: trainers offload while the rollout engine generates, the engine sleeps while they
train; see tppo.loop.driver). Separate: one bundle, one whole GPU, per rank of every role.

The group is reserved before any actor starts, so a cluster that cannot hold the layout fails at once with the
resources it asked for and what the cluster has, instead of actors waiting forever for a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tppo.cluster.config import ClusterConfig

ROLES = ("policy", "critic", "rollout", "reference")
CPU_PER_ACTOR = 0.01  # actors are bound by their threads, not Ray's CPU count
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Seat:
    """One rank's place: the bundle it runs in and the GPU share it asks Ray for."""

    bundle: int
    num_gpus: float


@dataclass(frozen=True)
class Layout:
    bundles: list[dict[str, float]]
    seats: dict[str, list[Seat]]


def layout(cluster: ClusterConfig, reference_ranks: int = 0) -> Layout:
    """The bundles and every rank's seat (see the module docstring); the reference policy (a KL penalty's) has
    `reference_ranks` ranks, placed like the policy's."""
    ranks = {
        "policy": cluster.policy_ranks,
        "critic": cluster.critic_ranks,
        "rollout": cluster.rollout_ranks,
        "reference": reference_ranks,
    }
    gpu = 1.0 if cluster.gpus_per_node else 0.0
    if cluster.placement == "colocated":
        num_bundles = max(ranks.values())
        sharing = [sum(1 for r in ROLES if i < ranks[r]) for i in range(num_bundles)]
        seats = {r: [Seat(i, gpu / sharing[i]) for i in range(ranks[r])] for r in ROLES}
        bundles = [_bundle(gpu, sharing[i]) for i in range(num_bundles)]
        return Layout(bundles, seats)
    seats, bundles = {}, []
    for role in ROLES:
        seats[role] = [Seat(len(bundles) + i, gpu) for i in range(ranks[role])]
        bundles += [_bundle(gpu, 1) for _ in range(ranks[role])]
    return Layout(bundles, seats)


def _bundle(gpu: float, num_actors: int) -> dict[str, float]:
    bundle = {"CPU": CPU_PER_ACTOR * num_actors}
    if gpu:
        bundle["GPU"] = gpu
    return bundle


@dataclass
class Reservation:
    """The reserved placement group and the layout it holds."""

    group: Any
    layout: Layout

    def options(self, role: str, rank: int) -> dict[str, Any]:
        """Ray actor options that put `role`'s rank `rank` in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        seat = self.layout.seats[role][rank]
        return {
            "num_cpus": CPU_PER_ACTOR,
            "num_gpus": seat.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=seat.bundle
            ),
        }


@contextmanager
def reserve(
    cluster: ClusterConfig, reference_ranks: int = 0, timeout_s: float = READY_TIMEOUT_S
) -> Iterator[Reservation]:
    """Reserve the run's placement group for the block (Ray must be up); RuntimeError if it cannot be placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    plan = layout(cluster, reference_ranks)
    group = placement_group(plan.bundles, strategy="PACK")
    try:
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            need = {k: sum(b.get(k, 0.0) for b in plan.bundles) for k in ("CPU", "GPU")}
            have = {k: ray.cluster_resources().get(k, 0.0) for k in ("CPU", "GPU")}
            raise RuntimeError(
                f"the roles need {len(plan.bundles)} bundles ({need['GPU']:g} GPUs, {need['CPU']:g} CPUs in "
                f"Ray's books, placement={cluster.placement}); the Ray cluster has {have['GPU']:g} GPUs and "
                f"{have['CPU']:g} CPUs: no placement within {timeout_s:.0f} s"
            ) from err
        yield Reservation(group, plan)
    finally:
        remove_placement_group(group)
