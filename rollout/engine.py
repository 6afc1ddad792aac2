"""RolloutEngine: continuous-batching generation for Qwen3-MoE / Mixtral with routing capture and T-PPO windows.

    engine = RolloutEngine.from_pretrained(path, device="cuda", dtype="bfloat16")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=64, temperature=1.0, seed=7))
    outs[0].token_ids, outs[0].logprobs, outs[0].finish_reason, outs[0].routed_experts  # [P + G, L, K]
    engine.load_weights(trainer_named_tensors)   # in place; later generate calls prefill again

Scheduling: every request gets a cache slot when one is free (lowest first) and is prefilled at once (prompts
longer than `max_prefill_tokens` are prefilled in chunks); then all slots decode one token per step; a
request that finishes frees its slot for the next waiting one (continuous batching). When requests thin out,
the survivors are moved to low slots so the step runs a smaller batch bucket.

Routing capture: for every prompt token and every generated token, the top-k expert ids the engine itself
used, per MoE layer. The last generated token has no successor, but the trainer's forward still routes it,
so a finished request is fed once more (its row rides along in the next step; the output is discarded) to
record that token's experts.

T-PPO windows: a continuation is simply a new request whose prompt is prompt + earlier windows' tokens, with a
fresh max_new_tokens; the KV cache never outlives a generate call, so after `load_weights` every prefix is
prefilled again with the new weights (no stale KV). With the same seed, a resumed request continues the same
random stream (the sampler's counter is the token's position in the sequence).
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rollout.config import RolloutConfig
from rollout.cuda_graphs import DecodeInputs, DecodeRunner
from rollout.kv_cache import CachePlan, KVCache, available_bytes, plan_cache
from rollout.model import MoeDecoder, PrefillPiece
from rollout.model_spec import MoeModelSpec
from rollout.sampling import SamplingParams, counter_uniform_torch, sample
from rollout.weights import WeightMap, allocate, init_random, load_checkpoint

FINISH_REASONS = ("eos", "stop", "length")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerationOutput:
    """One request's result. `routed_experts[t, l, k]` is the k-th expert (in the router's top-k order) of token t
    (prompt tokens first, then generated ones) in MoE layer l; dtype uint8 for <= 256 experts, else int16."""

    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: np.ndarray
    finish_reason: str
    routed_experts: np.ndarray
    seed: int

    @property
    def finished(self) -> bool:
        """True when the model ended the response (EOS or a stop token), False when cut by max_new_tokens."""
        return self.finish_reason != "length"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.token_ids)


@dataclass
class GenerateStats:
    """Counters of the last `generate` call (for benchmarks and logs)."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_decode_steps: int = 0
    num_decode_rows: int = 0
    cuda_graphs: bool = False
    num_graphs: int = 0


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    row: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    route_chunks: list[np.ndarray] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)


class RolloutEngine:
    """The generation engine of one device (see the module docstring)."""

    def __init__(
        self, spec: MoeModelSpec, weights, device: torch.device, config: RolloutConfig | None = None
    ) -> None:
        self.config = config or RolloutConfig()
        self.spec = spec
        self.device = device
        self.dtype = weights.embed_VH.dtype
        self.weights = weights
        self._weight_map = WeightMap(spec, weights)
        self.cache_plan = self._plan_cache()
        self.cache = KVCache(spec, self.cache_plan, device, self.dtype)
        self.model = MoeDecoder(spec, weights, self.cache)
        self.runner = DecodeRunner(self.model, self.config.cuda_graphs)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.route_dtype = np.uint8 if spec.num_experts <= 256 else np.int16
        self.last_stats = GenerateStats()
        self._batch_sizes = _batch_buckets(self.cache.num_slots)

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        config: RolloutConfig | None = None,
    ) -> RolloutEngine:
        """Load a Hugging Face safetensors checkpoint folder (config.json + *.safetensors)."""
        spec = MoeModelSpec.from_pretrained(path)
        device = torch.device(device)
        weights = allocate(spec, device, _resolve_dtype(dtype, spec, config))
        load_checkpoint(WeightMap(spec, weights), path)
        return cls(spec, weights, device, config)

    @classmethod
    def from_config(
        cls,
        hf_config: dict,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        config: RolloutConfig | None = None,
        seed: int = 0,
        init_std: float = 0.02,
    ) -> RolloutEngine:
        """Random weights for a Hugging Face config dict (benchmarks; load_weights fills real ones later)."""
        spec = MoeModelSpec.from_hf_config(hf_config)
        device = torch.device(device)
        weights = allocate(spec, device, _resolve_dtype(dtype, spec, config))
        init_random(weights, std=init_std, seed=seed)
        return cls(spec, weights, device, config)

    def _plan_cache(self) -> CachePlan:
        c = self.config
        if c.max_model_len > self.spec.max_position_embeddings:
            raise ValueError(
                f"max_model_len={c.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.spec.max_position_embeddings}"
            )
        per_token = self.spec.kv_bytes_per_token(torch.empty((), dtype=self.dtype).element_size())
        if c.kv_cache_tokens > 0:
            budget, source = c.kv_cache_tokens * per_token, f"kv_cache_tokens={c.kv_cache_tokens}"
        else:
            free = available_bytes(self.device)
            budget = int(c.kv_cache_fraction * free)
            source = (
                f"kv_cache_fraction={c.kv_cache_fraction} of {free / 2**30:.2f} GiB free on {self.device}"
            )
        return plan_cache(
            self.spec,
            torch.empty((), dtype=self.dtype).element_size(),
            max_model_len=c.max_model_len,
            max_batch_size=c.max_batch_size,
            budget_bytes=budget,
            source=source,
        )

    @property
    def num_slots(self) -> int:
        return self.cache.num_slots

    @property
    def max_model_len(self) -> int:
        return self.cache.max_model_len

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Decoder-layer index of each MoE layer: `routed_experts[:, l]` belongs to layer `moe_layers[l]`."""
        return tuple(i for i, is_moe in enumerate(self.spec.moe_layers) if is_moe)

    # ------------------------------------------------------------------------------------------ weights
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (hf_name, tensor) pairs into the engine's weights in place (any subset: buckets); returns the
        number of hub tensors written (fused expert tensors count once per expert). Unknown names raise."""
        return len(self._weight_map.load(named_tensors))

    # ------------------------------------------------------------------------------------------ generation
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (prompt = prompt + earlier windows for a T-PPO continuation)."""
        requests = self._make_requests(prompt_token_ids, params)
        self.last_stats = stats = GenerateStats(
            num_requests=len(requests), num_prompt_tokens=sum(len(r.prompt) for r in requests)
        )
        rows = _Rows(self.num_slots)
        waiting, done = deque(requests), []
        with torch.inference_mode():
            while waiting or rows.num_used:
                free = rows.free()
                if waiting and free:
                    admitted = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                    for req, row in zip(admitted, free):
                        rows.put(row, req)
                    t0 = time.perf_counter()
                    self._prefill(admitted, rows)
                    stats.prefill_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                self._compact(rows)
                done += self._decode_step(rows)
                stats.decode_s += time.perf_counter() - t0
        stats.num_generated_tokens = sum(len(r.tokens) for r in requests)
        stats.cuda_graphs, stats.num_graphs = self.runner.use_cuda_graphs, self.runner.num_graphs
        return [self._output(r) for r in sorted(done, key=lambda r: r.index)]

    def _make_requests(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[_Request]:
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
            raise ValueError("prompt_token_ids: expected a list of token-id lists")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"params: got {len(params)} SamplingParams for {len(prompts)} prompts; expected one "
                "SamplingParams or one per prompt"
            )
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            prompt = self._check_prompt(i, prompt, p)
            seed = p.seed if p.seed is not None else secrets.randbits(63)
            requests.append(_Request(i, prompt, p, seed, frozenset(p.stop_token_ids)))
        return requests

    def _check_prompt(self, i: int, prompt: Sequence[int], p: SamplingParams) -> list[int]:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"params[{i}]: expected a SamplingParams, got {type(p).__name__}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt_token_ids[{i}] is empty; expected at least one token")
        bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids[{i}] holds ids outside [0, {self.spec.vocab_size}): {bad[:5]}"
            )
        if len(prompt) + p.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_token_ids[{i}]: {len(prompt)} prompt tokens + max_new_tokens="
                f"{p.max_new_tokens} exceed max_model_len={self.max_model_len}"
            )
        return prompt

    # ------------------------------------------------------------------------------------------ prefill
    def _prefill(self, requests: list[_Request], rows: _Rows) -> None:
        for chunk in _pack_pieces(requests, self.config.max_prefill_tokens):
            pieces = [PrefillPiece(r.row, start, n) for r, start, n in chunk]
            tokens = [t for r, start, n in chunk for t in r.prompt[start : start + n]]
            ends, last_index, offset = [], [], 0
            for r, start, n in chunk:
                offset += n
                if start + n == len(r.prompt):
                    ends.append(r)
                    last_index.append(offset - 1)
            tokens_T = torch.tensor(tokens, dtype=torch.long, device=self.device)
            logits_RV, routes_TLK = self.model.prefill(tokens_T, pieces, last_index)
            if ends:
                idx = [r.row for r in ends]
                counters = np.array([len(r.prompt) for r in ends], dtype=np.int64)
                tokens_R, logprobs_R = self._sample(logits_RV, rows, idx, counters)
            routes = routes_TLK.cpu().numpy().astype(self.route_dtype)
            offset = 0
            for r, _, n in chunk:
                r.route_chunks.append(routes[offset : offset + n])
                offset += n
            if ends:
                for r, tok, lp in zip(ends, tokens_R.tolist(), logprobs_R.tolist()):
                    self._append(r, tok, lp, rows)

    # ------------------------------------------------------------------------------------------ decode
    def _decode_step(self, rows: _Rows) -> list[_Request]:
        used = rows.used()
        b = self._bucket(used[-1] + 1)
        num_keys = key_bucket(int(rows.position[:b].max()) + 1, self.max_model_len)
        out = self.runner.run(rows.inputs(b), num_keys)
        tokens, logprobs = out.tokens_B.tolist(), out.logprobs_B.tolist()
        routes = out.routes_BLK.astype(self.route_dtype)
        stats = self.last_stats
        stats.num_decode_steps += 1
        stats.num_decode_rows += b
        finished = []
        for i in used:
            r = rows.req[i]
            r.route_chunks.append(routes[i : i + 1])
            if r.finish_reason is not None:  # this step only recorded its last token's experts
                rows.clear(i)
                finished.append(r)
            else:
                self._append(r, tokens[i], logprobs[i], rows)
        return finished

    def _sample(
        self, logits_BV: torch.Tensor, rows: _Rows, index, counters: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per logits row, with the sampling parameters of rows[index] and the given counters."""
        temperature, top_p, top_k = rows.temperature[index], rows.top_p[index], rows.top_k[index]
        filtered = bool(((top_p < 1) | (top_k > 0)).any())
        dev = self.device
        uniform = counter_uniform_torch(
            torch.from_numpy(rows.seed[index].view(np.int64)).to(dev), torch.from_numpy(counters).to(dev)
        )
        return sample(
            logits_BV,
            torch.from_numpy(temperature).to(dev),
            torch.from_numpy(top_k).to(dev),
            torch.from_numpy(top_p).to(dev),
            uniform,
            filtered,
        )

    def _append(self, r: _Request, token: int, logprob: float, rows: _Rows) -> None:
        r.tokens.append(token)
        r.logprobs.append(logprob)
        rows.token[r.row], rows.position[r.row] = token, r.length - 1
        if token in self.eos_token_ids and not r.params.ignore_eos:
            r.finish_reason = "eos"
        elif token in r.stop_ids:
            r.finish_reason = "stop"
        elif len(r.tokens) >= r.params.max_new_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            rows.temperature[r.row] = 0.0  # its last step only records routing: sample it greedily

    def _bucket(self, rows_needed: int) -> int:
        return next(b for b in self._batch_sizes if b >= rows_needed)

    def _compact(self, rows: _Rows) -> None:
        """Move requests from high rows into free low rows when that lets the step use a smaller batch bucket."""
        used = rows.used()
        if not used:
            return
        target = self._bucket(len(used))
        if self._bucket(used[-1] + 1) <= target:
            return
        free_low = [i for i in range(target) if rows.req[i] is None]
        for src in reversed([i for i in used if i >= target]):
            dst = free_low.pop(0)
            self.cache.move(src, dst, rows.req[src].length)
            rows.move(src, dst)

    def _output(self, r: _Request) -> GenerationOutput:
        routes = np.concatenate(r.route_chunks, axis=0)
        assert routes.shape[0] == r.length, (routes.shape, r.length)
        return GenerationOutput(
            index=r.index,
            prompt_token_ids=r.prompt,
            token_ids=r.tokens,
            logprobs=np.asarray(r.logprobs, dtype=np.float32),
            finish_reason=r.finish_reason,
            routed_experts=routes,
            seed=r.seed,
        )


class _Rows:
    """Decode rows (= cache slots): the request in each and, as arrays, what a step needs from it (the token to
    feed, its position, sampling parameters), so building a step's inputs needs no per-row Python work."""

    def __init__(self, n: int) -> None:
        self.req: list[_Request | None] = [None] * n
        self.token = np.zeros(n, dtype=np.int64)
        self.position = np.zeros(n, dtype=np.int64)
        self.temperature = np.zeros(n, dtype=np.float32)
        self.top_p = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)
        self.seed = np.zeros(n, dtype=np.uint64)
        self.num_used = 0

    def inputs(self, b: int) -> DecodeInputs:
        """The decode-step inputs of rows [0, b) (views: the runner copies them before the next change)."""
        return DecodeInputs(
            self.token[:b],
            self.position[:b],
            self.seed[:b],
            self.top_k[:b],
            self.temperature[:b],
            self.top_p[:b],
        )

    def used(self) -> list[int]:
        return [i for i, r in enumerate(self.req) if r is not None]

    def free(self) -> list[int]:
        return [i for i, r in enumerate(self.req) if r is None]

    def put(self, row: int, req: _Request) -> None:
        p = req.params
        self.req[row], req.row = req, row
        self.temperature[row], self.top_p[row], self.top_k[row] = p.temperature, p.top_p, p.top_k
        self.seed[row] = req.seed
        self.num_used += 1

    def clear(self, row: int) -> None:
        self.req[row] = None
        self.token[row] = self.position[row] = self.top_k[row] = self.seed[row] = 0
        self.temperature[row], self.top_p[row] = 0.0, 1.0
        self.num_used -= 1

    def move(self, src: int, dst: int) -> None:
        for a in (self.token, self.position, self.temperature, self.top_p, self.top_k, self.seed):
            a[dst] = a[src]
        self.req[dst], self.req[src].row = self.req[src], dst
        self.num_used += 1
        self.clear(src)


def _resolve_dtype(dtype: str | torch.dtype, spec: MoeModelSpec, config: RolloutConfig | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and config is not None and config.dtype != "auto":
        dtype = config.dtype
    if dtype == "auto":
        dtype = spec.torch_dtype if spec.torch_dtype in _DTYPES else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected 'auto', a torch dtype or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def key_bucket(num_keys: int, max_model_len: int) -> int:
    """Attended length of a decode step rounded up (one CUDA graph per bucket): to a multiple of 64, or of 1/16 of
    the next power of two for long sequences, so padding stays under ~12% and the number of buckets small."""
    step = max(64, (1 << max(0, (num_keys - 1).bit_length())) // 16)
    return min(max_model_len, -(-num_keys // step) * step)


def _batch_buckets(num_slots: int) -> list[int]:
    """Decode batch sizes a step is padded to (each one a CUDA graph): fine at small batch, every 32 above 64."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, *range(96, num_slots, 32), num_slots]
    return sorted({s for s in sizes if s <= num_slots})


def _pack_pieces(requests: list[_Request], budget: int) -> list[list[tuple[_Request, int, int]]]:
    """Cut prompts into (request, start, length) pieces packed into chunks of at most `budget` tokens, in order."""
    chunks, current, used = [], [], 0
    for r in requests:
        start = 0
        while start < len(r.prompt):
            n = min(len(r.prompt) - start, budget - used)
            current.append((r, start, n))
            start, used = start + n, used + n
            if used == budget:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks
