"""Countdown: the synthetic verifiable task of the default recipe (long-tailed lengths, reward in [-1, 1]).

A prompt `[BOS, n, SEP]` asks for the countdown `n-1, n-2, ..., 1, 0, EOS` (n + 1 tokens). Starts follow a
log-uniform law over [min_start, max_number), so response lengths have a long tail: with the default recipe's
numbers (4..59) about half of the correct responses are longer than 16 tokens, i.e. need more than one T-PPO
window of W = 16. The verifier credits every valid transition (a new number one below the token before it, or
EOS right after 0) and scores `2 * valid / (n + 1) - 1`: +1 for the exact countdown, -1 for nothing valid,
partial credit in between; stopping early or wandering off never reaches +1.

The supervised warm start (`warm_start_response`) teaches the format but not the rule: it counts down by
one OR two at random, so a warmed-up policy scores around -0.3 and reinforcement learning has to find out that
steps of one are what the verifier wants. Vocabulary: numbers 0..max_number-1 are their own ids; BOS, EOS, SEP,
PAD follow. `Countdown(max_number)` sizes the task (`data.countdown_max`): the default recipe's 60 keeps
responses within 64 tokens; a few hundred makes responses long enough that generation dominates an RL step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_MAX_NUMBER = 60  # the default recipe's task: starts 4..59, responses up to 60 tokens
MIN_START = 4


@dataclass(frozen=True)
class Countdown:
    """The countdown over numbers 0..max_number-1 (their own token ids) and four special ids after them."""

    max_number: int = DEFAULT_MAX_NUMBER

    def __post_init__(self) -> None:
        if self.max_number <= MIN_START:
            raise ValueError(
                f"countdown max_number={self.max_number} must exceed the smallest start {MIN_START}"
            )

    @classmethod
    def from_vocab_size(cls, vocab_size: int) -> Countdown:
        """The task whose vocabulary has `vocab_size` ids (numbers then the four specials)."""
        return cls(vocab_size - 4)

    @property
    def bos(self) -> int:
        return self.max_number

    @property
    def eos(self) -> int:
        return self.max_number + 1

    @property
    def sep(self) -> int:
        return self.max_number + 2

    @property
    def pad(self) -> int:
        return self.max_number + 3

    @property
    def vocab_size(self) -> int:
        return self.max_number + 4

    @property
    def max_response_tokens(self) -> int:
        """The longest correct response: max_number - 2 .. 0, then EOS."""
        return self.max_number

    def check_start(self, n: int) -> int:
        if not 1 <= n < self.max_number:
            raise ValueError(
                f"countdown start n={n} must be in [1, {self.max_number - 1}] (a number's token id)"
            )
        return int(n)

    def sample_starts(self, num: int, rng: np.random.Generator, min_start: int = MIN_START) -> np.ndarray:
        """n = floor(min * (max_number / min) ** u), u ~ U[0, 1): log-uniform below max_number, so long responses
        are a heavy minority."""
        self.check_start(min_start)
        u = rng.random(num)
        starts = np.floor(min_start * (self.max_number / min_start) ** u)
        return np.minimum(starts, self.max_number - 1).astype(np.int64)

    def prompt_ids(self, n: int) -> list[int]:
        return [self.bos, self.check_start(n), self.sep]

    def start_of(self, prompt: list[int] | np.ndarray) -> int:
        """The n of a countdown prompt; ValueError when the prompt is not one."""
        p = [int(t) for t in prompt]
        if len(p) != 3 or p[0] != self.bos or p[2] != self.sep:
            raise ValueError(f"not a countdown prompt: {p}")
        return self.check_start(p[1])

    def reference_response(self, n: int) -> list[int]:
        return [*range(self.check_start(n) - 1, -1, -1), self.eos]

    def warm_start_response(self, n: int, rng: np.random.Generator, p_two: float = 0.5) -> list[int]:
        """A countdown from n by steps of 1 or 2 (2 with probability p_two), never below 0, then EOS."""
        out, cur = [], self.check_start(n)
        while cur > 0:
            step = 2 if (cur >= 2 and rng.random() < p_two) else 1
            cur -= step
            out.append(cur)
        return [*out, self.eos]

    def score(self, prompt: list[int] | np.ndarray, response: list[int] | np.ndarray) -> float:
        """2 * valid / (n + 1) - 1 over the transitions of the response.

        A number is a valid transition when it is one below the token before it (the prompt's n for the first),
        below n, and has not appeared yet; EOS is valid when it follows 0 in a response without any invalid
        token. So at most n + 1 transitions are valid, only the exact countdown scores +1, a slip costs one
        transition plus the final EOS credit, and jumping back up to count down again earns nothing. A response
        that never ends (cut at the maximum length) scores -1.
        """
        n = self.start_of(prompt)
        if self.eos not in (int(t) for t in response):
            return -1.0  # cut at the maximum length: not an answer (specs/tppo.md: usually -1)
        prev, valid, clean, seen = n, 0, True, set()
        for tok in (int(t) for t in response):
            if tok == self.eos:
                valid += prev == 0 and clean
                break
            ok = 0 <= tok < n and tok == prev - 1 and tok not in seen
            valid += ok
            clean = clean and ok
            seen.add(tok)
            prev = tok
        return 2.0 * valid / (n + 1) - 1.0


COUNTDOWN = Countdown()  # the default recipe's task
