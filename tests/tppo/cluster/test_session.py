"""Ray bootstrap on this machine: a small local instance, used and shut down cleanly."""

from __future__ import annotations

import pytest

from tppo.cluster.config import ClusterConfig
from tppo.cluster.session import ray_init_kwargs, ray_session


def test_local_kwargs_are_small_and_join_kwargs_touch_nothing():
    local = ray_init_kwargs(ClusterConfig(object_store_mb=100, cpus_per_node=2))
    assert local["object_store_memory"] == 100 * 1024 * 1024 and local["num_cpus"] == 2
    assert local["include_dashboard"] is False
    assert ray_init_kwargs(ClusterConfig(ray_address="auto")) == {"address": "auto", "log_to_driver": True}


@pytest.mark.dist
def test_local_ray_session_runs_a_task_and_shuts_down():
    import ray

    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)) as info:
        assert info.started_here and info.num_cpus == 2

        @ray.remote
        def square(x: int) -> int:
            return x * x

        assert ray.get([square.remote(i) for i in range(4)]) == [0, 1, 4, 9]
    assert not ray.is_initialized()


@pytest.mark.dist
def test_joining_a_missing_cluster_is_a_clear_error():
    with (
        pytest.raises(RuntimeError, match="cannot join the Ray cluster"),
        ray_session(ClusterConfig(ray_address="127.0.0.1:1")),
    ):
        pass


JOIN = """
import os, sys
import ray
try:
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    print("joined", flush=True)
    ray.shutdown()
except BaseException as err:
    print("refused", type(err).__name__, flush=True)
"""


def _joins(address: str, envs_and_timeouts: list[tuple[dict, float]]) -> list[str]:
    """What separate processes, started together, get when each tries to join the cluster with its environment:
    'joined', 'refused ...' or '' when it is still waiting at its timeout, counted from the start (Ray retries
    an unauthenticated connection instead of failing)."""
    import subprocess
    import sys
    import time

    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", JOIN, address],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for env, _ in envs_and_timeouts
    ]
    out = []
    for proc, (_, timeout) in zip(procs, envs_and_timeouts):
        try:
            out.append(proc.communicate(timeout=max(0.0, start + timeout - time.monotonic()))[0].strip())
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out.append("")
    return out


@pytest.mark.dist
def test_local_cluster_admits_only_holders_of_its_token(monkeypatch):
    import os

    import ray

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=1)):
        assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
        address = ray.get_runtime_context().gcs_address
        assert ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_MODE")).remote()) == "token"
        outsider = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        no_token, wrong_token, same_token = _joins(
            address,
            [
                (outsider | {"RAY_AUTH_MODE": "disabled"}, 15),
                (outsider | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, 15),
                (dict(os.environ), 60),
            ],
        )
        assert not no_token.startswith("joined") and not wrong_token.startswith("joined")
        assert same_token == "joined"  # the same token: admitted
