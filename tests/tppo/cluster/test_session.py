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
