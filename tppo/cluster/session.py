"""Ray bootstrap: a local instance sized for small machines, or joining an existing cluster by address.

Local mode keeps the object store small (it is shared memory: the default of 30% of RAM is wasteful on
24 GiB machines), turns Ray's token authentication off for the loopback-only cluster, and leaves the
dashboard off. Joining (`ray_address`: "auto" inside an sbatch allocation or host:port) never changes the
cluster's resources. Only a session that started Ray shuts it down.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from tppo.cluster.config import ClusterConfig

QUIET_WARNINGS = ",".join(
    [
        "ignore::FutureWarning",
        "ignore::DeprecationWarning",
        "ignore:Apex is not installed",
        "ignore:Transformer Engine and Apex are not installed",
        "ignore:full scope is deprecated",
    ]
)


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
        # Megatron-Core and torch.distributed warn on every rank about optional packages and renamed APIs;
        # repeated by each actor they bury the run's own output.
        "runtime_env": {"env_vars": {"PYTHONWARNINGS": QUIET_WARNINGS}},
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
    else:
        _check_reachable(cfg.ray_address)
    kwargs = ray_init_kwargs(cfg)
    try:
        context = ray.init(**kwargs)
    except (ConnectionError, SystemExit) as err:
        raise RuntimeError(
            f"cannot join the Ray cluster at cluster.ray_address={cfg.ray_address!r}: {err}"
        ) from err
    try:
        yield _info(ray, started_here=True, address=getattr(context, "address_info", {}).get("address", ""))
    finally:
        ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a host:port nobody listens on; ray.init would retry for minutes before giving up."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto" and ray:// client addresses are resolved by Ray itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise RuntimeError(f"cannot join the Ray cluster at cluster.ray_address={address!r}: {err}") from err


def _info(ray: object, *, started_here: bool, address: str = "") -> RayInfo:
    resources = ray.cluster_resources()  # type: ignore[attr-defined]
    return RayInfo(
        address=address,
        num_cpus=resources.get("CPU", 0.0),
        num_gpus=resources.get("GPU", 0.0),
        started_here=started_here,
    )
