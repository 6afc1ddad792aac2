"""Routing replay for transformers' own sparse-MoE blocks (Qwen3-MoE, Mixtral): record or replace each router's top-k.

transformers (>= 5) routes through a router module per MoE block (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`) that
returns (router_logits_NE, weights_NK, ids_NK); the block hands the ids and weights to its experts. A forward hook
on every router does the rest, leaving the module tree (and so every parameter name) untouched:
- record: keep the ids the router chose, [N, K] per layer;
- replay: return the given ids instead, with weights recomputed from the LIVE logits at those ids, as the model's
  own router computes them (so the router keeps its gradient, as in Megatron's replay, tppo.engine.replay):

      p = softmax(logits_N.)  (fp32),    w_k = p[ids_k],    normalised top-k:  w_k / sum_j w_j

  Qwen3-MoE normalises when `norm_topk_prob` and casts back to the logits' dtype; Mixtral always normalises and
  keeps fp32. The weights come back in the dtype the live router produced, so both rules hold unchanged.

Replay is strict: a layer without ids for the pass, or ids whose shape is not (tokens the router sees, k), raise
ValueError naming the layer. There is never a fall-back to the router's own choice. Validation of the ids against
the batch (range, repeats) is `tppo.engine.replay.check_routed_experts`, shared with the Megatron engine.

Legend: N tokens as a router sees them (B*T, row-major over the batch), E experts, K top-k, L MoE layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["ROUTER_CLASSES", "HFRoutingReplay", "replayed_weights"]

# Router classes by name -> whether their top-k weights are always normalised (None: the `norm_topk_prob` attribute).
ROUTER_CLASSES: dict[str, bool | None] = {"Qwen3MoeTopKRouter": None, "MixtralTopKRouter": True}


def replayed_weights(
    logits_NE: torch.Tensor, ids_NK: torch.Tensor, *, normalize: bool, dtype: torch.dtype
) -> torch.Tensor:
    """w_k = softmax(logits)[ids_k] (fp32), divided by sum_j w_j when `normalize`; cast to `dtype`.

    Equal to the router's own weights whenever ids_NK is the router's own top-k.
    """
    probs_NE = torch.softmax(logits_NE.float(), dim=-1)
    w_NK = probs_NE.gather(1, ids_NK)
    if normalize:
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
    return w_NK.to(dtype)


class HFRoutingReplay:
    """The routers of one transformers MoE model in layer order, recorded or replayed together."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers: list[tuple[str, torch.nn.Module]] = [
            (name, m) for name, m in model.named_modules() if type(m).__name__ in ROUTER_CLASSES
        ]
        if not self.routers:
            raise ValueError(
                f"{type(model).__name__} has no router module of {sorted(ROUTER_CLASSES)} "
                "(routing replay needs transformers >= 5 with Qwen3-MoE or Mixtral)"
            )
        first = self.routers[0][1]
        self.topk, self.num_experts = int(first.top_k), int(first.num_experts)
        self.mode: str | None = None  # None, "record" or "replay"
        self._targets: list[torch.Tensor | None] = [None] * len(self.routers)
        self._recorded: list[torch.Tensor | None] = [None] * len(self.routers)
        for i, (_, router) in enumerate(self.routers):
            router.register_forward_hook(self._hook(i))

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def _normalize(self, router: torch.nn.Module) -> bool:
        fixed = ROUTER_CLASSES[type(router).__name__]
        return bool(router.norm_topk_prob) if fixed is None else fixed

    def _hook(self, i: int):
        def hook(router, args, output):
            if self.mode == "record":
                self._recorded[i] = output[2].detach()
                return None
            if self.mode != "replay":
                return None
            logits_NE, weights_NK, _ = output
            ids_NK = self._checked(i, logits_NE.shape[0])
            w_NK = replayed_weights(
                logits_NE, ids_NK, normalize=self._normalize(router), dtype=weights_NK.dtype
            )
            return logits_NE, w_NK, ids_NK

        return hook

    def _checked(self, i: int, num_tokens: int) -> torch.Tensor:
        name, router = self.routers[i]
        ids_NK = self._targets[i]
        if ids_NK is None:
            raise ValueError(f"routing replay is on but {name} has no replay data for this pass")
        if tuple(ids_NK.shape) != (num_tokens, self.topk):
            raise ValueError(
                f"replay data of {name} has shape {tuple(ids_NK.shape)}; "
                f"expected (tokens={num_tokens}, k={self.topk})"
            )
        return ids_NK.to(device=router.weight.device, dtype=torch.long)

    def set_targets(self, per_layer_NK: list[torch.Tensor]) -> None:
        """Every router's [N, K] ids for the coming passes (kept until `clear`: a recompute sees them too)."""
        if len(per_layer_NK) != self.num_layers:
            raise ValueError(f"replay data for {len(per_layer_NK)} layers; the model has {self.num_layers}")
        self._targets = list(per_layer_NK)

    def recorded(self) -> list[torch.Tensor]:
        """The ids each router chose in the last recorded pass, [N, K] per layer."""
        missing = [name for (name, _), ids in zip(self.routers, self._recorded) if ids is None]
        if missing:
            raise ValueError(f"{missing[0]} recorded nothing: was the forward run in record mode?")
        return list(self._recorded)

    def clear(self) -> None:
        self.mode = None
        self._targets = [None] * self.num_layers
        self._recorded = [None] * self.num_layers

    @contextmanager
    def replaying(self, per_layer_NK: list[torch.Tensor]) -> Iterator[HFRoutingReplay]:
        self.clear()
        self.set_targets(per_layer_NK)
        self.mode = "replay"
        try:
            yield self
        finally:
            self.clear()

    @contextmanager
    def recording(self) -> Iterator[HFRoutingReplay]:
        """Record inside the block; the ids stay readable (`recorded`) until the next `clear`."""
        self.clear()
        self.mode = "record"
        try:
            yield self
        finally:
            self.mode = None
