"""The evaluation metrics against independent references: pass@k against its closed form (exact rationals) and a
brute-force enumeration of k-subsets; avg@n, majority vote, lengths and truncation against hand computations."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tppo.eval.metrics import (
    avg_at_n,
    default_ks,
    length_stats,
    majority_vote,
    mean_pass_at_k,
    normalize_answer,
    pass_at_k,
    truncation_rate,
)


def closed_form(n: int, c: int, k: int) -> Fraction:
    """1 - C(n - c, k) / C(n, k) in exact rationals (math.comb is 0 when k > n - c)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def brute_force(correct: list[bool], k: int) -> Fraction:
    """The fraction of all k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return Fraction(sum(any(correct[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_equals_closed_form_and_brute_force_for_every_c_and_k(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            # samples in an arbitrary order: the estimator depends only on the count
            correct = [True] * c + [False] * (n - c)
            np.random.default_rng(n * 100 + c * 10 + k).shuffle(correct)
            got = pass_at_k(n, c, k)
            assert got == pytest.approx(float(closed_form(n, c, k)), abs=1e-12)
            assert got == pytest.approx(float(brute_force(correct, k)), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12), st.data())
def test_pass_at_k_brute_force_property(correct, data):
    k = data.draw(st.integers(1, len(correct)))
    assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(
        float(brute_force(correct, k)), abs=1e-12
    )


@pytest.mark.parametrize(("n", "c", "k"), [(1024, 3, 512), (1024, 1, 1), (4096, 17, 64), (2000, 1990, 5)])
def test_pass_at_k_is_stable_where_binomials_overflow_floats(n, c, k):
    # C(1024, 512) ~ 4e306 and C(4096, 64) overflow doubles; the product form stays accurate.
    assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), rel=1e-12, abs=1e-15)


def test_pass_at_1_is_the_fraction_correct_and_pass_at_n_is_any_correct():
    for n in (1, 4, 32):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
            assert pass_at_k(n, c, n) == (1.0 if c else 0.0)


def test_mean_pass_at_k_averages_problems():
    counts = [0, 3, 8, 1]
    expected = np.mean([float(closed_form(8, c, 2)) for c in counts])
    assert mean_pass_at_k(counts, 8, 2) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("args", "message"),
    [((4, 5, 1), "num_correct=5"), ((4, -1, 1), "num_correct=-1"), ((4, 2, 0), "k=0"), ((4, 2, 5), "k=5")],
)
def test_pass_at_k_rejects_impossible_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(*args)


def test_avg_at_n_is_the_mean_of_all_samples():
    correct_PN = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    assert avg_at_n(correct_PN) == pytest.approx(6 / 12)
    assert avg_at_n(correct_PN) == pytest.approx(mean_pass_at_k(correct_PN.sum(1), 4, 1))
    with pytest.raises(ValueError, match="correct_PN"):
        avg_at_n(np.array([1, 0]))


def test_default_ks_are_powers_of_two_up_to_n_and_n():
    assert default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_ks(1) == [1]
    assert default_ks(10) == [1, 2, 4, 8, 10]


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("204", "204"),
        (" 204 ", "204"),
        ("$204$", "204"),
        ("0204", "204"),
        ("204.0", "204"),
        ("1,000", "1000"),
        ("1{,}000", "1{,}000"),  # LaTeX grouping stays a string (math-verify decides correctness)
        ("3.50", "3.5"),
        ("\\text{ 17 }", "17"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("90^\\circ", "90"),
        ("x = 5.", "x=5"),
        ("-0", "0"),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_majority_vote_counts_normalised_answers_and_ignores_missing_ones():
    vote = majority_vote(["12", None, "$13$", "13", "12.0", "13", None])
    assert (vote.key, vote.count, vote.first_index, vote.answer) == ("13", 3, 2, "$13$")


def test_majority_vote_tie_goes_to_the_earliest_answer():
    assert majority_vote(["7", "8", "8", "7"]).key == "7"
    assert majority_vote(["8", "7", "7", "8"]).key == "8"


def test_majority_vote_without_answers():
    vote = majority_vote([None, None])
    assert (vote.key, vote.answer, vote.count, vote.first_index) == (None, None, 0, -1)


def test_length_stats_against_hand_computed_percentiles():
    stats = length_stats([10, 20, 30, 40, 50], percentiles=(50, 90, 0, 100))
    assert stats.mean == 30 and stats.max == 50
    # linear interpolation between order statistics: position p/100 * (m - 1)
    assert stats.percentiles == {50: 30.0, 90: 46.0, 0: 10.0, 100: 50.0}
    with pytest.raises(ValueError, match="empty"):
        length_stats([])


def test_truncation_rate_is_the_fraction_cut_by_length():
    assert truncation_rate(np.array([[True, False], [False, False]])) == 0.25
