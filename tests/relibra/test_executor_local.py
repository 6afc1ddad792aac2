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

from relibra.executor.executor import ExpertExecutor

pytestmark = pytest.mark.filterwarnings("ignore:.*(Transformer Engine|Apex).*:UserWarning")

LR = 1e-2  # test_executor_workers._engine
CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(
    "optimizer",
    [
        pytest.param("torch", id="torch-adamw"),
        pytest.param(
            "megatron",
            id="megatron-distributed",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="Megatron's optimizer needs CUDA")],
        ),
    ],
)
def test_permuting_slots_between_steps_changes_nothing(optimizer):
    static = W._engine(1, optimizer=optimizer)
    moved = W._engine(1, optimizer=optimizer)
    executor = ExpertExecutor(moved)
    batches = W.make_batches(1, 2, seed=5)[0]
    E = W.TINY["num_experts"]
    orders = [list(range(E))[::-1], [3, 0, 7, 1, 6, 2, 5, 4]]
    for step, order in enumerate(orders):
        layers = [order, order[::-1]]
        stats = executor.migrate_slots(torch.tensor(layers).unsqueeze(1).numpy())
        assert stats.num_experts_in == 0 and stats.bytes_sent == 0  # one rank: local moves only
        assert [list(layer.experts.logical_expert_ids) for layer in moved.moe_layers] == layers
        loss_static = static.train_step(batches, nll_loss).loss
        loss_moved = moved.train_step(batches, nll_loss).loss
        assert loss_moved == pytest.approx(loss_static, rel=1e-6), step
    want, got = W._hf_weights(static), W._hf_weights(moved)
    assert sorted(want) == sorted(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=LR / 100, msg=name)
