"""MegaScale-Infer's disaggregated expert parallelism for the rollout engine: M attention workers and N expert
workers, with ping-pong micro-batches between them.

An attention worker (`DisaggregatedEngine`) is the rollout engine without experts: it owns its requests, the
KV cache, the router, sampling and routing capture, and the dense tensors; expert workers (`ExpertWorker`) each
hold a contiguous range of every MoE layer's experts and nothing else, and serve every attention worker. Per MoE
layer and micro-batch there are two transfers over torch.distributed point-to-point on an explicit process
group (gloo on CPU, NCCL on GPUs): dispatch (an attention worker sends the post-attention hidden states, router
weights and expert ids of the micro-batch's tokens to each expert worker that holds one of their top-k experts,
a count first) and combine (each expert worker returns its experts' weighted sum of those rows in fp32; the
attention worker adds the partial sums to the residual and rounds once). An expert worker gathers micro-batch j of the same step number from every attention worker still
generating into one batch (the M-to-N aggregation that makes the expert GEMMs larger than any one attention
worker's batch), and answers each its rows.

Ping-pong (MegaScale-Infer section 4.1): a step's sequences are split into m micro-batches; the attention worker
runs layer l of micro-batch j+1 while the expert workers run layer l of micro-batch j, and layer l+1 of
micro-batch 0 while they finish micro-batch m-1. With T_a and T_e one layer's attention and expert time of a
micro-batch, T_c one transfer and T_f = max(T_a, T_e), the pipeline stays full when T_a ~ T_e, T_c < T_f and
m T_f >= 2 (T_f + T_c) (m >= 3 once T_c < T_f / 2, else m >= 4), and a step over L MoE layers takes

    T_total = (T_a + T_e + 2 T_c) + T_f (m L - 1).

Both sides walk the (MoE layer, micro-batch) pairs in the same order, so messages between two ranks match
by order alone (no tags; NCCL ignores them). A step opens with a header (its micro-batches' token counts), an
attention worker's generate call closes with an END header; the expert workers' `serve` returns once every
attention worker has ended. Attention workers need not take the same number of steps: a finished one simply
drops out of the gather. Steps run eagerly (no CUDA graphs: the transfers sit between the layers).

Legend: T tokens of a micro-batch, H hidden, K top-k, E experts of a worker, L MoE layers.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rollout.config import RolloutConfig
from rollout.engine import RolloutEngine, resolve_dtype
from rollout.model import MoeDecoder, StepBatch, sorted_experts
from rollout.model_spec import MoeModelSpec
from rollout.paged_attention import decode_splits, prefill_tile_tokens, prefill_tiles
from rollout.runner import POSITION, StepInputs, StepOutputs, sample_at, step_batch
from rollout.weights import WeightMap, allocate, expert_of, init_random, is_expert_weight, load_checkpoint

STEP, END = 1, 2  # header ops
MAX_MICRO_BATCHES = 4
# MegaScale-Infer's m >= 3 (transfers under half a stage); `python -m rollout.plan` may pick another m.
AUTO_MICRO_BATCHES = 3
_HEADER = 2 + MAX_MICRO_BATCHES  # op, m, tokens of each micro-batch


@dataclass(frozen=True)
class Layout:
    """Who is who in the process group: the attention ranks and the expert ranks serving all of them (group
    ranks)."""

    group: dist.ProcessGroup | None  # None: the default group
    attention_ranks: tuple[int, ...]
    expert_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.attention_ranks or not self.expert_ranks:
            raise ValueError("disaggregated layout: expected at least one attention and one expert worker")
        ranks = self.attention_ranks + self.expert_ranks
        if len(set(ranks)) != len(ranks):
            raise ValueError(
                f"disaggregated layout: attention ranks {self.attention_ranks} and expert ranks "
                f"{self.expert_ranks} must be distinct"
            )

    def peer(self, rank: int) -> int:
        """The global rank of a group rank (torch.distributed's point-to-point calls take global ranks)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


@dataclass(frozen=True)
class DisaggSeat:
    """A rollout worker's place in the layout: ranks [0, num_attention) the attention workers (experts None),
    the rest the expert workers with their expert ranges; all rendezvous at init_method (their default group)."""

    rank: int
    world_size: int
    num_attention: int
    init_method: str
    experts: range | None = None

    @property
    def layout(self) -> Layout:
        a = self.num_attention
        return Layout(None, tuple(range(a)), tuple(range(a, self.world_size)))


def layout_seats(
    num_experts: int, attention_workers: int, expert_workers: int, init_method: str
) -> list[DisaggSeat]:
    """The seats of a deployment: the attention workers, then one expert worker per expert range."""
    world, a = attention_workers + expert_workers, attention_workers
    ranges = expert_ranges(num_experts, expert_workers)
    return [DisaggSeat(r, world, a, init_method) for r in range(a)] + [
        DisaggSeat(a + w, world, a, init_method, held) for w, held in enumerate(ranges)
    ]


def expert_ranges(num_experts: int, num_workers: int) -> list[range]:
    """Contiguous, near-equal expert ranges of the expert workers: worker w holds [w E / N, (w + 1) E / N)."""
    if not 1 <= num_workers <= num_experts:
        raise ValueError(
            f"{num_workers} expert workers for {num_experts} experts: expected between 1 and {num_experts}"
        )
    bounds = [w * num_experts // num_workers for w in range(num_workers + 1)]
    return [range(lo, hi) for lo, hi in itertools.pairwise(bounds)]


def micro_batch_count(setting: int) -> int:
    """rollout.micro_batches: 0 = auto (MegaScale-Infer's m >= 3), else 1..MAX_MICRO_BATCHES."""
    if not 0 <= setting <= MAX_MICRO_BATCHES:
        raise ValueError(f"rollout.micro_batches={setting}: expected 0 (auto) or 1..{MAX_MICRO_BATCHES}")
    return setting or AUTO_MICRO_BATCHES


# ----------------------------------------------------------------------------------------- micro-batches
@dataclass(frozen=True)
class MicroBatch:
    """Part of a step: its own StepInputs (decode rows first, then whole prefill pieces), the step's flat
    indices of its tokens, and the step's sample indices of its sampled rows (in its order)."""

    inputs: StepInputs
    tokens: np.ndarray  # int64 [T]
    samples: np.ndarray  # int64 [S]


def split_step(x: StepInputs, m: int) -> list[MicroBatch]:
    """Split a step into at most m micro-batches of whole sequences: decode rows in m near-equal runs, each
    prefill piece to the micro-batch with the fewest tokens so far. Empty micro-batches are dropped."""
    decode = np.array_split(np.arange(x.num_decode), m)
    loads = [len(d) for d in decode]
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(m)]
    for start, length in x.pieces:
        j = int(np.argmin(loads))
        pieces[j].append((start, length))
        loads[j] += length
    return [_micro_batch(x, decode[j], pieces[j]) for j in range(m) if loads[j]]


def _micro_batch(x: StepInputs, decode: np.ndarray, pieces: list[tuple[int, int]]) -> MicroBatch:
    prefill = [np.arange(start, start + length) for start, length in pieces]
    tokens = np.concatenate([decode, *prefill]).astype(np.int64)
    local = np.full(x.num_tokens, -1, dtype=np.int64)
    local[tokens] = np.arange(len(tokens))
    samples = np.flatnonzero(local[x.samples_S] >= 0)
    offsets = np.cumsum([len(decode), *(length for _, length in pieces)])[:-1]
    inputs = StepInputs(
        tokens_T4=x.tokens_T4[tokens],
        num_decode=len(decode),
        pieces=[(int(o), length) for o, (_, length) in zip(offsets, pieces)],
        samples_S=local[x.samples_S[samples]],
        seeds_S=x.seeds_S[samples],
        top_k_S=x.top_k_S[samples],
        temperature_S=x.temperature_S[samples],
        top_p_S=x.top_p_S[samples],
    )
    return MicroBatch(inputs, tokens, samples)


def exact_step_batch(
    x: StepInputs, device: torch.device, tile: int, num_kv_heads: int, num_sms: int
) -> StepBatch:
    """The device tensors of a step at its exact shape (no padding: steps of this layout run eagerly)."""
    starts, lengths = prefill_tiles(x.pieces, tile)
    tiles_2Q = torch.tensor([starts, lengths], dtype=torch.int32, device=device).reshape(2, -1)
    splits = decode_splits(x.num_decode, num_kv_heads, num_sms) if x.num_decode else 1
    sample_S = torch.as_tensor(x.samples_S, device=device)
    return step_batch(torch.as_tensor(x.tokens_T4, device=device), tiles_2Q, x.num_decode, splits, sample_S)


# ----------------------------------------------------------------------------------------- transfers
def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as uint8 (point-to-point moves bytes: any dtype travels over gloo and NCCL alike)."""
    return t.contiguous().view(-1).view(torch.uint8)


class Sent:
    """A send in flight and its buffer (kept alive until the send completes)."""

    def __init__(self, t: torch.Tensor, rank: int, layout: Layout) -> None:
        self.buffer = _bytes(t)
        self.work = dist.isend(self.buffer, layout.peer(rank), group=layout.group)

    def wait(self) -> None:
        self.work.wait()


def _recv_into(t: torch.Tensor, rank: int, layout: Layout) -> dist.Work:
    return dist.irecv(t.view(-1).view(torch.uint8), layout.peer(rank), group=layout.group)


class Combine:
    """The expert workers' answer to one dispatch, in flight: `wait(residual)` = residual + each worker's partial
    sums at the rows it was sent, added in fp32 in worker order and rounded once to the residual's dtype."""

    def __init__(
        self, works: list[dist.Work], partials: list[tuple[torch.Tensor, torch.Tensor]], sent: list[Sent]
    ) -> None:
        self.works, self.partials, self.sent = works, partials, sent

    def wait(self, residual_TH: torch.Tensor) -> torch.Tensor:
        for work in self.sent + self.works:
            work.wait()
        out_TH = residual_TH.float()
        for rows_R, partial_RH in self.partials:
            out_TH.index_add_(0, rows_R, partial_RH)  # rows are distinct: no two adds meet
        return out_TH.to(residual_TH.dtype)


class RemoteExperts:
    """The attention worker's side of the transfers. Dispatch is routed: an expert worker receives only the
    tokens with at least one of their top-k experts in its range (a count first, then those rows)."""

    def __init__(self, layout: Layout, hidden_size: int, device: torch.device, num_experts: int) -> None:
        self.layout, self.hidden_size, self.device = layout, hidden_size, device
        self.ranges = expert_ranges(num_experts, len(layout.expert_ranks))

    def _header(self, op: int, sizes: Sequence[int] = ()) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        header[:2] = torch.tensor([op, len(sizes)])
        header[2 : 2 + len(sizes)] = torch.tensor(list(sizes), dtype=torch.int64)
        for sent in [Sent(header, rank, self.layout) for rank in self.layout.expert_ranks]:
            sent.wait()

    def begin_step(self, sizes: Sequence[int]) -> None:
        """Announce a step of len(sizes) micro-batches of these token counts."""
        self._header(STEP, sizes)

    def end(self) -> None:
        """End of a generate call: the expert workers' `serve` returns."""
        self._header(END)

    def dispatch(self, h_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> Combine:
        """Send each expert worker the micro-batch's tokens routed to it (hidden states, router weights, ids);
        their partial sums arrive in the Combine."""
        sent, works, partials = [], [], []
        w_TK, i_TK = weights_TK.float(), ids_TK.to(torch.int32)
        for rank, held in zip(self.layout.expert_ranks, self.ranges):
            rows_R = ((i_TK >= held.start) & (i_TK < held.stop)).any(dim=1).nonzero().squeeze(1)
            count = torch.tensor([rows_R.numel()], dtype=torch.int64, device=self.device)
            sent.append(Sent(count, rank, self.layout))
            if not rows_R.numel():
                continue
            sent += [Sent(t[rows_R], rank, self.layout) for t in (h_TH, w_TK, i_TK)]
            partial_RH = torch.empty(
                rows_R.numel(), self.hidden_size, dtype=torch.float32, device=self.device
            )
            works.append(_recv_into(partial_RH, rank, self.layout))
            partials.append((rows_R, partial_RH))
        return Combine(works, partials, sent)


class PingPongRunner:
    """The attention worker's step runner: the step split into micro-batches, every MoE layer's experts on the
    expert workers, layer l of micro-batch j+1 computed while they run micro-batch j (see the module
    docstring). Same interface as StepRunner.run; no CUDA graphs."""

    use_cuda_graphs = False
    num_graphs = 0
    capture_error = None

    def __init__(self, model: MoeDecoder, remote: RemoteExperts, micro_batches: int) -> None:
        self.model, self.remote, self.micro_batches = model, remote, micro_batches
        spec, self.device = model.spec, model.weights.embed_VH.device
        self.tile = prefill_tile_tokens(spec.num_heads, spec.num_kv_heads)
        self.num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 1
        )

    def run(self, x: StepInputs) -> StepOutputs:
        parts = split_step(x, self.micro_batches)
        self.model.cache.sync_table()  # the scheduler's block-table changes, for the attention kernels
        self.remote.begin_step([len(p.tokens) for p in parts])
        steps = [
            exact_step_batch(p.inputs, self.device, self.tile, self.model.spec.num_kv_heads, self.num_sms)
            for p in parts
        ]
        logits, routes = self._forward(steps)
        order_S = np.argsort(np.concatenate([p.samples for p in parts]), kind="stable")
        logits_SV = torch.cat(logits)[torch.as_tensor(order_S, device=self.device)]
        tok = torch.as_tensor(x.tokens_T4, device=self.device)
        index_S = torch.as_tensor(x.samples_S, device=self.device)
        seeds_S, temperature_S, top_k_S, top_p_S = (
            torch.as_tensor(a, device=self.device)
            for a in (x.seeds_S.view(np.int64), x.temperature_S, x.top_k_S, x.top_p_S)
        )
        sampled_S, logprobs_S = sample_at(
            logits_SV, tok[index_S, POSITION], seeds_S, temperature_S, top_k_S, top_p_S, x.filtered
        )
        routes_TLK = np.empty((x.num_tokens, *routes[0].shape[1:]), dtype=np.int16)
        for p, r in zip(parts, routes):
            routes_TLK[p.tokens] = r.cpu().numpy()
        return StepOutputs(sampled_S.cpu().numpy(), logprobs_S.float().cpu().numpy(), routes_TLK)

    def _forward(self, steps: list[StepBatch]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The ping-pong schedule: per layer, each micro-batch's attention half waits for its previous MoE
        layer's combine first, then dispatches its experts; the other micro-batches' attention overlaps."""
        model = self.model
        state = [model.embed(step) for step in steps]
        xs = [x_TH for x_TH, _, _ in state]
        pending: list[Combine | None] = [None] * len(steps)
        residual: list[torch.Tensor | None] = [None] * len(steps)
        ids: list[list[torch.Tensor]] = [[] for _ in steps]
        for i, layer in enumerate(model.weights.layers):
            for j, step in enumerate(steps):
                if pending[j] is not None:
                    xs[j], pending[j] = pending[j].wait(residual[j]), None
                _, cos_TD, sin_TD = state[j]
                x_TH, h_TH = model.attention_block(i, xs[j], step, cos_TD, sin_TD)
                if layer.router_EH is None:
                    xs[j] = model.dense_mlp(layer, h_TH, x_TH)
                    continue
                weights_TK, ids_TK = model.route(layer, h_TH)
                ids[j].append(ids_TK)
                residual[j], pending[j] = x_TH, self.remote.dispatch(h_TH, weights_TK, ids_TK)
        for j in range(len(steps)):
            if pending[j] is not None:
                xs[j] = pending[j].wait(residual[j])
        logits = [model.logits(x_TH, step.sample_S) for x_TH, step in zip(xs, steps)]
        return logits, [torch.stack(r, dim=1) for r in ids]


# ----------------------------------------------------------------------------------------- the workers
class DisaggregatedEngine(RolloutEngine):
    """An attention worker: the rollout engine (same API: generate, windows, routing capture, load_weights)
    whose experts run on the expert workers of `layout`. Its weights hold no expert."""

    def __init__(self, spec, weights, device, config: RolloutConfig | None, layout: Layout) -> None:
        self.layout = layout
        self.remote = RemoteExperts(layout, spec.hidden_size, torch.device(device), spec.num_experts)
        super().__init__(spec, weights, device, config)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, layout: Layout, device="cpu", dtype="auto", config: RolloutConfig | None = None
    ) -> DisaggregatedEngine:
        spec = MoeModelSpec.from_pretrained(path)
        weights = allocate(spec, torch.device(device), resolve_dtype(dtype, spec, config), experts=range(0))
        load_checkpoint(WeightMap(spec, weights), path)
        return cls(spec, weights, torch.device(device), config, layout)

    def new_runner(self, cuda_graphs: bool) -> PingPongRunner:
        return PingPongRunner(self.model, self.remote, micro_batch_count(self.config.micro_batches))

    def generate(self, prompt_token_ids, params=None):
        """RolloutEngine.generate; the expert workers' `serve` returns when it does."""
        try:
            return super().generate(prompt_token_ids, params)
        finally:
            self.remote.end()


@dataclass
class ServeStats:
    """What one `serve` call did."""

    steps: int = 0
    dispatches: int = 0
    offered: int = 0  # tokens of the micro-batches served
    tokens: int = 0  # of those, routed here (received)


class ExpertWorker:
    """An expert worker: every MoE layer's experts `experts` (local index e - experts.start) and nothing else."""

    def __init__(self, spec: MoeModelSpec, weights, layout: Layout) -> None:
        if weights.dense:
            raise ValueError("ExpertWorker: expected weights allocated with dense=False (experts only)")
        self.spec, self.weights, self.layout = spec, weights, layout
        self.device = weights.layers[0].gate_up_EFH.device if weights.layers else torch.device("cpu")
        self._weight_map = WeightMap(spec, weights)
        self.moe_layers = [layer for layer in weights.layers if layer.gate_up_EFH is not None]
        self.experts_E = torch.arange(len(weights.experts), device=self.device, dtype=torch.int32)

    @classmethod
    def allocate(
        cls, spec: MoeModelSpec, experts: range, layout: Layout, device="cpu", dtype=torch.float32
    ) -> ExpertWorker:
        return cls(spec, allocate(spec, torch.device(device), dtype, experts=experts, dense=False), layout)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, experts: range, layout: Layout, device="cpu", dtype="auto"
    ) -> ExpertWorker:
        spec = MoeModelSpec.from_pretrained(path)
        worker = cls.allocate(spec, experts, layout, device, resolve_dtype(dtype, spec, None))
        load_checkpoint(worker._weight_map, path)
        return worker

    def init_random(self, std: float = 0.02, seed: int = 0) -> None:
        init_random(self.weights, std, seed)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy expert tensors in place (per-expert names of this worker's experts, or fused tensors of all)."""
        return len(self._weight_map.load(named_tensors))

    def partial(
        self, i: int, h_TH: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor
    ) -> torch.Tensor:
        """sum over the pairs (t, k) whose expert e = ids_tk is held here of w_tk down_e(silu(gate_e h) * up_e h),
        in fp32 [T, H]; the other pairs count zero (their rows are sorted past the last expert, not computed)."""
        layer, held = self.moe_layers[i], self.weights.experts
        local_TK = ids_TK.long() - held.start
        mine_TK = (local_TK >= 0) & (local_TK < len(held))
        local_TK = torch.where(mine_TK, local_TK, len(held))
        y_RH = sorted_experts(h_TH, local_TK, layer.gate_up_EFH, layer.down_EHF, self.experts_E)
        y_TKH = torch.where(mine_TK[..., None], y_RH.view(*ids_TK.shape, -1).float(), 0.0)
        return (weights_TK[..., None] * y_TKH).sum(1)

    def serve(self) -> ServeStats:
        """Answer the attention workers' dispatches until every one has ended its generate call. Step k of
        every attention worker still generating is served together: micro-batch j of each (those with at least
        j + 1) gathered into one batch per MoE layer."""
        stats = ServeStats()
        active = list(self.layout.attention_ranks)
        sent: list[Sent] = []
        with torch.inference_mode():
            while active:
                sizes = {rank: self._header(rank) for rank in active}
                active = [rank for rank in active if sizes[rank] is not None]
                if not active:
                    break
                stats.steps += 1
                for i in range(len(self.moe_layers)):
                    for j in range(max(len(sizes[rank]) for rank in active)):
                        part = {rank: sizes[rank][j] for rank in active if j < len(sizes[rank])}
                        for done in sent:
                            done.wait()
                        sent, received = self._answer(i, part)
                        stats.dispatches += 1
                        stats.offered += sum(part.values())
                        stats.tokens += received
            for done in sent:
                done.wait()
        return stats

    def _header(self, rank: int) -> list[int] | None:
        """The token counts of an attention worker's next step's micro-batches, or None when it ended."""
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        _recv_into(header, rank, self.layout).wait()
        op, m = int(header[0]), int(header[1])
        if op == END:
            return None
        if op != STEP:
            raise RuntimeError(f"expert worker: unknown header op {op} from rank {rank} (a protocol bug)")
        return header[2 : 2 + m].tolist()

    def _answer(self, i: int, offered: dict[int, int]) -> tuple[list[Sent], int]:
        """Receive one dispatch of layer i from each attention rank (a count, then the rows routed here),
        compute their partial sums in one batch, send each rank its rows; (the sends, the rows received)."""
        s = self.spec
        counts = {}
        for rank in offered:
            count = torch.empty(1, dtype=torch.int64, device=self.device)
            _recv_into(count, rank, self.layout).wait()
            counts[rank] = int(count)
        t = sum(counts.values())
        if not t:
            return [], 0
        h_TH = torch.empty(t, s.hidden_size, dtype=self.moe_layers[i].gate_up_EFH.dtype, device=self.device)
        weights_TK = torch.empty(t, s.top_k, dtype=torch.float32, device=self.device)
        ids_TK = torch.empty(t, s.top_k, dtype=torch.int32, device=self.device)
        spans = [(rank, lo, hi) for rank, lo, hi in _spans(counts) if hi > lo]
        works = [
            _recv_into(x[lo:hi], rank, self.layout)
            for rank, lo, hi in spans
            for x in (h_TH, weights_TK, ids_TK)
        ]
        for work in works:
            work.wait()
        partial_TH = self.partial(i, h_TH, weights_TK, ids_TK)
        return [Sent(partial_TH[lo:hi], rank, self.layout) for rank, lo, hi in spans], t


def _spans(counts: dict[int, int]) -> list[tuple[int, int, int]]:
    """(rank, first row, end row) of each rank's rows in the gathered batch, in the dict's order."""
    bounds = [0, *itertools.accumulate(counts.values())]
    return [(rank, lo, hi) for rank, lo, hi in zip(counts, bounds, bounds[1:])]


def split_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], ranges: Sequence[range]
) -> tuple[list[tuple[str, torch.Tensor]], list[list[tuple[str, torch.Tensor]]]]:
    """A weight-sync bucket split by owner: (the attention worker's non-expert tensors, each expert worker's
    expert tensors): a per-expert tensor goes to the worker whose range holds its expert, a fused tensor of all
    experts to every expert worker (each copies its slice)."""
    dense: list[tuple[str, torch.Tensor]] = []
    experts: list[list[tuple[str, torch.Tensor]]] = [[] for _ in ranges]
    for name, tensor in named_tensors:
        if not is_expert_weight(name):
            dense.append((name, tensor))
            continue
        e = expert_of(name)
        for held, bucket in zip(ranges, experts):
            if e is None or e in held:
                bucket.append((name, tensor))
    return dense, experts


def init_group(rank: int, world_size: int, init_method: str, timeout_s: float = 120.0) -> None:
    """The default process group of one disaggregated deployment: NCCL when CUDA is available, else gloo; a
    transfer that waits longer than timeout_s fails instead of hanging."""
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
