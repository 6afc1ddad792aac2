"""Driver-side handles of the roles: the policy, critic and reference trainers (groups of Megatron ranks) and
the rollout engines, as Ray actors in the run's placement group (tppo.cluster.placement), or in-process objects
for single-rank debugging and tests.

The driver talks to a role only through the typed methods of its handle (`Trainer.train`, `.offload`,
`Rollout.generate`, `.load_weights`, ...); a handle names the worker method it runs by reference, never by a
string. A trainer handle turns pool samples into per-rank micro-batches (tppo.algo.batching) and gathers
per-rank outputs back into per-sample rows, so the driver never sees the ranks' nesting. A dead actor ends the
run with a message that names the role and rank, never a hang: every remote call waits with a timeout.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relibra.plan import Plan
from rollout.config import RolloutConfig
from rollout.disagg import DisaggSeat, layout_seats, split_weights
from rollout.engine import GenerateStats
from rollout.model_spec import MoeModelSpec
from rollout.params import SamplingParams
from rollout.worker import RolloutWorker, WorkerInfo
from tppo.algo.batching import Placement, critic_batch, place_samples, policy_batch, split_for_ranks
from tppo.algo.pool import Sample
from tppo.cluster.placement import Reservation
from tppo.cluster.workers import ExecutorSpec, RankSpec, TrainerWorker
from tppo.engine.batch import ForwardOutput, StepResult, TrainBatch
from tppo.engine.config import BackendConfig, ModelConfig, OptimConfig, ParallelConfig
from tppo.engine.layout import RouterLayout
from tppo.engine.parallel import reserved_port

CALL_TIMEOUT_S = 1800.0
# Weight-sync buckets a policy rank may gather ahead of the engines' loading (bounds the object store's share).
STREAM_AHEAD = 2

# Per-rank micro-batches of one role: batches[r][m] is micro-batch m of rank r.
RankBatches = list[list[TrainBatch]]
# One weight-sync bucket of (HF name, tensor) pairs, or a Ray object ref of one.
WeightBucket = Any


@dataclass(frozen=True)
class OldLogprobs:
    """What the driver gets back from the old log-probs pass: the rollout/trainer mismatch of the whole batch and,
    when the ranks recorded the routing (R2), each rank's expert loads [M, L, E] in rank order."""

    metrics: dict[str, float]
    counts_MLE: list[np.ndarray] | None = None


@dataclass(frozen=True)
class Values:
    """The critic's values of a batch's samples: V(s_t) over every token of each sequence (aligned with the
    tokens, as ForwardOutput.values_BT), and the value of the state after each sequence's last token."""

    rows: list[np.ndarray]
    after_last_B: np.ndarray


class RoleError(RuntimeError):
    """A role's process died or failed; the message names the role and rank."""


class RankGroup:
    """The ranks of one role. Every call goes to all ranks (they run collectives together)."""

    def __init__(self, name: str, handles: list[Any], remote: bool) -> None:
        self.name, self.handles, self.remote = name, handles, remote

    @property
    def size(self) -> int:
        return len(self.handles)

    def call(
        self, method: Callable[..., Any], per_rank: Sequence[tuple] | None = None, *args: Any
    ) -> list[Any]:
        """Run the worker method `method` (e.g. `TrainerWorker.offload`) on every rank, with per-rank arguments
        or the same `args`, and wait for all."""
        return self.submit(method, per_rank, *args).result()

    def submit(
        self, method: Callable[..., Any], per_rank: Sequence[tuple] | None = None, *args: Any
    ) -> PendingCall:
        """`call` without the wait: the ranks run `method` while the driver goes on (in-process ranks run it
        here, before this returns). A rank runs its calls in the order they were made."""
        name = method.__name__
        arg_lists = list(per_rank) if per_rank is not None else [args] * self.size
        if not self.remote:
            return PendingCall(
                self, name, values=[getattr(h, name)(*a) for h, a in zip(self.handles, arg_lists)]
            )
        return PendingCall(
            self, name, refs=[getattr(h, name).remote(*a) for h, a in zip(self.handles, arg_lists)]
        )

    def stream(self, method: Callable[..., Iterator[Any]], *args: Any) -> Iterator[Any]:
        """Run the generator method `method` (e.g. `TrainerWorker.hf_weights`) on every rank and yield rank 0's
        items as they come: Ray object refs of actors (a worker given one as an argument reads it from the
        object store, so the data never passes through the driver; at most STREAM_AHEAD wait unread), the
        items themselves in-process. The other ranks run alongside (their collectives pair with rank 0's) and
        are waited for after rank 0's last item. Each item, and the end, waits at most CALL_TIMEOUT_S."""
        name = method.__name__
        if not self.remote:
            generators = [getattr(h, name)(*args) for h in self.handles]
            yield from generators[0]
            for rest in generators[1:]:
                for _ in rest:
                    pass
            return
        import ray

        options = {"num_returns": "streaming", "_generator_backpressure_num_objects": STREAM_AHEAD}
        generators = [getattr(h, name).options(**options).remote(*args) for h in self.handles]
        with self._role_errors(name, rank=0):
            yield from _refs(generators[0], name)
        for rank, rest in enumerate(generators[1:], start=1):
            with self._role_errors(name, rank):
                ray.get(list(_refs(rest, name)), timeout=CALL_TIMEOUT_S)

    @contextlib.contextmanager
    def _role_errors(self, name: str, rank: int | None = None) -> Iterator[None]:
        """Ray's errors of a call to `name` as RoleErrors that name the role and the rank (`rank` when only
        that rank's results are read, else the rank Ray's error names)."""
        import ray

        def who(err: Exception) -> str:
            return self._rank_of(err) if rank is None else f"{self.name} rank {rank}"

        try:
            yield
        except ray.exceptions.RayActorError as err:
            if getattr(err, "actor_init_failed", False):
                raise RoleError(f"{who(err)} could not be built{_init_failure(err)}") from err
            raise RoleError(f"{who(err)} died during {name}(){_death_cause(err)}") from err
        except ray.exceptions.GetTimeoutError as err:
            raise RoleError(f"{self.name}.{name}() did not finish within {CALL_TIMEOUT_S:.0f} s") from err
        except ray.exceptions.RayTaskError as err:
            producer = _failed_input(err, name)
            if producer is not None:
                raise RoleError(
                    f"{self.name}.{name}() could not read its input: {producer} failed: "
                    f"{type(err.cause).__name__}: {err.cause}"
                ) from err
            raise RoleError(f"{who(err)}: {name}() failed: {err}") from err

    def subset(self, ranks: Sequence[int]) -> RankGroup:
        """The group of some of these ranks (in that order), for calls that only they answer."""
        return RankGroup(self.name, [self.handles[r] for r in ranks], self.remote)

    def _rank_of(self, err: Exception) -> str:
        """The role and rank of the actor a Ray error came from ("policy rank 1"; "a policy rank" when the
        error does not say)."""
        actor_id = getattr(err, "actor_id", None)
        ids = [h._actor_id.hex() for h in self.handles]  # a Ray ActorHandle keeps its id there
        return f"{self.name} rank {ids.index(actor_id)}" if actor_id in ids else f"a {self.name} rank"


@dataclass
class PendingCall:
    """A call running on every rank of a group (`RankGroup.submit`): Ray object refs, or the in-process ranks'
    results."""

    group: RankGroup
    name: str
    refs: list[Any] | None = None
    values: list[Any] | None = None

    def result(self) -> list[Any]:
        """Every rank's result, in rank order, once all are done (each waits at most CALL_TIMEOUT_S); a failed or
        dead rank raises a RoleError that names it."""
        if self.refs is None:
            return self.values
        import ray

        with self.group._role_errors(self.name):
            return ray.get(self.refs, timeout=CALL_TIMEOUT_S)


@dataclass
class PendingUpdate:
    """A trainer's update in flight (`Trainer.update`)."""

    call: PendingCall

    def result(self) -> list[StepResult]:
        """Rank 0's result of each optimizer step (losses and norms are reduced over the ranks), once every rank
        is done."""
        return self.call.result()[0]


def _failed_input(err: Exception, name: str) -> str | None:
    """The task whose result a call to `name` could not read (e.g. an item of a stream that raised, passed as an
    argument or read with ray.get), from Ray's report; None when the call itself failed. Ray passes the
    producer's error on as the call's cause and names the producing task only in its text."""
    report = str(err)
    names = re.findall(r"ray::([\w.]+)\(\)", report)
    if "input arguments for this task could not be computed" in report:
        return f"{names[1]}()" if len(names) > 1 else "the task that produced it"
    if names and names[0].rsplit(".", 1)[-1] != name:
        return f"{names[0]}()"
    return None


def _refs(generator: Any, name: str) -> Iterator[Any]:
    """The object refs of a Ray streaming generator, each waited for at most CALL_TIMEOUT_S."""
    import ray

    while True:
        ready, _ = ray.wait([generator], timeout=CALL_TIMEOUT_S)
        if not ready:
            raise ray.exceptions.GetTimeoutError(f"{name}() yielded nothing for {CALL_TIMEOUT_S:.0f} s")
        try:
            yield next(generator)
        except StopIteration:
            return


def _death_cause(err: Exception) -> str:
    """The pid and Ray's first sentence on why the process ended, in parentheses, of an actor-death error (""
    when it names neither)."""
    text = " ".join(str(err).split())
    pid = re.search(r"\bpid: (\d+)", text)
    why = re.search(r"Worker exit detail: (.+?)\.(?: |$)", text)
    parts = [f"pid {pid.group(1)}" if pid else "", why.group(1) if why else ""]
    return f" ({'; '.join(p for p in parts if p)})" if any(parts) else ""


def _init_failure(err: Exception) -> str:
    """The pid and the exception its constructor raised (the last line of Ray's traceback), of an actor whose
    creation failed: " (pid 123): FileNotFoundError: ..."."""
    text = str(err)
    pid = re.search(r"\bpid=(\d+)", text)
    raised = [line.strip() for line in text.splitlines() if line.strip()][-1:]
    return (f" (pid {pid.group(1)})" if pid else "") + (f": {raised[0]}" if raised else "")


def start_group(
    name: str, cls: type, args: Sequence[tuple], remote: bool, placement: Reservation | None = None
) -> RankGroup:
    """One `cls(*args[i])` per rank i: Ray actors in `placement`'s bundles when `remote`, else in-process."""
    handles = []
    for rank, rank_args in enumerate(args):
        if remote:
            import ray

            options = placement.options(name, rank) if placement else {"num_cpus": 0.01}
            handles.append(ray.remote(cls).options(**options).remote(*rank_args))
        else:
            handles.append(cls(*rank_args))
    return RankGroup(name, handles, remote)


# ------------------------------------------------------------------------------------------------ rollout
@dataclass
class Rollout:
    """The rollout engines: generation is split over them, weights go to all of them. In the disaggregated
    layout (`seats` given) the engines are the attention workers; the expert workers serve all of them during
    each generate call and receive only their experts' weights."""

    ranks: RankGroup
    seats: list[DisaggSeat] | None = None

    @property
    def engines(self) -> list[int]:
        """The ranks that take requests."""
        if self.seats is None:
            return list(range(self.ranks.size))
        return [r for r, seat in enumerate(self.seats) if seat.experts is None]

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[Any]:
        """Generate on every engine at once, the requests shared by their expected tokens (`share_by_cost`:
        prefill + new tokens, so long continuations spread over the engines); outputs come back in request
        order (a request's seed, not its engine, decides what it samples)."""
        costs = [len(p) + q.max_new_tokens for p, q in zip(prompts, params, strict=True)]
        engines = self.engines
        shares = share_by_cost(costs, len(engines))
        args: list[tuple] = [([], [])] * self.ranks.size
        for rank, share in zip(engines, shares):
            args[rank] = ([list(prompts[i]) for i in share], [params[i] for i in share])
        results = self.ranks.call(RolloutWorker.generate, args)
        outs: list[Any] = [None] * len(prompts)
        for share, rank in zip(shares, engines, strict=True):
            for i, out in zip(share, results[rank], strict=True):
                outs[i] = out
        return outs

    def last_stats(self) -> list[GenerateStats]:
        """Every engine's counters of its last generate call (prefill and decode time, decode rows)."""
        return self.ranks.subset(self.engines).call(RolloutWorker.last_stats)

    def load_weights(self, bucket: WeightBucket) -> None:
        """Every engine gets the bucket (as a ref, each engine reads it from the object store); in the
        disaggregated layout the attention workers get its non-expert tensors and each expert worker its experts'
        tensors (split here, so the driver reads the bucket)."""
        if self.seats is None:
            self.ranks.call(RolloutWorker.load_weights, None, bucket)
            return
        held = [seat.experts for seat in self.seats if seat.experts is not None]
        with self.ranks._role_errors("load_weights"):
            dense, experts = split_weights(_materialized(bucket), held)
        by_range = dict(zip(held, experts))
        parts = [(dense if seat.experts is None else by_range[seat.experts],) for seat in self.seats]
        self.ranks.call(RolloutWorker.load_weights, parts)

    def sleep(self) -> None:
        """Release the engines' KV cache and weights (colocated roles); the next call brings them back."""
        self.ranks.call(RolloutWorker.sleep)

    def info(self) -> list[WorkerInfo]:
        return self.ranks.subset(self.engines).call(RolloutWorker.info)


def _materialized(bucket: WeightBucket) -> list[tuple[str, Any]]:
    """The (name, tensor) pairs of a bucket, read from the object store when it is a ref."""
    if isinstance(bucket, list):
        return bucket
    import ray

    return ray.get(bucket, timeout=CALL_TIMEOUT_S)


def share_by_cost(costs: Sequence[int], num_workers: int) -> list[list[int]]:
    """Request indices per worker, each worker's in request order: longest-processing-time first (the costliest
    request goes to the worker with the least cost so far), so no worker's total exceeds the mean by more than one
    request's cost."""
    totals = [0] * num_workers
    shares: list[list[int]] = [[] for _ in range(num_workers)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(num_workers), key=lambda w: (totals[w], w))
        shares[w].append(i)
        totals[w] += costs[i]
    return [sorted(share) for share in shares]


def start_rollout(
    hf_dir: Path,
    device: str,
    dtype: str,
    rollout_cfg: RolloutConfig,
    num_workers: int,
    remote: bool,
    placement: Reservation | None = None,
    expert_workers: int = 0,
) -> Rollout:
    """The rollout engines, each in its own process, built from an HF directory (the policy's export); waits
    until all are built (or fails with a message naming the role). With `expert_workers` (the disaggregated
    layout) the engines are attention workers that share that many expert workers, one process group."""
    args = (str(hf_dir), device, dtype, rollout_cfg, 1 if device == "cpu" else None)
    if not expert_workers:
        group = start_group("rollout", RolloutWorker, [args] * num_workers, remote, placement)
        group.call(RolloutWorker.ready)  # a Ray actor builds in the background: the first call waits for it
        return Rollout(group)
    num_experts = MoeModelSpec.from_pretrained(hf_dir).num_experts
    with reserved_port() as port:
        seats = layout_seats(num_experts, num_workers, expert_workers, f"tcp://127.0.0.1:{port}")
        group = start_group("rollout", RolloutWorker, [(*args, seat) for seat in seats], remote, placement)
        group.call(RolloutWorker.ready)  # every worker joined: the port may be released
    return Rollout(group, seats)


# ----------------------------------------------------------------------------------------------- trainers
def start_trainers(
    role: str,
    model: ModelConfig,
    parallel: ParallelConfig,
    optim: OptimConfig,
    num_ranks: int,
    *,
    seed: int,
    total_steps: int,
    executor: ExecutorSpec | None = None,
    remote: bool = True,
    placement: Reservation | None = None,
    backend: BackendConfig | None = None,
) -> RankGroup:
    """Start `num_ranks` TrainerWorkers of `role` and wait until all are built (the rendezvous port stays
    reserved until then)."""
    with reserved_port() as port:
        args = [
            (
                RankSpec(
                    role=role, rank=rank, world_size=num_ranks, master_addr="127.0.0.1", master_port=port
                ),
                model,
                parallel,
                optim,
                total_steps,
                seed,
                executor,
                backend,
            )
            for rank in range(num_ranks)
        ]
        group = start_group(role, TrainerWorker, args, remote, placement)
        group.call(TrainerWorker.ready)
    return group


@dataclass
class Trainer:
    """A policy, critic or reference: turns samples into per-rank micro-batches and runs them on its ranks."""

    ranks: RankGroup
    micro_batch_size: int
    routing: bool
    temperature: float = (
        1.0  # of the policy's log-probs: the rollout's (tppo.algo.batching.logprob_temperature)
    )
    micro_batch_tokens: int = 0  # > 0: micro-batches cut by length (tppo.algo.batching.place_by_tokens)

    def placement(self, samples: Sequence[Sample]) -> Placement:
        return place_samples(samples, self.ranks.size, self.micro_batch_size, self.micro_batch_tokens)

    def policy_batches(self, samples: Sequence[Sample], advantages: Sequence[np.ndarray]) -> RankBatches:
        adv = {s.uid: a for s, a in zip(samples, advantages)}
        split = split_for_ranks(samples, self.placement(samples))
        return [
            [
                policy_batch(ss, ff, [adv[s.uid] for s in ss], self.routing, self.temperature)
                for ss, ff in rank
            ]
            for rank in split
        ]

    def critic_batches(
        self, samples: Sequence[Sample], gamma: float = 1.0, placement: Placement | None = None
    ) -> RankBatches:
        """The critic's micro-batches (in `placement`, by default this trainer's), its targets the returns
        discounted by `gamma`."""
        split = split_for_ranks(samples, placement or self.placement(samples))
        return [[critic_batch(ss, ff, self.routing, gamma) for ss, ff in rank] for rank in split]

    def forward(
        self, batches: RankBatches, with_entropy: bool = False, record_routing: bool = False
    ) -> list[list[ForwardOutput]]:
        """Per rank, per micro-batch: the engine's outputs (aligned with `batches`)."""
        return self.ranks.call(TrainerWorker.forward, [(b, with_entropy, record_routing) for b in batches])

    def values(self, samples: Sequence[Sample]) -> Values:
        """The critic's values of each sample's sequence, in the samples' order."""
        placement = self.placement(samples)
        outs = self.forward(self.critic_batches(samples, placement=placement))
        return _values(outs, placement, len(samples))

    def stage(self, batches: RankBatches) -> None:
        """Send this step's micro-batches to the ranks, which keep them for the calls below and the update."""
        self.ranks.call(TrainerWorker.stage, [(b,) for b in batches])

    def old_logprobs(self, record_routing: bool = False) -> OldLogprobs:
        """The pre-update log-probs of the staged batches, kept on the ranks; the mismatch metrics of the whole
        batch and, with `record_routing` (R2), every rank's expert loads in rank order."""
        reports = self.ranks.call(TrainerWorker.old_logprobs, None, record_routing)
        counts = [r.counts_MLE for r in reports] if record_routing else None
        return OldLogprobs(metrics=reports[0].metrics, counts_MLE=counts)

    def ref_logprobs(self, outs: list[list[ForwardOutput]]) -> None:
        """Store the reference policy's outputs on the same micro-batches into the staged batches."""
        self.ranks.call(TrainerWorker.ref_logprobs, [(o,) for o in outs])

    def train(
        self,
        batches: RankBatches | None,
        objective: Callable[..., Any],
        plan: Plan | None = None,
        loads_MLSE: np.ndarray | None = None,
    ) -> StepResult:
        """One optimizer step on every rank over `batches` (None: those staged), under ReLibra's `plan` when
        given; the result of rank 0 (losses and norms are reduced over the ranks)."""
        return self.update(batches, [objective], None, plan, loads_MLSE).result()[0]

    def update(
        self,
        batches: RankBatches | None,
        objectives: Sequence[Callable[..., Any]],
        schedule: Sequence[Sequence[int]] | None = None,
        plan: Plan | None = None,
        loads_MLSE: np.ndarray | None = None,
        old_from_update: bool = False,
    ) -> PendingUpdate:
        """Start one optimizer step per entry of `schedule` (micro-batch indices, the same on every rank; None: one
        step over all) with the matching objective, after staging `batches` (None: those staged); the ranks run it
        while the driver goes on. ReLibra's `plan` places the experts once; the ReLibra metrics and `plan_applied`
        ride on the last step's result. With `old_from_update` the update's forward gives the old log-probs
        (`TrainerWorker.train`) and their mismatch metrics ride there too."""
        if batches is not None:
            self.stage(batches)
        args = (list(objectives), schedule, plan, loads_MLSE, old_from_update)
        return PendingUpdate(self.ranks.submit(TrainerWorker.train, None, *args))

    def router_layout(self) -> RouterLayout:
        return self.ranks.call(TrainerWorker.router_layout)[0]

    def weights(self, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The policy's weights in HF names and logical expert order, in buckets of about `bucket_bytes`, one at
        a time (on Ray: object refs, for `Rollout.load_weights`)."""
        return self.ranks.stream(TrainerWorker.hf_weights, bucket_bytes)

    def offload(self) -> None:
        """Free the devices for a colocated role; the next call that needs the state brings it back."""
        self.ranks.call(TrainerWorker.offload)

    def export_hf(self, out_dir: Path) -> None:
        self.ranks.call(TrainerWorker.export_hf, None, str(out_dir))

    def load_hf(self, path: Path) -> None:
        """Every rank loads a Hugging Face checkpoint's weights (the reference from the policy's export)."""
        self.ranks.call(TrainerWorker.load_hf, None, str(path))

    def save(self, shards: Sequence[Path], with_optimizer: bool = True) -> None:
        """Every rank writes its shard to `shards[rank]`."""
        self.ranks.call(TrainerWorker.save, [(str(p), with_optimizer) for p in self._per_rank(shards)])

    def load(self, shards: Sequence[Path]) -> None:
        self.ranks.call(TrainerWorker.load, [(str(p),) for p in self._per_rank(shards)])

    def _per_rank(self, shards: Sequence[Path]) -> Sequence[Path]:
        if len(shards) != self.ranks.size:
            raise ValueError(
                f"{len(shards)} shard paths for the {self.ranks.size} ranks of {self.ranks.name}"
            )
        return shards


def _values(outs: list[list[ForwardOutput]], placement: Placement, num: int) -> Values:
    """Per-sample values back in the samples' order (fillers dropped)."""
    rows: list[np.ndarray | None] = [None] * num
    ends = np.zeros(num, np.float32)
    for rank_rows, rank_outs in zip(placement.rows, outs):
        for mb_rows, out in zip(rank_rows, rank_outs):
            for j, i in enumerate(mb_rows):
                rows[i] = out.values_BT[j].float().numpy()
                ends[i] = float(out.end_values_S[j])
    return Values(rows=[r for r in rows if r is not None], after_last_B=ends)
