"""ReLibra's executor on a real Megatron-Core engine, EP=2 over gloo: any valid plan (reorders, replicas) gives the
same losses, gradients and weights in logical order as the static placement; an empty plan is bit-identical;
checkpoints load across placements; bad plans are refused before anything moves."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tppo" / "engine"))

import test_executor_workers as W
from engine_testing import run_ranks

from relibra.plan import Plan, Topology, static_home_LE
from relibra.planners.base import home_plan

pytestmark = [
    pytest.mark.dist,
    pytest.mark.timeout(400),
    pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning"),
]

EP, NUM_MB, NUM_STEPS = 2, 2, 2
LR = 1e-2  # test_executor_workers._engine


def _setup(replicas: int, seed: int, *, reorder: bool = True, ep: int = EP, gpn: int = EP, tokens=8):
    topo = Topology(
        num_gpus=ep, gpus_per_node=gpn, num_experts=W.TINY["num_experts"], num_replica_slots=replicas
    )
    rng = np.random.default_rng(seed)
    batches = [W.make_batches(ep, NUM_MB, seed=100 * seed + s, tokens=tokens) for s in range(NUM_STEPS)]
    loads = [W.loads_of(b, topo.num_experts) for b in batches]
    if reorder:
        plans = [W.random_plan(d, topo, rng, replicas=replicas > 0) for d in loads]
    else:
        plans = [home_plan(d, static_home_LE(d.shape[1], topo), topo) for d in loads]
    return topo, batches, loads, plans


def _close(a: dict, b: dict, rtol=1e-5, atol=1e-6):
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(
            a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
        )


ONE_LAYER = 1e-6  # MiB of migration buffers: every moved layer's optimizer state is a chunk of its own
CASES = [
    pytest.param(2, 2, 0, False, 8, 0.0, None, 1024, id="ep2-reorder"),
    pytest.param(2, 2, 0, False, 8, 0.0, None, ONE_LAYER, id="ep2-reorder-state-per-layer"),
    pytest.param(2, 2, 1, False, 8, 0.0, None, 1024, id="ep2-reorder+replicas"),
    pytest.param(2, 2, 1, False, [8, 5], 0.0, None, 1024, id="ep2-replicas-padded"),
    pytest.param(2, 2, 1, True, 8, 0.0, None, 1024, id="ep2-replicas-recompute"),
    pytest.param(2, 2, 1, False, 8, 0.1, None, 1024, id="ep2-replicas-aux-loss"),
    # The GPU's token dispatcher (all-to-all), here over gloo through the engine's CPU compat layer.
    pytest.param(2, 2, 1, False, 8, 0.0, "alltoall", 1024, id="ep2-replicas-alltoall"),
    pytest.param(4, 2, 1, False, 6, 0.0, None, 1024, id="ep4-two-nodes-replicas", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    ("ep", "gpn", "replicas", "recompute", "tokens", "aux_loss", "dispatcher", "buffer_mb"), CASES
)
def test_any_plan_equals_static(ep, gpn, replicas, recompute, tokens, aux_loss, dispatcher, buffer_mb):
    """Random valid plans (a reorder every step, random intra-node replicas with random quota splits) give the
    static placement's losses, gradients and weights in logical order (the optimizer state of a reorder lands
    only at the optimizer step); the dispatcher hands every slot exactly
    its quota; a checkpoint saved under the final placement loads under the static one (weights and Adam
    moments: one more step agrees)."""
    topo, batches, loads, plans = _setup(replicas, seed=1 + replicas, ep=ep, gpn=gpn, tokens=tokens)
    if replicas:
        assert sum((p.slots_MLGJ[..., topo.num_home_slots :] >= 0).sum() for p in plans) > 0
    assert any((p.home_LE != static_home_LE(p.num_layers, topo)).any() for p in plans)
    ranks = run_ranks(
        W.invariance_worker,
        ep,
        batches,
        plans,
        loads,
        replicas,
        gpn,
        dispatcher,
        recompute,
        aux_loss,
        buffer_mb,
        timeout_s=300,
    )
    H = topo.num_home_slots
    for rank, out in enumerate(ranks):
        ref, got = out["ref"], out["got"]
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6)
        for step in range(NUM_STEPS):
            _close(got["grads"][step], ref["grads"][step])
            served = plans[step].served_MLGJ()[:, :, rank]  # [M, L, J]
            want = [served[m, layer].tolist() for m in range(NUM_MB) for layer in range(W.TINY["num_layers"])]
            counts = [c.tolist() for c in got["counts"][step]]
            if recompute:  # every layer ran twice per micro-batch (first pass, recompute in the backward)
                want = sorted(want * 2)
                counts = sorted(counts)
            if isinstance(tokens, int):  # padding tokens come on top of the plan's quotas (home slots)
                assert counts == want
            else:
                assert all(sum(c) >= sum(w) for c, w in zip(counts, want, strict=True))
            metrics = got["metrics"][step]
            before = plans[step - 1].home_LE if step else static_home_LE(2, topo)
            now = plans[step].home_LE
            moved_in = ((now == rank) & (before != rank)).sum()
            moved_out = ((now != rank) & (before == rank)).sum()
            assert metrics["relibra/exec_migrated_experts"] == moved_in
            # The moved experts' Adam moments (there are some once a step has run) were still travelling when
            # the backward ended, and the equal weights below say they landed before the optimizer read them.
            layers_moved = int((now != before).any(axis=1).sum())
            assert got["in_flight"][step] == bool(step and layers_moved)
            chunks = layers_moved if buffer_mb == ONE_LAYER else min(layers_moved, 1)
            assert metrics["relibra/exec_state_chunks"] == (chunks if step else 0)
            waited = metrics["relibra/exec_state_waited_chunks"]
            if (
                torch.cuda.is_available()
            ):  # NCCL: chunks may land in the expert hooks, before the optimizer step
                assert 0 <= waited <= metrics["relibra/exec_state_chunks"]
            else:  # gloo completes a transfer only in its wait: the optimizer step waited for every chunk
                assert waited == metrics["relibra/exec_state_chunks"]
            # W1 + W2 of an expert (3 F D fp32 values), with AdamW's two moments once a step has run.
            per_expert = 3 * W.TINY["moe_ffn_hidden_size"] * W.TINY["hidden_size"] * 4 * (3 if step else 1)
            assert metrics["relibra/exec_migration_bytes"] == moved_out * per_expert
            assert metrics["relibra/exec_expert_fwd_ms_max"] >= metrics["relibra/exec_expert_fwd_ms"] > 0
            if isinstance(tokens, int):
                per_gpu_MLG = plans[step].served_MLGJ().sum(-1)
                skew = (per_gpu_MLG.max(-1) / per_gpu_MLG.mean(-1)).mean()
                assert metrics["relibra/exec_skew_measured"] == pytest.approx(skew, rel=1e-12)
            if replicas:
                pushes = (plans[step].slots_MLGJ[:, :, rank, H:] >= 0).sum() * (2 if recompute else 1)
                assert metrics["relibra/exec_replica_pushes"] == pushes
        # Adam turns 1e-7 gradient differences of near-zero gradients into up to ~lr-sized steps: 1% of lr.
        _close(got["weights"], ref["weights"], atol=LR / 100)  # the export path: HF names, logical order
        assert out["placement"] == plans[-1].slots_MLGJ[0, :, rank, :H].tolist()
        assert out["fresh_placement"] == [list(range(H * rank, H * rank + H))] * W.TINY["num_layers"]
        _close(out["loaded"], got["weights"], rtol=0, atol=0)
        assert out["kept_placement"] == out["placement"]
        _close(out["kept_weights"], got["weights"], rtol=0, atol=0)
        _close(out["after_loaded"], out["after_engine"], atol=LR / 100)


def test_static_plan_is_bit_identical():
    _topo, batches, loads, plans = _setup(0, seed=7, reorder=False)
    (out0, out1) = run_ranks(W.invariance_worker, EP, batches, plans, loads, 0, EP, timeout_s=300)
    for out in (out0, out1):
        assert out["got"]["losses"] == out["ref"]["losses"]
        for step in range(NUM_STEPS):
            _close(out["got"]["grads"][step], out["ref"]["grads"][step], rtol=0, atol=0)
        _close(out["got"]["weights"], out["ref"]["weights"], rtol=0, atol=0)


def test_bad_plans_are_refused_before_anything_moves():
    # Two nodes of one GPU each: no replica may exist at all.
    topo = Topology(num_gpus=EP, gpus_per_node=1, num_experts=8, num_replica_slots=1)
    batches = W.make_batches(EP, NUM_MB, seed=3)
    loads = W.loads_of(batches, 8)
    rng = np.random.default_rng(0)
    wide = Topology(num_gpus=EP, gpus_per_node=EP, num_experts=8, num_replica_slots=1)
    cross = W.random_plan(loads, wide, rng, replicas=True)  # replicas across the two nodes, and a reorder
    assert (cross.slots_MLGJ[..., 4:] >= 0).any()
    good = home_plan(loads, W.random_home_LE(2, topo, rng), topo)
    slots = good.slots_MLGJ.copy()
    slots[:, 0, 1, 0] = slots[:, 0, 0, 0]  # one expert in home slots of both GPUs: two owners
    two_owners = Plan(good.home_LE, slots, good.quota_MLGJS, 4)
    big = Topology(num_gpus=EP, gpus_per_node=EP, num_experts=8, num_replica_slots=2)
    too_many = W.random_plan(loads, big, rng, replicas=True)  # 2 replica slots, the executor has 1
    other = home_plan(loads, W.random_home_LE(2, topo, rng), topo)
    differ = [good, other]  # rank 0 and rank 1 were handed different plans
    plans = [cross, two_owners, too_many, differ, good]
    results = run_ranks(W.refusal_worker, EP, plans, loads, 1, 1, timeout_s=200)
    for per_rank in results:
        for (error, weights_same, ids_same), what in zip(
            per_rank[:4], ["node", "", "shape", "different"], strict=True
        ):
            assert error is not None and what in error
            assert weights_same and ids_same
        error, weights_same, ids_same = per_rank[4]
        assert error is None and not ids_same  # the good plan reorders
