"""Countdown: the synthetic verifiable task of the default recipe (long-tailed lengths, reward in [-1, 1]).

A prompt `[BOS, n, SEP]` asks for the countdown `n-1, n-2, ..., 1, 0, EOS` (n + 1 tokens). Starts follow a
log-uniform law over [min_start, max_start], so response lengths have a long tail: with the defaults
(4..60) about half of the correct responses are longer than 16 tokens, i.e. need more than one T-PPO window
of W = 16. The verifier credits every valid transition (a new number one below the token before it, or EOS right
after 0) and scores `2 * valid / (n + 1) - 1`: +1 for the exact countdown, -1 for nothing valid, partial
credit in between; stopping early or wandering off never reaches +1.

The supervised warm start (`warm_start_response`) teaches the format but not the rule: it counts down by
one OR two at random, so a warmed-up policy scores around -0.3 and reinforcement learning has to find out that
steps of one are what the verifier wants. Vocabulary: numbers 0..59 are their own ids; BOS, EOS, SEP, PAD follow.
"""

from __future__ import annotations

import numpy as np

MAX_NUMBER = 60
BOS, EOS, SEP, PAD = MAX_NUMBER, MAX_NUMBER + 1, MAX_NUMBER + 2, MAX_NUMBER + 3
VOCAB_SIZE = MAX_NUMBER + 4


def check_start(n: int) -> int:
    if not 1 <= n <= MAX_NUMBER:
        raise ValueError(f"countdown start n={n} must be in [1, {MAX_NUMBER}]")
    return int(n)


def sample_starts(
    num: int, rng: np.random.Generator, min_start: int = 4, max_start: int = MAX_NUMBER
) -> np.ndarray:
    """n = floor(min * (max / min) ** u), u ~ U[0, 1): log-uniform, so long responses are a heavy minority."""
    check_start(min_start)
    check_start(max_start)
    if min_start > max_start:
        raise ValueError(f"min_start={min_start} exceeds max_start={max_start}")
    u = rng.random(num)
    return np.minimum(np.floor(min_start * (max_start / min_start) ** u), max_start).astype(np.int64)


def prompt_ids(n: int) -> list[int]:
    return [BOS, check_start(n), SEP]


def start_of(prompt: list[int] | np.ndarray) -> int:
    """The n of a countdown prompt; ValueError when the prompt is not one."""
    p = [int(t) for t in prompt]
    if len(p) != 3 or p[0] != BOS or p[2] != SEP:
        raise ValueError(f"not a countdown prompt: {p}")
    return check_start(p[1])


def reference_response(n: int) -> list[int]:
    return [*range(check_start(n) - 1, -1, -1), EOS]


def warm_start_response(n: int, rng: np.random.Generator, p_two: float = 0.5) -> list[int]:
    """A countdown from n by steps of 1 or 2 (2 with probability p_two), never below 0, then EOS."""
    out, cur = [], check_start(n)
    while cur > 0:
        step = 2 if (cur >= 2 and rng.random() < p_two) else 1
        cur -= step
        out.append(cur)
    return [*out, EOS]


def score(prompt: list[int] | np.ndarray, response: list[int] | np.ndarray) -> float:
    """2 * valid / (n + 1) - 1 over the transitions of the response.

    A number is a valid transition when it is one below the token before it (the prompt's n for the first),
    below n, and has not appeared yet; EOS is valid when it follows 0 in a response without any invalid token.
    So at most n + 1 transitions are valid, only the exact countdown scores +1, a slip costs one transition
    plus the final EOS credit, and jumping back up to count down again earns nothing. A response that never
    ends (cut at the maximum length) scores -1.
    """
    n = start_of(prompt)
    if EOS not in (int(t) for t in response):
        return -1.0  # cut at the maximum length: not an answer (specs/tppo.md: usually -1)
    prev, valid, clean, seen = n, 0, True, set()
    for tok in (int(t) for t in response):
        if tok == EOS:
            valid += prev == 0 and clean
            break
        ok = 0 <= tok < n and tok == prev - 1 and tok not in seen
        valid += ok
        clean = clean and ok
        seen.add(tok)
        prev = tok
    return 2.0 * valid / (n + 1) - 1.0
