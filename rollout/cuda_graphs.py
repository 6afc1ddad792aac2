"""Runs decode steps, captured as CUDA graphs on GPU (one graph per (batch rows, attended length) bucket).

A decode step of a 48-layer MoE model is ~2000 small kernels; launching them from Python costs more than the
weights take to stream at small batch, so on CUDA each (B, S) bucket is captured once, lazily, and replayed.
Inputs (token ids, positions) live in static device buffers that every graph reads through slices; logits and
routing ids land in static buffers too (so many graphs cost no extra output memory) and are consumed (sampled,
copied to the host) before the next replay. Weights are updated in place by `load_weights`, so graphs stay valid.
On CPU (or with graphs off, or if a capture fails) the same function runs eagerly.

Legend: S slots (max rows), B rows of a step, L MoE layers, K top-k, V vocab.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from rollout.model import MoeDecoder

log = logging.getLogger(__name__)

MAX_GRAPHS = 256  # least recently used graphs beyond this are dropped (each holds ~2000 kernel nodes)


class DecodeRunner:
    def __init__(self, model: MoeDecoder, use_cuda_graphs: bool) -> None:
        self.model = model
        spec, device = model.spec, model.weights.embed_VH.device
        num_slots = model.cache.num_slots
        self.device = device
        self.tokens_S = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.positions_S = torch.zeros(num_slots, dtype=torch.long, device=device)
        route_dtype = torch.int16 if spec.num_experts <= 2**15 else torch.int32
        self.routes_SLK = torch.zeros(
            num_slots, spec.num_moe_layers, spec.top_k, dtype=route_dtype, device=device
        )
        dtype = model.weights.embed_VH.dtype
        self.logits_SV = torch.zeros(num_slots, spec.vocab_size, dtype=dtype, device=device)
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self.capture_error: str | None = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        pin = device.type == "cuda"
        self._host_inputs_2S = torch.zeros(2, num_slots, dtype=torch.long, pin_memory=pin)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(
        self, tokens: np.ndarray, positions: np.ndarray, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens [B] at positions [B] (row b = cache slot b); returns (logits [B, V] in the model dtype,
        routes [B, L, K]): views of static buffers, valid until the next call."""
        b = tokens.shape[0]
        staged = self._host_inputs_2S[:, :b]
        staged[0].copy_(torch.from_numpy(tokens))
        staged[1].copy_(torch.from_numpy(positions))
        self.tokens_S[:b].copy_(staged[0], non_blocking=True)
        self.positions_S[:b].copy_(staged[1], non_blocking=True)
        graph = None
        if self.use_cuda_graphs:
            graph = self._graphs.pop((b, num_keys), None) or self._capture(b, num_keys)
            if graph is not None:
                self._graphs[(b, num_keys)] = graph  # most recently used last
                if len(self._graphs) > MAX_GRAPHS:
                    self._graphs.pop(next(iter(self._graphs)))
        if graph is not None:
            graph.replay()
        else:
            self._eager(b, num_keys)
        return self.logits_SV[:b], self.routes_SLK[:b]

    def _eager(self, b: int, num_keys: int) -> None:
        self.model.decode(
            self.tokens_S[:b], self.positions_S[:b], num_keys, self.routes_SLK[:b], self.logits_SV[:b]
        )

    def _capture(self, b: int, num_keys: int) -> torch.cuda.CUDAGraph | None:
        # Warm-up runs execute the real step on the real inputs (the KV writes are the ones the replay repeats).
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._eager(b, num_keys)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._eager(b, num_keys)
        except RuntimeError as err:  # e.g. an op that cannot be captured in this torch build
            self.capture_error = f"{type(err).__name__}: {err}"
            log.warning("CUDA graph capture failed (%s); decoding eagerly from now on", self.capture_error)
            self.use_cuda_graphs = False
            torch.cuda.synchronize(self.device)
            return None
        return graph
