"""Runs decode steps, captured as CUDA graphs on GPU (one graph per (batch rows, attended length) bucket).

A decode step of a 48-layer MoE model is ~2000 small kernels; launching them from Python costs more than the
weights take to stream at small batch, so on CUDA each (B, S) bucket is captured once, lazily, and replayed.
Inputs (token ids, positions) live in static device buffers that every graph reads through slices; routing
ids land in a static buffer too; the logits tensor belongs to the graphs' shared memory pool and is consumed
(sampled) before the next replay. Weights are updated in place by `load_weights`, so graphs stay valid.
On CPU (or with graphs off, or if a capture fails) the same function runs eagerly.

Legend: S slots (max rows), B rows of a step, L MoE layers, K top-k, V vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from rollout.model import MoeDecoder

log = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    logits_BV: torch.Tensor


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
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self.capture_error: str | None = None
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = None
        pin = device.type == "cuda"
        self._host_inputs_2S = torch.zeros(2, num_slots, dtype=torch.long, pin_memory=pin)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(
        self, tokens: np.ndarray, positions: np.ndarray, num_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed tokens [B] at positions [B] (row b = cache slot b); returns (logits [B, V], routes [B, L, K])."""
        b = tokens.shape[0]
        staged = self._host_inputs_2S[:, :b]
        staged[0].copy_(torch.from_numpy(tokens))
        staged[1].copy_(torch.from_numpy(positions))
        self.tokens_S[:b].copy_(staged[0], non_blocking=True)
        self.positions_S[:b].copy_(staged[1], non_blocking=True)
        routes_BLK = self.routes_SLK[:b]
        if self.use_cuda_graphs:
            captured = self._graphs.get((b, num_keys)) or self._capture(b, num_keys)
            if captured is not None:
                captured.graph.replay()
                return captured.logits_BV, routes_BLK
        return self._eager(b, num_keys), routes_BLK

    def _eager(self, b: int, num_keys: int) -> torch.Tensor:
        return self.model.decode(self.tokens_S[:b], self.positions_S[:b], num_keys, self.routes_SLK[:b])

    def _capture(self, b: int, num_keys: int) -> _Captured | None:
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
                logits_BV = self._eager(b, num_keys)
        except RuntimeError as err:  # e.g. an op that cannot be captured in this torch build
            self.capture_error = f"{type(err).__name__}: {err}"
            log.warning("CUDA graph capture failed (%s); decoding eagerly from now on", self.capture_error)
            self.use_cuda_graphs = False
            torch.cuda.synchronize(self.device)
            return None
        captured = _Captured(graph, logits_BV)
        self._graphs[(b, num_keys)] = captured
        return captured
