"""The training calls both backends (Megatron-Core, DeepSpeed) share, over their own `_forward_backward` and
`optimizer_step`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from tppo.engine.batch import ForwardOutput, LossOutput, StepResult, TrainBatch

LossFn = Callable[[ForwardOutput, TrainBatch], LossOutput]


class TrainSteps(ABC):
    """`forward_backward` and `train_step` of an engine that implements

        _forward_backward(batches, loss_fn, *, require_replay, keep_logprobs) -> (loss, metrics, kept)
        optimizer_step() -> StepResult

    where `kept` is each micro-batch's detached log-probs on every rank when `keep_logprobs`, else None."""

    @abstractmethod
    def _forward_backward(
        self,
        batches: Sequence[TrainBatch],
        loss_fn: LossFn,
        *,
        require_replay: bool,
        keep_logprobs: bool = False,
    ) -> tuple[float, dict[str, float], list[ForwardOutput] | None]:
        """The backend's forward and backward over every micro-batch (see the class docstring)."""

    @abstractmethod
    def optimizer_step(self) -> StepResult:
        """The backend's optimizer step on the gradients `_forward_backward` left."""

    def forward_backward(
        self, batches: Sequence[TrainBatch], loss_fn: LossFn, *, require_replay: bool = False
    ) -> tuple[float, dict[str, float]]:
        """Run every micro-batch forward and backward and reduce the gradients (not yet divided: see
        `optimizer_step`). Returns the step's loss  sum(loss_sum) / sum(denominator)  over micro-batches and
        data-parallel ranks, and the loss callable's metrics averaged over this rank's micro-batches."""
        loss, metrics, _ = self._forward_backward(batches, loss_fn, require_replay=require_replay)
        return loss, metrics

    def train_step(
        self,
        batches: Sequence[TrainBatch],
        loss_fn: LossFn,
        *,
        require_replay: bool = False,
        keep_logprobs: bool = False,
    ) -> StepResult:
        """forward_backward, then one optimizer step (skipped if a gradient is not finite); with `keep_logprobs`
        the result carries the forward's log-probs (StepResult.outputs)."""
        loss, metrics, kept = self._forward_backward(
            batches, loss_fn, require_replay=require_replay, keep_logprobs=keep_logprobs
        )
        result = self.optimizer_step()
        result.loss, result.metrics, result.num_microbatches = loss, metrics, len(batches)
        result.outputs = kept
        return result
