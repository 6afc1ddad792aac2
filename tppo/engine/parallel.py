"""Process groups of one trainer: torch.distributed start-up and Megatron's parallel state for TP/PP/EP/DP.

`init_parallel(parallel_cfg)` starts torch.distributed when it is not running yet (gloo on CPU, NCCL on GPU;
the ranks of a larger world rendezvous through the usual RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables, a
world of one uses an in-memory store), initialises Megatron's model-parallel state and returns a
`ParallelGroups` record: the explicit group objects that code which communicates receives (ReLibra's executor,
the weight exporter, the gradient-norm reduction). Megatron itself keeps its state in process globals, so one
process holds one layout: a second call with the same layout returns the same groups, a different layout is
refused.

Experts are never tensor-parallel here (expert_tensor_parallel_size = 1): experts split over EP only.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tppo.engine.compat import fix_missing_te_symbols, maybe_enable_cpu_compat
from tppo.engine.config import ParallelConfig

__all__ = ["ParallelGroups", "init_parallel", "reserved_port", "start_torch_distributed"]


@dataclass
class ParallelGroups:
    """The process groups of one trainer and this rank's coordinates in them."""

    world: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup
    ep: dist.ProcessGroup
    dp: dist.ProcessGroup
    expt_dp: dist.ProcessGroup
    mp: dist.ProcessGroup
    expt_mp: dist.ProcessGroup
    tp_size: int
    pp_size: int
    ep_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    device: torch.device
    backend: str

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def pg_collection(self):
        """Megatron's ProcessGroupCollection for model construction (built from its parallel state)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return ProcessGroupCollection.use_mpu_process_groups()


_STATE: dict[str, object] = {}


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A TCP port for a single-host rendezvous, held until the block ends.

    The port stays bound (SO_REUSEADDR, not listening) in this process, so the kernel hands it to no other socket
    meanwhile, while rank 0's TCPStore, which also sets SO_REUSEADDR, can still listen on it. A port that is only
    probed free and released races with every other process on the host (seen in CI: rank 0 of a Slurm sweep job
    got EADDRINUSE seconds after the probe), so keep the block open until every rank has joined.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def start_torch_distributed(backend: str, timeout_s: float) -> None:
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    timeout = datetime.timedelta(seconds=timeout_s)
    if world == 1:
        # A world of one needs no rendezvous: an in-memory store, and no port that another process on the host
        # could take first, even where the launcher set MASTER_PORT.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    if "MASTER_PORT" not in os.environ:
        raise ValueError("MASTER_PORT must be set when WORLD_SIZE > 1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)


def _layout(p: ParallelConfig) -> tuple[int, int, int]:
    return (p.tensor_parallel, p.pipeline_parallel, p.expert_parallel)


def _check_layout(p: ParallelConfig, world: int) -> None:
    tp, pp, ep = _layout(p)
    if world % (tp * pp):
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel x pipeline_parallel = {tp * pp}"
        )
    if (world // pp) % ep:
        raise ValueError(f"expert_parallel={ep} must divide the data x tensor ranks ({world // pp})")


def init_parallel(parallel: ParallelConfig, *, timeout_s: float = 300.0) -> ParallelGroups:
    """Start torch.distributed if needed and Megatron's parallel state for `parallel`; return the groups."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        maybe_enable_cpu_compat()
    fix_missing_te_symbols()
    start_torch_distributed(backend, timeout_s)
    world = dist.get_world_size()
    _check_layout(parallel, world)
    if "layout" in _STATE:
        if _STATE["layout"] != _layout(parallel):
            raise ValueError(
                f"this process already holds the parallel layout (tp, pp, ep) = {_STATE['layout']}; "
                f"Megatron keeps one layout per process, {_layout(parallel)} was asked for"
            )
        return _STATE["groups"]  # type: ignore[return-value]
    tp, pp, ep = _layout(parallel)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(1234)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    groups = ParallelGroups(
        world=dist.group.WORLD,
        tp=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        expt_dp=ps.get_expert_data_parallel_group(),
        mp=ps.get_model_parallel_group(),
        expt_mp=ps.get_expert_tensor_model_pipeline_parallel_group(),
        tp_size=tp,
        pp_size=pp,
        ep_size=ep,
        dp_size=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device,
        backend=backend,
    )
    _STATE["layout"] = _layout(parallel)
    _STATE["groups"] = groups
    return groups


def destroy_parallel() -> None:
    """Tear down Megatron's parallel state and torch.distributed (end of a test process)."""
    from megatron.core import parallel_state as ps

    _STATE.clear()
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
