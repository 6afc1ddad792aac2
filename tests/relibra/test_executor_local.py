"""Expert migration inside one rank (EP=1, one process): slot contents are permuted between optimizer steps and
training continues exactly as without the permutation. On CPU with torch's AdamW; on a GPU also with Megatron's
distributed optimizer (fp32 master weights and Adam moments through its per-parameter accessors)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tppo" / "engine"))

import test_executor_workers as W
from engine_testing import nll_loss

from relibra.executor.engine_api import ExpertEngine
from relibra.executor.executor import ExpertExecutor

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")

LR = 1e-2  # test_executor_workers._engine
CUDA = torch.cuda.is_available()


GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="Megatron's optimizer needs CUDA")]


@pytest.mark.parametrize(
    "optimizer, dtype",
    [
        pytest.param("torch", "float32", id="torch-adamw"),
        # fp32: Megatron's main parameter is a view of the model parameter; bf16: a separate fp32 master copy.
        pytest.param("megatron", "float32", id="megatron-distributed-fp32", marks=GPU),
        pytest.param("megatron", "bfloat16", id="megatron-distributed-bf16", marks=GPU),
    ],
)
def test_permuting_slots_between_steps_changes_nothing(optimizer, dtype):
    static = W._engine(1, optimizer=optimizer, dtype=dtype)
    moved = W._engine(1, optimizer=optimizer, dtype=dtype)
    assert isinstance(moved, ExpertEngine)  # the surface the executor declares is the engine's
    executor = ExpertExecutor(moved)
    batches = W.make_batches(1, 2, seed=5)[0]
    E = W.TINY["num_experts"]
    orders = [list(range(E))[::-1], [3, 0, 7, 1, 6, 2, 5, 4]]
    # torch's AdamW in fp32: the same numbers up to summation order. Megatron's optimizer on a GPU: a permuted slot
    # order changes the grouped GEMM's rounding (TF32 / bf16, ~1e-4 of the loss). A weight or Adam moment left in
    # the wrong slot would be off by the init scale (~0.1) or ~lr per step, 10x the weight tolerance.
    rel, rtol, atol = (1e-6, 1e-5, LR / 100) if optimizer == "torch" else (1e-3, 1e-2, LR / 10)
    for step, order in enumerate(orders):
        layers = [order, order[::-1]]
        # As in a step: the weights move now, the optimizer state lands before the optimizer reads it.
        stats = executor.migrate_slots(torch.tensor(layers).unsqueeze(1).numpy(), defer_state=True)
        assert stats.num_experts_in == 0 and stats.bytes_sent == 0  # one rank: local moves only
        assert [list(layer.experts.logical_expert_ids) for layer in moved.moe_layers] == layers
        assert executor.state_in_flight or step == 0  # the optimizers create their state in the first step
        loss_static = static.train_step(batches, nll_loss).loss
        loss_moved = moved.train_step(batches, nll_loss).loss
        assert not executor.state_in_flight
        assert loss_moved == pytest.approx(loss_static, rel=rel), step
    want, got = W._hf_weights(static), W._hf_weights(moved)
    assert sorted(want) == sorted(got)
    for name in want:
        if optimizer == "torch":
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)
            continue
        # Adam's first steps move each weight by ~lr * sign(grad): rounding noise may flip the sign of a
        # near-zero gradient here and there, a misplaced expert or moment changes most of its weights.
        off = (got[name].float() - want[name].float()).abs() > atol + rtol * want[name].float().abs()
        assert off.float().mean().item() <= 0.01, (name, off.float().mean().item())


@pytest.mark.parametrize(
    "optimizer",
    [pytest.param("torch", id="torch-adamw"), pytest.param("megatron", id="megatron-distributed", marks=GPU)],
)
def test_a_fresh_engine_resumes_from_a_checkpoint_saved_under_another_placement(optimizer):
    """A checkpoint saved after a step under a permuted placement, loaded by a fresh engine (its optimizer has no
    state yet; the executor moves its experts to the saved placement first): one more step on both agrees."""
    batches = W.make_batches(1, 2, seed=7)[0]
    E = W.TINY["num_experts"]
    trained = W._engine(1, optimizer=optimizer)
    order = [3, 0, 7, 1, 6, 2, 5, 4]
    ExpertExecutor(trained).migrate_slots(torch.tensor([order, order[::-1]]).unsqueeze(1).numpy())
    trained.train_step(batches, nll_loss)
    fresh = W._engine(1, optimizer=optimizer)
    ExpertExecutor(fresh).load_checkpoint(trained.state_dict())
    assert [list(layer.experts.logical_expert_ids) for layer in fresh.moe_layers] == [list(range(E))] * 2
    trained.train_step(batches, nll_loss)
    fresh.train_step(batches, nll_loss)
    want, got = W._hf_weights(trained), W._hf_weights(fresh)
    for name in want:
        # The same step from the same weights and moments; only the slot order of the grouped GEMM differs.
        torch.testing.assert_close(got[name], want[name], rtol=1e-2, atol=LR / 10, msg=name)


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_slot_layout_with_an_empty_replica_slot_equals_static(dispatcher):
    """One rank, R=1: the dispatcher built for H + R slots (Megatron's allgather or alltoall, the GPU default)
    and the weights home + (empty) replica slot train exactly like the static engine."""
    import numpy as np

    from relibra.planners.base import home_plan

    static = W._engine(1, dispatcher=dispatcher, optimizer="torch")
    engine = W._engine(1, dispatcher=dispatcher, optimizer="torch")
    executor = ExpertExecutor(engine, num_replica_slots=1, gpus_per_node=1)
    batches = W.make_batches(1, 2, seed=6)[0]
    loads = W.loads_of([batches], W.TINY["num_experts"])
    plan = home_plan(loads, np.zeros((2, W.TINY["num_experts"]), dtype=np.int64), executor.topo)
    with executor.step(plan, loads, num_microbatches=2) as step:
        loss = engine.train_step(batches, nll_loss).loss
    assert step.extra["relibra/exec_replica_pushes"] == 0
    assert [len(c) for c in [layer.experts.last_tokens_per_expert for layer in engine.moe_layers]] == [9, 9]
    assert loss == pytest.approx(static.train_step(batches, nll_loss).loss, rel=1e-6)
    want, got = W._hf_weights(static), W._hf_weights(engine)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=LR / 100, msg=name)
