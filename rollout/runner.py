"""Runs whole engine steps (model forward + sampling), captured as CUDA graphs on GPU.

A step of a 48-layer MoE model is ~2000 small kernels; launching them from Python costs more than the weights
take to stream at small batch, so on CUDA every step of at most `cuda_graph_max_tokens` tokens runs as a graph,
one per bucket (decode rows, prefill tokens, prefill tiles, sampled rows, top-k/top-p filtering), captured
lazily and replayed; larger steps (a prefill-only start) are compute-bound and run eagerly. A bucket pads the
step: decode rows to a batch size, prefill tokens to a power of two; padding tokens belong to the block table's
all-zero row, so their K/V go to the null block, and their outputs are dropped.

The graph holds the sampler too (temperature, top-k/top-p, the counter-based uniform of (seed, position + 1)
computed on the device, the sampled token's log-prob), so a step is: host-to-device copies of the per-token,
per-tile and per-sample inputs from pinned memory, the replay, device-to-host copies of tokens, log-probs and
routed experts into pinned memory, and ONE synchronisation. Inputs live in static device buffers that every
graph reads through slices; outputs land in static buffers too. Weights are updated in place by
`load_weights`, so graphs stay valid. With graphs off or after a failed capture the same step function runs
eagerly at the same padded shape (the same bits); on CPU it runs on the unpadded step.

`launch` queues a step and returns before it has run; its `LaunchedStep.outputs()` waits for it. So the host can
schedule and queue step t + 1 while the device runs step t: a decoding row's token sampled by step t is then
not on the host yet, and the step names it by its index among step t's samples (`StepInputs.feed_D`), gathered
on the device from the static sample buffer before the step runs. The pinned host buffers come in two sets used
in turn, so step t + 1 is staged while step t's copies are in flight.

Legend: T flat tokens, Q prefill tiles, S sampled rows, L MoE layers, K top-k, V vocab.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from rollout.model import MoeDecoder, StepBatch
from rollout.paged_attention import AttentionBatch, decode_splits, prefill_tile_tokens, prefill_tiles
from rollout.sampling import counter_uniform_torch, sample

log = logging.getLogger(__name__)

MAX_GRAPHS = 256  # least recently used graphs beyond this are dropped (each holds ~2000 kernel nodes)
TOKEN, POSITION, SEQ, CACHE_ROW = range(4)  # columns of StepInputs.tokens_T4


@dataclass(frozen=True)
class StepInputs:
    """One step as the scheduler sees it (numpy, unpadded): decode rows first, then prefill pieces."""

    tokens_T4: np.ndarray  # int64 [T, 4]: token, position, block-table row, cache row
    num_decode: int
    pieces: list[tuple[int, int]]  # prefill runs (flat start, length), each of one sequence, positions rising
    samples_S: np.ndarray  # int64: flat index of each token whose successor is sampled
    seeds_S: np.ndarray  # uint64
    top_k_S: np.ndarray  # int64, 0 = off
    temperature_S: np.ndarray  # float32, 0 = greedy
    top_p_S: np.ndarray  # float32
    # int64 per decoding row: the index of its token among the previous launch's samples, which the device
    # holds and the host does not yet (-1: tokens_T4 holds the token); None: every token is in tokens_T4
    feed_D: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens_T4.shape[0]

    @property
    def filtered(self) -> bool:
        """Whether any row needs the top-k/top-p sort (a separate graph: the sort is the sampler's costliest op)."""
        return bool(((self.top_p_S < 1) | (self.top_k_S > 0)).any())


@dataclass(frozen=True)
class StepOutputs:
    """Host (numpy) results of one step, valid until the next `run`."""

    tokens_S: np.ndarray  # int64
    logprobs_S: np.ndarray  # float32
    routes_TLK: np.ndarray  # int16 (int32 beyond 32767 experts), the step's tokens in StepInputs order


class LaunchedStep:
    """A queued step. `outputs()` waits for it and returns its results as host arrays, which stay valid until the
    launch after the next one reuses its buffers (asking later raises); `seconds` is then its device time (CUDA:
    between events around its copies and its run; CPU: the launch, which ran it)."""

    def __init__(self, x: StepInputs, shape: _Shape, host: _HostSet, number: int, began: float) -> None:
        self._x, self._shape, self._host, self._number = x, shape, host, number
        self._started, self._done = host.started, host.done
        self._outputs: StepOutputs | None = None
        self.seconds = time.perf_counter() - began if self._done is None else 0.0

    def outputs(self) -> StepOutputs:
        if self._outputs is None:
            host, x, shape = self._host, self._x, self._shape
            if host.launch != self._number:
                raise RuntimeError(
                    f"step {self._number}'s outputs were asked for after launch {host.launch} reused its buffers"
                )
            if self._done is not None:
                self._done.synchronize()  # the step's only host sync
                self.seconds = self._started.elapsed_time(self._done) / 1e3
            s, n = len(x.samples_S), x.num_decode
            routes = host.routes_TLK.numpy()
            if shape.decode != n:
                routes = np.concatenate((routes[:n], routes[shape.decode : shape.decode + x.num_tokens - n]))
            self._outputs = StepOutputs(
                host.tokens_S[:s].numpy(), host.logprobs_S[:s].numpy(), routes[: x.num_tokens]
            )
        return self._outputs


@dataclass
class _HostSet:
    """One set of the host's staging buffers (pinned on CUDA) and the events of the last step that used it."""

    tokens_T4: torch.Tensor
    tiles_2Q: torch.Tensor
    feed_2D: torch.Tensor  # decoding rows fed from the previous step's samples | their sample indices
    sample_ints_S3: torch.Tensor
    sample_floats_S2: torch.Tensor
    routes_TLK: torch.Tensor
    tokens_S: torch.Tensor
    logprobs_S: torch.Tensor
    launch: int = -1  # the launch that last used the set
    # CUDA: recorded around each step that uses the set, read before the set's next use (LaunchedStep)
    started: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None


@dataclass(frozen=True)
class _Shape:
    """A padded step: decode rows, prefill tokens, prefill tiles, sampled rows, filtering."""

    decode: int
    prefill: int
    tiles: int
    samples: int
    filtered: bool

    @property
    def tokens(self) -> int:
        return self.decode + self.prefill


class StepRunner:
    def __init__(
        self,
        model: MoeDecoder,
        use_cuda_graphs: bool,
        *,
        max_step_tokens: int,
        max_seqs: int,
        graph_max_tokens: int,
    ) -> None:
        self.model = model
        spec, device = model.spec, model.weights.embed_VH.device
        self.device = device
        self.max_seqs = max_seqs
        self.tile = prefill_tile_tokens(spec.num_heads, spec.num_kv_heads)
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        )
        self.graph_max_tokens = graph_max_tokens
        self._batch_sizes = batch_buckets(max_seqs)
        # A padded step may exceed max_step_tokens by the padding of its decode rows and prefill tokens.
        max_tokens = max_step_tokens + max_seqs + max(max_step_tokens, graph_max_tokens)
        max_tiles = -(-max_tokens // self.tile) + max_seqs
        route_dtype = torch.int16 if spec.num_experts <= 2**15 else torch.int32
        shapes = dict(
            tokens_T4=((max_tokens, 4), torch.long),
            # tile starts | tile lengths as rows, so each is a contiguous vector (the kernels index them so)
            tiles_2Q=((2, max_tiles), torch.int32),
            feed_2D=((2, max_seqs), torch.long),
            # samples: flat index, seed bits, top_k | temperature, top_p
            sample_ints_S3=((max_seqs, 3), torch.long),
            sample_floats_S2=((max_seqs, 2), torch.float32),
            routes_TLK=((max_tokens, spec.num_moe_layers, spec.top_k), route_dtype),
            tokens_S=(max_seqs, torch.long),
            logprobs_S=(max_seqs, torch.float32),
        )
        for name, (shape, dtype) in shapes.items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
        pin = device.type == "cuda"
        self._hosts = [
            _HostSet(**{n: torch.zeros(sh, dtype=dt, pin_memory=pin) for n, (sh, dt) in shapes.items()})
            for _ in range(2)
        ]
        for host in self._hosts if pin else ():
            host.started, host.done = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._num_launches = 0
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self.capture_error: str | None = None
        self._graphs: dict[_Shape, torch.cuda.CUDAGraph] = {}
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, x: StepInputs) -> StepOutputs:
        """One step, waited for (see `launch`)."""
        return self.launch(x).outputs()

    def launch(self, x: StepInputs) -> LaunchedStep:
        """Queue one step: stage the inputs, run (graph replay or eager), queue the outputs' copies to the host.
        On CUDA a step runs at its padded bucket shape with or without graphs, so both give the same bits."""
        began = time.perf_counter()
        starts, lengths = prefill_tiles(x.pieces, self.tile)
        shape = self._bucket_shape(x, len(starts)) if self.device.type == "cuda" else None
        shape = shape or self._exact_shape(x, len(starts))
        host = self._hosts[self._num_launches % 2]
        host.launch = self._num_launches
        self._num_launches += 1
        if host.done is not None:
            host.done.synchronize()  # the launch before last, which staged from these buffers, has run
            host.started.record()
        self._stage(x, shape, starts, lengths, host)
        graph = None
        if self.use_cuda_graphs and shape.tokens <= self.graph_max_tokens:
            graph = self._graphs.pop(shape, None) or self._capture(shape)
        if graph is None:
            self._step(shape)
        else:
            self._graphs[shape] = graph  # most recently used last
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            graph.replay()
        return self._fetch(x, shape, host, began)

    def _exact_shape(self, x: StepInputs, num_tiles: int) -> _Shape:
        return _Shape(x.num_decode, x.num_tokens - x.num_decode, num_tiles, len(x.samples_S), x.filtered)

    def _bucket_shape(self, x: StepInputs, num_tiles: int) -> _Shape | None:
        """The bucket of a step, or None when it is too large for a graph (it then runs at its exact shape)."""
        exact = self._exact_shape(x, num_tiles)
        decode = next(b for b in self._batch_sizes if b >= exact.decode) if exact.decode else 0
        prefill = _pow2_at_least(exact.prefill, 16) if exact.prefill else 0
        if decode + prefill > self.graph_max_tokens:
            return None
        tiles = _pow2_at_least(exact.tiles, 1) if exact.tiles else 0
        ends = exact.samples - exact.decode
        samples = decode + (_pow2_at_least(ends, 1) if ends else 0)
        return _Shape(decode, prefill, tiles, min(samples, self.max_seqs), exact.filtered)

    def _stage(
        self, x: StepInputs, shape: _Shape, starts: list[int], lengths: list[int], host: _HostSet
    ) -> None:
        """Copy the step into the static buffers at the padded layout: decode rows [0, n) then padding rows to
        shape.decode, prefill tokens from shape.decode; padding tokens sit in the padding row at position 0.
        Then the fed rows take their tokens from the previous step's samples, still in `tokens_S`."""
        n, t = x.num_decode, shape.tokens
        shift = shape.decode - n
        tok = host.tokens_T4[:t].numpy()
        tok[:] = 0
        tok[:, SEQ] = self.model.cache.table.padding_row
        tok[:n] = x.tokens_T4[:n]
        tok[shape.decode : shape.decode + x.num_tokens - n] = x.tokens_T4[n:]
        tiles = host.tiles_2Q[:, : shape.tiles].numpy()
        tiles[:] = 0
        tiles[0, : len(starts)] = np.asarray(starts, dtype=np.int64) + shift
        tiles[1, : len(starts)] = lengths
        s = len(x.samples_S)
        ints, floats = (
            host.sample_ints_S3[: shape.samples].numpy(),
            host.sample_floats_S2[: shape.samples].numpy(),
        )
        ints[:] = 0
        floats[:] = (0.0, 1.0)
        ints[:s, 0] = np.where(x.samples_S >= n, x.samples_S + shift, x.samples_S)
        ints[:s, 1], ints[:s, 2] = x.seeds_S.view(np.int64), x.top_k_S
        floats[:s, 0], floats[:s, 1] = x.temperature_S, x.top_p_S
        fed = np.flatnonzero(x.feed_D >= 0) if x.feed_D is not None else ()
        if len(fed):
            feed = host.feed_2D[:, : len(fed)].numpy()
            feed[0], feed[1] = fed, x.feed_D[fed]
        self.model.cache.sync_table()
        for dev, src, rows in (
            (self.tokens_T4, host.tokens_T4, t),
            (self.tiles_2Q.T, host.tiles_2Q.T, shape.tiles),
            (self.feed_2D.T, host.feed_2D.T, len(fed)),
            (self.sample_ints_S3, host.sample_ints_S3, shape.samples),
            (self.sample_floats_S2, host.sample_floats_S2, shape.samples),
        ):
            dev[:rows].copy_(src[:rows], non_blocking=True)
        if len(fed):
            rows_D, index_D = self.feed_2D[:, : len(fed)]
            self.tokens_T4[rows_D, TOKEN] = self.tokens_S[index_D]

    def _fetch(self, x: StepInputs, shape: _Shape, host: _HostSet, began: float) -> LaunchedStep:
        """Queue the copies of the step's outputs to the host set's buffers, then its done event."""
        s, t = len(x.samples_S), shape.tokens
        for dst, dev, rows in (
            (host.tokens_S, self.tokens_S, s),
            (host.logprobs_S, self.logprobs_S, s),
            (host.routes_TLK, self.routes_TLK, t),
        ):
            dst[:rows].copy_(dev[:rows], non_blocking=True)
        if host.done is not None:
            host.done.record()
        return LaunchedStep(x, shape, host, host.launch, began)

    def _step(self, shape: _Shape) -> None:
        """The captured work: forward of the step's tokens, then sampling into tokens_S / logprobs_S."""
        t, s = shape.tokens, shape.samples
        tok = self.tokens_T4[:t]
        tiles = self.tiles_2Q[:, : shape.tiles]
        index_S, seeds_S, top_k_S = self.sample_ints_S3[:s].unbind(1)
        temperature_S, top_p_S = self.sample_floats_S2[:s].unbind(1)
        splits = (
            decode_splits(shape.decode, self.model.spec.num_kv_heads, self.num_sms) if shape.decode else 1
        )
        step = step_batch(tok, tiles, shape.decode, splits, index_S)
        logits_SV, routes_TLK = self.model.forward(step)
        self.routes_TLK[:t].copy_(routes_TLK)
        sampled_S, logprobs_S = sample_at(
            logits_SV, tok[:, POSITION][index_S], seeds_S, temperature_S, top_k_S, top_p_S, shape.filtered
        )
        self.tokens_S[:s].copy_(sampled_S)
        self.logprobs_S[:s].copy_(logprobs_S)

    def _capture(self, shape: _Shape) -> torch.cuda.CUDAGraph | None:
        # The warm-up run executes the real step on the real inputs (the KV writes are the ones the replay repeats).
        # Every graph is captured on torch's default capture stream, so all of them embed that stream's cuBLAS
        # workspace: safe because they replay one at a time on one stream (graphs replayed concurrently must be
        # captured on streams of their own, see bench/rollout_expertplex.py's graphed).
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._step(shape)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(shape)
        except RuntimeError as err:  # e.g. an op that cannot be captured in this torch build
            self.capture_error = f"{type(err).__name__}: {err}"
            log.warning(
                "CUDA graph capture failed (%s); running steps eagerly from now on", self.capture_error
            )
            self.use_cuda_graphs = False
            torch.cuda.synchronize(self.device)
            return None
        return graph


def step_batch(
    tok_T4: torch.Tensor, tiles_2Q: torch.Tensor, num_decode: int, num_splits: int, sample_S: torch.Tensor
) -> StepBatch:
    """The model's view of a step from its device tensors: flat tokens (TOKEN, POSITION, SEQ, CACHE_ROW
    columns, decode rows first), prefill tiles (starts | lengths) and the flat indices of the sampled tokens."""
    attention = AttentionBatch(
        seq_T=tok_T4[:, SEQ].to(torch.int32),
        pos_T=tok_T4[:, POSITION].to(torch.int32),
        num_decode=num_decode,
        tile_start_Q=tiles_2Q[0],
        tile_len_Q=tiles_2Q[1],
        num_splits=num_splits,
    )
    return StepBatch(tok_T4[:, TOKEN], tok_T4[:, POSITION], tok_T4[:, CACHE_ROW], attention, sample_S)


def sample_at(
    logits_SV: torch.Tensor,
    positions_S: torch.Tensor,
    seeds_S: torch.Tensor,
    temperature_S: torch.Tensor,
    top_k_S: torch.Tensor,
    top_p_S: torch.Tensor,
    filtered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and their log-probs sampled from logits of tokens at positions_S: the draw is the counter-based
    uniform of (seed, position + 1), the position of the sampled token, so a recomputed row draws the same."""
    uniform_S = counter_uniform_torch(seeds_S, positions_S + 1)
    return sample(logits_SV, temperature_S, top_k_S, top_p_S, uniform_S, filtered)


def batch_buckets(max_rows: int) -> list[int]:
    """Decode row counts a step is padded to (each one a CUDA graph): fine at small batch, every 32 above 64."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, *range(96, max_rows, 32), max_rows]
    return sorted({s for s in sizes if s <= max_rows})


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))
