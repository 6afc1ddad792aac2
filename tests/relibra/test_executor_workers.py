"""Helpers of the executor tests (no tests here): random valid plans and the ranks of the gloo runs.

The worker functions live in an importable module because the test processes start from a forkserver.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tppo" / "engine"))

from relibra.plan import Plan, Topology
from relibra.planners.base import home_plan

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=8,
    ffn_hidden_size=64,
    moe_ffn_hidden_size=16,
    num_experts=8,
    moe_topk=2,
)


def random_home_LE(num_layers: int, topo: Topology, rng: np.random.Generator) -> np.ndarray:
    """Every GPU owns exactly H experts per layer, chosen at random."""
    base = np.arange(topo.num_experts) // topo.num_home_slots
    return np.stack([rng.permutation(base) for _ in range(num_layers)])


def random_plan(loads_MLSE: np.ndarray, topo: Topology, rng: np.random.Generator, *, replicas: bool) -> Plan:
    """A random valid ReLibra-style plan: random homes; optionally random intra-node replicas with a random split
    of every source's pairs among the instances of each expert."""
    M, L, S, E = loads_MLSE.shape
    H, R, G = topo.num_home_slots, topo.num_replica_slots, topo.num_gpus
    home = random_home_LE(L, topo, rng)
    plan = home_plan(loads_MLSE, home, topo)
    if not replicas or R == 0:
        return plan
    node = topo.node_of_gpu()
    slots = plan.slots_MLGJ.copy()
    for m in range(M):
        for layer in range(L):
            for g in range(G):
                for r in range(R):
                    held = set(slots[m, layer, g].tolist())
                    cands = [e for e in range(E) if node[home[layer, e]] == node[g] and e not in held]
                    if cands and rng.random() < 0.8:
                        slots[m, layer, g, H + r] = rng.choice(cands)
    quota = np.zeros((M, L, G, H + R, S), dtype=np.int64)
    for m in range(M):
        for layer in range(L):
            flat = slots[m, layer].reshape(-1)
            for e in range(E):
                inst = np.flatnonzero(flat == e)
                for s in range(S):
                    split = rng.multinomial(int(loads_MLSE[m, layer, s, e]), np.ones(len(inst)) / len(inst))
                    quota[m, layer].reshape(-1, S)[inst, s] = split
    return Plan(home_LE=home, slots_MLGJ=slots, quota_MLGJS=quota, num_home_slots=H)


def make_batches(
    num_ranks: int, num_mb: int, seed: int, rows: int = 2, tokens: int | list[int] = 8
) -> list[list]:
    """batches[rank][m]: random tokens with random replayed routing; `tokens` per rank (unequal lengths make
    the engine pad the shorter ranks for its allgather dispatcher)."""
    from tppo.engine.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    E, K, L = TINY["num_experts"], TINY["moe_topk"], TINY["num_layers"]
    out = []
    lengths = tokens if isinstance(tokens, list) else [tokens] * num_ranks
    for rank in range(num_ranks):
        mbs = []
        for _ in range(num_mb):
            ids = torch.randint(0, TINY["vocab_size"], (rows, lengths[rank]), generator=g)
            # Skewed routing: experts 0..2 hot, so that replicas and reorders matter.
            weights = torch.tensor([6.0, 4.0, 3.0] + [1.0] * (E - 3))
            routed = torch.stack(
                [
                    torch.multinomial(weights, K, replacement=False, generator=g)
                    for _ in range(rows * lengths[rank] * L)
                ]
            ).view(rows, lengths[rank], L, K)
            mbs.append(TrainBatch(input_ids_BT=ids, routed_experts_BTLK=routed))
        out.append(mbs)
    return out


def loads_of(batches: list[list], num_experts: int) -> np.ndarray:
    """D[m, l, s, e] of batches[s][m] (every token real)."""
    S, M = len(batches), len(batches[0])
    L = batches[0][0].routed_experts_BTLK.shape[2]
    loads = np.zeros((M, L, S, num_experts), dtype=np.int64)
    for s in range(S):
        for m in range(M):
            ids = batches[s][m].routed_experts_BTLK
            for layer in range(L):
                loads[m, layer, s] = np.bincount(ids[:, :, layer].reshape(-1).numpy(), minlength=num_experts)
    return loads


def _engine(
    ep: int,
    dispatcher: str | None = None,
    recompute: bool = False,
    optimizer: str = "auto",
    aux_loss: float = 0.0,
    dtype: str = "float32",
):
    from tppo.engine.config import ModelConfig, OptimConfig, ParallelConfig
    from tppo.engine.engine import MegatronEngine

    return MegatronEngine(
        ModelConfig(**TINY, router_aux_loss_coef=aux_loss, dtype=dtype),
        ParallelConfig(expert_parallel=ep, recompute=recompute),
        OptimConfig(lr=1e-2, grad_clip=0.0),
        seed=3,
        dispatcher=dispatcher,
        optimizer=optimizer,
    )


def _hf_weights(engine) -> dict:
    from tppo.engine.convert import iter_hf_tensors

    return {n: t.clone() for n, t in iter_hf_tensors(engine.built, engine.groups)}


def _train(engine, batches, executor=None, plans=None, loads=None) -> dict:
    from engine_testing import hf_gradients, nll_loss

    losses, grads, counts, metrics, in_flight = [], [], [], [], []
    for step, mbs in enumerate(batches):
        seen = []
        hooks = [
            layer.experts.register_forward_hook(lambda mod, a, o, seen=seen: seen.append(a[1].clone()))
            for layer in engine.moe_layers
        ]
        if executor is not None:
            executor.begin_step(plans[step], loads[step])
        loss, _ = engine.forward_backward(mbs, nll_loss)
        for h in hooks:
            h.remove()
        counts.append(seen)
        grads.append(hf_gradients(engine))
        # As tppo.cluster.workers orders it: the optimizer step, whose state hook lands migrated state, then end_step.
        if executor is not None:
            in_flight.append(executor.state_in_flight)
        engine.optimizer_step()
        if executor is not None:
            metrics.append(executor.end_step())
        losses.append(loss)
    return dict(
        losses=losses,
        grads=grads,
        counts=counts,
        metrics=metrics,
        in_flight=in_flight,
        weights=_hf_weights(engine),
    )


def invariance_worker(
    rank: int,
    steps_batches: list,
    plans: list,
    loads: list,
    replicas: int,
    gpn: int,
    dispatcher: str | None = None,
    recompute: bool = False,
    aux_loss: float = 0.0,
    state_buffer_mb: float = 1024,
) -> dict:
    """Static engine vs engine with the executor applying `plans`, on the same data; plus checkpoint loading."""
    from relibra.executor.executor import ExpertExecutor

    batches = [b[rank] for b in steps_batches]
    ep = len(steps_batches[0])
    static = _engine(ep, dispatcher, recompute, aux_loss=aux_loss)
    ref = _train(static, batches)
    engine = _engine(ep, dispatcher, recompute, aux_loss=aux_loss)
    executor = ExpertExecutor(
        engine, num_replica_slots=replicas, gpus_per_node=gpn, state_buffer_mb=state_buffer_mb
    )
    got = _train(engine, batches, executor, plans, loads)
    placement = [list(layer.experts.logical_expert_ids) for layer in engine.moe_layers]
    # A checkpoint saved under the final (reordered) placement, loaded by an engine under the static one.
    sd = engine.state_dict()
    fresh = _engine(ep, dispatcher, recompute, aux_loss=aux_loss)
    ExpertExecutor(fresh).load_checkpoint(sd)
    loaded = _hf_weights(fresh)
    # The same checkpoint again, keeping its placement this time.
    kept = _engine(ep, dispatcher, recompute, aux_loss=aux_loss)
    ExpertExecutor(kept).load_checkpoint(sd, keep_saved_placement=True)
    kept_placement = [list(layer.experts.logical_expert_ids) for layer in kept.moe_layers]
    kept_weights = _hf_weights(kept)
    from engine_testing import nll_loss

    # One more step on both: equal only if the Adam moments came along in logical order.
    engine.train_step(batches[0], nll_loss)
    fresh.train_step(batches[0], nll_loss)
    return dict(
        ref=ref,
        got=got,
        placement=placement,
        loaded=loaded,
        after_engine=_hf_weights(engine),
        after_loaded=_hf_weights(fresh),
        fresh_placement=[list(layer.experts.logical_expert_ids) for layer in fresh.moe_layers],
        kept_placement=kept_placement,
        kept_weights=kept_weights,
    )


def refusal_worker(rank: int, plans: list, loads, replicas: int, gpn: int) -> list:
    """Apply each plan; report (error text or None, weights unchanged, placement unchanged) for each."""
    from relibra.executor.executor import ExpertExecutor
    from relibra.validate import PlanError

    engine = _engine(2)
    executor = ExpertExecutor(engine, num_replica_slots=replicas, gpus_per_node=gpn)
    out = []
    for plan in plans:
        plan = plan[rank] if isinstance(plan, list) else plan
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        ids = [list(layer.experts.logical_expert_ids) for layer in engine.moe_layers]
        error = None
        try:
            executor.begin_step(plan, loads)
            executor.end_step()
        except PlanError as err:
            error = str(err)
        same = all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
        out.append(
            (error, same, ids == [list(layer.experts.logical_expert_ids) for layer in engine.moe_layers])
        )
    return out
