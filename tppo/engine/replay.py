"""Routing replay on Megatron-Core's RouterReplay: record the experts each token chose, replay given ones.

Three modes per forward pass (Megatron's `RouterReplayAction`):
- RECORD: route normally and keep each MoE layer's top-k expert ids ([N, K] per layer);
- REPLAY_FORWARD: use the given top-k ids instead of the router's own choice; the gate probabilities are
  still computed from the trainer's router logits at those ids (softmax over the K replayed logits for
  normalised top-k routing), so the router keeps its gradient;
- REPLAY_BACKWARD: the same ids again while activation recompute re-runs the layer inside the backward
  pass. a pair of identity autograd functions switches the routers into this mode when a micro-batch's backward begins and back
  when it ends, so recompute of micro-batch m replays m's ids even when later micro-batches were already
  forwarded (pipeline schedules): `mark_backward_begin` wraps the stage output, `mark_backward_end`
  the decoder input.

Replay data is strict: a missing layer, a token count that does not match the layer's input, a k other
than the router's, ids out of range or repeated within a token raise ValueError naming the layer and
the shapes. There is never a silent fall-back to the router's own choice.

Legend: B batch, T tokens per sequence, L MoE layers (of the whole model), K top-k, N tokens seen by a
router (T*B in Megatron's sequence-first order, divided by TP under sequence parallelism).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

__all__ = [
    "ReplayRouter",
    "RouterReplayAction",
    "RoutingReplay",
    "StrictRouterReplay",
    "check_routed_experts",
    "mark_backward_end",
]


class StrictRouterReplay(RouterReplay):
    """Megatron's per-layer RouterReplay with validation of the replayed ids and a layer name in errors."""

    def __init__(self, layer_name: str, num_experts: int, topk: int) -> None:
        super().__init__()
        # Megatron keeps every instance in a process-global list; several models can live in one process
        # here (policy, critic, reference), so each model addresses its own routers instead.
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer_name = layer_name
        self.num_experts = num_experts
        self.topk = topk

    def _checked(self, top_indices: torch.Tensor | None, scores: torch.Tensor, topk: int) -> torch.Tensor:
        if top_indices is None:
            raise ValueError(f"routing replay is on but {self.layer_name} has no replay data for this pass")
        num_tokens = scores.shape[0]
        if top_indices.shape != (num_tokens, topk):
            raise ValueError(
                f"replay data of {self.layer_name} has shape {tuple(top_indices.shape)}; "
                f"expected (tokens={num_tokens}, k={topk})"
            )
        return top_indices.to(device=scores.device, dtype=torch.long)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        if action == RouterReplayAction.REPLAY_FORWARD:
            top_indices = self._checked(self.target_topk_idx, scores, topk)
        elif action == RouterReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise ValueError(f"activation recompute of {self.layer_name} found no replay data left")
            top_indices = self._checked(self.replay_backward_list.pop(0), scores, topk)
        else:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        return scores.gather(1, top_indices), top_indices


class ReplayRouter(TopKRouter):
    """Megatron's top-k router with a strict RouterReplay attached (recording, replay, recompute replay)."""

    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.router_replay = StrictRouterReplay(
            "an MoE layer", config.num_moe_experts, config.moe_router_topk
        )

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        # Megatron's version is wrapped in torch.compile and runs on every routing call even when the
        # expert bias is off: dynamo compile time on each new process and shape for nothing. Same logic.
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & (~padding_mask)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def set_layer_number(self, layer_number: int) -> None:
        super().set_layer_number(layer_number)
        self.router_replay.layer_name = f"MoE layer at decoder layer {layer_number - 1}"


def check_routed_experts(
    routed_BTLK: torch.Tensor,
    *,
    batch_shape: tuple[int, int],
    num_moe_layers: int,
    topk: int,
    num_experts: int,
    valid_BT: torch.Tensor | None = None,
) -> None:
    """Validate replay data [B, T, L, K] against the batch and the model; raise ValueError naming the problem."""
    if not isinstance(routed_BTLK, torch.Tensor):
        raise ValueError(f"routed_experts_BTLK must be a tensor, got {type(routed_BTLK).__name__}")
    if routed_BTLK.dtype.is_floating_point or routed_BTLK.dtype == torch.bool:
        raise ValueError(f"routed_experts_BTLK must hold integer expert ids, got dtype {routed_BTLK.dtype}")
    if routed_BTLK.dim() != 4:
        raise ValueError(f"routed_experts_BTLK must be [B, T, L, K], got shape {tuple(routed_BTLK.shape)}")
    b, t, layers, k = routed_BTLK.shape
    if (b, t) != tuple(batch_shape):
        raise ValueError(
            f"routed_experts_BTLK covers (B={b}, T={t}) tokens; the batch has "
            f"(B={batch_shape[0]}, T={batch_shape[1]})"
        )
    if layers != num_moe_layers:
        raise ValueError(f"routed_experts_BTLK has {layers} MoE layers; the model has {num_moe_layers}")
    if k != topk:
        raise ValueError(f"routed_experts_BTLK has k={k} experts per token; the model routes top-{topk}")
    ids = routed_BTLK if valid_BT is None else routed_BTLK[valid_BT.bool()]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise ValueError(
            f"routed_experts_BTLK holds expert ids in [{int(ids.min())}, {int(ids.max())}]; "
            f"the model has experts 0..{num_experts - 1}"
        )
    if ids.numel() and k > 1:
        sorted_ids = ids.sort(dim=-1).values
        if bool((sorted_ids[..., 1:] == sorted_ids[..., :-1]).any()):
            raise ValueError("routed_experts_BTLK repeats an expert within one token's top-k")


class RoutingReplay:
    """The routers of one model (this rank's pipeline stage), addressed together, in layer order."""

    def __init__(self, routers: list[ReplayRouter], moe_layer_ids: list[int]) -> None:
        if len(routers) != len(moe_layer_ids):
            raise ValueError("one MoE layer id per router is needed")
        self.routers = routers
        self.moe_layer_ids = moe_layer_ids  # index of each local router among the model's MoE layers

    @property
    def replays(self) -> list[StrictRouterReplay]:
        return [r.router_replay for r in self.routers]

    def set_action(self, action: RouterReplayAction | None) -> None:
        for rep in self.replays:
            if action is None:
                rep.clear_router_replay_action()
            else:
                rep.set_router_replay_action(action)

    def clear(self) -> None:
        self.set_action(None)
        for rep in self.replays:
            rep.clear_indices()

    def set_targets(self, per_layer_NK: list[torch.Tensor]) -> None:
        """Give every local router its [N, K] ids for the next forward (also queued for recompute)."""
        if len(per_layer_NK) != len(self.routers):
            raise ValueError(
                f"replay data for {len(per_layer_NK)} layers; this stage has {len(self.routers)} MoE layers"
            )
        for rep, ids in zip(self.replays, per_layer_NK):
            rep.set_target_indices(ids)

    def recorded(self) -> list[torch.Tensor]:
        out = []
        for rep in self.replays:
            ids = rep.get_recorded_indices()
            if ids is None:
                raise ValueError(f"{rep.layer_name} recorded nothing: was the forward run in record mode?")
            out.append(ids)
        return out

    @contextmanager
    def recording(self) -> Iterator[RoutingReplay]:
        self.clear()
        self.set_action(RouterReplayAction.RECORD)
        try:
            yield self
        finally:
            self.set_action(None)

    def clear_targets(self) -> None:
        """Drop replay targets (and the recompute queue), keep the action."""
        for rep in self.replays:
            rep.target_topk_idx = None
            rep.replay_backward_list = []

    def mark_backward_begin(self, output: torch.Tensor, per_layer_NK: list[torch.Tensor]) -> torch.Tensor:
        """Identity on a stage's output whose backward arms recompute replay of `per_layer_NK`."""
        if not output.requires_grad:
            return output
        return _BackwardBegins.apply(output, self, per_layer_NK)


def mark_backward_end(x: torch.Tensor, replay: RoutingReplay) -> torch.Tensor:
    """Identity on a stage's decoder input whose backward (the micro-batch's last) disarms recompute replay."""
    if not x.requires_grad:
        return x
    return _BackwardEnds.apply(x, replay)


class _BackwardBegins(torch.autograd.Function):
    """Identity on a stage's output; its backward (the first of the micro-batch) arms recompute replay."""

    @staticmethod
    def forward(ctx, x, replay: RoutingReplay, per_layer_NK):
        ctx.replay, ctx.per_layer = replay, per_layer_NK
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for rep, ids in zip(ctx.replay.replays, ctx.per_layer):
            rep.replay_backward_list = [ids]
        ctx.replay.set_action(RouterReplayAction.REPLAY_BACKWARD)
        return grad, None, None


class _BackwardEnds(torch.autograd.Function):
    """Identity on a stage's decoder input; its backward (the last of the micro-batch) disarms replay."""

    @staticmethod
    def forward(ctx, x, replay: RoutingReplay):
        ctx.replay = replay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for rep in ctx.replay.replays:
            rep.replay_backward_list = []
        ctx.replay.set_action(RouterReplayAction.REPLAY_FORWARD)
        return grad, None
