"""From pool samples to trainer micro-batches: the full-sequence layout, the current-window masks, and the
deterministic assignment of samples to (data-parallel rank, micro-batch) that ReLibra's load tensor uses.

Every trainer row is a whole sequence, prompt + every response token so far (the prompt and earlier windows are
context), right-padded. Per-token outputs of the engine are aligned with the tokens they score: position j
holds log p(token j | tokens < j) and the critic's V(s_j), the value of the state in which token j is chosen.
So a window's tokens at positions [P + w0, P + w1) read their log-probs and values at those same positions.

Ranks of one role must run the same number of micro-batches (expert parallelism exchanges tokens in every MoE
layer); ranks or micro-batches left short are filled with copies of a real row whose masks are all zero
("filler"), which adds nothing to any loss, count or load.

Legend: B rows, T tokens (the longest sequence of the micro-batch), L MoE layers, K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tppo.algo.advantages import mc_returns
from tppo.algo.pool import Sample
from tppo.engine.batch import TrainBatch


@dataclass
class PolicyTargets:
    """Per-token inputs of the policy loss, riding in TrainBatch.payload. [B, T] float32 each."""

    window_mask_BT: torch.Tensor  # 1 on the current window's tokens (what the policy-gradient loss trains)
    advantages_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor  # the trainer's log-probs before the update (filled by the driver)
    rollout_logprobs_BT: torch.Tensor  # the rollout engine's log-probs of the same tokens
    response_mask_BT: torch.Tensor  # 1 on every response token (positive-example LM loss, SFT)
    positive_B: torch.Tensor  # 1 for finished responses with reward > 0
    ref_logprobs_BT: torch.Tensor | None = None  # the reference policy's log-probs (filled when a KL is on)


@dataclass
class CriticTargets:
    """Per-token inputs of the value loss. [B, T] float32 each."""

    mask_BT: torch.Tensor  # 1 on every response token of a finished response
    returns_BT: torch.Tensor  # Monte-Carlo return: R on every token (gamma = 1, outcome reward)
    old_values_BT: torch.Tensor  # values at generation time (value clipping)


@dataclass(frozen=True)
class Placement:
    """Where each sample trains: rank r's micro-batch m holds rows `rows[r][m]` (indices into the samples)."""

    rows: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.rows)

    @property
    def num_microbatches(self) -> int:
        return len(self.rows[0])


def place(num_samples: int, num_ranks: int, micro_batch_size: int) -> Placement:
    """Deal samples round-robin to ranks, then cut each rank's share into the same number of micro-batches.

    num_microbatches = max_r ceil(n_r / micro_batch_size), and every rank splits its n_r samples into that many
    contiguous, near-equal chunks (a chunk may be empty; it becomes a filler row).
    """
    if num_ranks < 1 or micro_batch_size < 1:
        raise ValueError(f"num_ranks={num_ranks} and micro_batch_size={micro_batch_size} must be >= 1")
    shares = [list(range(r, num_samples, num_ranks)) for r in range(num_ranks)]
    num_mb = max(1, max(-(-len(s) // micro_batch_size) for s in shares))
    return Placement(
        tuple(tuple(tuple(int(i) for i in c) for c in np.array_split(s, num_mb)) for s in shares)
    )


def place_samples(
    samples: Sequence[Sample], num_ranks: int, micro_batch_size: int, max_tokens: int = 0
) -> Placement:
    """`place_by_tokens` over the samples' sequence lengths when max_tokens > 0, else `place`."""
    if max_tokens:
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        return place_by_tokens(lengths, num_ranks, micro_batch_size, max_tokens)
    return place(len(samples), num_ranks, micro_batch_size)


def place_by_tokens(
    lengths: Sequence[int], num_ranks: int, micro_batch_size: int, max_tokens: int
) -> Placement:
    """Micro-batches cut by length, for long-tailed sequences: padded to their longest row, fixed-count
    micro-batches of a few long and many short rows are mostly padding, and short rows alone waste launches.

    Samples sorted longest first are dealt round-robin to ranks (near-equal tokens per rank). Each rank cuts its
    share in that order: a micro-batch takes the next sample while its padded size, rows x its first (longest)
    row, stays <= max_tokens and its rows <= micro_batch_size; a sample longer than max_tokens is a micro-batch
    alone. Ranks short of the largest count split their micro-batches of most rows in two, and only a rank with
    fewer samples than micro-batches gets fillers.
    """
    if num_ranks < 1 or micro_batch_size < 1 or max_tokens < 1:
        raise ValueError(
            f"num_ranks={num_ranks}, micro_batch_size={micro_batch_size} and max_tokens={max_tokens} must be >= 1"
        )
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    cuts = [
        _cut_by_tokens(order[r::num_ranks], lengths, micro_batch_size, max_tokens) for r in range(num_ranks)
    ]
    num_mb = max(1, max(len(c) for c in cuts))
    for chunks in cuts:
        while len(chunks) < num_mb and max((len(c) for c in chunks), default=0) > 1:
            i = max(range(len(chunks)), key=lambda j: len(chunks[j]))
            half = -(-len(chunks[i]) // 2)
            chunks[i : i + 1] = [chunks[i][:half], chunks[i][half:]]
        chunks += [()] * (num_mb - len(chunks))
    return Placement(tuple(tuple(chunks) for chunks in cuts))


def _cut_by_tokens(
    share: Sequence[int], lengths: Sequence[int], micro_batch_size: int, max_tokens: int
) -> list[tuple[int, ...]]:
    """`share` (longest first) in order, into micro-batches of rows x longest <= max_tokens."""
    chunks: list[tuple[int, ...]] = []
    for i in share:
        last = chunks[-1] if chunks else ()
        if last and len(last) < micro_batch_size and (len(last) + 1) * int(lengths[last[0]]) <= max_tokens:
            chunks[-1] = (*last, int(i))
        else:
            chunks.append((int(i),))
    return chunks


def update_schedule(
    num_microbatches: int, mini_batches: int, epochs: int, rng: np.random.Generator
) -> list[list[int]]:
    """The optimizer steps of one update: per epoch, the micro-batches in an order `rng` shuffles, cut into
    min(mini_batches, num_microbatches) contiguous mini-batches of near-equal size; one list of micro-batch
    indices per optimizer step. Every rank holds the same number of micro-batches, so every rank takes the same
    steps over its own micro-batches with the same indices. A single mini-batch of a single epoch keeps the
    micro-batches in order (the gradient is the same; so is its summation order).

    Shuffling is over micro-batches: the samples of one micro-batch stay together (they were dealt to it
    round-robin by `place`)."""
    if num_microbatches < 1 or mini_batches < 1 or epochs < 1:
        raise ValueError(
            f"num_microbatches={num_microbatches}, mini_batches={mini_batches} and epochs={epochs} must be >= 1"
        )
    k = min(mini_batches, num_microbatches)
    if k == 1 and epochs == 1:
        return [list(range(num_microbatches))]
    steps = []
    for _ in range(epochs):
        order = rng.permutation(num_microbatches)
        steps += [[int(m) for m in chunk] for chunk in np.array_split(order, k)]
    return steps


def padding_fraction(batches: Sequence[Sequence[TrainBatch]]) -> float:
    """Share of the trainer positions of every rank's micro-batches (rows x longest row, summed) that are right
    padding: compute that placing rows of similar lengths together (`place_by_tokens`) saves."""
    area = sum(b.shape[0] * b.shape[1] for rank in batches for b in rank)
    real = sum(int(b.valid_BT().sum()) for rank in batches for b in rank)
    return 1.0 - real / area if area else 0.0


def select_microbatches(
    batches: list[list[TrainBatch]], microbatches: Sequence[int]
) -> list[list[TrainBatch]]:
    """Every rank's micro-batches `microbatches` (one optimizer step's share of the step's batches)."""
    return [[rank[m] for m in microbatches] for rank in batches]


def _padded(rows: Sequence[np.ndarray], width: int, fill: float = 0, dtype=torch.float32) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.as_tensor(np.asarray(row), dtype=dtype)
    return out


def sequence_ids(sample: Sample) -> np.ndarray:
    return np.concatenate([sample.prompt_ids, sample.response_ids]).astype(np.int64)


def _routing_rows(samples: Sequence[Sample], width: int) -> torch.Tensor | None:
    routes = [s.routed_experts for s in samples]
    missing = [s.uid for s, r in zip(samples, routes) if r is None]
    if missing:
        raise ValueError(
            f"routing replay is on but samples {missing[:5]} carry no routed experts from the rollout"
        )
    num_layers, k = routes[0].shape[1:]
    out = torch.zeros(len(samples), width, num_layers, k, dtype=torch.int32)
    for b, (s, r) in enumerate(zip(samples, routes)):
        n = len(sequence_ids(s))
        if r.shape[0] < n - 1:
            raise ValueError(f"routed_experts of sample {s.uid} cover {r.shape[0]} of its {n} tokens")
        out[b, : min(n, r.shape[0])] = torch.as_tensor(r[:n].astype(np.int32))
        # The final token is only ever scored, never fed through the router by the rollout engine: its
        # own routing does not affect any score, so it reuses the previous token's experts.
        if r.shape[0] < n:
            out[b, n - 1] = out[b, n - 2]
    return out


def _base(samples: Sequence[Sample], routing: bool) -> tuple[TrainBatch, int]:
    seqs = [sequence_ids(s) for s in samples]
    width = max(len(x) for x in seqs)
    attention = _padded([np.ones(len(x)) for x in seqs], width, dtype=torch.long)
    batch = TrainBatch(
        input_ids_BT=_padded(seqs, width, dtype=torch.long),
        attention_mask_BT=attention,
        routed_experts_BTLK=_routing_rows(samples, width) if routing else None,
    )
    return batch, width


def _window_rows(s: Sample, live: bool) -> tuple[np.ndarray, np.ndarray]:
    """0/1 over the sequence: the current window's tokens, and every response token."""
    p, r = len(s.prompt_ids), s.num_response_tokens
    window = np.zeros(p + r, np.float32)
    response = np.zeros(p + r, np.float32)
    if live:
        window[p + s.window_start :] = 1.0
        response[p:] = 1.0
    return window, response


def logprob_temperature(sampling_temperature: float) -> float:
    """The temperature the trainer's log-probs are taken at: the rollout's sampling temperature (its log-probs
    are of the full tempered distribution), or 1 for greedy sampling (T = 0), which reports log softmax(logits)."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


def policy_batch(
    samples: Sequence[Sample],
    filler: Sequence[bool],
    advantages: Sequence[np.ndarray],
    routing: bool,
    temperature: float = 1.0,
) -> TrainBatch:
    """A policy micro-batch; `advantages[i]` holds the window tokens' advantages of sample i; log-probs at the
    sampling `temperature` (`logprob_temperature`)."""
    batch, width = _base(samples, routing)
    batch.temperature = temperature
    windows, responses, adv, rollout = [], [], [], []
    for s, is_filler, a in zip(samples, filler, advantages):
        w, resp = _window_rows(s, not is_filler)
        p = len(s.prompt_ids)
        windows.append(w)
        responses.append(resp)
        full_adv = np.zeros_like(w)
        full_adv[p + s.window_start :] = a
        adv.append(full_adv)
        lp = np.zeros_like(w)
        lp[p:] = s.rollout_logprobs
        rollout.append(lp)
    positive = [float(s.finished and (s.reward or 0.0) > 0 and not f) for s, f in zip(samples, filler)]
    batch.payload = PolicyTargets(
        window_mask_BT=_padded(windows, width),
        advantages_BT=_padded(adv, width),
        old_logprobs_BT=torch.zeros(len(samples), width),
        rollout_logprobs_BT=_padded(rollout, width),
        response_mask_BT=_padded(responses, width),
        positive_B=torch.tensor(positive, dtype=torch.float32),
    )
    batch.loss_mask_BT = batch.payload.window_mask_BT
    return batch


def critic_batch(
    samples: Sequence[Sample], filler: Sequence[bool], routing: bool, gamma: float = 1.0
) -> TrainBatch:
    """A critic micro-batch over finished responses: on response token t of a response of n tokens with outcome
    reward R, the discounted Monte-Carlo return G_t = gamma^(n-1-t) R (`mc_returns`; R on every token at
    gamma = 1), the target of V(s_t)."""
    batch, width = _base(samples, routing)
    masks, returns, old = [], [], []
    for s, is_filler in zip(samples, filler):
        _, resp = _window_rows(s, not is_filler)
        p = len(s.prompt_ids)
        masks.append(resp)
        returns.append(_mc_targets(s, resp, gamma))
        v = np.zeros_like(resp)
        if s.values is not None:
            v[p : p + len(s.values)] = s.values
        old.append(v)
    batch.payload = CriticTargets(
        mask_BT=_padded(masks, width), returns_BT=_padded(returns, width), old_values_BT=_padded(old, width)
    )
    batch.loss_mask_BT = batch.payload.mask_BT
    return batch


def _mc_targets(s: Sample, response_row: np.ndarray, gamma: float) -> np.ndarray:
    """G_t over the sequence row: the discounted outcome reward on the response tokens, 0 elsewhere."""
    p, n = len(s.prompt_ids), s.num_response_tokens
    out = np.zeros_like(response_row)
    if not response_row.any() or n == 0:
        return out
    rewards = torch.zeros(1, n)
    rewards[0, -1] = float(s.reward or 0.0)
    out[p : p + n] = mc_returns(rewards, torch.ones(1, n), gamma)[0].numpy()
    return out


def split_for_ranks(
    samples: Sequence[Sample], placement: Placement
) -> list[list[tuple[list[Sample], list[bool]]]]:
    """Per rank, per micro-batch: the samples (fillers padded in) and which of them are fillers."""
    if not samples:
        raise ValueError("samples: nothing to place")
    out = []
    for rank_rows in placement.rows:
        mbs = []
        for rows in rank_rows:
            if rows:
                mbs.append(([samples[i] for i in rows], [False] * len(rows)))
            else:
                mbs.append(([samples[0]], [True]))
        out.append(mbs)
    return out
