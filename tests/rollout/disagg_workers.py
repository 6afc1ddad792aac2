"""Rank functions of the disaggregated-layout tests (importable by the worker processes): ranks [0, A) are the
attention workers, the rest the expert workers, over gloo."""

from __future__ import annotations

import os

import torch

from rollout import SamplingParams
from rollout.config import RolloutConfig
from rollout.disagg import DisaggregatedEngine, ExpertWorker, Layout, expert_ranges, init_group, split_weights
from rollout.model_spec import MoeModelSpec
from rollout.weights import iter_checkpoint


def share(items: list, rank: int, num_attention: int) -> list:
    """Attention worker `rank`'s requests: every num_attention-th, from its rank on."""
    return items[rank::num_attention]


def disagg_rank(
    rank: int,
    num_attention: int,
    ckpt: str,
    config: RolloutConfig,
    prompts: list[list[int]],
    params: list[SamplingParams],
    window: int,
    sync_ckpt: str | None,
):
    """Three generate calls on each attention worker (its share of the prompts): the prompts, a T-PPO
    continuation of each (prompt + tokens, `window` more), and after a weight sync from `sync_ckpt` (when given)
    the prompts again. Attention ranks return their outputs and stats; expert ranks their serve stats."""
    world = int(os.environ["WORLD_SIZE"])
    init_group(rank, world, "env://", timeout_s=60)
    layout = Layout(None, tuple(range(num_attention)), tuple(range(num_attention, world)))
    spec = MoeModelSpec.from_pretrained(ckpt)
    ranges = expert_ranges(spec.num_experts, world - num_attention)
    sync = split_weights(iter_checkpoint(sync_ckpt), ranges) if sync_ckpt else None
    try:
        if rank < num_attention:
            mine = share(prompts, rank, num_attention), share(params, rank, num_attention)
            return _attention(ckpt, layout, config, *mine, window, sync)
        worker = ExpertWorker.from_pretrained(ckpt, ranges[rank - num_attention], layout)
        served = [worker.serve(), worker.serve()]
        if sync is not None:
            worker.load_weights(sync[1][rank - num_attention])
            served.append(worker.serve())
        return served
    finally:
        torch.distributed.destroy_process_group()


def _attention(ckpt, layout, config, prompts, params, window, sync):
    engine = DisaggregatedEngine.from_pretrained(ckpt, layout, config=config)
    first = engine.generate(prompts, params)
    stats = [engine.last_stats]
    more = [SamplingParams(**{**vars(p), "max_new_tokens": window}) for p in params]
    second = engine.generate([o.prompt_token_ids + o.token_ids for o in first], more)
    stats.append(engine.last_stats)
    outs = [first, second]
    if sync is not None:
        engine.load_weights(sync[0])
        outs.append(engine.generate(prompts, params))
        stats.append(engine.last_stats)
    return outs, stats
