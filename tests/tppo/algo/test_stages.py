"""The stages of a T-PPO step on plain records: placement, batch layout, scoring failures, advantages."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from rollout import synthetic
from tppo.algo.advantages import egae, length_adaptive_lambda, postprocess_advantages
from tppo.algo.batching import (
    critic_batch,
    padding_fraction,
    place,
    place_by_tokens,
    place_samples,
    policy_batch,
    split_for_ranks,
    update_schedule,
)
from tppo.algo.config import AlgoConfig
from tppo.algo.pool import Sample
from tppo.algo.stages import (
    advantages,
    request_seed,
    score_finished,
    shape_rewards,
    store_values,
    update_metrics,
    window_values,
)
from tppo.engine.batch import StepResult


def _sample(uid, prompt, earlier, window, finished=False, reward=None, layers=2, k=2):
    s = Sample(uid=uid, group_id=0, prompt_uid="p", prompt_ids=np.asarray(prompt), max_response_length=64)
    if earlier:
        s.max_new_tokens = len(earlier)
        s.add_window(earlier, np.full(len(earlier), -1.0))
    s.max_new_tokens = max(len(window), 1) if finished else len(window)
    n = len(prompt) + len(earlier) + len(window)
    routes = np.arange(n * layers * k).reshape(n, layers, k) % 7
    s.add_window(
        window, np.full(len(window), -0.5), finish_reason="eos" if finished else None, routed_experts=routes
    )
    s.reward = reward
    return s


@pytest.mark.parametrize(("n", "ranks", "mbs"), [(16, 2, 4), (5, 2, 4), (1, 2, 1), (7, 3, 2), (9, 1, 4)])
def test_placement_covers_every_sample_once_with_equal_microbatch_counts(n, ranks, mbs):
    p = place(n, ranks, mbs)
    seen = sorted(i for rank in p.rows for mb in rank for i in mb)
    assert seen == list(range(n))
    assert len({len(rank) for rank in p.rows}) == 1
    assert all(len(mb) <= mbs for rank in p.rows for mb in rank)


@pytest.mark.parametrize(
    ("lengths", "ranks", "mbs", "max_tokens", "want"),
    [
        # longest first; a micro-batch grows while rows x its longest row <= 20
        ([10, 9, 3, 3, 2, 1], 1, 8, 20, (((0, 1), (2, 3, 4, 5)),)),
        ([10, 9, 3, 3, 2, 1], 1, 3, 20, (((0, 1), (2, 3, 4), (5,)),)),
        # dealt longest first round-robin: rank 0 gets 10, 3, 2 and rank 1 gets 9, 3, 1
        ([10, 9, 3, 3, 2, 1], 2, 8, 20, (((0, 2), (4,)), ((1, 3), (5,)))),
        # rank 1's one micro-batch (50 + 5 = 2 x 50) is split to match rank 0's two
        ([100, 10, 50, 5], 2, 8, 100, (((0,), (1,)), ((2,), (3,)))),
        # a rank with fewer samples than micro-batches gets a filler; a row longer than the budget is alone
        ([100, 100, 5], 2, 8, 60, (((0,), (2,)), ((1,), ()))),
    ],
)
def test_token_budget_placement_groups_similar_lengths_within_the_budget(
    lengths, ranks, mbs, max_tokens, want
):
    assert place_by_tokens(lengths, ranks, mbs, max_tokens).rows == want


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_placement_covers_every_sample_once_within_its_limits(seed):
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.normal(3, 1.2, int(rng.integers(1, 60)))).astype(int) + 1
    ranks, mbs, max_tokens = int(rng.integers(1, 4)), int(rng.integers(1, 9)), int(rng.integers(20, 400))
    p = place_by_tokens(lengths, ranks, mbs, max_tokens)
    assert sorted(i for rank in p.rows for mb in rank for i in mb) == list(range(len(lengths)))
    assert len({len(rank) for rank in p.rows}) == 1
    for rank in p.rows:
        for mb in rank:
            assert len(mb) <= mbs
            assert len(mb) <= 1 or len(mb) * max(lengths[i] for i in mb) <= max_tokens


def test_samples_are_placed_by_their_sequence_lengths_when_a_token_budget_is_set():
    samples = [_sample(str(i), [1, 2], [], [3] * n) for i, n in enumerate((1, 8, 2))]  # lengths 3, 10, 4
    assert place_samples(samples, 1, 4).rows == place(3, 1, 4).rows == (((0, 1, 2),),)
    assert place_samples(samples, 1, 4, max_tokens=10).rows == (((1,), (2, 0)),)
    with pytest.raises(ValueError, match="max_tokens=0"):
        place_by_tokens([3], 1, 4, 0)


def test_padding_fraction_counts_the_right_padding_of_every_micro_batch():
    short, long, mid = (
        _sample(str(i), [1, 2], [], [3] * n) for i, n in enumerate((1, 8, 2))
    )  # 3, 10, 4 tokens
    together = [[critic_batch([short, long, mid], [False] * 3, routing=False)]]
    assert padding_fraction(together) == pytest.approx(1 - 17 / 30)
    apart = [
        [critic_batch([long], [False], routing=False), critic_batch([mid, short], [False] * 2, routing=False)]
    ]
    assert padding_fraction(apart) == pytest.approx(1 - 17 / 18)


def test_policy_batch_masks_the_current_window_only():
    a = _sample("a", [1, 2], [5, 6, 7], [8, 9])
    b = _sample("b", [1, 2, 3], [], [4], finished=True, reward=1.0)
    batch = policy_batch([a, b], [False, False], [np.array([0.5, -0.5]), np.array([2.0])], routing=True)
    t = batch.payload
    assert batch.input_ids_BT.tolist() == [[1, 2, 5, 6, 7, 8, 9], [1, 2, 3, 4, 0, 0, 0]]
    assert t.window_mask_BT.tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 0, 0, 0]]
    assert t.response_mask_BT.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0, 0]]
    assert t.advantages_BT[0, 5:].tolist() == [0.5, -0.5] and t.advantages_BT[1, 3] == 2.0
    assert t.positive_B.tolist() == [0.0, 1.0]
    assert torch.equal(batch.routed_experts_BTLK[0], torch.as_tensor(a.routed_experts, dtype=torch.int32))


def test_filler_rows_train_nothing_and_missing_routing_fails_loudly():
    a = _sample("a", [1, 2], [], [3, 4], finished=True, reward=0.5)
    split = split_for_ranks([a], place(1, 2, 4))
    fill_samples, fill_flags = split[1][0]
    assert fill_flags == [True]
    batch = critic_batch(fill_samples, fill_flags, routing=False)
    assert batch.payload.mask_BT.sum() == 0
    a.routed_experts = None
    with pytest.raises(ValueError, match="carry no routed experts"):
        policy_batch([a], [False], [np.zeros(2)], routing=True)


def test_critic_targets_are_the_outcome_on_every_response_token():
    a = _sample("a", [1, 2], [5, 6], [7], finished=True, reward=-1.0)
    a.values = np.array([0.1, 0.2, 0.3], np.float32)
    t = critic_batch([a], [False], routing=False).payload
    assert t.returns_BT.tolist() == [[0, 0, -1, -1, -1]]
    assert t.old_values_BT[0, 2:].tolist() == pytest.approx([0.1, 0.2, 0.3])


def test_critic_targets_are_discounted_returns_under_gamma():
    """gamma = 0.9, outcome R = 2 on the last of 3 response tokens: G = (0.81 R, 0.9 R, R), the prompt none."""
    a = _sample("a", [1, 2], [5, 6], [7], finished=True, reward=2.0)
    t = critic_batch([a], [False], routing=False, gamma=0.9).payload
    assert t.returns_BT[0].tolist() == pytest.approx([0.0, 0.0, 0.81 * 2, 0.9 * 2, 2.0])
    filler = critic_batch([a], [True], routing=False, gamma=0.9).payload
    assert filler.returns_BT.abs().sum() == 0 and filler.mask_BT.sum() == 0


def test_scoring_counts_raising_nonfinite_and_hanging_verifiers():
    samples = [_sample(str(i), [1], [], [2], finished=True) for i in range(4)]
    samples.append(_sample("open", [1], [], [2, 3]))

    def verifier(s):
        if s.uid == "0":
            raise RuntimeError("boom")
        if s.uid == "1":
            return float("nan")
        if s.uid == "2":
            time.sleep(5)
        return 0.25

    m = score_finished(samples, verifier, timeout_s=0.5)
    assert [s.reward for s in samples[:4]] == [-1.0, -1.0, -1.0, 0.25]
    assert samples[4].reward is None
    assert m == {"rollout/reward_failures": 2.0, "rollout/reward_timeouts": 1.0}


def test_advantages_match_egae_then_postprocessing():
    a = _sample("a", [1], [2, 3], [4, 5, 6])
    b = _sample("b", [1], [], [7, 8], finished=True, reward=1.0)
    values = [np.array([0.1, 0.4, 0.2], np.float32), np.array([0.3, -0.2], np.float32)]
    cfg = AlgoConfig(window=3, max_response_length=64)
    got, metrics = advantages([a, b], values, cfg)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    finished = torch.tensor([0.0, 1.0])
    lam = length_adaptive_lambda(torch.tensor([5.0 + 1.5, 2.0]), 0.05, 0.95)
    ref = egae(
        torch.tensor([[0.0, 0, 0], [0, 1.0, 0]]),
        torch.tensor([[0.1, 0.4, 0.2], [0.3, -0.2, 0]]),
        mask,
        finished,
        lam=lam,
    )
    ref = postprocess_advantages(ref, mask, finished, whiten=True, clamp=10.0)
    assert np.allclose(got[0], ref[0].numpy()) and np.allclose(got[1], ref[1, :2].numpy())
    assert metrics["tppo/lambda_mean"] == pytest.approx(float(lam.mean()))


def test_advantage_means_per_window_kind_by_hand():
    # gamma = lambda = 1, repeat_last: cut row a, values (0.1, 0.4, 0.2): deltas (0.3, -0.2, 0), A = (0.1, -0.2, 0);
    # finished row b, values (0.3, -0.2), R = 1: deltas (-0.5, 1.2), A = (0.7, 1.2).
    a = _sample("a", [1], [2, 3], [4, 5, 6])
    b = _sample("b", [1], [], [7, 8], finished=True, reward=1.0)
    values = [np.array([0.1, 0.4, 0.2], np.float32), np.array([0.3, -0.2], np.float32)]
    raw_cut, raw_fin = [0.1, -0.2, 0.0], [0.7, 1.2]
    plain = AlgoConfig(
        window=3, max_response_length=64, lam=1.0, lam_adaptive=False, whiten=False, adv_clamp=0.0
    )
    _, m = advantages([a, b], values, plain)
    assert m["tppo/adv_cut_raw_mean"] == pytest.approx(np.mean(raw_cut))
    assert m["tppo/adv_cut_mean"] == pytest.approx(np.mean(raw_cut))
    assert m["tppo/adv_finished_raw_mean"] == pytest.approx(np.mean(raw_fin))
    assert m["tppo/adv_finished_mean"] == pytest.approx(np.mean(raw_fin))
    _, m = advantages([a, b], values, dataclasses.replace(plain, whiten=True))
    every = np.array(raw_cut + raw_fin)
    whitened = (every - every.mean()) / every.std(ddof=1)
    assert m["tppo/adv_cut_raw_mean"] == pytest.approx(np.mean(raw_cut))
    assert m["tppo/adv_cut_mean"] == pytest.approx(whitened[:3].mean(), abs=1e-6)
    assert m["tppo/adv_finished_mean"] == pytest.approx(whitened[3:].mean(), abs=1e-6)
    _, m = advantages([b], values[1:], plain)
    assert "tppo/adv_cut_mean" not in m and m["tppo/adv_finished_mean"] == pytest.approx(np.mean(raw_fin))


def test_window_values_cut_the_current_window():
    a = _sample("a", [1, 2], [3], [4, 5])
    full = np.arange(5, dtype=np.float32)
    assert window_values([a], [full])[0].tolist() == [3.0, 4.0]


def test_request_seeds_are_stable_and_distinct():
    assert request_seed(0, 3, "x") == request_seed(0, 3, "x")
    assert len({request_seed(0, s, u) for s in range(20) for u in "abc"}) == 60


def test_countdown_verifier():
    task = synthetic.COUNTDOWN
    n = 5
    p = task.prompt_ids(n)
    assert task.score(p, task.reference_response(n)) == 1.0
    assert task.score(p, [task.eos]) == -1.0
    assert task.score(p, [4, 2, 1, 0, task.eos]) == pytest.approx(2 * 3 / 6 - 1)
    assert task.score(p, [4, 3, 4, 3, 2, 1, 0, task.eos]) == pytest.approx(2 * 5 / 6 - 1)  # repeats
    # A policy found this once: count down, jump back up, count down again. It must not beat the answer.
    assert task.score(p, [4, 3, 2, 1, 0, 59, 58, 57, 3, 2, 1, 0, task.eos]) == pytest.approx(2 * 5 / 6 - 1)
    rng = np.random.default_rng(0)
    for _ in range(200):
        response = rng.integers(0, task.vocab_size, size=rng.integers(1, 64))
        assert -1.0 <= task.score(p, response) <= 1.0
    with pytest.raises(ValueError, match="not a countdown prompt"):
        task.score([1, 2], [3])


def test_a_larger_countdown_moves_its_specials_after_its_numbers():
    small, large = synthetic.COUNTDOWN, synthetic.Countdown(300)
    assert (small.bos, small.eos, small.vocab_size) == (60, 61, 64)  # the default recipe's ids, unchanged
    assert (large.bos, large.eos, large.sep, large.pad, large.vocab_size) == (300, 301, 302, 303, 304)
    assert synthetic.Countdown.from_vocab_size(304) == large
    answer = large.reference_response(250)
    assert len(answer) == 251 and large.score(large.prompt_ids(250), answer) == 1.0
    assert large.score(large.prompt_ids(250), [*answer[:-1], small.eos]) == -1.0  # 61 is a number here
    with pytest.raises(ValueError, match=r"must be in \[1, 59\]"):
        small.prompt_ids(60)  # 60 is BOS's id, not a number
    with pytest.raises(ValueError, match="must exceed the smallest start"):
        synthetic.Countdown(4)


def test_countdown_starts_are_log_uniform_below_max_number():
    """floor(4 (max / 4)^u): every start is a number below max_number, and the law's quantiles hold (the
    median of a log-uniform over [4, max) is 4 sqrt(max / 4))."""
    for task in (synthetic.COUNTDOWN, synthetic.Countdown(1000)):
        starts = task.sample_starts(20000, np.random.default_rng(1))
        assert starts.min() >= 4 and starts.max() <= task.max_number - 1
        median = 4 * (task.max_number / 4) ** 0.5
        assert np.median(starts) == pytest.approx(median, rel=0.05)


def test_overlong_shaping_adds_dapos_penalty_to_finished_rewards():
    """DAPO's piecewise penalty, written out: 0 up to L_max - L_cache, then linear down to -1 at L_max."""
    algo = AlgoConfig(window=8, max_response_length=64, overlong_buffer=16)
    lengths = [10, 48, 56, 64]
    batch = [_sample(f"s{n}", [1], [], list(range(2, 2 + n)), finished=True, reward=1.0) for n in lengths]
    open_ = _sample("open", [1], [], [2, 3])  # unfinished: no reward yet, nothing to shape
    metrics = shape_rewards([*batch, open_], algo)
    want = [0.0, 0.0, -0.5, -1.0]
    assert [s.reward for s in batch] == pytest.approx([1.0 + w for w in want])
    assert open_.reward is None
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(np.mean(want))
    untouched = _sample("u", [1], [], list(range(2, 66)), finished=True, reward=1.0)
    assert shape_rewards([untouched], AlgoConfig(window=8, max_response_length=64)) == {}
    assert untouched.reward == 1.0


def test_store_values_keeps_windows_or_recomputes_every_response_token_of_finished_samples():
    def fresh():
        done = _sample("d", [1, 2], [5, 6, 7], [8], finished=True, reward=1.0)
        done.values = np.zeros(3, np.float32)  # the earlier window's, stored window by window
        return done, _sample("o", [1, 2], [], [3, 4])

    rows = [np.arange(6, dtype=np.float32) * 0.5, np.arange(4, dtype=np.float32)]
    windows = [np.full(1, 9.0, np.float32), np.full(2, 7.0, np.float32)]
    done, open_ = fresh()
    store_values([done, open_], windows, rows, AlgoConfig(critic_old_values="stored"))
    np.testing.assert_array_equal(done.values, [0.0, 0.0, 0.0, 9.0])
    np.testing.assert_array_equal(open_.values, windows[1])
    done, open_ = fresh()
    store_values([done, open_], windows, rows, AlgoConfig(critic_old_values="recompute"))
    np.testing.assert_array_equal(done.values, rows[0][2:6])
    np.testing.assert_array_equal(open_.values, windows[1])  # still in flight: its stored values stay
    batch = critic_batch([done], [False], routing=False)
    np.testing.assert_array_equal(batch.payload.old_values_BT[0, 2:6].numpy(), rows[0][2:6])


def test_exact_bootstrap_uses_the_value_after_a_cut_windows_last_token():
    """algo.bootstrap=exact: a cut window's advantages are EGAE's with the critic's value after its last token as
    V(s_l); a finished window ignores it. Checked against the estimator called directly, and against repeat_last
    (which must differ for the cut row only)."""
    cut = _sample("cut", [1], [], [2, 3, 4])
    done = _sample("done", [1], [], [5, 6], finished=True, reward=1.0)
    values = [np.array([0.1, 0.2, 0.3], np.float32), np.array([0.4, 0.5], np.float32)]
    after = np.array([0.9, -7.0], np.float32)
    algo = AlgoConfig(bootstrap="exact", lam_adaptive=False, whiten=False, adv_clamp=0.0)
    exact, _ = advantages([cut, done], values, algo, after)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    rewards = torch.tensor([[0.0, 0, 0], [0, 1, 0]])
    v = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])
    ref = egae(
        rewards,
        v,
        mask,
        torch.tensor([0.0, 1.0]),
        gamma=1.0,
        lam=0.95,
        bootstrap="exact",
        bootstrap_values=torch.tensor([0.9, -7.0]),
    )
    np.testing.assert_allclose(exact[0], ref[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(exact[1], ref[1, :2].numpy(), rtol=1e-6)
    last, _ = advantages([cut, done], values, dataclasses.replace(algo, bootstrap="repeat_last"))
    assert not np.allclose(exact[0], last[0]) and np.allclose(exact[1], last[1])
    with pytest.raises(ValueError, match="after_last_B"):
        advantages([cut, done], values, algo)


def test_update_schedule_shuffles_each_epoch_into_mini_batches():
    steps = update_schedule(7, 3, 2, np.random.default_rng(5))
    assert len(steps) == 6 and [len(s) for s in steps] == [3, 2, 2, 3, 2, 2]
    for epoch in (steps[:3], steps[3:]):
        assert sorted(m for s in epoch for m in s) == list(range(7))  # every micro-batch once per epoch
    assert steps[:3] != steps[3:]  # reshuffled
    assert steps == update_schedule(7, 3, 2, np.random.default_rng(5))  # seeded
    assert update_schedule(4, 1, 1, np.random.default_rng(0)) == [[0, 1, 2, 3]]  # one step: in order
    assert [len(s) for s in update_schedule(2, 4, 1, np.random.default_rng(0))] == [
        1,
        1,
    ]  # <= one per micro-batch
    with pytest.raises(ValueError, match="mini_batches=0"):
        update_schedule(3, 0, 1, np.random.default_rng(0))


def test_update_metrics_average_the_optimizer_steps():
    def result(loss, skipped, **metrics):
        return StepResult(
            loss=loss, grad_norm=2 * loss, lr=loss / 10, skipped=skipped, num_microbatches=1, metrics=metrics
        )

    out = update_metrics(
        "tppo",
        [
            result(1.0, False, **{"tppo/clip_fraction": 0.0}),
            result(3.0, True, **{"tppo/clip_fraction": 0.5, "relibra/exec_skew_measured": 1.2}),
        ],
    )
    assert out["tppo/loss"] == 2.0 and out["tppo/grad_norm"] == 4.0 and out["tppo/lr"] == 0.3
    assert out["tppo/skipped_updates"] == 1.0 and out["tppo/optimizer_steps"] == 2.0
    assert out["tppo/clip_fraction"] == 0.25 and out["relibra/exec_skew_measured"] == 1.2
