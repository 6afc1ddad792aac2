"""Rank functions of the disaggregated-layout tests (importable by the worker processes): rank 0 is the
attention worker, ranks 1.. the expert workers, over gloo."""

from __future__ import annotations

import os

import torch

from rollout import SamplingParams
from rollout.config import RolloutConfig
from rollout.disagg import DisaggregatedEngine, ExpertWorker, Layout, expert_ranges, init_group, split_weights
from rollout.model_spec import MoeModelSpec
from rollout.weights import iter_checkpoint


def layout_of(world: int) -> Layout:
    return Layout(group=None, attention_rank=0, expert_ranks=tuple(range(1, world)))


def disagg_rank(
    rank: int,
    ckpt: str,
    config: RolloutConfig,
    prompts: list[list[int]],
    params: list[SamplingParams],
    window: int,
    sync_ckpt: str | None,
):
    """Three generate calls: the prompts, a T-PPO continuation of each (prompt + tokens, `window` more), and
    after a weight sync from `sync_ckpt` (when given) the prompts again. Rank 0 returns the outputs and the
    engine's stats; expert ranks return their serve stats."""
    world = int(os.environ["WORLD_SIZE"])
    init_group(rank, world, "env://", timeout_s=60)
    layout = layout_of(world)
    spec = MoeModelSpec.from_pretrained(ckpt)
    ranges = expert_ranges(spec.num_experts, world - 1)
    sync = split_weights(iter_checkpoint(sync_ckpt), ranges) if sync_ckpt else None
    try:
        if rank == 0:
            return _attention(ckpt, layout, config, prompts, params, window, sync)
        worker = ExpertWorker.from_pretrained(ckpt, ranges[rank - 1], layout)
        served = [worker.serve(), worker.serve()]
        if sync is not None:
            worker.load_weights(sync[1][rank - 1])
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
