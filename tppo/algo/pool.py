"""The sample pool of successive batching (T-PPO): which responses generate in each step, and their state.

A prompt enters the pool as a group of G items (`Sample`s sharing a group id). Every step the pool hands out a
batch of fixed size: the unfinished continuations first (in the order they came back), then fresh items (the rest
of a group admitted earlier, then new groups) to fill it. Each item generates at most W new tokens per step
(`Sample.max_new_tokens`, also capped by L_max), so a response takes at most ceil(L_max / W) windows. Finished
items (EOS/stop, or L_max reached) are scored by the driver and retire with their reward; unfinished items go back
to the front of the next batch.

The driver's loop, once per step:

    batch = pool.take()                              # list[Sample]; each knows its budget max_new_tokens
    for sample, out in zip(batch, generate(batch)):  # the rollout engine, W tokens at most per item
        sample.add_window(out.token_ids, out.logprobs, finish_reason=out.finish_reason,
                          routed_experts=out.routed_experts)   # finish_reason None: cut at the budget
    for sample in batch:
        if sample.finished: sample.reward = verifier(sample)
    ... values = critic(batch); sample.store_values(window_values) (optional) ... train ...
    outcome = pool.put_back(batch)                   # PoolStep: retired (finished, scored), dropped
    ... checkpoint: pool.state_dict() between put_back and the next take ...

The samples may travel to other processes and come back as copies: `put_back` matches them by uid against what
`take` handed out and checks that nothing is lost, duplicated or inconsistent.

Prompts come from a dataset of known length (`len(dataset)`, `dataset[i] -> Prompt`) read in the order of a
seeded, epoch-aware `PromptSampler` that the pool owns; its cursor is part of `state_dict()`, so the pool's state
and the data position resume together, exactly.

Departures and readings of ours: a group admitted into the pool always enters whole, but when the batch has fewer
free slots than G its remaining items wait (first in line after the continuations) for the next step, so every
batch has exactly `batch_size` items while prompts last. Dynamic sampling (DAPO) holds finished items until
their whole group has finished, then retires the group if its rewards are mixed and drops it (returned in
`PoolStep.dropped`) if they are all equal; with a fixed batch every continuation is scheduled every step, so the
"prefer mixed groups" half of DAPO has nothing to reorder and is not implemented. Routing of a multi-window
response is replaced by each new window's (the prefix is prefilled again with the new weights).

Legend of array suffixes: P prompt tokens, R response tokens so far, N tokens of the routed sequence,
L MoE layers, K experts per token (top-k).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np

__all__ = [
    "FINISH_REASONS",
    "PoolStep",
    "Prompt",
    "PromptDataset",
    "PromptSampler",
    "Sample",
    "SamplePool",
]

# How a response ended: the model stopped it (EOS or a stop string), or it reached L_max.
FINISH_REASONS = ("eos", "stop", "length")
_STATE_VERSION = 1


def _int_array(name: str, values: Any) -> np.ndarray:
    ids = np.asarray(values)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{name}: expected a 1-D sequence of integer token ids, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int32)


def _float_array(name: str, values: Any, length: int) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float32)
    if arr.shape != (length,):
        raise ValueError(f"{name}: expected {length} values (one per token), got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: contains NaN or inf")
    return arr


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return int(value)


@dataclass
class Prompt:
    """One prompt of the dataset: its id, its token ids, and what the verifier needs (answer, metadata)."""

    uid: str
    prompt_ids: np.ndarray
    answer: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.uid, str) or not self.uid:
            raise ValueError(f"uid: expected a non-empty string, got {self.uid!r}")
        self.prompt_ids = _int_array("prompt_ids", self.prompt_ids)
        if self.prompt_ids.size == 0:
            raise ValueError(f"prompt_ids: prompt {self.uid!r} has no tokens")


class PromptDataset(Protocol):
    """What the pool reads prompts from: a sequence of known length."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Prompt: ...


@dataclass
class Sample:
    """One response in flight (or retired): its prompt, its tokens so far, and what training needs of it.

    `window_start` is where the latest window begins in `response_ids`; `max_new_tokens` is the budget of the
    window being generated (set by `SamplePool.take`). `values` (optional) are the critic's values stored for the
    response tokens of earlier windows; `routed_experts` [N, L, K] are the experts the rollout chose for each token
    of the sequence in the latest window (any integer dtype; the smallest that fits the experts saves memory).
    """

    uid: str
    group_id: int
    prompt_uid: str
    prompt_ids: np.ndarray
    max_response_length: int
    answer: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    response_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    rollout_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    values: np.ndarray | None = None
    routed_experts: np.ndarray | None = None
    window_round: int = 0
    window_start: int = 0
    max_new_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    reward: float | None = None

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def window_ids(self) -> np.ndarray:
        """The tokens of the latest window (what the policy trains on this step)."""
        return self.response_ids[self.window_start :]

    @property
    def context_ids(self) -> np.ndarray:
        """Prompt and every response token so far: what the next window is prefilled with."""
        return np.concatenate([self.prompt_ids, self.response_ids])

    def add_window(
        self,
        token_ids: Any,
        logprobs: Any,
        *,
        finish_reason: str | None = None,
        routed_experts: np.ndarray | None = None,
    ) -> None:
        """Append the tokens generated in this step's window and decide whether the response finished.

        `finish_reason` None means the window was cut at its budget (exactly `max_new_tokens` tokens); "eos" or
        "stop" mean the model ended the response. Reaching `max_response_length` finishes it with "length".
        """
        if self.finished:
            raise ValueError(f"token_ids: sample {self.uid} is already finished")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"token_ids: sample {self.uid} has no window budget (was it taken from the pool?)"
            )
        new_ids = _int_array("token_ids", token_ids)
        num_new = int(new_ids.shape[0])
        new_logprobs = _float_array("logprobs", logprobs, num_new)
        if not 1 <= num_new <= self.max_new_tokens:
            raise ValueError(
                f"token_ids: expected 1..{self.max_new_tokens} tokens for sample {self.uid}, got {num_new}"
            )
        if finish_reason is None and num_new != self.max_new_tokens:
            raise ValueError(
                f"finish_reason: sample {self.uid} stopped after {num_new} of {self.max_new_tokens} "
                "tokens without a finish reason"
            )
        if finish_reason not in (None, "eos", "stop"):
            raise ValueError(f"finish_reason: expected None, 'eos' or 'stop', got {finish_reason!r}")
        if routed_experts is not None:
            self.routed_experts = self._checked_routing(routed_experts, num_new)
        else:
            self.routed_experts = None
        self.window_start = self.num_response_tokens
        self.response_ids = np.concatenate([self.response_ids, new_ids])
        self.rollout_logprobs = np.concatenate([self.rollout_logprobs, new_logprobs])
        self.window_round += 1
        self.max_new_tokens = 0
        if finish_reason is not None:
            self.finished, self.finish_reason = True, finish_reason
        elif self.num_response_tokens >= self.max_response_length:
            self.finished, self.finish_reason = True, "length"

    def _checked_routing(self, routed_experts: Any, num_new: int) -> np.ndarray:
        routing = np.asarray(routed_experts)
        num_tokens = self.prompt_ids.shape[0] + self.num_response_tokens + num_new
        if routing.ndim != 3 or not np.issubdtype(routing.dtype, np.integer) or routing.shape[0] > num_tokens:
            raise ValueError(
                f"routed_experts: expected an integer array [num_tokens <= {num_tokens}, "
                f"num_moe_layers, top_k], got {routing.dtype} {routing.shape}"
            )
        return routing

    def store_values(self, window_values: Any) -> None:
        """Store the critic's values of the latest window's tokens (after those of earlier windows)."""
        stored = 0 if self.values is None else int(self.values.shape[0])
        if stored != self.window_start:
            raise ValueError(
                f"window_values: sample {self.uid} has values for {stored} tokens; the latest window "
                f"starts at {self.window_start}"
            )
        new_values = _float_array(
            "window_values", window_values, self.num_response_tokens - self.window_start
        )
        self.values = new_values if self.values is None else np.concatenate([self.values, new_values])

    def to_state(self) -> dict[str, Any]:
        """A plain-Python/numpy copy of every field (picklable)."""
        return {f.name: _copy_value(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sample:
        return cls(**{f.name: _copy_value(state[f.name]) for f in fields(cls)})


def _copy_value(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {k: _copy_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_value(v) for v in value]
    return value


class PromptSampler:
    """A deterministic, seeded, epoch-aware order over `num_prompts` prompt indices.

    Epoch e visits every index once, in the permutation drawn from numpy's PCG64 seeded with (seed, e) when
    `shuffle`, else in order. `max_epochs` None never runs out. The cursor (epoch, position) is the whole state.
    """

    def __init__(
        self, num_prompts: int, seed: int = 0, shuffle: bool = True, max_epochs: int | None = None
    ) -> None:
        self.num_prompts = _check_int("num_prompts", num_prompts, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.max_epochs = None if max_epochs is None else _check_int("max_epochs", max_epochs, 1)
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None

    def _index(self) -> int:
        """The prompt at the cursor. Unshuffled epochs need no order array (a stream may be huge)."""
        if not self.shuffle:
            return self.position
        if self._order is None:
            self._order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_prompts)
        return int(self._order[self.position])

    @property
    def exhausted(self) -> bool:
        return self.max_epochs is not None and self.epoch >= self.max_epochs

    def next(self) -> tuple[int, int] | None:
        """The next (prompt index, epoch), or None once `max_epochs` epochs are done."""
        if self.exhausted:
            return None
        index, epoch = self._index(), self.epoch
        self.position += 1
        if self.position == self.num_prompts:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return index, epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "max_epochs": self.max_epochs,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_prompts", "seed", "shuffle", "max_epochs"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"state_dict: sampler {key}={state[key]!r} differs from this sampler's "
                    f"{getattr(self, key)!r}"
                )
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


@dataclass
class PoolStep:
    """What `SamplePool.put_back` reports for one step."""

    retired: list[Sample]
    dropped: list[Sample]
    num_continuing: int

    def metrics(self) -> dict[str, float]:
        rewards = [s.reward for s in self.retired if s.reward is not None]
        lengths = [s.num_response_tokens for s in self.retired]
        return {
            "pool/num_retired": float(len(self.retired)),
            "pool/num_dropped": float(len(self.dropped)),
            "pool/num_continuing": float(self.num_continuing),
            "pool/retired_reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
            "pool/retired_length_mean": float(np.mean(lengths)) if lengths else float("nan"),
        }


@dataclass
class _Taken:
    """What the pool remembers of a sample it handed out, to check what comes back."""

    window_round: int
    num_response_tokens: int
    max_new_tokens: int
    group_id: int


class SamplePool:
    """Successive batching: fixed-size batches of continuations first, then fresh items in whole groups of G.

    Args:
        dataset: the prompts (`len(dataset)`, `dataset[i] -> Prompt`).
        batch_size: items per step (a multiple of `group_size` is usual, not required).
        group_size: G, items per prompt.
        window: W, new tokens per item per step.
        max_response_length: L_max; an item finishes after at most ceil(L_max / W) windows.
        seed, shuffle, max_epochs: the prompt order (see `PromptSampler`).
        dynamic_sampling: DAPO's filter (see the module docstring).
    """

    def __init__(
        self,
        dataset: PromptDataset,
        *,
        batch_size: int,
        group_size: int,
        window: int,
        max_response_length: int,
        seed: int = 0,
        shuffle: bool = True,
        max_epochs: int | None = None,
        dynamic_sampling: bool = False,
    ) -> None:
        self.dataset = dataset
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.group_size = _check_int("group_size", group_size, 1)
        self.window = _check_int("window", window, 1)
        self.max_response_length = _check_int("max_response_length", max_response_length, 1)
        self.dynamic_sampling = bool(dynamic_sampling)
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError(
                "dynamic_sampling: needs group_size >= 2 (a group of one always has equal rewards)"
            )
        self.sampler = PromptSampler(len(dataset), seed=seed, shuffle=shuffle, max_epochs=max_epochs)
        self._continuations: list[Sample] = []
        self._pending: list[Sample] = []
        self._held: dict[int, list[Sample]] = {}
        self._group_remaining: dict[int, int] = {}
        self._next_group_id = 0
        self._outstanding: dict[str, _Taken] = {}

    @classmethod
    def from_config(
        cls,
        algo: Any,
        dataset: PromptDataset,
        *,
        seed: int = 0,
        shuffle: bool = True,
        max_epochs: int | None = None,
    ) -> SamplePool:
        """Build from `tppo.config.AlgoConfig` (batch_size, group_size, window, max_response_length, ...)."""
        return cls(
            dataset,
            batch_size=algo.batch_size,
            group_size=algo.group_size,
            window=algo.window,
            max_response_length=algo.max_response_length,
            seed=seed,
            shuffle=shuffle,
            max_epochs=max_epochs,
            dynamic_sampling=algo.dynamic_sampling,
        )

    @property
    def max_windows(self) -> int:
        """ceil(L_max / W): the most windows any response takes."""
        return math.ceil(self.max_response_length / self.window)

    @property
    def num_in_flight(self) -> int:
        """Items admitted and not yet retired or dropped (handed out ones included)."""
        return sum(self._group_remaining.values())

    @property
    def exhausted(self) -> bool:
        """No prompt left to admit and nothing in flight."""
        return self.sampler.exhausted and self.num_in_flight == 0

    # -- the step ----------------------------------------------------------------------------------------------

    def take(self) -> list[Sample]:
        """This step's batch: every continuation, then fresh items; `batch_size` items while prompts last."""
        if self._outstanding:
            raise RuntimeError("take: the previous batch was not put back (call put_back(batch) first)")
        batch, self._continuations = self._continuations, []
        return self._hand_out(batch + self._fresh(self.batch_size - len(batch)))

    def take_more(self, num_items: int) -> list[Sample]:
        """Up to `num_items` more fresh items for the batch that is out (dynamic sampling's refill): the rest of
        a group admitted earlier, then new groups. They come back with the batch in the same `put_back`."""
        if not self._outstanding:
            raise RuntimeError("take_more: no batch is out (call take() first)")
        return self._hand_out(self._fresh(num_items))

    def _fresh(self, num_items: int) -> list[Sample]:
        fresh: list[Sample] = []
        while len(fresh) < num_items:
            if not self._pending:
                self._pending = self._admit_group()
                if not self._pending:
                    break
            num = min(num_items - len(fresh), len(self._pending))
            fresh.extend(self._pending[:num])
            self._pending = self._pending[num:]
        return fresh

    def _hand_out(self, items: list[Sample]) -> list[Sample]:
        for sample in items:
            sample.max_new_tokens = min(self.window, self.max_response_length - sample.num_response_tokens)
            self._outstanding[sample.uid] = _Taken(
                sample.window_round, sample.num_response_tokens, sample.max_new_tokens, sample.group_id
            )
        return items

    def _admit_group(self) -> list[Sample]:
        """The G fresh items of the next prompt, or [] when the sampler has run out."""
        drawn = self.sampler.next()
        if drawn is None:
            return []
        index, epoch = drawn
        prompt = self.dataset[index]
        if not isinstance(prompt, Prompt):
            raise TypeError(f"dataset[{index}]: expected a Prompt, got {type(prompt).__name__}")
        group_id, self._next_group_id = self._next_group_id, self._next_group_id + 1
        self._group_remaining[group_id] = self.group_size
        return [
            Sample(
                uid=f"g{group_id}.{k}",
                group_id=group_id,
                prompt_uid=prompt.uid,
                prompt_ids=prompt.prompt_ids.copy(),
                max_response_length=self.max_response_length,
                answer=prompt.answer,
                metadata=_copy_value(prompt.metadata),
                epoch=epoch,
            )
            for k in range(self.group_size)
        ]

    def put_back(self, batch: Sequence[Sample]) -> PoolStep:
        """Take back the batch after its window: unfinished items to the front, finished ones retire (scored).

        Every sample handed out by `take` must come back exactly once, with one more window, and every finished
        one with a finite `reward`.
        """
        self._check_returned(batch)
        continuing: list[Sample] = []
        retired: list[Sample] = []
        dropped: list[Sample] = []
        for sample in batch:
            if not sample.finished:
                continuing.append(sample)
            elif self.dynamic_sampling:
                self._hold(sample, retired, dropped)
            else:
                self._retire([sample])
                retired.append(sample)
        self._continuations = continuing
        self._outstanding = {}
        return PoolStep(retired=retired, dropped=dropped, num_continuing=len(continuing))

    def _hold(self, sample: Sample, retired: list[Sample], dropped: list[Sample]) -> None:
        """Dynamic sampling: keep a finished item until its group is complete, then retire or drop the group."""
        held = self._held.setdefault(sample.group_id, [])
        held.append(sample)
        if len(held) < self.group_size:
            return
        del self._held[sample.group_id]
        self._retire(held)
        if len({s.reward for s in held}) == 1:
            dropped.extend(held)
        else:
            retired.extend(held)

    def _retire(self, samples: list[Sample]) -> None:
        for sample in samples:
            self._group_remaining[sample.group_id] -= 1
            if self._group_remaining[sample.group_id] == 0:
                del self._group_remaining[sample.group_id]

    def _check_returned(self, batch: Sequence[Sample]) -> None:
        uids = [s.uid for s in batch]
        if len(set(uids)) != len(uids):
            duplicates = sorted({u for u in uids if uids.count(u) > 1})
            raise ValueError(f"batch: samples returned more than once: {duplicates[:5]}")
        missing = sorted(set(self._outstanding) - set(uids))
        extra = sorted(set(uids) - set(self._outstanding))
        if missing or extra:
            raise ValueError(
                f"batch: must hold exactly the samples of the last take(); missing {missing[:5]}, "
                f"not handed out {extra[:5]}"
            )
        for sample in batch:
            self._check_sample(sample, self._outstanding[sample.uid])

    def _check_sample(self, sample: Sample, taken: _Taken) -> None:
        uid = sample.uid
        if sample.group_id != taken.group_id or sample.window_round != taken.window_round + 1:
            raise ValueError(
                f"batch: sample {uid} did not generate exactly one window (window_round "
                f"{taken.window_round} -> {sample.window_round}; call add_window once)"
            )
        num_new = sample.num_response_tokens - taken.num_response_tokens
        if sample.window_start != taken.num_response_tokens or not 1 <= num_new <= taken.max_new_tokens:
            raise ValueError(
                f"batch: sample {uid} generated {num_new} tokens from position {sample.window_start}; "
                f"expected 1..{taken.max_new_tokens} from {taken.num_response_tokens}"
            )
        if not sample.finished:
            if num_new != taken.max_new_tokens or sample.num_response_tokens >= self.max_response_length:
                raise ValueError(
                    f"batch: sample {uid} is unfinished but did not fill its window "
                    f"({num_new} of {taken.max_new_tokens} tokens)"
                )
            if sample.reward is not None:
                raise ValueError(
                    f"batch: sample {uid} is unfinished but has a reward (score finished ones only)"
                )
            return
        if sample.finish_reason not in FINISH_REASONS or (
            sample.finish_reason == "length" and sample.num_response_tokens < self.max_response_length
        ):
            raise ValueError(
                f"batch: sample {uid} finished with reason {sample.finish_reason!r} after "
                f"{sample.num_response_tokens} tokens (max_response_length {self.max_response_length})"
            )
        reward = sample.reward
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"batch: finished sample {uid} needs a finite reward, got {reward!r}")

    # -- state -------------------------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "group_size": self.group_size,
            "window": self.window,
            "max_response_length": self.max_response_length,
            "dynamic_sampling": self.dynamic_sampling,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything in flight and the data position, as plain Python/numpy (picklable). Between steps only."""
        if self._outstanding:
            raise RuntimeError("state_dict: a batch is out (take() without put_back()); save between steps")
        return {
            "version": _STATE_VERSION,
            "config": self._config(),
            "sampler": self.sampler.state_dict(),
            "next_group_id": self._next_group_id,
            "continuations": [s.to_state() for s in self._continuations],
            "pending": [s.to_state() for s in self._pending],
            "held": {gid: [s.to_state() for s in held] for gid, held in self._held.items()},
            "group_remaining": dict(self._group_remaining),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a pool saved by `state_dict` (same configuration and dataset length), exactly."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"state_dict: version {state.get('version')!r} is not {_STATE_VERSION}")
        for key, value in self._config().items():
            if state["config"][key] != value:
                raise ValueError(
                    f"state_dict: {key}={state['config'][key]!r} differs from this pool's {value!r}"
                )
        self.sampler.load_state_dict(state["sampler"])
        self._next_group_id = int(state["next_group_id"])
        self._continuations = [Sample.from_state(s) for s in state["continuations"]]
        self._pending = [Sample.from_state(s) for s in state["pending"]]
        self._held = {int(gid): [Sample.from_state(s) for s in held] for gid, held in state["held"].items()}
        self._group_remaining = {int(gid): int(n) for gid, n in state["group_remaining"].items()}
        self._outstanding = {}

    def metrics(self) -> dict[str, float]:
        """The pool's occupancy now (log after put_back)."""
        return {
            "pool/num_in_flight": float(self.num_in_flight),
            "pool/num_continuations": float(len(self._continuations)),
            "pool/num_pending": float(len(self._pending)),
            "pool/num_held": float(sum(len(h) for h in self._held.values())),
            "pool/num_groups_in_flight": float(len(self._group_remaining)),
            "pool/epoch": float(self.sampler.epoch),
        }

    def __iter__(self) -> Iterator[Sample]:
        """The items waiting in the pool (continuations, pending fresh items, held finished ones)."""
        yield from self._continuations
        yield from self._pending
        for held in self._held.values():
            yield from held
