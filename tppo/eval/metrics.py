"""Metrics of a sampled evaluation (AIME-style): avg@n, unbiased pass@k, majority vote (cons@n), lengths.

Pure functions of per-sample correctness, extracted answers and lengths; no model, no I/O. The conventions are
the field's: avg@n is the mean accuracy over all n samples of every problem (pass@1 averaged over n); pass@k is
the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"), averaged over
problems; cons@n is the accuracy of the most frequent final answer among the n samples.

Majority vote groups answers by a normalised string (`normalize_answer`: whitespace, `$`, `\\text{}`,
`\\left/\\right`, thousands separators and trailing zeros of numbers removed), not by pairwise math-verify
equivalence: pairwise verification costs O(n^2) verifier calls per problem, and for AIME (integer answers)
normalised strings already coincide with equality. Whether the winning answer is correct is then decided by
math-verify, through the score of the group's first sample (see `tppo.eval.evaluation`).

Legend: P problems, N samples per problem (n), K values of k.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

import numpy as np

DEFAULT_PERCENTILES = (50, 90, 99)


# --------------------------------------------------------------------------------------------- pass@k
def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k of one problem with c correct among n samples:

        pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n-c+1}^{n} (1 - k / i)

    (the product form avoids huge binomials; it is exactly 1 when n - c < k, since every k-subset then holds a
    correct sample)."""
    n, c = int(num_samples), int(num_correct)
    if n < 1 or not 0 <= c <= n:
        raise ValueError(
            f"num_correct={c}, num_samples={n}: expected 0 <= num_correct <= num_samples, n >= 1"
        )
    if not 1 <= k <= n:
        raise ValueError(f"k={k}: expected 1 <= k <= num_samples={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def mean_pass_at_k(num_correct_P: Sequence[int], num_samples: int, k: int) -> float:
    """Mean over problems p of pass@k(n, c_p, k)."""
    if len(num_correct_P) == 0:
        raise ValueError("num_correct_P is empty; expected one count per problem")
    return float(np.mean([pass_at_k(num_samples, c, k) for c in num_correct_P]))


def avg_at_n(correct_PN: np.ndarray) -> float:
    """avg@n = (1 / (P n)) sum_p sum_j correct[p, j]: the mean accuracy of all samples (= mean pass@1)."""
    correct_PN = _as_matrix(correct_PN, "correct_PN")
    return float(correct_PN.mean())


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself (the usual pass@k curve)."""
    if n < 1:
        raise ValueError(f"n={n}: expected >= 1")
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks if ks[-1] == n else [*ks, n]


# --------------------------------------------------------------------------------------------- majority vote
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\s+")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+(\.\d+)?$")


def normalize_answer(answer: str) -> str:
    """A canonical string for voting: `\\text{..}` unwrapped, `\\left`/`\\right`/`\\displaystyle`/`^\\circ` and
    spacing commands dropped, whitespace and surrounding `$`, `.` removed, `\\dfrac`/`\\tfrac` written `\\frac`; a plain
    decimal number is written in canonical form (1,000 -> 1000, 042 -> 42, 3.50 -> 3.5, 2.0 -> 2)."""
    s = _TEXT.sub(r"\1", answer)
    for token in ("\\left", "\\right", "\\displaystyle", "^\\circ", "^{\\circ}", "\\%", "%"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACES.sub("", s).strip("$").rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    try:
        value = Decimal(s)
    except InvalidOperation:
        return s
    if not value.is_finite() or not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", s):
        return s
    value = value.normalize()
    text = format(value, "f")
    return "0" if text in ("-0", "+0") else text


@dataclass(frozen=True)
class Vote:
    """The most frequent answer among one problem's samples: its normalised `key`, its first raw form `answer`,
    how many samples gave it (`count`) and the index of the first of them (`first_index`); None/0/-1 when no
    sample has an answer."""

    key: str | None
    answer: str | None
    count: int
    first_index: int


def majority_vote(answers: Sequence[str | None]) -> Vote:
    """The normalised answer given by the most samples; samples without an answer (None) do not vote; a tie goes
    to the answer whose first occurrence comes first."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, raw in enumerate(answers):
        if raw is None:
            continue
        key = normalize_answer(raw)
        if not key:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return Vote(None, None, 0, -1)
    key = min(counts, key=lambda a: (-counts[a], first[a]))
    return Vote(key, answers[first[key]], counts[key], first[key])


# --------------------------------------------------------------------------------------------- lengths
@dataclass(frozen=True)
class LengthStats:
    """Response lengths in generated tokens: mean, max and percentiles (linear interpolation, numpy's default)."""

    mean: float
    max: int
    percentiles: dict[int, float]


def length_stats(num_tokens: Sequence[int], percentiles: Sequence[int] = DEFAULT_PERCENTILES) -> LengthStats:
    """Mean, max and the given percentiles of the response lengths."""
    lengths = np.asarray(num_tokens, dtype=np.float64)
    if lengths.size == 0:
        raise ValueError("num_tokens is empty; expected at least one response length")
    values = np.percentile(lengths, list(percentiles)) if percentiles else []
    return LengthStats(
        mean=float(lengths.mean()),
        max=int(lengths.max()),
        percentiles={int(p): float(v) for p, v in zip(percentiles, values)},
    )


def truncation_rate(truncated_PN: np.ndarray) -> float:
    """Fraction of samples cut by the token limit (finish reason "length") rather than ended by the model."""
    return float(_as_matrix(truncated_PN, "truncated_PN").mean())


def _as_matrix(values: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"{name}: expected a non-empty [problems, samples] array, got shape {arr.shape}")
    return arr
