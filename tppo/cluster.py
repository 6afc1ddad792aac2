"""Ray bootstrap: a local instance sized for small machines, or joining an existing cluster by address.

Local mode keeps the object store small (it is shared memory: the default of 30% of RAM is wasteful on
24 GiB machines), turns Ray's token authentication off for the loopback-only cluster, and leaves the
dashboard off. Joining (`ray_address`: "auto" inside an sbatch allocation or host:port) never changes the
cluster's resources. Only a session that started Ray shuts it down.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tppo.config import ClusterConfig


@dataclass(frozen=True)
class RayInfo:
    """What the driver learned about the Ray cluster it is attached to."""

    address: str
    num_cpus: float
    num_gpus: float
    started_here: bool


def ray_init_kwargs(cfg: ClusterConfig) -> dict[str, object]:
    """Arguments of ray.init for this cluster config (a pure function, so tests can check it without Ray)."""
    if cfg.ray_address:
        return {"address": cfg.ray_address, "log_to_driver": True}
    num_cpus = cfg.cpus_per_node if cfg.cpus_per_node is not None else max(os.cpu_count() or 1, 1)
    return {
        "num_cpus": num_cpus,
        "num_gpus": cfg.gpus_per_node,
        "object_store_memory": cfg.object_store_mb * 1024 * 1024,
        "include_dashboard": False,
        "log_to_driver": True,
    }


@contextmanager
def ray_session(cfg: ClusterConfig) -> Iterator[RayInfo]:
    """Attach to Ray for the duration of the block; shut down only what this call started."""
    import ray

    if ray.is_initialized():
        yield _info(ray, started_here=False)
        return
    if not cfg.ray_address:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs = ray_init_kwargs(cfg)
    try:
        context = ray.init(**kwargs)
    except ConnectionError as err:
        raise RuntimeError(
            f"cannot join the Ray cluster at cluster.ray_address={cfg.ray_address!r}: {err}"
        ) from err
    try:
        yield _info(ray, started_here=True, address=getattr(context, "address_info", {}).get("address", ""))
    finally:
        ray.shutdown()


def _info(ray: object, *, started_here: bool, address: str = "") -> RayInfo:
    resources = ray.cluster_resources()  # type: ignore[attr-defined]
    return RayInfo(
        address=address,
        num_cpus=resources.get("CPU", 0.0),
        num_gpus=resources.get("GPU", 0.0),
        started_here=started_here,
    )
