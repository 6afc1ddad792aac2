"""Runs whole decode steps (model forward + sampling), captured as CUDA graphs on GPU (one graph per (batch rows,
attended length, top-k/top-p filtering) bucket).

A decode step of a 48-layer MoE model is ~2000 small kernels; launching them from Python costs more than the
weights take to stream at small batch, so on CUDA each bucket is captured once, lazily, and replayed. The graph
holds the sampler too (temperature, top-k/top-p, the counter-based uniform of (seed, position + 1) computed on
the device, the sampled token's log-prob), so a step is: one host-to-device copy of the per-row inputs from
pinned memory, the replay, device-to-host copies of tokens, log-probs and routed experts into pinned memory,
and ONE synchronisation. Inputs live in static device buffers that every graph reads through slices; logits,
tokens, log-probs and routing land in static buffers too (many graphs cost no extra output memory). Weights are
updated in place by `load_weights`, so graphs stay valid. On CPU (or with graphs off, or if a capture fails)
the same step function runs eagerly and gives the same outputs.

Legend: S slots (max rows), B rows of a step, L MoE layers, K top-k, V vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from rollout.model import MoeDecoder, flash_decode_works
from rollout.sampling import counter_uniform_torch, sample

log = logging.getLogger(__name__)

MAX_GRAPHS = 256  # least recently used graphs beyond this are dropped (each holds ~2000 kernel nodes)


@dataclass(frozen=True)
class DecodeInputs:
    """Per-row inputs of one decode step (numpy, row b = cache slot b): the token to feed and its position, and
    the row's sampling parameters; the sampled token's random counter is position + 1."""

    tokens_B: np.ndarray  # int64
    positions_B: np.ndarray  # int64
    seeds_B: np.ndarray  # uint64
    top_k_B: np.ndarray  # int64, 0 = off
    temperature_B: np.ndarray  # float32, 0 = greedy
    top_p_B: np.ndarray  # float32

    @property
    def num_rows(self) -> int:
        return self.tokens_B.shape[0]

    @property
    def filtered(self) -> bool:
        """Whether any row needs the top-k/top-p sort (a separate graph: the sort is the sampler's costliest op)."""
        return bool(((self.top_p_B < 1) | (self.top_k_B > 0)).any())


@dataclass(frozen=True)
class DecodeOutputs:
    """Host (numpy) views of one step's results, valid until the next `run`."""

    tokens_B: np.ndarray  # int64
    logprobs_B: np.ndarray  # float32
    routes_BLK: np.ndarray  # int16 (int32 beyond 32767 experts)


class DecodeRunner:
    def __init__(self, model: MoeDecoder, use_cuda_graphs: bool) -> None:
        self.model = model
        spec, device = model.spec, model.weights.embed_VH.device
        num_slots = model.cache.num_slots
        self.device = device
        model.flash_decode = flash_decode_works(model)
        pin = device.type == "cuda"
        # Columns of the int64 and float32 inputs: token, position, seed bits, top_k | temperature, top_p (row
        # major, so the first B rows are one contiguous block: one copy each).
        self.ints_S4 = torch.zeros(num_slots, 4, dtype=torch.long, device=device)
        self.floats_S2 = torch.zeros(num_slots, 2, dtype=torch.float32, device=device)
        self._host_ints_S4 = torch.zeros(num_slots, 4, dtype=torch.long, pin_memory=pin)
        self._host_floats_S2 = torch.zeros(num_slots, 2, dtype=torch.float32, pin_memory=pin)
        route_dtype = torch.int16 if spec.num_experts <= 2**15 else torch.int32
        route_shape = (num_slots, spec.num_moe_layers, spec.top_k)
        self.routes_SLK = torch.zeros(route_shape, dtype=route_dtype, device=device)
        self.logits_SV = torch.zeros(
            num_slots, spec.vocab_size, dtype=model.weights.embed_VH.dtype, device=device
        )
        self.tokens_S = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.logprobs_S = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self._host_routes_SLK = torch.zeros(route_shape, dtype=route_dtype, pin_memory=pin)
        self._host_tokens_S = torch.zeros(num_slots, dtype=torch.long, pin_memory=pin)
        self._host_logprobs_S = torch.zeros(num_slots, dtype=torch.float32, pin_memory=pin)
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self.capture_error: str | None = None
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, inputs: DecodeInputs, num_keys: int) -> DecodeOutputs:
        """One decode step over rows [0, B) attending to the first `num_keys` positions of their slots."""
        b, filtered = inputs.num_rows, inputs.filtered
        self._stage(inputs)
        graph = None
        if self.use_cuda_graphs:
            key = (b, num_keys, filtered)
            graph = self._graphs.pop(key, None) or self._capture(b, num_keys, filtered)
            if graph is not None:
                self._graphs[key] = graph  # most recently used last
                if len(self._graphs) > MAX_GRAPHS:
                    self._graphs.pop(next(iter(self._graphs)))
        if graph is not None:
            graph.replay()
        else:
            self._step(b, num_keys, filtered)
        return self._fetch(b)

    def _stage(self, x: DecodeInputs) -> None:
        b = x.num_rows
        ints, floats = self._host_ints_S4[:b].numpy(), self._host_floats_S2[:b].numpy()
        ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3] = (
            x.tokens_B,
            x.positions_B,
            x.seeds_B.view(np.int64),
            x.top_k_B,
        )
        floats[:, 0], floats[:, 1] = x.temperature_B, x.top_p_B
        self.ints_S4[:b].copy_(self._host_ints_S4[:b], non_blocking=True)
        self.floats_S2[:b].copy_(self._host_floats_S2[:b], non_blocking=True)

    def _fetch(self, b: int) -> DecodeOutputs:
        pairs = (
            (self._host_tokens_S, self.tokens_S),
            (self._host_logprobs_S, self.logprobs_S),
            (self._host_routes_SLK, self.routes_SLK),
        )
        for host, dev in pairs:
            host[:b].copy_(dev[:b], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the step's only host sync
        return DecodeOutputs(*(host[:b].numpy() for host, _ in pairs))

    def _step(self, b: int, num_keys: int, filtered: bool) -> None:
        """The captured work: forward of rows [0, b), then sampling into tokens_S / logprobs_S."""
        tokens_B, positions_B, seeds_B, top_k_B = self.ints_S4[:b].unbind(1)
        temperature_B, top_p_B = self.floats_S2[:b].unbind(1)
        logits_BV = self.logits_SV[:b]
        self.model.decode(tokens_B, positions_B, num_keys, self.routes_SLK[:b], logits_BV)
        uniform_B = counter_uniform_torch(seeds_B, positions_B + 1)
        sampled_B, logprobs_B = sample(logits_BV, temperature_B, top_k_B, top_p_B, uniform_B, filtered)
        self.tokens_S[:b].copy_(sampled_B)
        self.logprobs_S[:b].copy_(logprobs_B)

    def _capture(self, b: int, num_keys: int, filtered: bool) -> torch.cuda.CUDAGraph | None:
        # Warm-up runs execute the real step on the real inputs (the KV writes are the ones the replay repeats).
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._step(b, num_keys, filtered)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(b, num_keys, filtered)
        except RuntimeError as err:  # e.g. an op that cannot be captured in this torch build
            self.capture_error = f"{type(err).__name__}: {err}"
            log.warning("CUDA graph capture failed (%s); decoding eagerly from now on", self.capture_error)
            self.use_cuda_graphs = False
            torch.cuda.synchronize(self.device)
            return None
        return graph
