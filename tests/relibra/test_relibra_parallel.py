"""Planning chunks of layers on worker processes against planning them in this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from relibra.config import RelibraConfig
from relibra.cost_model import CostModel
from relibra.plan import PlannerState, Topology, static_home_LE
from relibra.planners import PlanContext, _relibra_chunk, parallel, run_planner
from relibra.planners.parallel import plan_by_layer_chunks, shutdown_workers
from relibra.synthetic import SyntheticLoads, generate_loads
from relibra.validate import validate_plan

TOPO = Topology(16, 8, 32, 2)


def _loads(L: int = 5, seed: int = 0) -> np.ndarray:
    params = SyntheticLoads(
        num_steps=1, num_microbatches=3, num_layers=L, num_source_ranks=16, num_experts=32, topk=4,
        tokens_per_rank=512, group_size=4, seed=seed,
    )  # fmt: skip
    return generate_loads(params).loads_NMLSE[0]


def _ctx(processes: int) -> PlanContext:
    cfg = RelibraConfig(min_replica_tokens=32, anneal_iters=300, planner_processes=processes)
    return PlanContext(TOPO, cfg, CostModel.from_yaml(), 4)


def _shm_names() -> set[str]:
    """Python's shared-memory blocks (the workers' semaphores live there too, and stay with the pools)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}


@pytest.mark.parametrize("processes", [2, 3])
def test_workers_plan_what_this_process_plans_chunk_by_chunk(processes):
    loads = _loads()
    before = _shm_names()
    state = PlannerState(
        home_LE=np.random.default_rng(1).permuted(static_home_LE(5, TOPO), axis=1), num_steps=4
    )
    plan, _ = run_planner("relibra", loads, _ctx(processes), state)
    validate_plan(plan, loads, TOPO)
    chunks = [c for c in np.array_split(np.arange(5), processes)]
    ctx = _ctx(1)
    parts = [
        _relibra_chunk(
            loads[:, c[0] : c[-1] + 1], state.home_LE[c[0] : c[-1] + 1], np.random.default_rng([0, 4, k]), ctx
        )
        for k, c in enumerate(chunks)
    ]
    np.testing.assert_array_equal(plan.home_LE, np.concatenate([p.home_LE for p in parts]))
    np.testing.assert_array_equal(plan.slots_MLGJ, np.concatenate([p.slots_MLGJ for p in parts], axis=1))
    np.testing.assert_array_equal(plan.quota_MLGJS, np.concatenate([p.quota_MLGJS for p in parts], axis=1))
    assert _shm_names() <= before, "shared-memory blocks left behind"


@pytest.fixture
def faults(monkeypatch):
    """The failing chunk planners, importable by workers started after this (they take this sys.path)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    shutdown_workers()
    import chunk_faults

    yield chunk_faults
    shutdown_workers()


def test_a_workers_exception_reaches_the_caller_and_the_workers_stay(faults):
    loads, ctx, prev = _loads(), _ctx(2), static_home_LE(5, TOPO)
    before = _shm_names()
    with pytest.raises(ValueError, match="failed on purpose"):
        plan_by_layer_chunks(faults.fail_in_worker, loads, prev, ctx, step=0)
    plan = plan_by_layer_chunks(_relibra_chunk, loads, prev, ctx, step=0)
    validate_plan(plan, loads, TOPO)
    assert _shm_names() <= before


def test_a_dead_worker_costs_time_not_the_plan(faults):
    """The chunk of a worker that dies is planned in this process (the same plan); the next call has new workers."""
    loads, ctx, prev = _loads(), _ctx(2), static_home_LE(5, TOPO)
    before = _shm_names()
    want = plan_by_layer_chunks(_relibra_chunk, loads, prev, ctx, step=0)
    with pytest.warns(RuntimeWarning, match="planner worker died"):
        got = plan_by_layer_chunks(faults.die_in_worker, loads, prev, ctx, step=0)
    for name in ("home_LE", "slots_MLGJ", "quota_MLGJS"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # new workers: no death, no warning
        again = plan_by_layer_chunks(_relibra_chunk, loads, prev, ctx, step=0)
    np.testing.assert_array_equal(again.quota_MLGJS, want.quota_MLGJS)
    assert _shm_names() <= before


def test_a_script_without_the_main_guard_gets_a_clear_error_not_a_hang(tmp_path):
    """Workers import the main module: a script that starts them at import time would start them again in each
    worker. It must fail fast and say what to do."""
    script = tmp_path / "unguarded.py"
    script.write_text("from relibra.planners.parallel import start_workers\n\nstart_workers(2)\n")
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert run.returncode != 0
    assert "PlannerWorkerError" in run.stderr and 'if __name__ == "__main__":' in run.stderr


def test_without_room_in_shared_memory_this_process_plans_every_chunk(monkeypatch):
    """A full /dev/shm would kill the writer (SIGBUS): with too little room, no block is made, same plan."""
    loads, ctx, prev = _loads(), _ctx(3), static_home_LE(5, TOPO)
    want = plan_by_layer_chunks(_relibra_chunk, loads, prev, ctx, step=0)
    monkeypatch.setattr(parallel, "_shared_memory_free", lambda: 1024)
    monkeypatch.setattr(parallel, "_shared_block", None)  # any block would fail loudly
    with pytest.warns(RuntimeWarning, match="shm-size"):
        got = plan_by_layer_chunks(_relibra_chunk, loads, prev, ctx, step=0)
    for name in ("home_LE", "slots_MLGJ", "quota_MLGJS"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def _descendants(pid: int) -> set[int]:
    """The processes below `pid`, read from /proc (children of children included)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.isdigit():
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process tree from /proc")
def test_a_driver_killed_alone_takes_its_planner_processes_with_it(tmp_path):
    """SIGKILL gives the driver no chance to stop its workers: they, the fork server and the resource tracker
    must still be gone within seconds, not wait for ever on a call queue nobody writes to."""
    script = tmp_path / "driver.py"
    script.write_text(
        "import time\n"
        "from relibra.planners.parallel import start_workers\n\n"
        'if __name__ == "__main__":\n'
        "    start_workers(3)\n"
        '    print("ready", flush=True)\n'
        "    time.sleep(600)\n"
    )
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True
    )
    try:
        assert driver.stdout.readline().strip() == "ready"
        helpers = _descendants(driver.pid)
        # the resource tracker and the fork server below the driver, two workers below the fork server
        assert len(helpers) == 4, helpers
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 10
    while (left := {p for p in helpers if _running(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in left:  # do not leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"still running 10 s after the driver was killed: {sorted(left)}"
