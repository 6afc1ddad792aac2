"""Planning chunks of layers in parallel on worker processes (ours).

Every stage of the ReLibra family is independent per layer, so a step's layers split into fixed chunks. Threads do
not scale on them: the stages are thousands of NumPy calls on arrays of kilobytes to a few megabytes, and the GIL is
held between (and inside many of) them. Measured on a warm EP 32 step (32 micro-batches x 48 layers x 128 experts)
on a 2-core machine: 1 thread 0.83 s wall; 2 threads 0.76 s wall for 1.18 s of CPU; two separate processes planning
the whole step each at the same time ran at 0.84-0.87 s, i.e. at full speed. So the calling process plans the first
chunk and worker processes plan the others. The loads go to a worker and its quotas (the bulk of a plan: 19 MB per
24 layers at EP 32) come back through shared memory, since a pipe moved them at ~300 MB/s (0.1 s per step); the
placement and the slots are small and travel pickled.

Workers are forked by a fork server (`forkserver`), a clean process started for that, so they inherit neither the
threads of the driver that plans (Ray's; a forked child of a threaded process can deadlock) nor its memory; once per
worker count and process, and `start_workers` starts them ahead of the first step. Like spawned workers they import
the main module, so a script that plans with more than one process must do so under `if __name__ == "__main__":`.
A worker's exception is raised in the caller. A worker that dies (killed, out of memory) breaks its pool: this
process plans that chunk itself (the same plan), warns, and drops the pool, so the next call starts new workers.
A worker ends itself when the process that started it dies (even by SIGKILL), and the fork server and the
resource tracker then exit with it.

Chunk k of a step draws from the random stream (seed, step, k), so a plan depends on the seed and the number of
chunks, never on which process planned what.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from relibra.plan import Plan
from relibra.planners.base import PlanContext

__all__ = ["ChunkFn", "PlannerWorkerError", "plan_by_layer_chunks", "shutdown_workers", "start_workers"]

# (loads_MLSE of the chunk's layers, the placement in force for them [L, E], random stream, context) -> plan
ChunkFn = Callable[[np.ndarray, np.ndarray, np.random.Generator, PlanContext], Plan]

_POOLS: dict[int, ProcessPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


class PlannerWorkerError(RuntimeError):
    """The planner's worker processes could not start."""


@dataclass(frozen=True)
class _SharedArray:
    """An array in a named shared-memory block: what a process needs to map it.

    Reads and writes map the block only for the copy, so no array ever holds its buffer when it closes (an
    exception's traceback would otherwise keep a view alive and the close would fail). The workers share this
    process's resource tracker (the fork server passes it on), so mapping a block there registers nothing new: the
    creator's unlink is the only cleanup, and the tracker unlinks what a killed creator left.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    def write(self, src: np.ndarray) -> None:
        shm = SharedMemory(self.name)
        try:
            np.ndarray(self.shape, dtype=self.dtype, buffer=shm.buf)[...] = src
        finally:
            shm.close()

    def read_into(self, dst: np.ndarray) -> None:
        shm = SharedMemory(self.name)
        try:
            dst[...] = np.ndarray(self.shape, dtype=self.dtype, buffer=shm.buf)
        finally:
            shm.close()

    def read(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out


@contextmanager
def _shared_block(shape: tuple[int, ...], dtype):
    """A new shared-memory block for an array of `shape` and `dtype` (contents undefined), unlinked on exit."""
    dtype = np.dtype(dtype)
    shm = SharedMemory(create=True, size=max(1, int(np.prod(shape)) * dtype.itemsize))
    try:
        yield _SharedArray(shm.name, tuple(shape), dtype.str)
    finally:
        shm.close()
        shm.unlink()


def _exit_with(parent_pid: int) -> None:
    """Worker initializer: end this worker as soon as the process that started its pool is gone.

    Without it a killed driver leaves the workers blocked on their call queue for ever, and with them the fork
    server and the resource tracker: the workers hold the fork server's liveness pipe and the tracker's pipe
    open. PR_SET_PDEATHSIG would not do: a worker's parent is the fork server, not the driver."""
    threading.Thread(target=_watch, args=(parent_pid,), name="planner-parent-watch", daemon=True).start()


def _watch(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)  # Linux 5.3+: readable once the process has exited
    except ProcessLookupError:
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd here: ask every half second
        while _alive(pid):
            time.sleep(0.5)
    else:
        select.select([fd], [], [])
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (the pid was reused): ours is gone
        return False
    return True


def _import_planners() -> None:
    """Run in a fresh worker so that the first real chunk does not pay the imports."""
    import relibra.planners  # noqa: F401


def _pool(num_workers: int) -> ProcessPoolExecutor:
    """This process's pool of `num_workers` workers, started (and ready) on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(num_workers)
        if pool is not None:
            return pool
        pool = ProcessPoolExecutor(
            num_workers,
            mp_context=multiprocessing.get_context("forkserver"),
            initializer=_exit_with,
            initargs=(os.getpid(),),
        )
        try:
            for future in [pool.submit(_import_planners) for _ in range(num_workers)]:
                future.result()
        except BrokenProcessPool as err:
            pool.shutdown(wait=False, cancel_futures=True)
            # The usual cause: the worker re-imported the main script, which plans again at import time.
            raise PlannerWorkerError(
                f"a planner worker died while starting ({err}); a script that plans with planner_processes > 1 "
                'must do so under `if __name__ == "__main__":` (workers import the main module)'
            ) from err
        _POOLS[num_workers] = pool
        return pool


def _drop_pool(num_workers: int, pool: ProcessPoolExecutor) -> None:
    with _POOLS_LOCK:
        if _POOLS.get(num_workers) is pool:
            del _POOLS[num_workers]
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown_workers() -> None:
    """Stop every worker this process started (they also stop when it exits)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


def start_workers(num_processes: int) -> None:
    """Start the `num_processes - 1` workers that `plan_by_layer_chunks` uses ahead of the first step, and wait
    until they have imported the planners (~0.2-1 s)."""
    if num_processes > 1:
        _pool(num_processes - 1)


def _plan_in_worker(
    chunk_fn: ChunkFn,
    loads: _SharedArray,
    prev_LE: np.ndarray,
    seed: list[int],
    ctx: PlanContext,
    quota: _SharedArray,
) -> tuple[np.ndarray, np.ndarray]:
    """Plan one chunk from shared loads, write its quotas into the shared block; return (home_LE, slots_MLGJ)."""
    # int32 in transit; the chunk gets int64, as this process's does.
    loads_MLSE = loads.read().astype(np.int64, copy=False)
    plan = chunk_fn(loads_MLSE, prev_LE, np.random.default_rng(seed), ctx)
    if plan.quota_MLGJS.shape != quota.shape:
        raise ValueError(
            f"{getattr(chunk_fn, '__name__', chunk_fn)} returned quotas of shape {plan.quota_MLGJS.shape}, "
            f"expected {quota.shape}"
        )
    quota.write(plan.quota_MLGJS)
    return plan.home_LE, plan.slots_MLGJ


def _plan_here(chunk_fn: ChunkFn, loads_MLSE: np.ndarray, prev_LE: np.ndarray, lo: int, hi: int, seed, ctx):
    # Contiguous, as a worker gets its chunk: float reductions may depend on the layout.
    loads = np.ascontiguousarray(loads_MLSE[:, lo:hi])
    return chunk_fn(loads, prev_LE[lo:hi], np.random.default_rng(seed), ctx)


def _shared_memory_free() -> int | None:
    """Bytes free where POSIX shared memory lives (/dev/shm on Linux; a container's is 64 MiB unless raised), or
    None where that is not a directory to ask."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _plan_all_here(chunk_fn: ChunkFn, loads_MLSE, prev_LE, bounds, seeds, ctx: PlanContext) -> Plan:
    parts = [
        _plan_here(chunk_fn, loads_MLSE, prev_LE, lo, hi, seed, ctx) for (lo, hi), seed in zip(bounds, seeds)
    ]
    return Plan(
        home_LE=np.concatenate([p.home_LE for p in parts]),
        slots_MLGJ=np.concatenate([p.slots_MLGJ for p in parts], axis=1),
        quota_MLGJS=np.concatenate([p.quota_MLGJS for p in parts], axis=1),
        num_home_slots=ctx.topo.num_home_slots,
    )


def plan_by_layer_chunks(
    chunk_fn: ChunkFn, loads_MLSE: np.ndarray, prev_LE: np.ndarray, ctx: PlanContext, step: int
) -> Plan:
    """Plan `ctx.config.planner_processes` fixed chunks of layers, the first in this process and the others on
    workers, and stitch the plans. `chunk_fn` must be a module-level function (workers import it by name).

    A worker that dies (killed, out of memory) costs time, not the step: this process plans its chunk (the same
    plan: same loads, same random stream), warns, and the next call starts new workers. Where shared memory has no
    room for the workers' loads and quotas (writing past a full /dev/shm kills the writer with SIGBUS), this process
    plans every chunk, with a warning."""
    M, L, S, E = loads_MLSE.shape
    G, H = ctx.topo.num_gpus, ctx.topo.num_home_slots
    J = H + ctx.topo.num_replica_slots
    chunks = [c for c in np.array_split(np.arange(L), max(1, min(ctx.config.planner_processes, L))) if len(c)]
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
    seeds = [[ctx.config.seed, step, k] for k in range(len(chunks))]
    if len(chunks) == 1:
        return chunk_fn(loads_MLSE, prev_LE, np.random.default_rng(seeds[0]), ctx)
    # Counts fit int32 (the loads' in transit: half the bytes); quotas are int32 anyway.
    transit = np.int32 if loads_MLSE.max(initial=0) < 2**31 else np.int64
    need = sum(M * (hi - lo) * S * (E * np.dtype(transit).itemsize + G * J * 4) for lo, hi in bounds[1:])
    free = _shared_memory_free()
    if free is not None and need > 0.8 * free:
        warnings.warn(
            f"planning a step on workers needs {need / 2**20:.0f} MiB of shared memory and /dev/shm has "
            f"{free / 2**20:.0f} MiB free: planning in this process (in a container, raise its --shm-size)",
            RuntimeWarning,
            stacklevel=2,
        )
        return _plan_all_here(chunk_fn, loads_MLSE, prev_LE, bounds, seeds, ctx)
    workers = len(chunks) - 1
    pool = _pool(workers)
    quota = np.empty((M, L, G, J, S), dtype=np.int32)
    homes, slots, died = [None] * len(chunks), [None] * len(chunks), []
    with ExitStack() as blocks:
        futures, quotas = [], []
        for (lo, hi), seed in zip(bounds[1:], seeds[1:], strict=True):
            loads = blocks.enter_context(_shared_block((M, hi - lo, S, E), transit))
            loads.write(loads_MLSE[:, lo:hi])
            quotas.append(blocks.enter_context(_shared_block((M, hi - lo, G, J, S), np.int32)))
            try:
                futures.append(
                    pool.submit(_plan_in_worker, chunk_fn, loads, prev_LE[lo:hi], seed, ctx, quotas[-1])
                )
            except BrokenProcessPool:  # broken while idle: this process plans the chunk below
                futures.append(None)
        try:
            first = _plan_here(chunk_fn, loads_MLSE, prev_LE, *bounds[0], seeds[0], ctx)
        except BaseException:
            wait([f for f in futures if f is not None])  # the workers still map the blocks this exit unlinks
            raise
        homes[0], slots[0], quota[:, slice(*bounds[0])] = first.home_LE, first.slots_MLGJ, first.quota_MLGJS
        for k, (future, block) in enumerate(zip(futures, quotas, strict=True), start=1):
            lo, hi = bounds[k]
            try:
                if future is None:
                    raise BrokenProcessPool("the pool was broken before the step")
                homes[k], slots[k] = future.result()
                block.read_into(quota[:, lo:hi])
            except BrokenProcessPool as err:
                died.append((lo, hi, err))
                plan = _plan_here(chunk_fn, loads_MLSE, prev_LE, lo, hi, seeds[k], ctx)
                homes[k], slots[k], quota[:, lo:hi] = plan.home_LE, plan.slots_MLGJ, plan.quota_MLGJS
    if died:
        _drop_pool(workers, pool)
        warnings.warn(
            f"a planner worker died ({died[0][2]}); layers {[d[:2] for d in died]} were planned in this process, "
            "and the next step starts new workers",
            RuntimeWarning,
            stacklevel=2,
        )
    return Plan(
        home_LE=np.concatenate(homes),
        slots_MLGJ=np.concatenate(slots, axis=1),
        quota_MLGJS=quota,
        num_home_slots=H,
    )
