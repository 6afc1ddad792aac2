"""The evaluation with an oracle generation backend on the real AIME 2024 problems: responses that hold the right
answer score exactly 100%, wrong ones exactly 0%, and a known mixture gives the metrics computed independently
(closed-form pass@k, hand-counted majority votes); run_eval writes the generations, summary, table and metrics."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
from eval_testlib import Oracle, right, wrong

from rollout.config import DataConfig
from rollout.data import load_prompts
from tppo.base.metrics import LoggingConfig, read_metrics
from tppo.cluster.roles import RankGroup, Rollout
from tppo.eval.evaluation import EvalConfig, evaluate, run_eval, sample_seed

N = 4


def aime_data(path) -> DataConfig:
    return DataConfig(source="dataset", path=str(path), template="math_chat", shuffle=False)


def eval_config(path, **kw) -> EvalConfig:
    base = dict(
        data=aime_data(path),
        n=N,
        max_new_tokens=64,
        name="aime2024",
        verify_workers=1,
        logging=LoggingConfig(wandb="disabled", progress=False),
    )
    return EvalConfig(**{**base, **kw}).validate()


@pytest.fixture(scope="module")
def records(aime2024, qwen_tokenizer):
    return load_prompts(aime_data(aime2024), qwen_tokenizer)


def test_right_answers_score_exactly_100_percent(records, aime2024, qwen_tokenizer, verifier):
    oracle = Oracle(qwen_tokenizer, records, right)
    result = evaluate(oracle, records, eval_config(aime2024), qwen_tokenizer, verifier=verifier)
    m = result.metrics
    assert m.num_problems == 30 and m.n == N
    assert m.avg_at_n == 1.0 and m.cons_at_n == 1.0 and m.answered_rate == 1.0
    assert m.pass_at_k == {1: 1.0, 2: 1.0, 4: 1.0}
    assert m.truncation_rate == 0.0
    for p, rec in zip(result.problems, records):
        assert (p.id, p.num_correct, p.majority_answer, p.majority_count) == (rec.id, N, rec.answer, N)
        assert p.majority_correct
    logged = result.log_metrics()
    assert logged["eval/aime2024/avg@4"] == 1.0 and logged["eval/aime2024/pass@4"] == 1.0


def test_wrong_answers_score_exactly_0_percent(records, aime2024, qwen_tokenizer, verifier):
    oracle = Oracle(qwen_tokenizer, records, wrong)
    result = evaluate(oracle, records, eval_config(aime2024), qwen_tokenizer, verifier=verifier)
    m = result.metrics
    assert m.avg_at_n == 0.0 and m.cons_at_n == 0.0 and set(m.pass_at_k.values()) == {0.0}
    assert m.answered_rate == 1.0
    for p in result.problems:
        assert p.num_correct == 0 and p.majority_answer == str(int(p.reference) + 1)


def test_a_known_mixture_gives_the_independently_computed_metrics(
    records, aime2024, qwen_tokenizer, verifier
):
    # problem i: the first c_i samples right, the last one cut by the token limit when i % 3 == 0 (and not
    # already right), the rest wrong (all with the same wrong answer)
    def num_right(i):
        return i % (N + 1)

    def cut(i, j):
        return i % 3 == 0 and j == N - 1 and j >= num_right(i)

    def respond(i, answer, j):
        if j < num_right(i):
            return right(i, answer, j)
        return None if cut(i, j) else wrong(i, answer, j)

    oracle = Oracle(qwen_tokenizer, records, respond)
    cfg = eval_config(aime2024, batch_size=8, ks=[1, 3, 4])
    result = evaluate(oracle, records, cfg, qwen_tokenizer, verifier=verifier)
    m = result.metrics

    P = len(records)
    c = [num_right(i) for i in range(P)]
    num_cut = [sum(cut(i, j) for j in range(N)) for i in range(P)]
    assert m.avg_at_n == pytest.approx(sum(c) / (P * N))
    for k in (1, 3, 4):
        expected = sum(1 - Fraction(math.comb(N - ci, k), math.comb(N, k)) for ci in c) / P
        assert m.pass_at_k[k] == pytest.approx(float(expected))
    # right answers come first, so they win ties; with none right the wrong answer wins
    majority_right = [ci >= N - ci - cu and ci > 0 for ci, cu in zip(c, num_cut)]
    assert [p.majority_correct for p in result.problems] == majority_right
    assert m.cons_at_n == pytest.approx(np.mean(majority_right))
    assert m.truncation_rate == pytest.approx(sum(num_cut) / (P * N))
    assert m.answered_rate == pytest.approx(1 - sum(num_cut) / (P * N))
    assert [p.num_correct for p in result.problems] == c

    lengths = [s.num_tokens for s in result.samples]
    assert m.length.mean == pytest.approx(sum(lengths) / len(lengths)) and m.length.max == max(lengths)
    # whole problems per call (batch_size 8 / n 4), one seed per (problem, sample), the same for any batching
    assert oracle.num_calls == P // 2
    seeds = [p.seed for p in oracle.params]
    assert seeds == [sample_seed(cfg.seed, r.id, j) for r in records for j in range(N)]
    assert len(set(seeds)) == len(seeds)
    assert {p.stop_token_ids for p in oracle.params} == {(qwen_tokenizer.eos_token_id,)}
    assert {(p.temperature, p.top_p, p.max_new_tokens) for p in oracle.params} == {(0.6, 0.95, 64)}


def test_the_loops_rollout_handle_is_an_evaluation_generator(records, aime2024, qwen_tokenizer, verifier):
    oracle = Oracle(qwen_tokenizer, records[:3], right)
    rollout = Rollout(RankGroup("rollout", [oracle], remote=False))
    result = evaluate(rollout, records[:3], eval_config(aime2024), qwen_tokenizer, verifier=verifier)
    assert result.metrics.avg_at_n == 1.0 and oracle.num_calls == 1


def test_run_eval_writes_generations_summary_table_and_metrics(
    records, aime2024, qwen_tokenizer, tiny_qwen_ckpt, tmp_path
):
    oracle = Oracle(qwen_tokenizer, records, right)
    printed = []
    cfg = eval_config(
        aime2024,
        checkpoint=str(tiny_qwen_ckpt),
        tokenizer="qwen-tokenizer",
        output_dir=str(tmp_path),
        name=None,
    )
    run = run_eval(cfg, generator=oracle, print_fn=printed.append)

    assert run.out_dir == tmp_path / "tiny-qwen3-moe-aime2024"
    lines = [json.loads(x) for x in (run.out_dir / "generations.jsonl").read_text().splitlines()]
    assert len(lines) == 30 * N
    assert all(x["correct"] and x["extracted_answer"] == x["reference"] for x in lines)
    assert [x["problem_id"] for x in lines[:N]] == ["2024-I-1"] * N and lines[0]["reference"] == "204"
    assert lines[0]["response"].endswith("\\boxed{204}$.")  # decoded without the EOS token

    summary = json.loads((run.out_dir / "summary.json").read_text())
    assert summary["metrics"]["eval/aime2024/avg@4"] == 1.0
    assert summary["metrics"]["eval/aime2024/cons@4"] == 1.0
    assert len(summary["problems"]) == 30 and summary["sampling"]["n"] == N

    (record,) = read_metrics(run.out_dir / "metrics.jsonl")
    assert record["step"] == 0 and record["eval/aime2024/pass@1"] == 1.0
    table = (run.out_dir / "table.txt").read_text()
    assert table.strip() == printed[0].strip()
    row = next(line for line in table.splitlines() if line.startswith("2024-I-1 "))
    assert row.split() == ["2024-I-1", "4/4", "204", "(4)", "204", "yes"]
    assert "avg@4 1.0000  cons@4 1.0000  pass@1 1.0000  pass@2 1.0000  pass@4 1.0000" in table


def test_non_finite_weights_are_reported_with_the_result(
    records, aime2024, qwen_tokenizer, tiny_qwen_ckpt, tmp_path, caplog
):
    """A checkpoint holding a NaN is evaluated (a NaN no token reaches changes nothing, and the numbers show
    whether it did), but one warning line names it, and the table and summary carry it so none reads the
    result as normal."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen_ckpt, broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[-1]
    tensors[name].view(-1)[0] = torch.nan
    save_file(tensors, weights, metadata={"format": "pt"})
    cfg = eval_config(aime2024, checkpoint=str(broken), tokenizer="qwen-tokenizer", output_dir=str(tmp_path))
    printed = []
    with caplog.at_level("WARNING", logger="tppo.eval.evaluation"):
        run = run_eval(cfg, generator=Oracle(qwen_tokenizer, records, right), print_fn=printed.append)

    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (
        f"checkpoint '{broken}' has NaN/Inf weights in 1 tensor(s), e.g. {name}: these results are not those "
        "of a sound model"
    )
    assert run.result.metrics.avg_at_n == 1.0  # the result is still there
    assert printed[0].splitlines()[-1] == f"warning: {warning}"
    assert json.loads((run.out_dir / "summary.json").read_text())["non_finite_tensors"] == [name]
