"""Ray bootstrap: a local instance sized for small machines, or joining an existing cluster by address.

Local mode keeps the object store small (it is shared memory: the default of 30% of RAM is wasteful on
24 GiB machines), leaves the dashboard off, and requires Ray's token authentication with a fresh token that
lives only in the environment of this process tree (Ray 2.60's servers listen on every interface of the machine
whatever address the node advertises, so the token is what keeps other users of the network out; Ray's own
default would store a token readable by every local user in ~/.ray/auth_token). RAY_AUTH_MODE set by the user
is respected, "disabled" included. Joining (`ray_address`: "auto" inside an sbatch allocation or host:port) never changes the
cluster's resources. Only a session that started Ray shuts it down.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
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
        local_auth_token()
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


def local_auth_token() -> None:
    """Token authentication for a Ray instance this process starts, unless the user chose a mode or a token.

    The token goes into this process's environment, which Ray's processes and actors inherit. Ray reads its
    authentication settings once, at import: when it was imported before, they are reloaded here from the
    environment, so the driver presents the token the new cluster expects (a stale one would leave the driver
    retrying and its actors unreachable)."""
    mode = os.environ.setdefault("RAY_AUTH_MODE", "token")
    if mode == "token" and not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    if "ray" in sys.modules:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


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
