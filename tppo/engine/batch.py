"""Typed records that cross the engine's boundary: the micro-batch going in, the per-token outputs coming out.

A `TrainBatch` is either PADDED (B rows of T tokens, right padding marked by `attention_mask_BT`) or PACKED
(B = 1, several sequences back to back, their boundaries in `cu_seqlens`). Attention is causal inside
each sequence; rotary positions restart at every sequence, so `position_ids_BT`, when given, must be
0, 1, 2, ... per sequence (left padding is refused: it would shift positions).

Outputs are aligned with the tokens they score: `logprobs_BT[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`
and `values_BT[b, t]` is the critic's value of the prefix input_ids[b, :t] (the state in which token t
is chosen); both come from the model's output at position t - 1 and are 0 at every sequence start and
at padding tokens.

Legend: B sequences, T tokens per row, L MoE layers of the whole model, K experts per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ForwardOutput", "LossOutput", "StepResult", "TrainBatch", "replayed_ids", "to_device"]


@dataclass
class TrainBatch:
    """One micro-batch for the trainer (padded or packed). Extra per-token data rides in `payload`."""

    input_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor | None = None
    attention_mask_BT: torch.Tensor | None = None  # 1 = real token, 0 = right padding (padded batches)
    position_ids_BT: torch.Tensor | None = None  # checked against the positions the model uses
    cu_seqlens: torch.Tensor | None = None  # packed: [num_seqs + 1] cumulative lengths, B must be 1
    routed_experts_BTLK: torch.Tensor | None = None  # replay: top-k expert ids per token and MoE layer
    payload: Any = None  # the caller's own typed record (advantages, old log-probs...) for the loss
    # Log-probs and entropy are of softmax(logits / temperature): the temperature the tokens were sampled at.
    temperature: float = 1.0

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.input_ids_BT.shape[0]), int(self.input_ids_BT.shape[1]))

    def valid_BT(self) -> torch.Tensor:
        """True at real (non-padding) tokens."""
        if self.attention_mask_BT is not None:
            return self.attention_mask_BT.bool()
        if self.packed:
            valid = torch.zeros(self.shape, dtype=torch.bool, device=self.input_ids_BT.device)
            valid[:, : int(self.cu_seqlens[-1])] = True
            return valid
        return torch.ones(self.shape, dtype=torch.bool, device=self.input_ids_BT.device)

    def sequence_starts_BT(self) -> torch.Tensor:
        """True at the first token of every sequence."""
        starts = torch.zeros(self.shape, dtype=torch.bool, device=self.input_ids_BT.device)
        if self.packed:
            bounds = self.cu_seqlens[:-1].long().to(starts.device)
            starts[0, bounds[bounds < self.shape[1]]] = True
        else:
            starts[:, 0] = True
        return starts

    def expected_positions_BT(self) -> torch.Tensor:
        """0, 1, 2, ... restarting at every sequence start (what rotary embeddings use)."""
        b, t = self.shape
        ar = torch.arange(t, device=self.input_ids_BT.device)
        if not self.packed:
            return ar.expand(b, t)
        seq_of_token = torch.bucketize(ar, self.cu_seqlens[1:-1].long().to(ar.device), right=True)
        start_of_token = self.cu_seqlens.long().to(ar.device)[seq_of_token]
        return (ar - start_of_token).unsqueeze(0)

    def validate(self) -> None:
        """Raise ValueError naming the field when the batch is malformed."""
        ids = self.input_ids_BT
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
            raise ValueError(
                f"input_ids_BT must be an integer tensor [B, T], got {getattr(ids, 'shape', type(ids))}"
            )
        b, t = self.shape
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: expected > 0 (greedy sampling reports T = 1)")
        for name in ("loss_mask_BT", "attention_mask_BT", "position_ids_BT"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t):
                raise ValueError(f"{name} has shape {tuple(value.shape)}; input_ids_BT is {(b, t)}")
        if self.packed:
            self._validate_packed(b, t)
        elif self.attention_mask_BT is not None:
            mask = self.attention_mask_BT.long()
            if bool((mask[:, 1:] > mask[:, :-1]).any()):
                raise ValueError("attention_mask_BT must be right padding (ones then zeros in every row)")
        if self.position_ids_BT is not None:
            expect = self.expected_positions_BT().to(self.position_ids_BT.device)
            valid = self.valid_BT().to(expect.device)
            if not torch.equal(self.position_ids_BT.long()[valid], expect[valid]):
                raise ValueError(
                    "position_ids_BT must count 0, 1, 2, ... from every sequence start "
                    "(right padding; packed sequences restart at each cu_seqlens boundary)"
                )

    def _validate_packed(self, b: int, t: int) -> None:
        cu = self.cu_seqlens
        if b != 1:
            raise ValueError(f"a packed batch (cu_seqlens given) must have B=1, got B={b}")
        if self.attention_mask_BT is not None:
            raise ValueError("a packed batch marks its sequences with cu_seqlens, not attention_mask_BT")
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must be [0, ...] with at least one sequence, got {cu.tolist()}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be strictly increasing, got {cu.tolist()}")
        if int(cu[-1]) > t:
            raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but the packed row has T={t} tokens")


@dataclass
class ForwardOutput:
    """Per-token results of a forward pass, aligned as the module docstring says. [B, T] each."""

    logprobs_BT: torch.Tensor | None = None
    entropy_BT: torch.Tensor | None = None
    values_BT: torch.Tensor | None = None
    # The critic's value of the state after each sequence's last token (the bootstrap of a cut response): [B]
    # for a padded batch, one per sequence for a packed one.
    end_values_S: torch.Tensor | None = None
    routed_experts_BTLK: torch.Tensor | None = None  # filled when routing was recorded


@dataclass
class LossOutput:
    """What a loss callable returns for one micro-batch.

    The engine's gradient is that of  sum(loss_sum) / sum(denominator)  over all micro-batches and
    data-parallel ranks of the step: a token-mean loss returns (sum of token losses, token count), a
    sample-mean loss (sum of sample losses, sample count). `denominator` must be a whole number.
    """

    loss_sum: torch.Tensor
    denominator: int | torch.Tensor
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclass
class StepResult:
    """One optimizer step: the normalised loss, the gradient norm before clipping, the LR used."""

    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    num_microbatches: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    # With an expert placement plan (ReLibra's): whether the ranks applied it (False: they refused it together
    # and trained under the current placement). None when the step had no plan.
    plan_applied: bool | None = None
    # With train_step(keep_logprobs=True): each micro-batch's log-probs of the step's forward, detached, on every
    # rank (the worker keeps them; they do not travel back to the driver).
    outputs: list[ForwardOutput] | None = None


def replayed_ids(
    routed_BTLK: torch.Tensor, valid_BT: torch.Tensor, shape: tuple[int, int], num_experts: int
) -> torch.Tensor:
    """The expert ids the routers replay for a micro-batch run as `shape` = (rows, S) tokens: [rows, S, L, K].

    Real tokens keep their ids. Padding (the batch's own and the rows/columns added to reach `shape`) never
    reaches a real token's output, but the experts still compute it, so it gets K distinct experts spread
    evenly: padding token n (row-major over the grid) goes to (n K + k) mod E, k = 0..K-1. The load that
    ReLibra plans for is counted from this same grid, so plans cover every pair the experts compute.
    """
    b, t = routed_BTLK.shape[:2]
    rows, s = shape
    num_layers, k = routed_BTLK.shape[2:]
    if k > num_experts:
        raise ValueError(f"top-k {k} exceeds the number of experts {num_experts}")
    n = torch.arange(rows * s, device=routed_BTLK.device).view(rows, s, 1, 1)
    fill = (n * k + torch.arange(k, device=n.device)) % num_experts
    out = fill.expand(rows, s, num_layers, k).clone()
    valid = torch.zeros(rows, s, dtype=torch.bool, device=routed_BTLK.device)
    valid[:b, :t] = valid_BT.bool()
    out[valid] = routed_BTLK.long()[valid[:b, :t]]
    return out


def to_device(record: Any, device: torch.device) -> Any:
    """A copy of a dataclass record with every tensor field moved to `device` (others unchanged)."""
    if record is None or not dataclasses.is_dataclass(record):
        return record
    changes = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = value.to(device, non_blocking=True)
        elif dataclasses.is_dataclass(value):
            changes[f.name] = to_device(value, device)
    return dataclasses.replace(record, **changes)
