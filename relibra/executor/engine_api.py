"""What the executor needs from a training engine, declared here so that relibra never imports the trainer.

tppo.engine.engine.MegatronEngine satisfies `ExpertEngine` (a test checks it against a built engine); any other
engine that exposes its expert-parallel groups, its MoE layers and its optimizer the same way can run ReLibra's
plans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist


class ExpertGroups(Protocol):
    """The process groups the executor communicates over, and this rank's place in them."""

    ep: dist.ProcessGroup  # the expert-parallel group: slots, replicas and migrations move inside it
    ep_rank: int
    ep_size: int
    expt_dp: dist.ProcessGroup  # copies of the EP group (expert data parallel): they must get the same homes
    device: torch.device


class RoutedLayer(Protocol):
    """One MoE layer: its grouped experts (stacked home slots, `logical_expert_ids`, a `weight_provider` hook),
    its token dispatcher (swapped for the plan's physical layout), its config and a hook on the router's output."""

    experts: torch.nn.Module
    token_dispatcher: Any
    config: Any
    route_hook: Callable[..., Any] | None


class RoutingReplay(Protocol):
    moe_layer_ids: Sequence[int]  # the plan layer of each of this stage's MoE layers


class ModelShape(Protocol):
    num_experts: int


@runtime_checkable
class ExpertEngine(Protocol):
    """The engine surface ExpertExecutor drives: groups, MoE layers, optimizer state and its hooks, state dicts."""

    @property
    def groups(self) -> ExpertGroups: ...

    @property
    def config(self) -> Any: ...  # Megatron's TransformerConfig (recompute_granularity is read)

    @property
    def model_cfg(self) -> ModelShape: ...

    @property
    def moe_layers(self) -> Sequence[RoutedLayer]: ...

    @property
    def num_moe_layers(self) -> int: ...

    @property
    def replay(self) -> RoutingReplay: ...

    @property
    def module(self) -> torch.nn.Module: ...  # has `.decoder` (micro-batches are counted at its forward)

    @property
    def optimizer(
        self,
    ) -> Any: ...  # torch's optimizer or Megatron's (its per-parameter state moves with experts)

    @property
    def megatron_optimizer(self) -> bool: ...

    # Called before anything reads optimizer state (the step, offload, a checkpoint): migrations land there.
    optimizer_state_hooks: list[Callable[[], None]]

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...
