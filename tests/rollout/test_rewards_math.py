"""rollout.rewards.math on real AIME and GSM8K reference answers: correct, incorrect, malformed and adversarial
responses; the hard time limit works off the main thread and the pool survives a killed worker."""

from __future__ import annotations

import json
import threading
import time

import pytest
from rollout_testlib import DATA

from rollout.rewards import REWARDS
from rollout.rewards.math import MathVerifier, extract_final_answer, score, score_batch

needs_data = pytest.mark.skipif(not (DATA / "aime").is_dir(), reason=f"shared data folder {DATA} is absent")


def _rows(*parts: str) -> list[dict]:
    return [json.loads(line) for line in (DATA.joinpath(*parts)).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(num_workers=2, timeout_s=10.0) as v:
        yield v


@needs_data
def test_aime_correct_and_incorrect_answers(verifier):
    rows = _rows("aime", "aime2024.jsonl") + _rows("aime", "aime2025.jsonl")
    answers = [r["answer"] for r in rows]
    correct = [f"Working... so the result is \\boxed{{{a}}}." for a in answers]
    wrong = [f"Therefore the final answer is \\boxed{{{int(a) + 1}}}" for a in answers]
    # A correct value after a wrong intermediate box: only the last box counts.
    last_box = [f"First \\boxed{{{int(a) + 7}}}, corrected: \\boxed{{{a}}}" for a in answers[:10]]
    scores = score_batch(correct + wrong + last_box, answers * 2 + answers[:10], verifier=verifier)
    n = len(answers)
    assert scores[:n] == [1.0] * n
    assert scores[n : 2 * n] == [0.0] * n
    assert scores[2 * n :] == [1.0] * 10


@needs_data
def test_gsm8k_answers_in_several_notations(verifier):
    rows = _rows("gsm8k", "test_first50.jsonl")
    answers = [r["answer"] for r in rows]
    marked = [f"{r['solution'].split('####')[0]}#### {r['answer']}" for r in rows]
    commas = [f"The answer is \\boxed{{{int(a):,}}}" for a in answers]
    final = [f"Final Answer: {a}" for a in answers]
    wrong = [f"\\boxed{{{int(a) * 2 + 1}}}" for a in answers]
    scores = score_batch(marked + commas + final + wrong, answers * 4, verifier=verifier)
    n = len(answers)
    assert scores[: 3 * n] == [1.0] * (3 * n)
    assert scores[3 * n :] == [0.0] * n


@needs_data
def test_malformed_responses_score_zero_without_raising(verifier):
    answer = _rows("aime", "aime2024.jsonl")[0]["answer"]
    malformed = [
        "",
        "I am not sure.",
        "\\boxed{",
        "\\boxed{}",
        "\\boxed{{{{}",
        "}}}}\\boxed",
        f"\\boxed{{{answer}",
        "\\boxed{\\frac{1}{",
        "\x00\x01\x02 binary \udcff garbage",
        "\\boxed{" + "x" * 5000 + "}",
        ("word " * 200_000) + "no box at all",
        "\\boxed{\\begin{pmatrix} 1 & 2 \\end{pmatrix}}",
    ]
    assert score_batch(malformed, [answer] * len(malformed), verifier=verifier) == [0.0] * len(malformed)


def test_adversarial_answer_hits_the_time_limit_and_the_pool_recovers(verifier):
    t0 = time.monotonic()
    before = verifier.num_timeouts
    out = verifier.verify_many(["2", "9^{9^{9^{9^{9}}}}", "3"], ["2", "1", "3"], timeout_s=1.0)
    assert out == [True, False, True]
    assert time.monotonic() - t0 < 30
    assert verifier.num_timeouts == before + 1
    assert verifier.verify_many(["\\frac{1}{2}"], ["0.5"]) == [True]


def test_score_from_a_worker_thread():
    # math-verify's own signal-based timeouts fail off the main thread; ours do not use signals.
    results = []
    thread = threading.Thread(target=lambda: results.append(score("so \\boxed{\\frac{3}{4}}", "0.75")))
    thread.start()
    thread.join(timeout=120)
    assert results == [1.0]


def test_extract_final_answer():
    assert extract_final_answer("a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == "\\frac{1}{\\sqrt{2}}"
    assert extract_final_answer("x \\fbox{42}") == "42"
    assert extract_final_answer("\\boxed{5} then broken \\boxed{7") == "5"
    assert extract_final_answer("The final answer is $17$.") == "17"
    assert extract_final_answer("Final Answer: 3/4\nmore text") == "3/4"
    assert extract_final_answer("steps\n#### 1,234") == "1,234"
    assert extract_final_answer("the value is 12") is None


def test_registered_rewards_and_bad_input():
    assert REWARDS.get("exact")([" 46", "45"], ["46", "46"]) == [1.0, 0.0]
    assert "math" in REWARDS
    with pytest.raises(ValueError, match="same length"):
        score_batch(["a"], ["1", "2"])
    with pytest.raises(ValueError, match="must be str"):
        score_batch([None], ["1"])
