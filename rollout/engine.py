"""RolloutEngine: continuous-batching generation for Qwen3-MoE / Mixtral with a paged KV cache, mixed
prefill + decode steps, preemption, routing capture and T-PPO windows.

    engine = RolloutEngine.from_pretrained(path, device="cuda", dtype="bfloat16")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=64, temperature=1.0, seed=7))
    outs[0].token_ids, outs[0].logprobs, outs[0].finish_reason, outs[0].routed_experts  # [P + G, L, K]
    engine.load_weights(trainer_named_tensors)   # in place; later generate calls prefill again

Scheduling (one step = one forward): every decoding sequence contributes its next token, and prompts being
prefilled fill the rest of the step's token budget (`max_step_tokens`) in chunks, so admitting a request never
stalls the decoding rows; with `rollout.max_decode_slowdown` a tile cost model fitted from the engine's own steps
(`rollout.step_cost`) shrinks that budget so a mixed step is predicted to take at most (1 + slowdown) x the
decode-only step. A request is admitted, oldest first, when a sequence row is free and the KV blocks its
prompt needs are free (beyond a small reserve for the rows that are decoding); a decoding sequence takes a new
block when it crosses a block boundary. When none is free, the youngest running sequence is preempted: its
blocks are freed and it goes back to the head of the queue with its tokens kept; when it is admitted again, its
prompt and tokens are prefilled again (recomputation) and decoding continues where it stopped. No request is
dropped, and since a token's random draw is keyed by (seed, position), no token changes.

Overlapped steps (`rollout.overlap_steps`): step t + 1 is scheduled and launched before step
t's outputs are read, so the host's work of a step (reading the outputs, scheduling, building the inputs) runs
while the device computes. What scheduling needs is known without the tokens: a sampled row's length grows by
one, a response that reaches max_new_tokens ends; step t + 1's decoding rows take their tokens from step t's
samples on the device. A response that ends by EOS or a stop token at step t is known one step late, which is
when it would stop anyway: step t + 1 feeds its last token to record that token's experts (below), and it retires
when step t's outputs are read. So overlapped and waited-for steps schedule the same steps and give the same
bits.

Routing capture: for every prompt token and every generated token, the top-k expert ids the engine itself
used, per MoE layer (recorded the first time a position is computed; recomputation after a preemption records
nothing new). The last generated token has no successor, but the trainer's forward still routes it, so a
finished request is fed once more (its row rides along in the next step; the sample is discarded) to record
that token's experts.

T-PPO windows: a continuation is simply a new request whose prompt is prompt + earlier windows' tokens, with a
fresh max_new_tokens; the KV cache never outlives a generate call, so after `load_weights` every prefix is
prefilled again with the new weights (no stale KV). With the same seed, a resumed request continues the same
random stream (the sampler's counter is the token's position in the sequence).
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rollout.config import RolloutConfig
from rollout.kv_cache import BlockTable, CachePlan, KVCache, available_bytes, plan_cache
from rollout.model import MoeDecoder
from rollout.model_spec import MoeModelSpec
from rollout.runner import CACHE_ROW, POSITION, SEQ, TOKEN, LaunchedStep, StepInputs, StepOutputs, StepRunner
from rollout.sampling import SamplingParams
from rollout.step_cost import PrefillBudget, StepShape, layer_expert_counts
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


@dataclass(frozen=True)
class StepTrace:
    """One engine step, recorded when `RolloutConfig.trace_steps` is on (benchmarks: the roofline per step)."""

    num_decode: int  # decoding rows
    num_prefill: int  # prefill tokens
    decode_keys: int  # keys the decoding rows attended to (sum of their positions + 1)
    kv_positions: int  # positions in the blocks held after the step
    experts_touched: int  # distinct experts the step's tokens used, summed over MoE layers
    seconds: float
    captured_graph: bool  # the step captured a CUDA graph, so `seconds` holds the capture too


@dataclass
class GenerateStats:
    """Counters of the last `generate` call (for the loop's metrics, benchmarks and logs). Steps that carry
    decoding rows count as decode steps (mixed ones also carry prefill chunks); prefill_s is the time of steps
    with no decoding row. A step's seconds are the host's around it when steps are waited for, the device's
    (CUDA events around its copies and its run) when they overlap (`RolloutEngine.overlapping`)."""

    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    num_decode_steps: int = 0
    num_decode_rows: int = 0
    num_mixed_steps: int = 0
    num_prefill_tokens: int = 0  # computed: recomputation after preemption included
    num_preemptions: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    mixed_s: float = 0.0
    max_seqs: int = 0
    kv_block_size: int = 0
    kv_blocks: int = 0  # usable blocks of the cache
    kv_blocks_peak: int = 0
    kv_block_steps: int = 0  # blocks held, summed over steps
    peak_running: int = 0
    cuda_graphs: bool = False
    num_graphs: int = 0
    num_captures: int = 0  # steps that captured a CUDA graph (a step shape seen for the first time)
    capture_s: float = 0.0  # their seconds (in prefill_s / decode_s too): the capture and its warm-up run
    generate_s: float = 0.0  # the whole call: the steps and the scheduling around them
    steps: list[StepTrace] = field(default_factory=list)

    @property
    def decode_rows_mean(self) -> float:
        return self.num_decode_rows / self.num_decode_steps if self.num_decode_steps else 0.0

    @property
    def kv_blocks_mean(self) -> float:
        return self.kv_block_steps / self.num_steps if self.num_steps else 0.0


@dataclass(eq=False, slots=True)
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    row: int = -1  # block-table row while running
    num_cached: int = 0  # positions whose K/V are in the cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # position i's experts are row route_rows[i] of the call's _RouteLog
    route_rows: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # prompt + tokens drawn, the last one possibly still on the device (a step in flight sampled it): read several
    # times a step per request, so kept, not recounted
    length: int = 0
    max_length: int = 0  # prompt + max_new_tokens
    # the launch that drew the request's last token, and the token's index among that launch's samples
    drawn_at: int = -1
    drawn_index: int = -1

    def __post_init__(self) -> None:
        self.length = len(self.prompt) + len(self.tokens)
        self.max_length = len(self.prompt) + self.params.max_new_tokens

    @property
    def target(self) -> int:
        """Positions to prefill before decoding: the prompt, or after a preemption every token but the last
        (which the next decode step feeds)."""
        return self.length - 1 if self.length > len(self.prompt) else len(self.prompt)

    @property
    def all_drawn(self) -> bool:
        """No token left to draw: the response ended, or max_new_tokens are drawn (read or still on the device)."""
        return self.finish_reason is not None or self.length >= self.max_length

    @property
    def decoding(self) -> bool:
        return self.row >= 0 and self.num_cached >= self.target

    def record(self, start: int, first_row: int, count: int) -> None:
        """Positions [start, start + count), computed this step, whose routes are log rows [first_row, ...): keeps
        those of positions not recorded yet (a recomputed prefix after a preemption records nothing new)."""
        skip = len(self.route_rows) - start
        if skip <= 0:
            self.route_rows.extend(range(first_row, first_row + count))
        elif skip < count:
            self.route_rows.extend(range(first_row + skip, first_row + count))


class _RouteLog:
    """Every step's routes of one generate call, kept whole: a request holds the rows of its positions and
    gathers them once, when it is output (a step's bookkeeping then copies no routes). A step's rows are
    reserved when it is launched and filled, in launch order, when its outputs arrive."""

    def __init__(self) -> None:
        self.steps: list[np.ndarray] = []
        self.num_rows = 0  # filled
        self.num_reserved = 0
        self._joined: np.ndarray | None = None

    def reserve(self, num_tokens: int) -> int:
        """The log row of a launched step's first token."""
        first = self.num_reserved
        self.num_reserved += num_tokens
        return first

    def fill(self, first: int, routes_TLK: np.ndarray) -> None:
        """Keep a step's routes (an array the caller does not reuse) at the rows reserved for it."""
        assert first == self.num_rows, "steps filled out of launch order"
        self.steps.append(routes_TLK)
        self.num_rows += len(routes_TLK)
        self._joined = None

    def gather(self, rows: list[int]) -> np.ndarray:
        if self._joined is None:
            self._joined = np.concatenate(self.steps)
            self.steps = [self._joined]  # the steps' own arrays can go
        return self._joined[np.asarray(rows, dtype=np.int64)]


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
        self.model = MoeDecoder(spec, weights, self.cache, self.config.expert_kernel)
        self.runner = self.new_runner(self.config.cuda_graphs)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.route_dtype = np.uint8 if spec.num_experts <= 256 else np.int16
        self.last_stats = GenerateStats()
        self.prefill_budget = self._prefill_budget()

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
        weights = allocate(spec, device, resolve_dtype(dtype, spec, config))
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
        weights = allocate(spec, device, resolve_dtype(dtype, spec, config))
        init_random(weights, std=init_std, seed=seed)
        return cls(spec, weights, device, config)

    def _plan_cache(self) -> CachePlan:
        c, spec = self.config, self.spec
        if c.max_model_len > spec.max_position_embeddings:
            raise ValueError(
                f"rollout.max_model_len={c.max_model_len} exceeds the model's max_position_embeddings="
                f"{spec.max_position_embeddings}; lower it (0 takes the model's limit)"
            )
        if c.max_step_tokens < c.max_batch_size:
            raise ValueError(
                f"rollout.max_step_tokens={c.max_step_tokens} is below rollout.max_batch_size="
                f"{c.max_batch_size}: every decoding sequence feeds one token per step; raise max_step_tokens "
                "or lower max_batch_size"
            )
        if c.kv_block_size % 16:
            raise ValueError(f"rollout.kv_block_size={c.kv_block_size} is not a multiple of 16")
        max_model_len = c.max_model_len or spec.max_position_embeddings
        element_size = torch.empty((), dtype=self.dtype).element_size()
        per_token = spec.kv_bytes_per_token(element_size)
        if c.kv_cache_tokens > 0:
            budget, source = c.kv_cache_tokens * per_token, f"rollout.kv_cache_tokens={c.kv_cache_tokens}"
        else:
            free = available_bytes(self.device)
            budget = int(c.kv_cache_fraction * free)
            source = (
                f"rollout.kv_cache_fraction={c.kv_cache_fraction} of {free / 2**30:.2f} GiB free on "
                f"{self.device}"
            )
        block_size = c.kv_block_size or -(-max_model_len // 16) * 16
        return plan_cache(
            spec,
            element_size,
            max_model_len=max_model_len,
            block_size=block_size,
            max_seqs=c.max_batch_size,
            budget_bytes=budget,
            source=source,
        )

    def _prefill_budget(self) -> PrefillBudget | None:
        """The mixed steps' prefill sizing (rollout.max_decode_slowdown), learning across generate calls."""
        c, s = self.config, self.spec
        if not c.max_decode_slowdown:
            return None
        return PrefillBudget(
            c.max_decode_slowdown, s.num_experts, s.top_k, s.num_moe_layers, max_tokens=c.max_step_tokens
        )

    def new_runner(self, cuda_graphs: bool) -> StepRunner:
        """The step runner (a fresh one after the device memory was released: graphs hold old addresses)."""
        c = self.config
        return StepRunner(
            self.model,
            cuda_graphs,
            max_step_tokens=c.max_step_tokens,
            max_seqs=c.max_batch_size,
            graph_max_tokens=c.cuda_graph_max_tokens,
        )

    @property
    def overlapping(self) -> bool:
        """Whether step t + 1 is launched before step t's outputs are read: `rollout.overlap_steps` with the
        engine's own runner (one standing in for it, e.g. a benchmark's, runs each step to its end)."""
        return self.config.overlap_steps and isinstance(self.runner, StepRunner)

    @property
    def max_seqs(self) -> int:
        """Sequences decoded at once at most (block-table rows)."""
        return self.cache_plan.max_seqs

    @property
    def max_model_len(self) -> int:
        return self.cache_plan.max_model_len

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
        began = time.perf_counter()
        requests = self._make_requests(prompt_token_ids, params)
        plan = self.cache_plan
        self.last_stats = stats = GenerateStats(
            num_requests=len(requests),
            num_prompt_tokens=sum(len(r.prompt) for r in requests),
            max_seqs=plan.max_seqs,
            kv_block_size=plan.block_size,
            kv_blocks=plan.num_blocks - 1,
        )
        self.cache.reset()
        budget = self.prefill_budget.budget if self.prefill_budget is not None else None
        scheduler = _Scheduler(self.cache.table, requests, self.config.max_step_tokens, budget)
        done: list[_Request] = []
        log = _RouteLog()
        depth = 1 if self.overlapping else 0  # steps launched and not yet read, beside the one being launched
        flights: deque[_InFlight] = deque()
        launches = itertools.count()
        with torch.inference_mode():
            while not scheduler.idle:
                unread = flights[-1].launch if flights else -1
                flights.append(self._launch(scheduler, next(launches), unread, log, done))
                while len(flights) > depth:
                    self._complete(flights.popleft(), scheduler, log, stats, done)
            while flights:
                self._complete(flights.popleft(), scheduler, log, stats, done)
        stats.num_preemptions = scheduler.num_preemptions
        stats.num_generated_tokens = sum(len(r.tokens) for r in requests)
        stats.cuda_graphs, stats.num_graphs = self.runner.use_cuda_graphs, self.runner.num_graphs
        outputs = [self._output(r, log) for r in sorted(done, key=lambda r: r.index)]
        stats.generate_s = time.perf_counter() - began
        return outputs

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
                f"{p.max_new_tokens} exceed rollout.max_model_len={self.max_model_len} (the model allows "
                f"{self.spec.max_position_embeddings}): raise it or lower max_new_tokens"
            )
        return prompt

    # ------------------------------------------------------------------------------------------ steps
    def _launch(
        self, scheduler: _Scheduler, launch: int, unread: int, log: _RouteLog, done: list[_Request]
    ) -> _InFlight:
        """Schedule a step, launch it, and settle what does not wait for its outputs: the positions it computes,
        the draws it holds (as counts: their tokens come with the outputs), the requests it retires. `unread`:
        the launch whose outputs are not read yet (-1: none)."""
        step = scheduler.next_step()
        held = self.cache.table.num_used_blocks
        inputs = self._inputs(step, unread)
        graphs = self.runner.num_graphs
        if self.overlapping:
            launched = self.runner.launch(inputs)
        else:
            t0 = time.perf_counter()
            out = self.runner.run(inputs)
            launched = _Ran(out, time.perf_counter() - t0)
        captured = self.runner.num_graphs != graphs  # its time holds the capture (many steps' worth)
        first = log.reserve(inputs.num_tokens)
        draws = self._settle(step, launch, first, scheduler, done)
        return _InFlight(step, inputs, launched, launch, first, draws, held, captured)

    def _inputs(self, step: _Step, unread: int) -> StepInputs:
        """The step's flat tokens (decode rows, then prefill pieces) and the sampling rows, as arrays. A decoding
        row whose token the launch `unread` drew, still on the device, is fed from there (`feed_D`)."""
        decode, pieces = step.decode, step.pieces
        n = len(decode)
        total = n + sum(m for _, _, m in pieces)
        tok = np.empty((total, 4), dtype=np.int64)
        feed = None
        if n:
            tok[:n, TOKEN] = [r.tokens[-1] if r.drawn_at != unread else 0 for r in decode]
            if unread >= 0:
                feed = np.fromiter(
                    (r.drawn_index if r.drawn_at == unread else -1 for r in decode), np.int64, n
                )
            tok[:n, POSITION] = np.fromiter((r.length - 1 for r in decode), np.int64, n)
            tok[:n, SEQ] = np.fromiter((r.row for r in decode), np.int64, n)
        spans, offset = [], n
        for r, start, m in pieces:
            seq = r.prompt + r.tokens if r.tokens else r.prompt
            assert start + m <= len(seq), "a prefill piece reaches a token not fetched yet"
            tok[offset : offset + m, TOKEN] = seq[start : start + m]
            tok[offset : offset + m, POSITION] = np.arange(start, start + m)
            tok[offset : offset + m, SEQ] = r.row
            spans.append((offset, m))
            offset += m
        tok[:, CACHE_ROW] = self.cache.table.cache_rows(tok[:, SEQ], tok[:, POSITION])
        sampled = [*decode, *(r for (r, _, _), end in zip(pieces, step.ends) if end)]
        samples = [*range(n), *(o + m - 1 for (o, m), end in zip(spans, step.ends) if end)]
        return StepInputs(
            tokens_T4=tok,
            num_decode=n,
            pieces=spans,
            samples_S=np.asarray(samples, dtype=np.int64),
            seeds_S=np.fromiter((r.seed for r in sampled), np.uint64, len(sampled)),
            top_k_S=np.fromiter((r.params.top_k for r in sampled), np.int64, len(sampled)),
            # a request with every token drawn rides along only to record its last token's experts: greedy
            temperature_S=np.fromiter(
                (0.0 if r.all_drawn else r.params.temperature for r in sampled), np.float32, len(sampled)
            ),
            top_p_S=np.fromiter((r.params.top_p for r in sampled), np.float32, len(sampled)),
            feed_D=feed,
        )

    def _settle(
        self, step: _Step, launch: int, first: int, scheduler: _Scheduler, done: list[_Request]
    ) -> list[tuple[_Request, int]]:
        """A launched step's bookkeeping that needs none of its outputs: the positions it computed (their routes
        are log rows from `first`), one more drawn token for each row it samples, and the retirement of the
        requests it fed their last token. Returns (request, sample index) of the draws to fetch."""
        draws = []
        for i, r in enumerate(step.decode):
            n = r.length
            r.record(n - 1, first + i, 1)
            r.num_cached = n
            if r.all_drawn:  # fed its last token only to record that token's experts
                scheduler.retire(r)
                done.append(r)
            else:
                r.length, r.drawn_at, r.drawn_index = n + 1, launch, i
                draws.append((r, i))
        offset = j = len(step.decode)
        for (r, start, m), end in zip(step.pieces, step.ends):
            r.record(start, first + offset, m)
            r.num_cached = start + m
            offset += m
            if end:
                r.length, r.drawn_at, r.drawn_index = r.length + 1, launch, j
                draws.append((r, j))
                j += 1
        return draws

    def _complete(
        self, f: _InFlight, scheduler: _Scheduler, log: _RouteLog, stats: GenerateStats, done: list[_Request]
    ) -> None:
        """Read a launched step's outputs: its routes, the tokens it drew (ending responses), its counts."""
        out = f.launched.outputs()
        # astype copies: the runner reuses its output buffers
        log.fill(f.first_row, out.routes_TLK.astype(self.route_dtype))
        tokens, logprobs = out.tokens_S.tolist(), out.logprobs_S.tolist()
        for r, j in f.draws:
            if r.finish_reason is not None:  # an earlier draw ended the response: this one is dropped
                r.length -= 1
                continue
            self._append(r, tokens[j], logprobs[j])
            if r.finish_reason is not None and r.length > len(r.prompt) + len(r.tokens):
                # the step after this one, launched already, fed this token to record its experts: done
                assert r.row >= 0
                scheduler.retire(r)
                done.append(r)
        self._count(stats, f, out)
        if self.prefill_budget is not None and not f.captured:
            self.prefill_budget.record(self._shape(f.inputs, out), f.launched.seconds)

    def _append(self, r: _Request, token: int, logprob: float) -> None:
        r.tokens.append(token)
        r.logprobs.append(logprob)
        if token in self.eos_token_ids and not r.params.ignore_eos:
            r.finish_reason = "eos"
        elif token in r.stop_ids:
            r.finish_reason = "stop"
        elif len(r.tokens) >= r.params.max_new_tokens:
            r.finish_reason = "length"

    def _count(self, stats: GenerateStats, f: _InFlight, out: StepOutputs) -> None:
        """Step counts; `f.held` = the KV blocks held while the step ran."""
        step, inputs, seconds, held = f.step, f.inputs, f.launched.seconds, f.held
        n, prefill = len(step.decode), inputs.num_tokens - len(step.decode)
        table = self.cache.table
        stats.num_steps += 1
        stats.num_prefill_tokens += prefill
        if n:
            stats.num_decode_steps += 1
            stats.num_decode_rows += n
            stats.decode_s += seconds
            if prefill:
                stats.num_mixed_steps += 1
                stats.mixed_s += seconds
        else:
            stats.prefill_s += seconds
        if f.captured:
            stats.num_captures += 1
            stats.capture_s += seconds
        stats.kv_blocks_peak = max(stats.kv_blocks_peak, held)
        stats.kv_block_steps += held
        stats.peak_running = max(stats.peak_running, step.num_running)
        if self.config.trace_steps:
            touched = int((layer_expert_counts(out.routes_TLK, self.spec.num_experts) > 0).sum())
            keys = int(inputs.tokens_T4[:n, POSITION].sum()) + n
            stats.steps.append(
                StepTrace(n, prefill, keys, held * table.plan.block_size, touched, seconds, f.captured)
            )

    def _shape(self, inputs: StepInputs, out: StepOutputs) -> StepShape:
        """The step as the cost model reads it: its rows, keys, and each phase's MoE tiles from its routing."""
        n = inputs.num_decode
        return self.prefill_budget.measured(
            rows=n, keys=int(inputs.tokens_T4[:n, POSITION].sum()) + n, routes_TLK=out.routes_TLK
        )

    def _output(self, r: _Request, log: _RouteLog) -> GenerationOutput:
        assert len(r.route_rows) == r.length, (len(r.route_rows), r.length)
        routes = log.gather(r.route_rows)
        return GenerationOutput(
            index=r.index,
            prompt_token_ids=r.prompt,
            token_ids=r.tokens,
            logprobs=np.asarray(r.logprobs, dtype=np.float32),
            finish_reason=r.finish_reason,
            routed_experts=routes,
            seed=r.seed,
        )


@dataclass(frozen=True)
class _Ran:
    """A step a runner without `launch` ran to its end (`seconds`: host-timed)."""

    result: StepOutputs
    seconds: float

    def outputs(self) -> StepOutputs:
        return self.result


@dataclass(frozen=True)
class _InFlight:
    """A launched step and what reading its outputs completes."""

    step: _Step
    inputs: StepInputs
    launched: LaunchedStep | _Ran
    launch: int
    first_row: int  # the route log's row of its first token
    draws: list[tuple[_Request, int]]  # the requests it draws a token for, and the token's sample index
    held: int  # KV blocks held while it ran
    captured: bool  # it captured a CUDA graph, so its time holds the capture


@dataclass(frozen=True)
class _Step:
    """What the scheduler picked: decoding requests (one token each) and prefill pieces (request, first
    position, length); `ends[i]`: piece i completes a fresh prompt (its last token's successor is sampled)."""

    decode: list[_Request]
    pieces: list[tuple[_Request, int, int]]
    ends: list[bool]
    num_running: int


class _Scheduler:
    """Admission, block growth and preemption over one `generate` call (see the module docstring)."""

    def __init__(
        self,
        table: BlockTable,
        requests: list[_Request],
        max_step_tokens: int,
        prefill_budget: Callable[[int, int], int] | None = None,
    ) -> None:
        self.table = table
        self.prefill_budget = prefill_budget  # (decode rows, their keys) -> prefill tokens allowed
        self.waiting: deque[_Request] = deque(requests)
        self.running: list[_Request] = []  # admission order: the last is the youngest
        self.max_step_tokens = max_step_tokens
        # Blocks kept free at admission for the decoding rows' growth (preempting right after admitting wastes
        # the admitted prefill); none when a sequence's first block holds all its positions (slot layout).
        plan = table.plan
        self.reserve = max(1, (plan.num_blocks - 1) // 100) if plan.blocks_per_seq > 1 else 0
        self.num_preemptions = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def next_step(self) -> _Step:
        self._admit()
        # A step's host time is per running request, so each one's state is read once here.
        decoding = [r.decoding for r in self.running]
        prefill = [r for r, d in zip(self.running, decoding) if not d]
        decode = [r for r, d in zip(self.running, decoding) if d]
        for r in self._outgrowing(decode):
            if r.row >= 0:  # -1 for one preempted by an earlier row's growth
                self._grow(r)
        if len(decode) + len(prefill) != len(self.running):  # growth preempted the youngest requests
            decode, prefill = [r for r in decode if r.row >= 0], [r for r in prefill if r.row >= 0]
        budget, pieces = self.max_step_tokens - len(decode), []
        if self.prefill_budget is not None and prefill:  # a budget costs host time: decode-only steps skip it
            budget = min(budget, self.prefill_budget(len(decode), sum(r.length for r in decode)))
        for r in prefill:
            if budget <= 0:
                break
            m = min(budget, r.target - r.num_cached)
            pieces.append((r, r.num_cached, m))
            budget -= m
        if not decode and not pieces:
            raise RuntimeError(
                f"rollout scheduler: no step possible with {len(self.waiting)} waiting requests and "
                f"{self.table.num_free_blocks} free KV blocks (a bug: the cache holds one full-length sequence)"
            )
        ends = [start + m == r.target and r.length == len(r.prompt) for r, start, m in pieces]
        return _Step(decode, pieces, ends, len(self.running))

    def retire(self, r: _Request) -> None:
        self.table.release(r.row)
        self.running.remove(r)
        r.row = -1

    def _admit(self) -> None:
        while self.waiting and self.table.num_free_rows:
            r = self.waiting[0]
            need = self.table.blocks_for(r.target)
            reserve = self.reserve if self.running else 0
            if need + reserve > self.table.num_free_blocks:
                return
            self.waiting.popleft()
            r.row = self.table.open_row()
            self.table.grow(r.row, r.target)
            self.running.append(r)

    def _outgrowing(self, decode: list[_Request]) -> list[_Request]:
        """The decoding requests whose next position needs a block they do not hold, in running order."""
        n = len(decode)
        rows = np.fromiter((r.row for r in decode), np.int64, n)
        lengths = np.fromiter((r.length for r in decode), np.int64, n)
        return [decode[i] for i in np.flatnonzero(self.table.outgrown(rows, lengths))]

    def _grow(self, r: _Request) -> None:
        """Blocks for the position r feeds next; preempts the youngest running requests until they fit."""
        while not self.table.grow(r.row, r.length):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return

    def _preempt(self, r: _Request) -> None:
        self.table.release(r.row)
        self.running.remove(r)
        r.row, r.num_cached = -1, 0
        self.waiting.appendleft(r)
        self.num_preemptions += 1


def resolve_dtype(dtype: str | torch.dtype, spec: MoeModelSpec, config: RolloutConfig | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and config is not None and config.dtype != "auto":
        dtype = config.dtype
    if dtype == "auto":
        dtype = spec.torch_dtype if spec.torch_dtype in _DTYPES else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected 'auto', a torch dtype or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
