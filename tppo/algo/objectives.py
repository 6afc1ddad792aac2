"""The trainer-side loss callables: picklable records that turn one micro-batch's engine output into a LossOutput.

They travel to the trainer ranks (Ray actors) with the batch, so they carry only plain numbers: the algorithm's
coefficients and the batch-level denominators the driver counted over the whole training batch (every rank and
micro-batch). The engine's gradient is that of sum(loss_sum) / sum(denominator) over the step, so each callable
returns loss_sum = (its loss normalised by the batch-level counts) x (the batch-level count of its primary term)
with denominator = this micro-batch's share of that count; the sum over the step is then exactly the
batch-level loss (a token mean over the whole batch for the policy, a mean over finished samples for the critic).
"""

from __future__ import annotations

from dataclasses import dataclass

from tppo.algo.batching import CriticTargets, PolicyTargets
from tppo.algo.config import AlgoConfig
from tppo.algo.losses import clipped_value_loss, entropy_bonus, kl_loss, pos_lm_loss, ppo_clip_loss
from tppo.engine.batch import ForwardOutput, LossOutput, TrainBatch


@dataclass(frozen=True)
class PolicyObjective:
    """PPO clip (clip-higher, dual clip, optional TIS) + positive-example LM loss - entropy bonus + KL to the
    reference policy.

    `loss_agg` reduces the clip, entropy and KL terms: "token_mean" over all current-window tokens of the batch (the
    spec's default), or "sample_mean" (each sample's window token mean, then the mean over the batch's samples);
    the positive-example LM loss is always VAPO's token mean.

    With `old_from_forward` the old log-probs are this forward's own, detached (algo.old_logprobs=update: the one
    optimizer step of an update runs the old weights, so the ratio is 1 and the gradient PPO's at the old policy).
    """

    num_window_tokens: int  # all current-window tokens of the training batch
    num_positive_tokens: int  # all response tokens of positive finished responses in the batch
    num_window_samples: int = 0  # samples of the batch with current-window tokens (for sample_mean)
    loss_agg: str = "token_mean"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float = 10.0
    log_ratio_clamp: float = 20.0
    tis_cap: float = 0.0
    pos_lm_coef: float = 0.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # + kl_coef * KL(pi || pi_ref) on the window's tokens
    kl_estimator: str = "k3"
    old_from_forward: bool = False

    def _count(self) -> int:
        """The batch-level count that `loss_agg` divides by: window tokens or window samples."""
        return max(self.num_window_samples if self.loss_agg == "sample_mean" else self.num_window_tokens, 1)

    def __call__(self, out: ForwardOutput, batch: TrainBatch) -> LossOutput:
        t: PolicyTargets = batch.payload
        mask = t.window_mask_BT
        count = self._count()
        agg = {"agg": self.loss_agg, "num_tokens": count, "num_samples": count}
        old_BT = out.logprobs_BT.detach() if self.old_from_forward else t.old_logprobs_BT
        pg = ppo_clip_loss(
            out.logprobs_BT,
            old_BT,
            t.advantages_BT,
            mask,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            dual_clip=self.dual_clip,
            log_ratio_clamp=self.log_ratio_clamp,
            rollout_logprobs=t.rollout_logprobs_BT if self.tis_cap else None,
            tis_cap=self.tis_cap,
            **agg,
        )
        total, metrics = pg.loss, dict(pg.metrics)
        if self.pos_lm_coef and self.num_positive_tokens:
            lm = pos_lm_loss(
                out.logprobs_BT,
                t.response_mask_BT,
                t.positive_B,
                agg="token_mean",
                num_tokens=self.num_positive_tokens,
            )
            total = total + self.pos_lm_coef * lm.loss
            metrics.update(lm.metrics)
        if out.entropy_BT is not None:  # the update computes it anyway: reported whether or not it is a bonus
            ent = entropy_bonus(out.entropy_BT, mask, **agg)
            if self.entropy_coef:
                total = total - self.entropy_coef * ent.loss
            metrics.update(ent.metrics)
        if self.kl_coef:
            if t.ref_logprobs_BT is None:
                raise ValueError("kl_coef > 0 but the batch carries no reference log-probs (ref_logprobs_BT)")
            kl = kl_loss(out.logprobs_BT, t.ref_logprobs_BT, mask, estimator=self.kl_estimator, **agg)
            total = total + self.kl_coef * kl.loss
            metrics.update(kl.metrics)
        rows = mask.sum(dim=1) > 0
        local = int(rows.sum()) if self.loss_agg == "sample_mean" else int(mask.sum())
        return LossOutput(loss_sum=total * count, denominator=local, metrics=metrics)


@dataclass(frozen=True)
class ValueObjective:
    """The critic's clipped value loss: per-sample token mean, then mean over the finished samples."""

    num_samples: int  # finished samples in the critic's batch
    clip_low: float = 0.5
    clip_high: float = 0.6

    def __call__(self, out: ForwardOutput, batch: TrainBatch) -> LossOutput:
        t: CriticTargets = batch.payload
        live = t.mask_BT.sum(dim=1) > 0
        res = clipped_value_loss(
            out.values_BT,
            t.old_values_BT,
            t.returns_BT,
            t.mask_BT,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            agg="sample_mean",
            num_samples=max(self.num_samples, 1),
        )
        return LossOutput(
            loss_sum=res.loss * max(self.num_samples, 1), denominator=int(live.sum()), metrics=res.metrics
        )


@dataclass(frozen=True)
class SupervisedObjective:
    """Negative log-likelihood of the response tokens, a token mean over the whole batch (the warm start)."""

    num_tokens: int

    def __call__(self, out: ForwardOutput, batch: TrainBatch) -> LossOutput:
        mask = batch.loss_mask_BT.to(out.logprobs_BT.dtype)
        nll_sum = -(out.logprobs_BT * mask).sum()
        return LossOutput(
            loss_sum=nll_sum,
            denominator=int(mask.sum()),
            metrics={"train/sft_nll": float(nll_sum.detach()) / max(float(mask.sum()), 1.0)},
        )


def positive_tokens(batches: list[list[TrainBatch]]) -> int:
    total = 0
    for rank in batches:
        for b in rank:
            t: PolicyTargets = b.payload
            total += int((t.response_mask_BT * t.positive_B[:, None]).sum())
    return total


def live_rows(batches: list[list[TrainBatch]], mask: str = "mask_BT") -> int:
    """Rows of the whole batch with at least one token in the payload's `mask` (fillers have none)."""
    return sum(int((getattr(b.payload, mask).sum(dim=1) > 0).sum()) for rank in batches for b in rank)


def policy_objective(algo: AlgoConfig, batches: list[list[TrainBatch]]) -> PolicyObjective:
    """The policy's loss for this step's batch: the algorithm's coefficients and the batch-level counts."""
    return PolicyObjective(
        num_window_tokens=sum(int(b.payload.window_mask_BT.sum()) for rank in batches for b in rank),
        num_positive_tokens=positive_tokens(batches),
        num_window_samples=live_rows(batches, "window_mask_BT"),
        loss_agg=algo.loss_agg,
        eps_low=algo.eps_low,
        eps_high=algo.eps_high,
        dual_clip=algo.dual_clip,
        log_ratio_clamp=algo.log_ratio_clamp,
        tis_cap=algo.tis_cap,
        pos_lm_coef=algo.pos_lm_coef,
        entropy_coef=algo.entropy_coef,
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        old_from_forward=algo.old_logprobs_from_update,
    )


def value_objective(algo: AlgoConfig, batches: list[list[TrainBatch]]) -> ValueObjective:
    """The critic's loss for this step's batch of finished samples."""
    return ValueObjective(
        num_samples=live_rows(batches), clip_low=algo.value_clip_low, clip_high=algo.value_clip_high
    )


def supervised_objective(batches: list[list[TrainBatch]]) -> SupervisedObjective:
    """The warm start's loss: a token mean of the NLL over the whole batch."""
    return SupervisedObjective(num_tokens=sum(int(b.loss_mask_BT.sum()) for rank in batches for b in rank))


__all__ = [
    "PolicyObjective",
    "SupervisedObjective",
    "ValueObjective",
    "live_rows",
    "policy_objective",
    "positive_tokens",
    "supervised_objective",
    "value_objective",
]
