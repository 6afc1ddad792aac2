"""The successive-batching sample pool over long random runs, its checkpoint, and its input checks (tppo/algo/pool.py)."""

from __future__ import annotations

import math
import pickle
import zlib
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tppo.algo.pool import Prompt, PromptSampler, Sample, SamplePool


def make_dataset(num_prompts: int) -> list[Prompt]:
    return [
        Prompt(uid=f"p{i}", prompt_ids=np.arange(1 + i % 4) + 10 * i, answer=str(i), metadata={"i": i})
        for i in range(num_prompts)
    ]


def generate(sample: Sample, eos_prob: float, num_layers: int = 2, top_k: int = 2) -> None:
    """A fake rollout whose output depends only on (uid, window round): a resumed pool must see the same."""
    rng = np.random.default_rng([zlib.crc32(sample.uid.encode()), sample.window_round])
    budget = sample.max_new_tokens
    if rng.random() < eos_prob:
        num_new, reason = int(rng.integers(1, budget + 1)), "eos"
    else:
        num_new, reason = budget, None
    num_routed = len(sample.prompt_ids) + sample.num_response_tokens + num_new - 1
    sample.add_window(
        rng.integers(0, 100, num_new),
        -rng.random(num_new),
        finish_reason=reason,
        routed_experts=rng.integers(0, 8, (num_routed, num_layers, top_k)).astype(np.uint8),
    )
    if sample.finished:
        # a third of the prompts are always solved, the rest by chance: dynamic sampling has groups to drop
        solved = zlib.crc32(sample.prompt_uid.encode()) % 3 == 0
        sample.reward = 1.0 if solved else float(rng.choice([-1.0, 1.0]))


def run_step(pool: SamplePool, eos_prob: float):
    batch = pool.take()
    for sample in batch:
        generate(sample, eos_prob)
    return batch, pool.put_back(batch)


def summary(batch, outcome):
    """What a step did, as plain values (for comparing two pools)."""
    return (
        [(s.uid, s.prompt_uid, s.window_round, s.response_ids.tolist(), s.finished) for s in batch],
        [(s.uid, s.reward) for s in outcome.retired],
        [s.uid for s in outcome.dropped],
    )


# ---------------------------------------------------------------------------------------------------------------
# Invariants over long random runs.


def check_run(pool: SamplePool, num_steps: int, eos_prob: float, expect_full: bool = True) -> dict:
    """Run the pool, checking every invariant of successive batching on the way."""
    W, L_max, G = pool.window, pool.max_response_length, pool.group_size
    created: set[str] = set()
    retired: Counter[str] = Counter()
    group_members: dict[int, set[str]] = defaultdict(set)
    admissions: list[tuple[int, str]] = []
    previous_unfinished: list[str] = []
    for _ in range(num_steps):
        if pool.exhausted:
            break
        batch = pool.take()
        uids = [s.uid for s in batch]
        assert len(set(uids)) == len(uids)
        if expect_full and not pool.sampler.exhausted:
            assert len(batch) == pool.batch_size
        assert uids[: len(previous_unfinished)] == previous_unfinished  # continuations first, in order
        for s in batch:
            assert s.uid not in retired
            if s.window_round == 0:
                assert s.uid not in created
                created.add(s.uid)
                group_members[s.group_id].add(s.uid)
                if s.uid.endswith(".0"):
                    admissions.append((s.epoch, s.prompt_uid))
            else:
                assert s.uid in created
            assert s.max_new_tokens == min(W, L_max - s.num_response_tokens) >= 1
            generate(s, eos_prob)
            assert s.window_round <= pool.max_windows
            assert s.num_response_tokens <= L_max
            if not s.finished:
                assert s.num_response_tokens == s.window_round * W
            assert s.window_start == (s.window_round - 1) * W
        outcome = pool.put_back(batch)
        for s in outcome.retired + outcome.dropped:
            retired[s.uid] += 1
            assert s.finished and s.reward is not None and s.window_round <= math.ceil(L_max / W)
        previous_unfinished = [s.uid for s in batch if not s.finished]
        assert outcome.num_continuing == len(previous_unfinished)
    assert all(n == 1 for n in retired.values())
    in_pool = {s.uid for s in pool if s.window_round > 0}  # items not yet handed out were never created here
    assert (
        created == set(retired) | in_pool and not set(retired) & in_pool
    )  # nothing lost, nothing duplicated
    waiting = [s for s in pool if s.window_round == 0]  # admitted, not yet handed out
    for s in waiting:
        group_members[s.group_id].add(s.uid)
    for gid, members in group_members.items():
        assert members == {f"g{gid}.{k}" for k in range(G)}  # every group entered whole
    assert pool.num_in_flight == len(created) - len(retired) + len(waiting)
    return {"created": created, "retired": retired, "admissions": admissions}


def test_thousands_of_steps_keep_every_invariant():
    # batch 10 is not a multiple of G = 4, so groups regularly wait half-scheduled
    pool = SamplePool(make_dataset(7), batch_size=10, group_size=4, window=3, max_response_length=10, seed=1)
    assert pool.max_windows == 4
    log = check_run(pool, 2000, eos_prob=0.3)
    assert len(log["retired"]) > 5000
    # the data order: every epoch admits each prompt exactly once
    by_epoch = defaultdict(list)
    for epoch, prompt_uid in log["admissions"]:
        by_epoch[epoch].append(prompt_uid)
    complete = [uids for epoch, uids in by_epoch.items() if epoch < max(by_epoch)]
    assert complete and all(sorted(uids) == sorted(f"p{i}" for i in range(7)) for uids in complete)
    assert len({tuple(u) for u in complete}) > 1  # shuffled differently per epoch


@settings(max_examples=15, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 5),
    st.integers(1, 6),
    st.integers(1, 20),
    st.floats(0.0, 1.0),
    st.booleans(),
    st.integers(1, 9),
)
def test_random_configurations_keep_every_invariant(
    batch_size, group_size, window, max_length, eos_prob, dynamic, num_prompts
):
    dynamic = dynamic and group_size >= 2
    pool = SamplePool(
        make_dataset(num_prompts),
        batch_size=batch_size,
        group_size=group_size,
        window=window,
        max_response_length=max_length,
        seed=3,
        dynamic_sampling=dynamic,
    )
    check_run(pool, 150, eos_prob)


def test_every_response_ends_within_ceil_lmax_over_w_windows():
    pool = SamplePool(make_dataset(3), batch_size=4, group_size=2, window=3, max_response_length=10)
    budgets = defaultdict(list)
    finished = []
    for _ in range(30):
        batch = pool.take()
        for s in batch:
            budgets[s.uid].append(s.max_new_tokens)
            generate(s, eos_prob=0.0)  # nobody stops early: every response runs to L_max
        finished += pool.put_back(batch).retired
    assert finished
    for s in finished:
        assert budgets[s.uid] == [3, 3, 3, 1]
        assert s.window_round == 4 == math.ceil(10 / 3)
        assert s.finish_reason == "length" and s.num_response_tokens == 10


def test_window_covering_lmax_finishes_everything_in_one_window():
    pool = SamplePool(make_dataset(3), batch_size=4, group_size=2, window=16, max_response_length=10)
    assert pool.max_windows == 1
    for _ in range(5):
        batch, outcome = run_step(pool, eos_prob=0.5)
        assert all(s.finished and s.window_round == 1 for s in batch)
        assert outcome.num_continuing == 0 and len(outcome.retired) == 4


def test_finite_epochs_run_out_cleanly():
    pool = SamplePool(
        make_dataset(5), batch_size=6, group_size=3, window=2, max_response_length=5, seed=7, max_epochs=2
    )
    log = check_run(pool, 500, eos_prob=0.4, expect_full=False)
    assert pool.exhausted and pool.take() == []
    pool.put_back([])
    assert len(log["retired"]) == 5 * 2 * 3
    assert Counter(uid for _, uid in log["admissions"]) == {f"p{i}": 2 for i in range(5)}


def test_dynamic_sampling_retires_mixed_groups_whole_and_drops_uniform_ones():
    pool = SamplePool(
        make_dataset(9),
        batch_size=8,
        group_size=4,
        window=2,
        max_response_length=6,
        seed=2,
        dynamic_sampling=True,
    )
    retired, dropped = [], []
    for _ in range(300):
        _, outcome = run_step(pool, eos_prob=0.4)
        retired += outcome.retired
        dropped += outcome.dropped
    for samples, mixed in ((retired, True), (dropped, False)):
        groups = defaultdict(list)
        for s in samples:
            groups[s.group_id].append(s.reward)
        assert groups and all(len(r) == 4 for r in groups.values())
        assert all((len(set(r)) > 1) == mixed for r in groups.values())


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint.


def plain(obj) -> bool:
    """Only plain Python and numpy inside."""
    if isinstance(obj, dict):
        return all(isinstance(k, str | int) and plain(v) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return all(plain(v) for v in obj)
    return obj is None or isinstance(obj, str | int | float | bool | np.ndarray | np.generic)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("steps_before", [0, 1, 23, 57])
def test_state_dict_restores_a_pool_that_behaves_identically(dynamic, steps_before):
    def new_pool():
        return SamplePool(
            make_dataset(6),
            batch_size=7,
            group_size=3,
            window=2,
            max_response_length=7,
            seed=11,
            dynamic_sampling=dynamic,
        )

    original = new_pool()
    for _ in range(steps_before):
        run_step(original, eos_prob=0.35)
    state = original.state_dict()
    assert plain(state)
    restored = new_pool()
    restored.load_state_dict(pickle.loads(pickle.dumps(state)))
    for _ in range(60):
        assert summary(*run_step(original, 0.35)) == summary(*run_step(restored, 0.35))
    assert original.metrics() == restored.metrics()


def test_state_dict_is_a_copy_and_checks_compatibility():
    pool = SamplePool(make_dataset(4), batch_size=4, group_size=2, window=2, max_response_length=6)
    run_step(pool, 0.0)
    state = pool.state_dict()
    state["continuations"][0]["response_ids"][:] = -1  # editing the snapshot must not touch the pool
    assert all((s.response_ids >= 0).all() for s in pool)
    other = SamplePool(make_dataset(4), batch_size=4, group_size=2, window=3, max_response_length=6)
    with pytest.raises(ValueError, match="window"):
        other.load_state_dict(pool.state_dict())
    reseeded = SamplePool(
        make_dataset(4), batch_size=4, group_size=2, window=2, max_response_length=6, seed=5
    )
    with pytest.raises(ValueError, match="seed"):
        reseeded.load_state_dict(pool.state_dict())
    pool.take()
    with pytest.raises(RuntimeError, match="state_dict"):
        pool.state_dict()


def test_prompt_sampler_resumes_mid_epoch():
    a = PromptSampler(5, seed=4)
    first = [a.next() for _ in range(7)]
    b = PromptSampler(5, seed=4)
    b.load_state_dict(a.state_dict())
    assert [a.next() for _ in range(9)] == [b.next() for _ in range(9)]
    assert sorted(i for i, e in first if e == 0) == [0, 1, 2, 3, 4]
    assert [PromptSampler(5, shuffle=False).next() for _ in range(1)] == [(0, 0)]


# ---------------------------------------------------------------------------------------------------------------
# Samples and bad input.


def test_sample_windows_values_and_routing():
    pool = SamplePool(make_dataset(1), batch_size=1, group_size=1, window=3, max_response_length=5)
    (s,) = pool.take()
    assert s.max_new_tokens == 3 and s.prompt_uid == "p0" and s.answer == "0"
    s.add_window([5, 6, 7], [-0.1, -0.2, -0.3], routed_experts=np.zeros((3, 2, 2), np.uint8))
    s.store_values([0.5, 0.4, 0.3])
    assert not s.finished and s.window_ids.tolist() == [5, 6, 7]
    with pytest.raises(ValueError, match="window_values"):
        s.store_values([1.0])
    pool.put_back([s])
    (s,) = pool.take()
    assert s.max_new_tokens == 2
    s.add_window([8, 9], [-0.4, -0.5])
    assert s.finished and s.finish_reason == "length" and s.routed_experts is None
    s.store_values([0.2, 0.1])
    assert s.values.tolist() == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1])
    assert s.context_ids.tolist() == [0, 5, 6, 7, 8, 9]
    s.reward = -1.0
    outcome = pool.put_back([s])
    assert [r.uid for r in outcome.retired] == [s.uid]
    assert outcome.metrics()["pool/retired_reward_mean"] == -1.0


def test_add_window_rejects_bad_windows():
    pool = SamplePool(make_dataset(1), batch_size=1, group_size=1, window=3, max_response_length=9)
    (s,) = pool.take()
    with pytest.raises(ValueError, match="finish_reason"):
        s.add_window([1, 2], [0.0, 0.0])  # stopped early without a reason
    with pytest.raises(ValueError, match="token_ids"):
        s.add_window([1, 2, 3, 4], [0.0] * 4, finish_reason="eos")  # over budget
    with pytest.raises(ValueError, match="logprobs"):
        s.add_window([1, 2, 3], [0.0, 0.0])
    with pytest.raises(ValueError, match="logprobs"):
        s.add_window([1, 2, 3], [0.0, float("nan"), 0.0])
    with pytest.raises(ValueError, match="routed_experts"):
        s.add_window([1, 2, 3], [0.0] * 3, routed_experts=np.zeros((3, 2), np.int64))
    with pytest.raises(ValueError, match="finish_reason"):
        s.add_window([1], [0.0], finish_reason="timeout")
    s.add_window([1], [0.0], finish_reason="eos")
    with pytest.raises(ValueError, match="already finished"):
        s.add_window([1], [0.0], finish_reason="eos")


def test_put_back_rejects_lost_duplicated_or_unscored_samples():
    pool = SamplePool(make_dataset(2), batch_size=4, group_size=2, window=2, max_response_length=4)
    batch = pool.take()
    for s in batch:
        s.add_window([1, 2], [0.0, 0.0])
    with pytest.raises(ValueError, match="missing"):
        pool.put_back(batch[:3])
    with pytest.raises(ValueError, match="more than once"):
        pool.put_back(batch + batch[:1])
    stranger = Sample(uid="x", group_id=99, prompt_uid="p", prompt_ids=np.array([1]), max_response_length=4)
    with pytest.raises(ValueError, match="not handed out"):
        pool.put_back(batch[:3] + [stranger])
    batch[0].finished, batch[0].finish_reason = True, "eos"
    with pytest.raises(ValueError, match="reward"):
        pool.put_back(batch)
    batch[0].reward = float("nan")
    with pytest.raises(ValueError, match="reward"):
        pool.put_back(batch)
    batch[0].reward = 1.0
    with pytest.raises(RuntimeError, match="put_back"):
        pool.take()
    outcome = pool.put_back(batch)
    assert len(outcome.retired) == 1 and outcome.num_continuing == 3


def test_put_back_rejects_a_sample_without_its_window():
    pool = SamplePool(make_dataset(2), batch_size=2, group_size=2, window=2, max_response_length=4)
    batch = pool.take()
    batch[0].add_window([1, 2], [0.0, 0.0])
    with pytest.raises(ValueError, match="window"):
        pool.put_back(batch)


def test_bad_construction():
    with pytest.raises(ValueError, match="prompt_ids"):
        Prompt(uid="a", prompt_ids=[])
    with pytest.raises(ValueError, match="prompt_ids"):
        Prompt(uid="a", prompt_ids=[1.5, 2.0])
    with pytest.raises(ValueError, match="window"):
        SamplePool(make_dataset(2), batch_size=2, group_size=2, window=0, max_response_length=4)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        SamplePool(
            make_dataset(2),
            batch_size=2,
            group_size=1,
            window=2,
            max_response_length=4,
            dynamic_sampling=True,
        )
    with pytest.raises(TypeError, match="dataset"):
        SamplePool([{"uid": "a"}], batch_size=1, group_size=1, window=1, max_response_length=1).take()


def test_from_config():
    from tppo.algo.config import AlgoConfig

    algo = AlgoConfig(window=4, max_response_length=10, group_size=2, batch_size=4)
    pool = SamplePool.from_config(algo, make_dataset(3), seed=0)
    assert (pool.window, pool.max_windows, pool.batch_size, pool.group_size) == (4, 3, 4, 2)
