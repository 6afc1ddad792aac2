"""A local Ray instance shared by the tests of one module that ask for it: their own `ray_session` blocks then
attach to it (ray_session starts nothing when Ray is up) instead of each starting and stopping one, ~8 s a test
on the CI's two cores. Each test still starts its own actors, which end with their handles."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_instance():
    from tppo.cluster.config import ClusterConfig
    from tppo.cluster.session import ray_session

    with ray_session(ClusterConfig(object_store_mb=100, cpus_per_node=2)) as info:
        yield info
