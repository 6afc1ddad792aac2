"""relibra.executor.migration: the chunking of a migration's optimizer state against its definition, and the order
in which chunks are posted and landed, with transfers whose completion the test controls (the data path itself is
covered against the static placement in test_executor_dist)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relibra.executor import migration
from relibra.executor.comm import SlotTransfer
from relibra.executor.migration import StateJob, StateMigration, state_chunks
from relibra.executor.tables import MigrationMoves


@pytest.mark.parametrize("seed", range(5))
def test_chunks_are_consecutive_within_half_the_budget_and_maximal(seed):
    rng = np.random.default_rng(seed)
    recv_XG = rng.integers(0, 5, size=(30, 4)) * 100
    budget = 1000
    chunks = state_chunks(recv_XG, budget)
    assert [x for c in chunks for x in c] == list(range(30))
    for i, chunk in enumerate(chunks):
        load = recv_XG[chunk].sum(axis=0).max()
        assert len(chunk) == 1 or load <= budget / 2
        if i + 1 < len(chunks):  # the next job did not fit
            assert recv_XG[chunk + [chunks[i + 1][0]]].sum(axis=0).max() > budget / 2


class _Request:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.done = True


def _fake_migration(monkeypatch, num_jobs: int):
    posted: list[tuple[int, str]] = []  # (job, state key) in posting order
    landed: list[int] = []
    requests: dict[int, list[_Request]] = {}

    def post(tensor, moves, group):
        job = int(tensor[0, 0])
        req = _Request()
        requests.setdefault(job, []).append(req)
        posted.append(job)
        return SlotTransfer(moves, tensor.new_empty(0), [], [req], 0)

    def tensors_of(param):
        return {"exp_avg": param.data, "exp_avg_sq": param.data}

    def land_into(param, transfers):
        for t in transfers.values():
            for r in t.requests:
                r.wait()
        landed.append(int(param.data[0, 0]))

    monkeypatch.setattr(migration, "post_slot_moves", post)
    params = [torch.nn.Parameter(torch.full((2, 3), float(x))) for x in range(num_jobs)]
    moves = MigrationMoves(local=(), sends=((1, 0),), recvs=((1, 0),))
    jobs = [StateJob((p,), moves) for p in params]
    mig = StateMigration(None, 100, tensors_of, land_into)
    return mig, jobs, posted, landed, requests


def test_two_chunks_in_flight_landed_in_order_without_waiting(monkeypatch):
    mig, jobs, posted, landed, requests = _fake_migration(monkeypatch, 5)
    row_bytes = mig.row_bytes(jobs[0].params)
    assert row_bytes == 2 * 3 * 4  # two fp32 rows of 3 values
    sent = mig.begin(jobs, np.full((5, 2), 1), row_bytes=40)  # 40 bytes each > half of 100: a chunk per job
    assert sent == 5 * 40 and mig.num_chunks == 5
    assert posted == [0, 0, 1, 1] and mig.in_flight
    mig.progress()
    assert landed == []
    for r in requests[1]:
        r.done = True
    mig.progress()  # job 1 arrived first: it waits for job 0, which lands first
    assert landed == []
    for r in requests[0]:
        r.done = True
    mig.progress()
    assert landed == [0, 1] and posted[4:] == [2, 2, 3, 3]
    mig.finish()
    assert landed == [0, 1, 2, 3, 4] and not mig.in_flight
    assert mig.waited_chunks == 3  # jobs 2, 3 and 4 never completed on their own


def test_a_new_migration_lands_the_last_one_first(monkeypatch):
    mig, jobs, posted, landed, _requests = _fake_migration(monkeypatch, 3)
    mig.begin(jobs[:2], np.full((2, 2), 1), row_bytes=10)  # both fit in one chunk
    assert mig.num_chunks == 1 and posted == [0, 0, 1, 1]
    mig.begin(jobs[2:], np.full((1, 2), 1), row_bytes=10)
    assert landed == [0, 1] and posted[4:] == [2, 2]
    mig.finish()
    assert landed == [0, 1, 2]
    assert mig.begin(jobs, np.zeros((3, 2)), row_bytes=0) == 0 and not mig.in_flight  # no state yet
    with pytest.raises(ValueError, match="budget must be positive"):
        StateMigration(None, 0, lambda p: {}, lambda p, t: None)
