"""EGAE, GAE, Monte-Carlo returns, GRPO and the post-processing against plain loop references (tppo/algo/advantages.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tppo.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    apply_tail_mask,
    clamp_advantages,
    egae,
    expected_lengths,
    gae,
    grpo_advantages,
    length_adaptive_lambda,
    mc_returns,
    overlong_penalty,
    postprocess_advantages,
    tail_keep_mask,
    whiten_advantages,
)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------------------------------------------------------
# Loop references, written token by token from the spec's formulas.


def ref_egae(rewards, values, lengths, finished, gamma, lams, bootstrap, boot):
    """Per row: the reverse recursion A_t = delta_t + gamma lam A_{t+1} over the valid tokens."""
    B, T = len(rewards), len(rewards[0])
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        for t in reversed(range(n)):
            if t + 1 < n:
                v_next = values[b][t + 1]
            elif finished[b]:
                v_next = 0.0
            elif bootstrap == "repeat_last":
                v_next = values[b][n - 1]
            else:
                v_next = boot[b]
            delta = rewards[b][t] + gamma * v_next - values[b][t]
            later = out[b][t + 1] if t + 1 < n else 0.0
            out[b][t] = delta + gamma * lams[b] * later
    return out


def ref_returns(rewards, lengths, gamma):
    out = [[0.0] * len(row) for row in rewards]
    for b, row in enumerate(rewards):
        acc = 0.0
        for t in reversed(range(lengths[b])):
            acc = row[t] + gamma * acc
            out[b][t] = acc
    return out


def right_padded(lengths, T):
    return torch.tensor([[1 if t < n else 0 for t in range(T)] for n in lengths], dtype=torch.bool)


@st.composite
def windows(draw, max_rows=5, max_tokens=12):
    """A random batch of current-window rows: lengths 0..T, finished flags, rewards on finished rows' last token."""
    B = draw(st.integers(1, max_rows))
    T = draw(st.integers(1, max_tokens))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    finished = draw(st.lists(st.booleans(), min_size=B, max_size=B))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(B, T))
    rewards = np.zeros((B, T))
    for b in range(B):
        if finished[b] and lengths[b] > 0:
            rewards[b, lengths[b] - 1] = rng.choice([-1.0, 1.0])
    boot = rng.normal(size=B)
    return lengths, finished, values, rewards, boot


# ---------------------------------------------------------------------------------------------------------------
# Vectorised vs loop.


@SETTINGS
@given(
    windows(),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.sampled_from(["repeat_last", "exact"]),
    st.booleans(),
)
def test_egae_matches_loop(batch, gamma, lam, bootstrap, per_row_lam):
    lengths, finished, values, rewards, boot = batch
    B, T = values.shape
    lams = list(np.linspace(0.0, 1.0, B) * lam) if per_row_lam else [lam] * B
    lam_arg = torch.tensor(lams, dtype=torch.float64) if per_row_lam else lam
    got = egae(
        torch.tensor(rewards),
        torch.tensor(values),
        right_padded(lengths, T),
        torch.tensor(finished),
        gamma=gamma,
        lam=lam_arg,
        bootstrap=bootstrap,
        bootstrap_values=torch.tensor(boot),
    )
    want = ref_egae(
        rewards.tolist(), values.tolist(), lengths, finished, gamma, lams, bootstrap, boot.tolist()
    )
    assert got.shape == (B, T) and got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


@SETTINGS
@given(windows(max_rows=3, max_tokens=40), st.floats(0.5, 1.0), st.floats(0.5, 1.0))
def test_egae_float32_close_to_float64_loop(batch, gamma, lam):
    lengths, finished, values, rewards, _ = batch
    T = values.shape[1]
    got = egae(
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(values, dtype=torch.float32),
        right_padded(lengths, T),
        torch.tensor(finished),
        gamma=gamma,
        lam=lam,
    )
    want = ref_egae(
        rewards.tolist(), values.tolist(), lengths, finished, gamma, [lam] * len(lengths), "repeat_last", None
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-4)


@SETTINGS
@given(windows(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_loop_and_is_egae_all_finished(batch, gamma, lam):
    lengths, _, values, rewards, _ = batch
    B, T = values.shape
    mask = right_padded(lengths, T)
    got = gae(torch.tensor(rewards), torch.tensor(values), mask, gamma, lam)
    want = ref_egae(
        rewards.tolist(), values.tolist(), lengths, [True] * B, gamma, [lam] * B, "repeat_last", None
    )
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    same = egae(
        torch.tensor(rewards), torch.tensor(values), mask, torch.ones(B, dtype=torch.bool), gamma, lam
    )
    torch.testing.assert_close(got, same, rtol=0, atol=0)


@SETTINGS
@given(windows(max_tokens=30), st.floats(0.0, 1.0))
def test_mc_returns_match_loop(batch, gamma):
    lengths, _, values, _, _ = batch
    T = values.shape[1]
    rewards = values  # dense per-token rewards exercise the discounting
    got = mc_returns(torch.tensor(rewards), right_padded(lengths, T), gamma)
    torch.testing.assert_close(
        got,
        torch.tensor(ref_returns(rewards.tolist(), lengths, gamma), dtype=torch.float64),
        rtol=1e-9,
        atol=1e-9,
    )


def test_long_window_scan_is_exact():
    """A window of thousands of tokens (several doubling passes, with c^s underflowing to 0) against the loop."""
    rng = np.random.default_rng(0)
    B, T = 3, 3000
    lengths = [3000, 2049, 1]
    values = rng.normal(size=(B, T))
    rewards = np.zeros((B, T))
    rewards[0, -1] = 1.0
    finished = [True, False, False]
    for lam in (0.95, 1.0):
        got = egae(
            torch.tensor(rewards),
            torch.tensor(values),
            right_padded(lengths, T),
            torch.tensor(finished),
            gamma=1.0,
            lam=lam,
        )
        want = ref_egae(
            rewards.tolist(), values.tolist(), lengths, finished, 1.0, [lam] * B, "repeat_last", None
        )
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-8, atol=1e-8)


# ---------------------------------------------------------------------------------------------------------------
# Edge cases of the spec.


def test_finished_row_with_lambda_one_is_reward_minus_value():
    values = torch.tensor([[0.3, -0.2, 0.5, 9.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    got = egae(rewards, values, mask, torch.tensor([True]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(got, torch.tensor([[0.7, 1.2, 0.5, 0.0]]))


def test_cut_window_gamma_one_takes_no_reward_and_telescopes():
    """Unfinished, gamma = 1, repeat_last: A_t = sum_{k=t}^{l-2} lam^(k-t) (V_{k+1} - V_k); last token 0."""
    rng = np.random.default_rng(1)
    values = rng.normal(size=(1, 6))
    mask = torch.ones(1, 6)
    for lam in (0.0, 0.7, 1.0):
        got = egae(
            torch.zeros(1, 6, dtype=torch.float64),
            torch.tensor(values),
            mask,
            torch.tensor([False]),
            gamma=1.0,
            lam=lam,
        )[0]
        v = values[0]
        want = [sum(lam ** (k - t) * (v[k + 1] - v[k]) for k in range(t, 5)) for t in range(6)]
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-12, atol=1e-12)
        assert got[-1] == 0
    # lambda = 1: the telescoped form V_{l-1} - V_t
    got = egae(
        torch.zeros(1, 6, dtype=torch.float64), torch.tensor(values), mask, torch.tensor([False]), 1.0, 1.0
    )
    torch.testing.assert_close(got[0], torch.tensor(values[0, -1] - values[0]), rtol=1e-12, atol=1e-12)


def test_exact_bootstrap_equals_gae_on_the_extended_row():
    """Bootstrapping with b equals GAE on the row extended by one state of value b whose advantage is cut off."""
    rng = np.random.default_rng(2)
    values = torch.tensor(rng.normal(size=(1, 5)))
    b = torch.tensor([0.37], dtype=torch.float64)
    got = egae(
        torch.zeros(1, 5, dtype=torch.float64),
        values,
        torch.ones(1, 5),
        torch.tensor([False]),
        gamma=0.9,
        lam=0.8,
        bootstrap="exact",
        bootstrap_values=b,
    )
    # delta_4 = 0.9 * b - V_4; the rest as in GAE
    ext_values = torch.cat([values, b.view(1, 1)], dim=1)
    ext_rewards = torch.zeros(1, 6, dtype=torch.float64)
    ext_rewards[0, 5] = b[0]  # makes delta_5 = b - b = 0, so nothing flows back from the extra state
    full = gae(ext_rewards, ext_values, torch.ones(1, 6), gamma=0.9, lam=0.8)
    torch.testing.assert_close(got, full[:, :5], rtol=1e-12, atol=1e-12)


def test_length_one_windows_and_fully_padded_rows():
    values = torch.tensor([[0.4], [0.9], [-3.0]])
    rewards = torch.tensor([[1.0], [0.0], [0.0]])
    mask = torch.tensor([[1], [1], [0]])
    got = egae(rewards, values, mask, torch.tensor([True, False, True]), gamma=1.0, lam=0.95)
    # finished: R - V; cut with repeat_last and gamma 1: 0; padded: 0
    torch.testing.assert_close(got, torch.tensor([[0.6], [0.0], [0.0]]))
    assert torch.equal(mc_returns(rewards, mask), torch.tensor([[1.0], [0.0], [0.0]]))
    padded = egae(torch.zeros(2, 4), torch.randn(2, 4), torch.zeros(2, 4), torch.tensor([True, False]))
    assert torch.equal(padded, torch.zeros(2, 4))


def test_empty_windows_and_numpy_inputs():
    empty = egae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), torch.tensor([True, False]))
    assert empty.shape == (2, 0)
    values = np.array([[0.5, 0.25]])
    got = egae(np.zeros((1, 2)), values, np.ones((1, 2)), np.array([False]), gamma=1.0, lam=1.0)
    torch.testing.assert_close(got, torch.tensor([[-0.25, 0.0]], dtype=torch.float64))


def test_window_covering_the_whole_response_is_gae():
    """W >= L_max: every response finishes in its first window, and EGAE of that window is exactly GAE."""
    rng = np.random.default_rng(3)
    lengths = [7, 3, 10]
    T = 10  # = L_max <= W
    values = torch.tensor(rng.normal(size=(3, T)))
    rewards = torch.zeros(3, T, dtype=torch.float64)
    for b, n in enumerate(lengths):
        rewards[b, n - 1] = 1.0 if b % 2 else -1.0
    mask = right_padded(lengths, T)
    lam = length_adaptive_lambda(torch.tensor(lengths)).double()
    got = egae(rewards, values, mask, torch.ones(3, dtype=torch.bool), gamma=1.0, lam=lam)
    torch.testing.assert_close(got, gae(rewards, values, mask, 1.0, lam), rtol=0, atol=0)


def test_lambda_per_row_equals_separate_rows():
    rng = np.random.default_rng(4)
    values = torch.tensor(rng.normal(size=(3, 8)))
    rewards = torch.zeros(3, 8, dtype=torch.float64)
    rewards[0, 7] = 1.0
    mask = torch.ones(3, 8)
    finished = torch.tensor([True, False, False])
    lams = torch.tensor([0.9, 0.5, 1.0], dtype=torch.float64)
    together = egae(rewards, values, mask, finished, gamma=0.99, lam=lams)
    for b in range(3):
        alone = egae(
            rewards[b : b + 1],
            values[b : b + 1],
            mask[b : b + 1],
            finished[b : b + 1],
            gamma=0.99,
            lam=float(lams[b]),
        )
        torch.testing.assert_close(together[b : b + 1], alone, rtol=1e-12, atol=1e-12)


def test_padded_positions_ignore_rewards_there():
    values = torch.tensor([[0.1, 0.2, 0.3]])
    mask = torch.tensor([[1, 1, 0]])
    clean = egae(torch.tensor([[0.0, 1.0, 0.0]]), values, mask, torch.tensor([True]))
    noisy = egae(torch.tensor([[0.0, 1.0, 5.0]]), values, mask, torch.tensor([True]))
    assert torch.equal(clean, noisy)


# ---------------------------------------------------------------------------------------------------------------
# Lambda, GRPO, shaping, post-processing.


@SETTINGS
@given(st.lists(st.integers(0, 100_000), min_size=1, max_size=20), st.floats(1e-3, 1.0), st.floats(0.0, 1.0))
def test_length_adaptive_lambda_matches_formula(lengths, alpha, floor):
    got = length_adaptive_lambda(torch.tensor(lengths), alpha=alpha, floor=floor)
    want = [max(floor, 1.0 - 1.0 / (alpha * n)) if n > 0 else floor for n in lengths]
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_length_adaptive_lambda_known_values():
    got = length_adaptive_lambda(torch.tensor([0, 10, 100, 1000, 8192]))
    torch.testing.assert_close(got, torch.tensor([0.95, 0.95, 0.95, 0.98, 1 - 1 / (0.05 * 8192)]))


def test_expected_lengths_add_half_a_window_to_unfinished():
    got = expected_lengths(torch.tensor([100, 8192, 5]), torch.tensor([True, False, False]), window=8192)
    assert torch.equal(got, torch.tensor([100.0, 12288.0, 4101.0]))


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 5), st.sampled_from([-1.0, 0.0, 0.5, 1.0])), min_size=1, max_size=24),
    st.booleans(),
)
def test_grpo_matches_loop(items, normalize_std):
    group_ids = [g for g, _ in items]
    rewards = [r for _, r in items]
    got = grpo_advantages(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(group_ids), normalize_std=normalize_std
    )
    want = []
    for g, r in items:
        members = [rr for gg, rr in items if gg == g]
        if len(members) == 1:
            want.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        want.append((r - mean) / (std + 1e-6) if normalize_std else r - mean)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_grpo_estimator_broadcasts_to_valid_tokens():
    rewards = torch.zeros(4, 3)
    rewards[0, 2], rewards[1, 0], rewards[2, 1], rewards[3, 2] = 1.0, -1.0, 1.0, 1.0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    inputs = AdvantageInputs(
        rewards_BT=rewards,
        mask_BT=mask,
        finished_B=torch.ones(4, dtype=torch.bool),
        group_ids_B=torch.tensor([0, 0, 1, 1]),
    )
    got = ADVANTAGE_ESTIMATORS.get("grpo")(inputs)
    per_row = grpo_advantages(torch.tensor([1.0, -1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]))
    assert torch.equal(got, per_row.unsqueeze(1) * mask)


def test_registry_estimators_call_the_functions():
    assert {"egae", "gae", "grpo"} <= set(ADVANTAGE_ESTIMATORS.names())
    rng = np.random.default_rng(5)
    values = torch.tensor(rng.normal(size=(2, 5)), dtype=torch.float32)
    rewards = torch.zeros(2, 5)
    rewards[0, 3] = 1.0
    mask = right_padded([4, 5], 5)
    finished = torch.tensor([True, False])
    inputs = AdvantageInputs(rewards_BT=rewards, mask_BT=mask, finished_B=finished, values_BT=values, lam=0.9)
    assert torch.equal(
        ADVANTAGE_ESTIMATORS.get("egae")(inputs), egae(rewards, values, mask, finished, 1.0, 0.9)
    )
    with pytest.raises(ValueError, match="finished_B"):
        ADVANTAGE_ESTIMATORS.get("gae")(inputs)
    with pytest.raises(ValueError, match="values_BT"):
        ADVANTAGE_ESTIMATORS.get("egae")(AdvantageInputs(rewards, mask, finished))


@SETTINGS
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30), st.integers(1, 30), st.integers(1, 29))
def test_overlong_penalty_matches_piecewise(lengths, max_length, buffer):
    max_length = max(max_length, buffer + 1)
    got = overlong_penalty(torch.tensor(lengths), max_length, buffer)
    start = max_length - buffer
    want = [0.0 if n <= start else (start - n) / buffer if n <= max_length else -1.0 for n in lengths]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))


def test_overlong_penalty_dapo_values():
    got = overlong_penalty(torch.tensor([16384, 18432, 20480, 20481]), max_length=20480, buffer=4096)
    torch.testing.assert_close(got, torch.tensor([0.0, -0.5, -1.0, -1.0]))


@SETTINGS
@given(windows(max_tokens=10), st.integers(0, 12))
def test_tail_mask_matches_loop(batch, num_tail):
    lengths, finished, values, _, _ = batch
    B, T = values.shape
    got = apply_tail_mask(torch.tensor(values), right_padded(lengths, T), torch.tensor(finished), num_tail)
    want = np.zeros((B, T))
    for b in range(B):
        keep = lengths[b] if finished[b] else max(0, lengths[b] - num_tail)
        want[b, :keep] = values[b, :keep]
    assert torch.equal(got, torch.tensor(want))


@SETTINGS
@given(windows(max_tokens=10))
def test_whitening_matches_numpy(batch):
    lengths, _, values, _, _ = batch
    mask = right_padded(lengths, values.shape[1])
    got = whiten_advantages(torch.tensor(values), mask)
    valid = values[mask.numpy()]
    want = np.zeros_like(values)
    if valid.size:
        var = valid.var(ddof=1) if valid.size > 1 else 0.0
        want[mask.numpy()] = (valid - valid.mean()) / np.sqrt(var + 1e-8)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-7, atol=1e-7)


def test_whitening_gives_zero_mean_unit_std():
    adv = torch.randn(4, 9, dtype=torch.float64) * 3 + 2
    mask = right_padded([9, 4, 0, 7], 9)
    got = whiten_advantages(adv, mask)
    valid = got[mask]
    assert abs(float(valid.mean())) < 1e-12
    assert abs(float(valid.std()) - 1.0) < 1e-6
    assert torch.equal(got[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))


def test_clamp_and_postprocess_order():
    adv = torch.tensor([[100.0, -100.0, 1.0, 2.0], [3.0, 4.0, 5.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    finished = torch.tensor([True, False])
    assert torch.equal(
        clamp_advantages(adv, 10.0)[0], torch.tensor([10.0, -10.0, 1.0, 2.0], dtype=torch.float64)
    )
    got = postprocess_advantages(adv, mask, finished, num_tail=2, whiten=True, clamp=1.5)
    keep = tail_keep_mask(mask, finished, 2)
    assert keep.tolist() == [[True] * 4, [True, False, False, False]]
    kept = adv[keep]
    want_kept = ((kept - kept.mean()) / torch.sqrt(kept.var() + 1e-8)).clamp(-1.5, 1.5)
    assert torch.equal(got[~keep], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(got[keep], want_kept)
    assert torch.equal(postprocess_advantages(adv, mask, finished, whiten=False, clamp=0), adv * mask)


# ---------------------------------------------------------------------------------------------------------------
# Bad input.


def _good():
    return dict(
        rewards=torch.zeros(2, 3),
        values=torch.zeros(2, 3),
        mask=torch.ones(2, 3),
        finished=torch.tensor([True, False]),
    )


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("rewards", torch.zeros(2, 4)),
        ("values", torch.zeros(3, 3)),
        ("finished", torch.tensor([True, False, True])),
        ("rewards", torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]])),
        ("values", torch.tensor([[0.0, 0.0, 0.0], [float("inf"), 0.0, 0.0]])),
        ("rewards", torch.tensor([[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]])),
        ("mask", torch.tensor([[1, 0, 1], [1, 1, 1]])),
        ("mask", torch.tensor([[0, 1, 1], [1, 1, 1]])),
        ("mask", torch.tensor([[1, 2, 1], [1, 1, 1]])),
        ("values", torch.zeros(2, 3, dtype=torch.long)),
    ],
)
def test_egae_rejects_bad_input_naming_the_argument(name, bad):
    kwargs = _good()
    kwargs[name] = bad
    with pytest.raises(ValueError, match=name):
        egae(**kwargs)


def test_egae_rejects_bad_options():
    with pytest.raises(ValueError, match="lam"):
        egae(**_good(), lam=torch.tensor([0.9, 0.9, 0.9]))
    with pytest.raises(ValueError, match="lam"):
        egae(**_good(), lam=1.5)
    with pytest.raises(ValueError, match="gamma"):
        egae(**_good(), gamma=-0.1)
    with pytest.raises(ValueError, match="bootstrap"):
        egae(**_good(), bootstrap="zero")
    with pytest.raises(ValueError, match="bootstrap_values"):
        egae(**_good(), bootstrap="exact")
    with pytest.raises(ValueError, match="bootstrap_values"):
        egae(**_good(), bootstrap="exact", bootstrap_values=torch.tensor([0.0, float("nan")]))


def test_other_functions_reject_bad_input():
    with pytest.raises(ValueError, match="mask"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="rewards"):
        mc_returns(torch.tensor([[float("nan")]]), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"rewards: expected shape \[1, 3\] \(the shape of mask\)"):
        mc_returns(torch.zeros(1, 2), torch.ones(1, 3))
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(torch.tensor([1.0, float("inf")]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="lengths"):
        length_adaptive_lambda(torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="advantages"):
        whiten_advantages(torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([3]), max_length=10, buffer=10)
    with pytest.raises(ValueError, match="num_tail"):
        apply_tail_mask(torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([False]), -1)
