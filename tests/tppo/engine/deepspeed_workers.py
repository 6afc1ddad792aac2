"""Shared pieces of the DeepSpeed engine tests: batches with a T-PPO payload, the objective, one rank's ZeRO-3 step."""

from __future__ import annotations

import torch

from tppo.algo.batching import PolicyTargets
from tppo.algo.objectives import PolicyObjective
from tppo.engine.batch import TrainBatch

VOCAB = 96


def policy_batch(
    seed: int, rows: int = 2, tokens: int = 9, lengths: tuple[int, ...] | None = None
) -> TrainBatch:
    """A right-padded micro-batch whose payload carries T-PPO targets (old log-probs filled by `with_old_logprobs`)."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or (tokens,) * rows
    mask = torch.zeros(rows, tokens)
    for r, n in enumerate(lengths):
        mask[r, :n] = 1
    window = mask.clone()
    window[:, :3] = 0  # the prompt is not trained on
    payload = PolicyTargets(
        window_mask_BT=window,
        advantages_BT=torch.randn(rows, tokens, generator=g) * window,
        old_logprobs_BT=torch.zeros(rows, tokens),
        rollout_logprobs_BT=torch.zeros(rows, tokens),
        response_mask_BT=window,
        positive_B=torch.ones(rows),
    )
    ids = torch.randint(0, VOCAB, (rows, tokens), generator=g) * mask.long()
    return TrainBatch(input_ids_BT=ids, attention_mask_BT=mask, loss_mask_BT=window, payload=payload)


def with_old_logprobs(batches: list[TrainBatch], outs, seed: int = 0) -> None:
    """Old log-probs = the current ones shifted a little, so the ratio is not 1 and some tokens clip."""
    g = torch.Generator().manual_seed(seed)
    for b, o in zip(batches, outs, strict=True):
        shift = 0.3 * torch.randn(b.shape, generator=g)
        b.payload.old_logprobs_BT = (o.logprobs_BT.detach().cpu() + shift) * b.payload.window_mask_BT
        b.payload.rollout_logprobs_BT = b.payload.old_logprobs_BT.clone()


def objective(batches: list[TrainBatch]) -> PolicyObjective:
    """The T-PPO policy objective (clip-higher, dual clip, entropy bonus) with the step's batch-level count."""
    count = int(sum(b.payload.window_mask_BT.sum() for b in batches))
    return PolicyObjective(
        num_window_tokens=count, num_positive_tokens=count, entropy_coef=0.01, pos_lm_coef=0.1
    )


def zero_worker(rank: int, stage: int, ckpt: str, per_rank: list[list[TrainBatch]], loss_fn) -> dict:
    """One rank of a ZeRO engine: its micro-batches through one step, then the gathered HF weights."""
    from tppo.engine.config import BackendConfig, OptimConfig
    from tppo.engine.convert import model_config_from_hf
    from tppo.engine.deepspeed_engine import DeepSpeedEngine

    engine = DeepSpeedEngine(
        model_config_from_hf(ckpt),
        OptimConfig(lr=1e-3, grad_clip=0.5),
        zero=BackendConfig("deepspeed", stage),
    )
    result = engine.train_step(per_rank[rank], loss_fn)
    weights = {n: t for bucket in engine.iter_hf_weights(1 << 16) for n, t in bucket}
    return dict(loss=result.loss, grad_norm=result.grad_norm, weights=weights)
