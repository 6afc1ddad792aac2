"""Which tile height the persistent MoE kernel gives a step's prefill tokens and its decode tiles
(rollout.kernels.tiling), and that the engine's expert path passes the kernel that choice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import rollout.model
from rollout.kernels.tiling import (
    BLOCK_M_DECODE,
    BLOCK_M_DECODE_WIDE,
    BLOCK_M_PREFILL,
    SMALL_PREFILL_PAIRS,
    decode_block_m,
    kernel_num_decode,
    max_small_prefill,
    prefill_in_decode_tiles,
)
from rollout.runner import _pow2_at_least


@pytest.mark.parametrize(("top_k", "num_experts"), [(8, 128), (2, 8), (6, 64), (4, 60)])
def test_small_prefill_fills_one_decode_tile_per_expert(top_k, num_experts):
    """S is the largest power of two within one decode tile's pairs per expert, so a CUDA-graph step, whose
    prefill is padded to a power of two (at least 16), is cut as the eager step of its real tokens."""
    s = max_small_prefill(top_k, num_experts)
    assert s & (s - 1) == 0 and s * top_k <= SMALL_PREFILL_PAIRS * num_experts < 2 * s * top_k
    for p in range(1, 4 * s):
        padded = _pow2_at_least(p, 16)  # the runner's prefill bucket
        assert prefill_in_decode_tiles(p, 1, top_k, num_experts) == prefill_in_decode_tiles(
            padded, 1, top_k, num_experts
        )
    assert SMALL_PREFILL_PAIRS == BLOCK_M_DECODE < BLOCK_M_PREFILL
    assert prefill_in_decode_tiles(s, 1, top_k, num_experts)
    assert not prefill_in_decode_tiles(s + 1, 1, top_k, num_experts)
    assert not prefill_in_decode_tiles(1, 0, top_k, num_experts)  # a prefill pass alone keeps prefill tiles
    assert max_small_prefill(8, 128) == 256  # Qwen3-30B-A3B


@pytest.mark.parametrize(("top_k", "num_experts"), [(8, 128), (2, 8), (6, 64)])
def test_decode_tiles_widen_from_s_tokens(top_k, num_experts):
    """From S tokens in decode tiles (16 pairs per expert on average, half the experts over one 16-row tile) the
    tiles hold 32 pairs; below S, 16."""
    s = max_small_prefill(top_k, num_experts)
    assert [decode_block_m(d, top_k, num_experts) for d in (0, 1, s - 1)] == [BLOCK_M_DECODE] * 3
    assert [decode_block_m(d, top_k, num_experts) for d in (s, s + 1, 8 * s)] == [BLOCK_M_DECODE_WIDE] * 3
    assert BLOCK_M_DECODE < BLOCK_M_DECODE_WIDE < BLOCK_M_PREFILL
    assert decode_block_m(256, 8, 128) == 32 and decode_block_m(255, 8, 128) == 16  # Qwen3-30B-A3B


def test_kernel_num_decode():
    assert kernel_num_decode(num_tokens=128 + 256, num_decode=128, top_k=8, num_experts=128) == 384
    # a larger prefill segment takes the rows into prefill tiles with it
    assert kernel_num_decode(num_tokens=128 + 257, num_decode=128, top_k=8, num_experts=128) == 0
    assert kernel_num_decode(num_tokens=64, num_decode=64, top_k=8, num_experts=128) == 64  # decode only
    assert kernel_num_decode(num_tokens=200, num_decode=0, top_k=8, num_experts=128) == 0  # prefill only


@pytest.mark.parametrize(
    ("tokens", "num_decode", "want"), [(40, 8, 40), (200, 8, 0), (100, 0, 0), (12, 12, 12)]
)
def test_the_engines_expert_path_passes_the_kernel_that_choice(monkeypatch, tokens, num_decode, want):
    """MoeDecoder.experts on the persistent path, E = 16, K = 2: S = 16 x 16 / 2 = 128 prefill tokens."""
    seen = []
    monkeypatch.setattr(rollout.model, "persistent_moe", lambda *a, **kw: seen.append(kw["num_decode"]))
    model = SimpleNamespace(persistent=True, spec=SimpleNamespace(num_experts=16))
    layer = SimpleNamespace(gate_up_EFH=None, down_EHF=None)
    h_TH, ids_TK = torch.zeros(tokens, 4), torch.zeros(tokens, 2, dtype=torch.long)
    rollout.model.MoeDecoder.experts(model, layer, h_TH, torch.ones(tokens, 2), ids_TK, h_TH, num_decode)
    assert seen == [want]
