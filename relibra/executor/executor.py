"""`ExpertExecutor`: applies ReLibra plans to the MoE layers of an engine (`engine_api.ExpertEngine`, which
`tppo.engine.engine.MegatronEngine` is).

Slot layout. Every EP rank g holds H = E / EP home slots (the stacked `GroupedExperts.weight1/weight2`
parameters with their optimizer state; `logical_expert_ids` says which logical expert each holds, ascending)
and, while a plan with replicas runs, R replica slots (a buffer without optimizer state, rewritten for every
(micro-batch, layer)). Megatron's token dispatcher sees P = EP * J physical experts, J = H + R, physical id
p = g * J + j; the executor builds one dispatcher per layer for that layout and swaps it in for the step.

Per step (`step(plan, loads_MLSE)` or `begin_step` / `end_step` around `engine.train_step`):
1. check the plan (relibra.validate plus the engine's layer and micro-batch counts) and that every rank of the
   EP group holds the same plan, before any tensor moves: a bad plan raises PlanError on every rank;
2. reorder: migrate experts to the plan's `home_LE` by swapping slot contents between ranks (weights and the
   optimizer state tensors shaped like them: AdamW's exp_avg / exp_avg_sq; parameter objects, gradient
   buffers and optimizer state objects stay where they are). Only the weights move before the step; the
   optimizer state (12 of the 14 bytes per parameter under mixed precision) travels while the step computes,
   in chunks of layers within `state_buffer_mb` of receive buffers (relibra.executor.migration), landed by the
   expert hooks as it arrives and at the latest by the engine's `optimizer_state_hooks` (before the optimizer
   step, offload or a checkpoint);
3. for every micro-batch m (counted by a forward pre-hook on the decoder) and layer: reroute the router's
   logical top-k to physical slots following the plan's quotas for this rank's tokens
   (relibra.executor.reroute), push replica weights from their owners (relibra.executor.comm), compute home +
   replica slots in one grouped GEMM, and fold replica gradients into the owners' gradients in the backward.
Between steps the placement stays: routing maps every logical expert to its home slot (a column permutation,
skipped entirely under Megatron's static placement, so the static path is untouched).

Checkpoints and HF export follow `logical_expert_ids`, so they come out in logical order whatever the placement;
`load_checkpoint` loads an engine checkpoint saved under another placement.

Metrics of a step (`end_step`, keys `relibra/exec_*`): apply time (check + migration + tables), experts migrated
into this rank and bytes it sent, the chunks of optimizer state moved during the step and how many of them the
optimizer step still had to wait for, replica pushes, replicas per (micro-batch, layer), the measured skew (max/mean
over the EP group of the pairs each rank's experts computed, averaged over (micro-batch, layer); padding tokens
included) and the measured expert forward time (this rank, max and mean over the EP group; CUDA events on GPU).
Planner time, planned skew and simulated MoE time come from tppo.loop.balance.LoadPlanner.

Activation recompute: a checkpointed layer's recompute (in the backward) routes and re-pushes replicas for the
micro-batch of its first forward (a FIFO per layer, as the routing replay's queue), so plans stay indexed by
micro-batch id.

Optimizer state that migrates with an expert: torch optimizers' state tensors shaped like the parameter (AdamW's
exp_avg / exp_avg_sq; tested on CPU); Megatron's distributed optimizer's fp32 master weight and moments through
its per-parameter accessors when expert data parallelism is 1 (GPU only, test marked gpu).

Limits (raised, not silently wrong): migration with Megatron's distributed optimizer sharded over
expert-data-parallel ranks; plans must be
the same on every rank of the EP group; the expert-data-parallel copies of the EP group must get the same
`home_LE` (checked).

Legend: M micro-batches, L MoE layers (of the plan; `layers` are this stage's), E logical experts, G EP ranks,
J slots per rank, H home slots, R replica slots, P physical slots, N tokens seen by a router.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from relibra.executor.comm import land_slot_moves, move_slots, push_replicas
from relibra.executor.engine_api import ExpertEngine
from relibra.executor.migration import StateJob, StateMigration
from relibra.executor.reroute import permute_routing, reroute_routing
from relibra.executor.tables import (
    ReplicaExchange,
    check_plan,
    migration_moves,
    replica_exchanges,
    reroute_tables,
)
from relibra.plan import Plan, Topology, home_slots_LGH
from relibra.validate import PlanError

__all__ = ["ExecutorStep", "ExpertExecutor", "MigrationStats"]


@dataclass
class MigrationStats:
    """What one reorder moved on this rank: experts received from other ranks and bytes sent."""

    num_experts_in: int = 0
    bytes_sent: int = 0


@dataclass
class ExecutorStep:
    """The per-step state of an applied plan on this rank."""

    plan: Plan
    inst_MLEI: torch.Tensor
    cum_MLEI: torch.Tensor
    exchanges: list[list[ReplicaExchange]]
    migration: MigrationStats
    apply_s: float
    microbatch: int = -1
    pushes: int = 0
    current_LI: list[int] = field(default_factory=list)  # micro-batch of each layer's running forward
    pending_LI: list[list[int]] = field(default_factory=list)  # recompute FIFO per layer
    pairs: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (m, layer, pairs computed)
    timings: list = field(default_factory=list)  # (start, end) events or host times of expert forwards
    extra: dict = field(default_factory=dict)


class ExpertExecutor:
    """Applies plans to `engine`'s MoE layers; process groups come from `engine.groups` (EP and expert-DP)."""

    def __init__(
        self,
        engine: ExpertEngine,
        *,
        num_replica_slots: int = 0,
        gpus_per_node: int = 8,
        state_buffer_mb: float = 1024,
    ) -> None:
        groups = engine.groups
        self.engine = engine
        self.group, self.rank = groups.ep, groups.ep_rank
        self.expt_dp = groups.expt_dp
        self.device = groups.device
        # With activation recompute a layer's first forward runs without grad and its recompute (inside the
        # backward, grad on) must use the same micro-batch: a FIFO per layer, consumed in backward order,
        # which is the forward order under Megatron's schedules (as the routing replay's own queue).
        self.recompute = engine.config.recompute_granularity is not None
        self.layers = list(engine.moe_layers)
        for layer in self.layers:
            if not hasattr(layer.experts, "logical_expert_ids"):
                raise ValueError("the ReLibra executor needs GroupedExperts (engine experts='grouped')")
        self.layer_ids = list(engine.replay.moe_layer_ids)  # plan layer of each local MoE layer
        self.num_plan_layers = engine.num_moe_layers
        self.topo = Topology(
            num_gpus=groups.ep_size,
            gpus_per_node=gpus_per_node,
            num_experts=engine.model_cfg.num_experts,
            num_replica_slots=num_replica_slots,
        )
        self.slots_LGH = self._gather_slots()
        self._static = self._is_static()
        # Optimizer state of a migration travels over a group of its own while the step runs (NCCL serialises
        # the work of one communicator: on the EP group it would hold up the first dispatch).
        self._state_group = dist.new_group(
            dist.get_process_group_ranks(self.group), use_local_synchronization=True
        )
        # Initialise its communicator now, with every member, not inside a step (NCCL does so on first use).
        dist.all_reduce(torch.zeros(1, device=self.device), group=self._state_group)
        self._state = StateMigration(
            self._state_group,
            max(1, int(state_buffer_mb * 2**20)),
            self._state_tensors,
            self._land_state_rows,
        )
        engine.optimizer_state_hooks.append(self.land_state)
        self._log_of_phys = [self._home_permutation(li) for li in range(len(self.layers))]
        self._home_dispatchers = [layer.token_dispatcher for layer in self.layers]
        self._slot_dispatchers: list | None = None
        self._step: ExecutorStep | None = None
        for li, layer in enumerate(self.layers):
            layer.route_hook = self._route_hook(li)
        self._hook = engine.module.decoder.register_forward_pre_hook(self._next_microbatch)
        self._expert_hooks = []
        for li, layer in enumerate(self.layers):
            self._expert_hooks.append(layer.experts.register_forward_pre_hook(self._expert_start(li)))
            self._expert_hooks.append(layer.experts.register_forward_hook(self._expert_end))

    # ----------------------------------------------------------------- placement
    def _gather_slots(self) -> np.ndarray:
        """int [L_local, G, H]: the logical experts every rank's home slots hold, from `logical_expert_ids`."""
        ids = torch.tensor(
            [layer.experts.logical_expert_ids for layer in self.layers], dtype=torch.long, device=self.device
        )
        parts = [torch.empty_like(ids) for _ in range(self.topo.num_gpus)]
        dist.all_gather(parts, ids, group=self.group)
        return torch.stack(parts, dim=1).cpu().numpy()

    def _is_static(self) -> bool:
        G, H = self.topo.num_gpus, self.topo.num_home_slots
        static_GH = np.arange(G * H).reshape(G, H)
        return bool((self.slots_LGH == static_GH[None]).all())

    def _home_permutation(self, li: int) -> torch.Tensor:
        return torch.as_tensor(self.slots_LGH[li].reshape(-1), dtype=torch.long, device=self.device)

    @property
    def home_LE(self) -> np.ndarray:
        """int [L_local, E]: the EP rank owning every logical expert of this stage's MoE layers."""
        L, G, H = self.slots_LGH.shape
        home = np.empty((L, G * H), dtype=np.int64)
        for li in range(L):
            home[li, self.slots_LGH[li].reshape(-1)] = np.repeat(np.arange(G), H)
        return home

    # ----------------------------------------------------------------- hooks
    def _next_microbatch(self, module, args) -> None:
        if self._step is not None:
            self._step.microbatch += 1
            if self._step.microbatch >= self._step.plan.num_microbatches:
                raise ValueError(
                    f"the plan covers {self._step.plan.num_microbatches} micro-batches; the step runs more"
                )

    def _route_hook(self, li: int):
        def hook(layer, probs_NE: torch.Tensor, routing_map_NE: torch.Tensor):
            step = self._step
            if step is None:
                if self._static:
                    return probs_NE, routing_map_NE
                return permute_routing(probs_NE, routing_map_NE, self._log_of_phys[li])
            m = self._layer_microbatch(step, li)
            num_phys = self.topo.num_gpus * self.topo.num_slots
            return reroute_routing(
                probs_NE, routing_map_NE, step.inst_MLEI[m, li], step.cum_MLEI[m, li], num_phys
            )

        return hook

    def _expert_start(self, li: int):
        def hook(module, args) -> None:
            self._state.progress()  # land migrated optimizer state that has arrived, post the next chunk
            step = self._step
            if step is None or (self.recompute and torch.is_grad_enabled()):
                return  # measure first passes only
            step.pairs.append((step.current_LI[li], li, args[1].sum()))
            step.timings.append([self._now(), None])

        return hook

    def _expert_end(self, module, args, output) -> None:
        step = self._step
        if step is not None and step.timings and step.timings[-1][1] is None:
            step.timings[-1][1] = self._now()

    def _now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _measured(self, step: ExecutorStep) -> dict[str, float]:
        """Measured pairs per GPU (skew over the EP group) and expert forward time, from this step's hooks."""
        M, L = step.plan.num_microbatches, len(self.layers)
        pairs_ML = torch.zeros(M, L, dtype=torch.float64)
        for m, li, n in step.pairs:
            pairs_ML[m, li] += float(n)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            ms = sum(a.elapsed_time(b) for a, b in step.timings if b is not None)
        else:
            ms = sum((b - a) * 1e3 for a, b in step.timings if b is not None)
        parts = [
            torch.empty(M * L + 1, dtype=torch.float64, device=self.device) for _ in range(self.topo.num_gpus)
        ]
        mine = torch.cat([pairs_ML.reshape(-1), torch.tensor([ms], dtype=torch.float64)]).to(self.device)
        dist.all_gather(parts, mine, group=self.group)
        table = torch.stack(parts).cpu()  # [G, M L + 1]
        per_gpu = table[:, :-1]
        mean = per_gpu.mean(0)
        busy = mean > 0
        skew = (per_gpu.max(0).values[busy] / mean[busy]).mean() if busy.any() else torch.tensor(float("nan"))
        return {
            "relibra/exec_skew_measured": float(skew),
            "relibra/exec_expert_fwd_ms": float(ms),
            "relibra/exec_expert_fwd_ms_max": float(table[:, -1].max()),
            "relibra/exec_expert_fwd_ms_mean": float(table[:, -1].mean()),
        }

    def _layer_microbatch(self, step: ExecutorStep, li: int) -> int:
        """The micro-batch a layer's forward belongs to: the decoder's count, or the recompute FIFO's head."""
        if not self.recompute:
            m = step.microbatch
        elif torch.is_grad_enabled():  # the recompute pass inside the backward
            if not step.pending_LI[li]:
                raise RuntimeError(f"activation recompute of MoE layer {li} found no micro-batch left")
            m = step.pending_LI[li].pop(0)
        else:  # the first forward of a checkpointed layer
            m = step.microbatch
            step.pending_LI[li].append(m)
        step.current_LI[li] = m
        return m

    def _weight_provider(self, li: int):
        def provide(experts) -> tuple[torch.Tensor, torch.Tensor]:
            step = self._step
            w1, w2 = experts.weight1, experts.weight2
            if step is None:
                return w1, w2
            exchange = step.exchanges[step.current_LI[li]][li]
            step.pushes += len(exchange.recvs)
            r1, r2 = push_replicas(w1, w2, exchange, self.topo.num_replica_slots, self.group)
            return torch.cat([w1, r1]), torch.cat([w2, r2])

        return provide

    def _build_slot_dispatchers(self) -> list:
        from megatron.core.process_groups_config import ProcessGroupCollection

        J = self.topo.num_slots
        out = []
        for layer, home in zip(self.layers, self._home_dispatchers, strict=True):
            config = copy.copy(layer.config)
            config.num_moe_experts = self.topo.num_gpus * J
            pgs = ProcessGroupCollection(ep=home.ep_group, expt_tp=home.tp_group, tp_ep=home.tp_ep_group)
            indices = [self.rank * J + j for j in range(J)]
            out.append(type(home)(J, indices, config=config, pg_collection=pgs))
        return out

    # ----------------------------------------------------------------- plans
    def check(self, plan: Plan, loads_MLSE: np.ndarray, num_microbatches: int | None = None) -> None:
        """Raise PlanError on EVERY rank of the EP group (and its expert-DP copies) unless all can apply `plan`.

        Collective; nothing moves. The ranks agree on the outcome, so a bad plan never leaves some ranks waiting
        in a migration the others refused.
        """
        error = None
        try:
            check_plan(
                plan,
                loads_MLSE,
                self.topo,
                num_layers=self.num_plan_layers,
                num_microbatches=num_microbatches,
            )
        except Exception as err:  # any malformed plan: every rank must still reach the vote below
            error = f"{type(err).__name__}: {err}" if not isinstance(err, PlanError) else str(err)
        digest = _digest(plan) if error is None else 0
        home_digest = _digest_home(plan) if error is None else 0
        table = torch.tensor(
            [float(error is not None), digest, -digest, home_digest, -home_digest], dtype=torch.float64
        ).to(self.device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.group)
        if self.expt_dp is not None and dist.get_world_size(self.expt_dp) > 1:
            only_home = table.clone()
            only_home[1:3] = 0
            dist.all_reduce(only_home, op=dist.ReduceOp.MAX, group=self.expt_dp)
            table = torch.maximum(table, only_home)
        if error is not None:
            raise PlanError(error)
        if table[0] > 0:
            raise PlanError("another rank of the EP group refused the plan (see its error)")
        if table[1] != -table[2]:
            raise PlanError("the ranks of the EP group were given different plans")
        if table[3] != -table[4]:
            raise PlanError("the expert-data-parallel copies of the EP group were given different home_LE")

    def begin_step(
        self, plan: Plan, loads_MLSE: np.ndarray, num_microbatches: int | None = None
    ) -> ExecutorStep:
        """Check `plan`, migrate experts to its placement, and route the next step's micro-batches by it."""
        if self._step is not None:
            raise RuntimeError("a plan is already applied: call end_step() first")
        start = time.perf_counter()
        self.check(plan, loads_MLSE, num_microbatches)
        # The step's forward and backward need only the weights: the optimizer state travels meanwhile.
        migration = self.migrate(plan.home_LE[self.layer_ids], defer_state=True)
        inst, cum = reroute_tables(plan, self.topo, self.rank, self.layer_ids)
        step = ExecutorStep(
            plan=plan,
            inst_MLEI=torch.as_tensor(inst, device=self.device),
            cum_MLEI=torch.as_tensor(cum, device=self.device),
            exchanges=replica_exchanges(plan, self.topo, self.rank, self.layer_ids),
            migration=migration,
            apply_s=0.0,
            current_LI=[-1] * len(self.layers),
            pending_LI=[[] for _ in self.layers],
        )
        if self.topo.num_replica_slots > 0:
            if self._slot_dispatchers is None:
                self._slot_dispatchers = self._build_slot_dispatchers()
            for li, layer in enumerate(self.layers):
                layer.token_dispatcher = self._slot_dispatchers[li]
                layer.experts.weight_provider = self._weight_provider(li)
        step.apply_s = time.perf_counter() - start
        self._step = step
        return step

    def end_step(self) -> dict[str, float]:
        """Stop routing by the plan (the placement stays); return the step's metrics (`relibra/exec_*`)."""
        step, self._step = self._step, None
        self.land_state()  # when the step stopped before the optimizer step (an error, forward_backward alone)
        for layer, home in zip(self.layers, self._home_dispatchers, strict=True):
            layer.token_dispatcher = home
            layer.experts.weight_provider = None
        if step is None:
            return {}
        ran = step.microbatch + 1
        if ran not in (0, step.plan.num_microbatches):
            raise ValueError(
                f"the plan covers {step.plan.num_microbatches} micro-batches; the step ran {ran}"
            )
        H = self.topo.num_home_slots
        replicas = step.plan.slots_MLGJ[:, self.layer_ids, :, H:]
        return {
            "relibra/exec_apply_s": step.apply_s,
            "relibra/exec_migrated_experts": float(step.migration.num_experts_in),
            "relibra/exec_migration_bytes": float(step.migration.bytes_sent),
            "relibra/exec_state_chunks": float(self._state.num_chunks),
            "relibra/exec_state_waited_chunks": float(self._state.waited_chunks),
            "relibra/exec_replica_pushes": float(step.pushes),
            "relibra/exec_replicas_per_mb_layer": float((replicas >= 0).sum(axis=(2, 3)).mean()),
            **self._measured(step),
        }

    @contextmanager
    def step(
        self, plan: Plan, loads_MLSE: np.ndarray, num_microbatches: int | None = None
    ) -> Iterator[ExecutorStep]:
        """`with executor.step(plan, loads): engine.train_step(...)`; the metrics land in `step.extra`."""
        state = self.begin_step(plan, loads_MLSE, num_microbatches)
        try:
            yield state
        finally:
            state.extra.update(self.end_step())

    # ----------------------------------------------------------------- migration
    def migrate(self, home_LE: np.ndarray, *, defer_state: bool = False) -> MigrationStats:
        """Move experts so that rank g owns the experts home_LE[l] assigns to g (rows: this stage's layers).

        Collective over the EP group. Call between optimizer steps (gradients are not moved); `defer_state` as
        in `migrate_slots`.
        """
        new_LGH = home_slots_LGH(np.asarray(home_LE), self.topo)
        return self.migrate_slots(new_LGH, defer_state=defer_state)

    def migrate_slots(self, new_LGH: np.ndarray, *, defer_state: bool = False) -> MigrationStats:
        """Move slot contents to new_LGH[l, g, j] (logical ids, any order inside a rank).

        The weights move now. With `defer_state` the optimizer state moves behind the coming step
        (relibra.executor.migration) and has landed once the engine ran its optimizer-state hooks; otherwise it
        lands before this returns.
        """
        new_LGH = np.asarray(new_LGH)
        if new_LGH.shape != self.slots_LGH.shape:
            raise ValueError(f"new placement has shape {new_LGH.shape}, expected {self.slots_LGH.shape}")
        self.land_state()
        stats = MigrationStats()
        jobs, recv_XG = [], []
        for li in range(len(self.layers)):
            old_GH = self.slots_LGH[li]
            if (new_LGH[li] == old_GH).all():
                continue
            moves = migration_moves(old_GH, new_LGH[li], self.rank)
            experts = self.layers[li].experts
            for param in (experts.weight1, experts.weight2):
                stats.bytes_sent += move_slots(param.data, moves, self.group)
            jobs.append(StateJob((experts.weight1, experts.weight2), moves))
            recv_XG.append([np.setdiff1d(new_LGH[li, g], old_GH[g]).size for g in range(len(old_GH))])
            stats.num_experts_in += len(moves.recvs)
            experts.logical_expert_ids = [int(e) for e in new_LGH[li, self.rank]]
            self.slots_LGH[li] = new_LGH[li]
            self._log_of_phys[li] = self._home_permutation(li)
        self._static = self._is_static()
        row_bytes = self._state.row_bytes(jobs[0].params) if jobs else 0
        stats.bytes_sent += self._state.begin(jobs, np.array(recv_XG), row_bytes)
        if not defer_state:
            self.land_state()
        return stats

    @property
    def state_in_flight(self) -> bool:
        """Whether optimizer state of a migration is still on its way (`land_state` completes it)."""
        return self._state.in_flight

    def land_state(self) -> None:
        """Complete the optimizer-state transfers of the last migration (a no-op when none is in flight)."""
        self._state.finish()

    def _land_state_rows(self, param: torch.nn.Parameter, transfers: dict) -> None:
        if self.engine.megatron_optimizer:
            self._land_megatron_state(param, transfers)
            return
        state = self.engine.optimizer.state[param]
        for key, transfer in transfers.items():
            land_slot_moves(state[key], transfer)

    def _state_tensors(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The optimizer state of `param` that migrates with it, each viewed with the parameter's shape.

        torch optimizers: the state tensors shaped like the parameter (AdamW's exp_avg / exp_avg_sq). Megatron's
        distributed optimizer: the fp32 master weight and Adam moments, only unsharded (expert data-parallel
        size 1: this rank's shard is the whole parameter); a sharded state raises NotImplementedError.
        """
        if not self.engine.megatron_optimizer:
            state = self.engine.optimizer.state.get(param, {})
            return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == param.shape}
        out = {}
        for key, value in self._megatron_owner(param)._get_main_param_and_optimizer_states(param).items():
            if not isinstance(value, torch.Tensor) or value.numel() <= 1:
                continue
            # fp32 model parameters have no separate master copy: Megatron's "main param" is a view of the
            # parameter's own buffer, which the weights' move has already rewritten.
            if value.untyped_storage().data_ptr() == param.data.untyped_storage().data_ptr():
                continue
            if value.numel() != param.numel():
                raise NotImplementedError(
                    "expert migration with Megatron's distributed optimizer sharded over expert-data-parallel "
                    f"ranks is not implemented ({key}: {value.numel()} of {param.numel()} values here)"
                )
            out[key] = value.detach().reshape(param.shape)
        return out

    def _megatron_owner(self, param: torch.nn.Parameter):
        chained = getattr(self.engine.optimizer, "chained_optimizers", [self.engine.optimizer])
        owners = [opt for opt in chained if param in opt.model_param_group_index_map]
        if len(owners) != 1:
            raise RuntimeError(
                f"expert parameter {tuple(param.shape)} is in {len(owners)} Megatron optimizers, not 1"
            )
        return owners[0]

    def _land_megatron_state(self, param: torch.nn.Parameter, transfers: dict) -> None:
        # The accessors may hand out copies (precision-aware optimizer): land into a copy and write it back.
        opt = self._megatron_owner(param)
        tensors = opt._get_main_param_and_optimizer_states(param)
        moved = {}
        for key, transfer in transfers.items():
            full = tensors[key].detach().reshape(param.shape).clone()
            land_slot_moves(full, transfer)
            moved[key] = full.reshape(tensors[key].shape)
        # The fp32 main parameter is a leaf that requires grad: copy into it untracked.
        with torch.no_grad():
            opt._set_main_param_and_optimizer_states(param, {**tensors, **moved})

    # ----------------------------------------------------------------- checkpoints
    def load_checkpoint(self, state_dict: dict, *, keep_saved_placement: bool = False) -> None:
        """Load an engine checkpoint saved under any placement (`MegatronEngine.state_dict`).

        Collective over the EP group: migrates to the checkpoint's placement, loads, and (unless
        `keep_saved_placement`) migrates back to the placement in force before the call.
        """
        saved = state_dict["expert_placement"]
        ids = torch.tensor([saved[k] for k in sorted(saved, key=int)], dtype=torch.long, device=self.device)
        parts = [torch.empty_like(ids) for _ in range(self.topo.num_gpus)]
        dist.all_gather(parts, ids, group=self.group)
        saved_LGH = torch.stack(parts, dim=1).cpu().numpy()
        target = self.slots_LGH.copy()
        self.migrate_slots(saved_LGH)
        self.engine.load_state_dict(state_dict)
        if not keep_saved_placement:
            self.migrate_slots(target)

    def detach(self) -> None:
        """Remove the hooks (the placement stays in `logical_expert_ids`; routing falls back to Megatron's)."""
        if self._step is not None:
            self.end_step()
        self.land_state()
        if not self._static:
            raise RuntimeError(
                "detach under a non-static placement would route to the wrong experts: migrate back"
            )
        for layer in self.layers:
            layer.route_hook = None
        self._hook.remove()
        for hook in self._expert_hooks:
            hook.remove()
        self.engine.optimizer_state_hooks.remove(self.land_state)


def _digest(plan: Plan) -> float:
    h = hashlib.sha256()
    for a in (plan.home_LE, plan.slots_MLGJ, plan.quota_MLGJS):
        arr = np.ascontiguousarray(np.asarray(a, dtype=np.int64))
        h.update(str(arr.shape).encode())
        h.update(arr.tobytes())
    return float(int.from_bytes(h.digest()[:6], "little"))


def _digest_home(plan: Plan) -> float:
    h = hashlib.sha256(np.ascontiguousarray(np.asarray(plan.home_LE, dtype=np.int64)).tobytes())
    return float(int.from_bytes(h.digest()[:6], "little"))
