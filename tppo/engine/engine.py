"""The training engine: one Megatron-Core MoE model (policy or critic) with its optimizer, behind a small API.

    engine = MegatronEngine(model_cfg, parallel_cfg, optim_cfg, role="policy")
    outs = engine.forward(batches, with_entropy=True)            # per-token log-probs (no grad)
    result = engine.train_step(batches, loss_fn)                  # forward + backward + optimizer step
    engine.offload(); ...; engine.onload()                        # colocated rollout
    sd = engine.state_dict(); engine.load_state_dict(sd)          # checkpoints
    engine.export_hf(out_dir); engine.iter_hf_weights(bucket)     # logical expert order

Every rank of the trainer calls the same methods with its own micro-batches (ranks of one data-parallel
replica, i.e. TP and PP peers, must pass the same ones; ranks of one EP group must pass the same NUMBER of
micro-batches, which the engine checks, and on CPU it pads their shapes to a common one for the allgather
dispatcher). Micro-batches run through Megatron's
forward/backward schedule (1F1B with pipeline parallelism); the loss callable sees per-token outputs on
the last pipeline stage and returns a `LossOutput` whose gradient convention is
grad(sum loss_sum) / sum denominator over the whole step (Megatron's per-token loss mode).

Tested on CPU over gloo: EP=2, TP=2 with sequence parallelism (+EP=2), PP=2 (1F1B), each against one
process. On GPU: bf16 parameters, Megatron's distributed optimizer (fp32 master weights, Adam) and alltoall token
dispatch. On CPU (tests, CI): fp32, the allgather dispatcher, and torch's AdamW behind the same interface;
Megatron's DDP accumulates gradients in `param.main_grad`, so the CPU optimizer is handed main_grad
before every step (otherwise it would silently never move the weights). Gradient clipping, the LR
schedule and the non-finite-gradient skip are ours on both devices.

Legend: B sequences, T tokens, S tokens after padding for sequence parallelism, V vocabulary slice of
this TP rank, L MoE layers, K top-k, N tokens as a router sees them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from tppo.base.offload import StorageOffloader
from tppo.base.registry import Registry
from tppo.engine import grouped_wgrad
from tppo.engine.batch import ForwardOutput, LossOutput, StepResult, TrainBatch, replayed_ids, to_device
from tppo.engine.config import ModelConfig, OptimConfig, ParallelConfig
from tppo.engine.experts import GroupedExperts
from tppo.engine.layout import RouterLayout
from tppo.engine.logprobs import aligned_logprobs, aligned_values
from tppo.engine.model import BuiltModel, build_model, moe_layer_ids
from tppo.engine.parallel import ParallelGroups, init_parallel
from tppo.engine.replay import RouterReplayAction, check_routed_experts
from tppo.engine.steps import LossFn, TrainSteps

__all__ = ["LR_SCHEDULES", "MegatronEngine", "end_values", "lr_at", "unshare_adam_steps", "use_fused_adam"]

_KEPT = "logprobs_BT"  # the store entry of a micro-batch's kept log-probs (not a metric)

LR_SCHEDULES: Registry[Callable[[int, OptimConfig, int | None], float]] = Registry("LR schedule")


def _warmup(step: int, cfg: OptimConfig) -> float | None:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return None


@LR_SCHEDULES.register("constant")
def constant_lr(step: int, cfg: OptimConfig, total_steps: int | None) -> float:
    """lr_s = lr (s+1)/W for s < W warm-up steps, then lr."""
    warm = _warmup(step, cfg)
    return cfg.lr if warm is None else warm


@LR_SCHEDULES.register("cosine")
def cosine_lr(step: int, cfg: OptimConfig, total_steps: int | None) -> float:
    """Warm-up as `constant`, then lr_s = min + (lr - min) (1 + cos(pi (s-W)/(S-W))) / 2, held at min after S."""
    if not total_steps:
        raise ValueError("the cosine LR schedule needs total_steps (optimizer steps of the run)")
    warm = _warmup(step, cfg)
    if warm is not None:
        return warm
    span = max(total_steps - cfg.warmup_steps, 1)
    frac = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def lr_at(step: int, cfg: OptimConfig, total_steps: int | None = None) -> float:
    """Learning rate of optimizer step `step` (0-based) under `cfg.schedule`."""
    return LR_SCHEDULES.get(cfg.schedule)(step, cfg, total_steps)


def unshare_adam_steps(optimizer: torch.optim.Optimizer) -> int:
    """Give every parameter's Adam state its own `step` tensor; return how many were shared.

    Megatron 0.16.1's DistributedOptimizer.load_state_dict (without Apex/TE) puts ONE step tensor in every
    parameter's state; torch's Adam then increments it once per parameter, so after resuming the bias
    correction uses step 1 + N instead of 2 and the run silently diverges from the uninterrupted one.
    """
    seen: set[int] = set()
    shared = 0
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
                shared += 1
            seen.add(id(state["step"]))
    return shared


def use_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Switch a CUDA torch Adam/AdamW to its fused kernel (one launch per tensor chunk); return whether it did.

    Megatron builds torch's AdamW without `fused` when neither apex nor transformer-engine is installed; the
    default multi-tensor path reads and writes the optimizer state several times per step. The update rule
    is the same. Step counters already created on the host move to the device, where the fused kernel
    reads them.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or any(not p.is_cuda or not p.is_floating_point() for p in params):
        return False
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = True, False
    optimizer.defaults.update(fused=True, foreach=False)
    for p, state in optimizer.state.items():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return True


def _drop_empty_entries(state: dict) -> dict:
    """Remove the empty entries a lookup leaves in an optimizer's state (a defaultdict); return the state.

    Megatron reads a parameter's Adam state by indexing it, which adds an empty entry for a parameter that has
    not stepped; Megatron's load then skips allocating the moments it is about to fill (KeyError 'exp_avg' at
    the next step; seen at EP 2 on GPUs) and its state_dict looks for a step counter in every entry.
    """
    for param in [p for p, entry in state.items() if not entry]:
        del state[param]
    return state


def _cpu_copy(obj):
    """A copy of a (nested) state dict with every tensor cloned to the CPU: live optimizer state moves on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


@dataclass
class _MicroBatch:
    """A TrainBatch prepared for this rank: device tensors, padding for SP, this stage's replay ids."""

    batch: TrainBatch
    input_ids_BS: torch.Tensor
    num_rows: int  # B before padding
    num_tokens: int  # T before padding
    packed_seq_params: object | None
    padding_mask_BS: torch.Tensor | None
    replay_NK: list[torch.Tensor] | None
    record: bool
    recorded_BTLK: torch.Tensor | None = None


class MegatronEngine(TrainSteps):
    """A policy (log-probs) or critic (values) model on Megatron-Core with its optimizer and LR schedule."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        parallel_cfg: ParallelConfig,
        optim_cfg: OptimConfig,
        *,
        role: str = "policy",
        total_steps: int | None = None,
        seed: int = 0,
        experts: str = "grouped",
        load_weights: bool = True,
        dispatcher: str | None = None,
        optimizer: str = "auto",
    ) -> None:
        if role not in ("policy", "critic"):
            raise ValueError(f"role must be 'policy' or 'critic', got {role!r}")
        self.model_cfg, self.parallel_cfg, self.optim_cfg = model_cfg, parallel_cfg, optim_cfg
        self.role, self.total_steps = role, total_steps
        self.groups: ParallelGroups = init_parallel(parallel_cfg)
        self.cuda = self.groups.device.type == "cuda"
        if optimizer not in ("auto", "megatron", "torch", "none"):
            raise ValueError(f"optimizer must be 'auto', 'megatron', 'torch' or 'none', got {optimizer!r}")
        # Megatron's distributed optimizer on GPU, torch's AdamW on CPU; "torch" also works on GPU. "none": a
        # forward-only engine (a reference policy): no gradient buffers, no optimizer state.
        self.trainable = optimizer != "none"
        self.megatron_optimizer = optimizer == "megatron" or (optimizer == "auto" and self.cuda)
        if self.megatron_optimizer and not self.cuda:
            raise ValueError("optimizer='megatron' needs CUDA (Megatron's optimizer allocates CUDA tensors)")
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[model_cfg.dtype]
        if self.dtype == torch.bfloat16 and not self.cuda:
            raise ValueError("model.dtype=bfloat16 needs CUDA; CPU runs train in float32")
        if model_cfg.vocab_size % self.groups.tp_size:
            raise ValueError(
                f"vocab_size={model_cfg.vocab_size} is not divisible by tensor_parallel={self.groups.tp_size}"
            )
        torch.manual_seed(seed)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)  # GPU initialisation draws from Megatron's RNG tracker
        self.built: BuiltModel = build_model(
            model_cfg,
            parallel_cfg,
            pp_rank=self.groups.pp_rank,
            pp_size=self.groups.pp_size,
            cuda=self.cuda,
            dtype=self.dtype,
            value_head=role == "critic",
            experts=experts,
            dispatcher=dispatcher,
        )
        self.module = self.built.model
        self.config = self.built.config
        self.config.variable_seq_lengths = self.groups.pp_size > 1
        if self.trainable:
            self.ddp = self._wrap_ddp(self.built)
        else:
            self.ddp = None
            self.module.requires_grad_(False)
        self.num_moe_layers = len(moe_layer_ids(model_cfg))
        self._armed = None
        self._grad_divisor: torch.Tensor | None = None
        self.module.decoder.register_forward_pre_hook(self._decoder_pre_hook, with_kwargs=True)
        if load_weights and model_cfg.hf_path:
            from tppo.engine.convert import load_hf_checkpoint

            load_hf_checkpoint(self, model_cfg.hf_path)
        self.optimizer = self._build_optimizer() if self.trainable else None
        self.step_count = 0
        self._offloader = StorageOffloader()
        # Run before anything reads or moves optimizer state (the optimizer step, offload, checkpoints): ReLibra's
        # executor lands the optimizer state it migrates while a step computes.
        self.optimizer_state_hooks: list[Callable[[], None]] = []

    # ----------------------------------------------------------------- construction
    def _wrap_ddp(self, built: BuiltModel):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.megatron_optimizer,
            check_for_nan_in_grad=False,
        )
        ddp = DistributedDataParallel(built.config, ddp_config, built.model)
        if self.cuda and grouped_wgrad.available():
            # Expert weight gradients go straight into the fp32 main grads. Safe because gradients are
            # reduced once after the last micro-batch (overlap_grad_reduce=False), not by per-parameter hooks.
            for module in built.model.modules():
                if isinstance(module, GroupedExperts):
                    module.fuse_wgrad_accumulation = True
        cfg = built.config
        cfg.finalize_model_grads_func = self._finalize_grads
        cfg.no_sync_func = ddp.no_sync
        cfg.grad_scale_func = None
        return ddp

    def _finalize_grads(self, model, num_tokens=None, **kwargs) -> None:
        """Megatron's gradient reduction without its pass that divides every gradient by the step's token
        count: the divisor is kept (`_grad_divisor`) and applied with clipping inside the optimizer step."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        finalize_model_grads(model, None, **kwargs)
        self._grad_divisor = None
        if num_tokens is None:
            return
        if self.groups.pp_size > 1:  # the count exists on the last stage only
            last = dist.get_global_rank(self.groups.pp, self.groups.pp_size - 1)
            dist.broadcast(num_tokens, src=last, group=self.groups.pp)
        dist.all_reduce(num_tokens, group=self.groups.dp)
        # As Megatron: a step without tokens leaves the gradients as they are.
        self._grad_divisor = torch.where(num_tokens > 0, num_tokens, 1).to(torch.float32)

    def _build_optimizer(self):
        o = self.optim_cfg
        if self.megatron_optimizer:
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ocfg = OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.beta1,
                adam_beta2=o.beta2,
                adam_eps=o.eps,
                clip_grad=0.0,  # clipped in optimizer_step with the norm computed there
                bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype,
                use_distributed_optimizer=True,
            )
            optimizer = get_megatron_optimizer(ocfg, [self.ddp], use_gloo_process_groups=False)
            for inner in self._torch_optimizers(optimizer):
                use_fused_adam(inner)
            self._set_hyperparams(optimizer, o.lr)
            return optimizer
        # `wd_mult` as in Megatron's parameter groups: no weight decay on biases and 1-D tensors (norms).
        decay = [p for _, p in self._trainable() if p.dim() > 1]
        no_decay = [p for _, p in self._trainable() if p.dim() <= 1]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
        )
        self._set_hyperparams(optimizer, o.lr)
        return optimizer

    def _set_hyperparams(self, optimizer, lr: float) -> None:
        # Megatron's training loop applies each group's wd_mult through its LR scheduler, which this engine
        # does not use: without this, norms and biases would decay on the GPU (Megatron's groups).
        for group in optimizer.param_groups:
            if "wd_mult" not in group:
                # Groups torch's optimizer restores from a state dict carry no wd_mult: 1-D tensors do not decay.
                group["wd_mult"] = 0.0 if all(p.dim() <= 1 for p in group["params"]) else 1.0
            group["lr"] = lr
            group["weight_decay"] = self.optim_cfg.weight_decay * group["wd_mult"]

    @property
    def _model_chunk(self) -> torch.nn.Module:
        """What Megatron's schedules run: the DDP wrapper, or the bare model of a forward-only engine."""
        return self.module if self.ddp is None else self.ddp

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    @property
    def moe_layers(self):
        """This stage's RoutedMoELayer modules in layer order (ReLibra's executor hooks in here)."""
        return self.built.moe_layers

    @property
    def replay(self):
        return self.built.replay

    @property
    def router_layout(self) -> RouterLayout:
        """How this rank pads micro-batches for its routers (ReLibra's loads are counted the same way)."""
        return RouterLayout(
            ep=self.groups.ep_size,
            seq_multiple=self.groups.tp_size if self.config.sequence_parallel else 1,
            aligned=self.groups.ep_size > 1 and self.config.moe_token_dispatcher_type == "allgather",
        )

    # ----------------------------------------------------------------- batches
    def _prepare_all(
        self, batches: Sequence[TrainBatch], *, record: bool, require_replay: bool
    ) -> list[_MicroBatch]:
        """Validate, move to the device, and pad every micro-batch to the shape this rank must run."""
        if not batches:
            raise ValueError("no micro-batches given")
        ready = []
        for batch in batches:
            batch.validate()
            if record and batch.routed_experts_BTLK is not None:
                raise ValueError("a batch cannot both record routing and replay routed_experts_BTLK")
            if require_replay and batch.routed_experts_BTLK is None:
                raise ValueError("routing replay is required but the batch has no routed_experts_BTLK")
            batch = to_device(batch, self.groups.device)
            batch.payload = to_device(batch.payload, self.groups.device)
            ready.append(batch)
        return [self._micro_batch(b, shape, record) for b, shape in zip(ready, self.run_shapes(ready))]

    def run_shapes(self, batches: Sequence[TrainBatch]) -> list[tuple[int, int]]:
        """The (rows, tokens) each micro-batch runs as, padding included (`router_layout`). A collective over the
        EP group: every rank of it must call this with its own batches."""
        return self._align_over_ep([self.router_layout.padded(b.shape) for b in batches])

    def _align_over_ep(self, shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Every MoE layer communicates over the EP group: ranks must run the same number of micro-batches,
        and the allgather dispatcher needs equal token counts, so shapes are padded to the group's largest."""
        if self.groups.ep_size == 1:
            return shapes
        count = torch.tensor([len(shapes), -len(shapes)], device=self.groups.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.groups.ep)
        if int(count[0]) != -int(count[1]):
            raise ValueError(
                f"expert-parallel ranks were given different numbers of micro-batches "
                f"({-int(count[1])}..{int(count[0])}); every rank of an EP group must run the same number"
            )
        if not self.router_layout.aligned:
            return shapes
        table = torch.tensor(shapes, device=self.groups.device)
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=self.groups.ep)
        return [tuple(row) for row in table.tolist()]

    def _micro_batch(self, batch: TrainBatch, shape: tuple[int, int], record: bool) -> _MicroBatch:
        b, t = batch.shape
        rows, s = shape
        if batch.packed and rows != 1:
            raise ValueError(
                "packed micro-batches (B=1) cannot run beside padded ones of B>1 on other EP ranks"
            )
        ids = torch.zeros(rows, s, dtype=torch.long, device=self.groups.device)
        ids[:b, :t] = batch.input_ids_BT
        valid = torch.zeros(rows, s, dtype=torch.bool, device=self.groups.device)
        valid[:b, :t] = batch.valid_BT()
        packed = self._packed_params(batch, s) if batch.packed else None
        padding = (~valid) if (not batch.packed and self.groups.tp_size == 1) else None
        replay = self._replay_ids(batch, shape) if batch.routed_experts_BTLK is not None else None
        return _MicroBatch(
            batch=batch,
            input_ids_BS=ids,
            num_rows=b,
            num_tokens=t,
            packed_seq_params=packed,
            padding_mask_BS=padding,
            replay_NK=replay,
            record=record,
        )

    @staticmethod
    def _packed_params(batch: TrainBatch, s: int):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = batch.cu_seqlens.to(device=batch.input_ids_BT.device, dtype=torch.int32)
        if int(cu[-1]) < s:  # trailing padding runs as one more (ignored) segment
            cu = torch.cat([cu, cu.new_tensor([s])])
        longest = int((cu[1:] - cu[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )

    def _replay_ids(self, batch: TrainBatch, shape: tuple[int, int]) -> list[torch.Tensor]:
        """Per local MoE layer, the replayed ids [N, K] in the router's (sequence-first) token order."""
        m = self.model_cfg
        check_routed_experts(
            batch.routed_experts_BTLK,
            batch_shape=batch.shape,
            num_moe_layers=self.num_moe_layers,
            topk=m.moe_topk,
            num_experts=m.num_experts,
            valid_BT=batch.valid_BT(),
        )
        s = shape[1]
        routed = replayed_ids(batch.routed_experts_BTLK, batch.valid_BT(), shape, m.num_experts)
        per_layer = []
        for layer in self.replay.moe_layer_ids:
            ids_SBK = routed[:, :, layer, :].transpose(0, 1)
            if self.config.sequence_parallel:
                chunk = s // self.groups.tp_size
                ids_SBK = ids_SBK[self.groups.tp_rank * chunk : (self.groups.tp_rank + 1) * chunk]
            per_layer.append(ids_SBK.reshape(-1, m.moe_topk).contiguous())
        return per_layer

    # ----------------------------------------------------------------- one micro-batch through the model
    def _arm_routing(self, mb: _MicroBatch) -> None:
        replay = self.replay
        if mb.replay_NK is not None:
            replay.clear_targets()
            replay.set_targets(mb.replay_NK)
            replay.set_action(RouterReplayAction.REPLAY_FORWARD)
        elif mb.record:
            replay.clear()
            replay.set_action(RouterReplayAction.RECORD)
        else:
            replay.set_action(None)
        self._armed = replay if (mb.replay_NK is not None and torch.is_grad_enabled()) else None

    def _decoder_pre_hook(self, module, args, kwargs):
        if self._armed is None:
            return None
        from tppo.engine.replay import mark_backward_end

        hidden = kwargs.get("hidden_states")
        if hidden is None:
            module.input_tensor = mark_backward_end(module.input_tensor, self._armed)
            return None
        kwargs["hidden_states"] = mark_backward_end(hidden, self._armed)
        return args, kwargs

    def _forward_step(
        self,
        data_iterator: Iterator[_MicroBatch],
        model,
        *,
        loss_fn: LossFn | None,
        with_entropy: bool,
        keep_logprobs: bool = False,
    ):
        mb = next(data_iterator)
        self._arm_routing(mb)
        output = model(
            mb.input_ids_BS,
            None,
            None,
            packed_seq_params=mb.packed_seq_params,
            padding_mask=mb.padding_mask_BS,
        )
        if mb.record:
            mb.recorded_BTLK = self._recorded_local(mb)
        if self._armed is not None:
            output = self.replay.mark_backward_begin(output, mb.replay_NK)
        self._armed = None
        return output, partial(self._loss_func, mb, loss_fn, with_entropy, keep_logprobs)

    def _recorded_local(self, mb: _MicroBatch) -> torch.Tensor:
        """This stage's recorded ids as [B, T, L_local, K] (gathered over sequence-parallel ranks)."""
        b, s = mb.input_ids_BS.shape
        layers = []
        for ids_NK in self.replay.recorded():
            if self.config.sequence_parallel:
                parts = [torch.empty_like(ids_NK) for _ in range(self.groups.tp_size)]
                dist.all_gather(parts, ids_NK.contiguous(), group=self.groups.tp)
                ids_NK = torch.cat(parts)
            layers.append(ids_NK.reshape(s, b, -1).transpose(0, 1)[: mb.num_rows, : mb.num_tokens])
        return torch.stack(layers, dim=2).to(torch.int32)

    def _loss_func(
        self,
        mb: _MicroBatch,
        loss_fn: LossFn | None,
        with_entropy: bool,
        keep_logprobs: bool,
        output_tensor,
        non_loss_data: bool = False,
    ):
        out = self._per_token(mb, output_tensor, with_entropy=with_entropy)
        if non_loss_data or loss_fn is None:
            return out
        lo = loss_fn(out, mb.batch)
        if not isinstance(lo, LossOutput):
            raise TypeError(f"the loss callable must return a LossOutput, got {type(lo).__name__}")
        # Loss and denominator stay on the device until the step's end (`_reduce_metrics` checks the
        # denominators): reading them here would stall the GPU between every forward and its backward.
        dev = self.groups.device
        den = lo.denominator
        if isinstance(den, torch.Tensor):
            den_t = den.detach().to(device=dev, dtype=torch.float64).reshape(())
        else:
            den_t = torch.full((), float(den), dtype=torch.float64, device=dev)
        num = den_t.to(torch.int)
        metrics = {"loss_sum": lo.loss_sum.detach().to(torch.float64), "denominator": den_t, **lo.metrics}
        if keep_logprobs:
            metrics[_KEPT] = out.logprobs_BT.detach()
        # Every rank must run the same backward collectives (expert and sequence parallelism exchange tokens
        # in backward too). A loss that does not reach the model output, e.g. a micro-batch whose masks are all
        # zero, would skip them on one rank and hang the others: tie it to the output with a zero weight.
        loss_sum = lo.loss_sum + 0.0 * output_tensor.float().sum()
        return loss_sum, num, metrics

    def _per_token(self, mb: _MicroBatch, output_BSV: torch.Tensor, *, with_entropy: bool) -> ForwardOutput:
        batch = mb.batch
        b, t = batch.shape
        x = output_BSV[:b, :t]
        if self.role == "critic":
            out = aligned_values(batch, x[..., 0], end_values(batch, x[..., 0].float()))
        else:
            v_local = x.shape[-1]
            out = aligned_logprobs(
                batch,
                x,
                with_entropy=with_entropy,
                tp_group=self.groups.tp,
                vocab_start=self.groups.tp_rank * v_local,
            )
        out.routed_experts_BTLK = mb.recorded_BTLK
        return out

    def _run(
        self,
        mbs: list[_MicroBatch],
        *,
        loss_fn: LossFn | None,
        forward_only: bool,
        with_entropy: bool,
        keep_logprobs: bool = False,
    ):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:
            raise ValueError("no micro-batches given")
        seq = max(mb.input_ids_BS.shape[1] for mb in mbs)
        try:
            return get_forward_backward_func()(
                forward_step_func=partial(
                    self._forward_step,
                    loss_fn=loss_fn,
                    with_entropy=with_entropy,
                    keep_logprobs=keep_logprobs,
                ),
                data_iterator=iter(mbs),
                model=[self._model_chunk],
                num_microbatches=len(mbs),
                seq_length=seq,
                micro_batch_size=mbs[0].input_ids_BS.shape[0],
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        finally:
            self._armed = None
            self.replay.clear()

    # ----------------------------------------------------------------- public API
    @torch.no_grad()
    def forward(
        self,
        batches: Sequence[TrainBatch],
        *,
        with_entropy: bool = False,
        record_routing: bool = False,
        require_replay: bool = False,
    ) -> list[ForwardOutput]:
        """Per-token log-probs (policy) or values (critic) of every micro-batch, without gradients.

        Batches carrying routed_experts_BTLK are replayed; with `record_routing` the experts the router chose
        come back in ForwardOutput.routed_experts_BTLK ([B, T, L, K], all MoE layers). Every rank returns
        the outputs (broadcast from the last pipeline stage).
        """
        self._model_chunk.eval()
        mbs = self._prepare_all(batches, record=record_routing, require_replay=require_replay)
        store = self._run(mbs, loss_fn=None, forward_only=True, with_entropy=with_entropy)
        outs = list(store) if self.groups.is_last_stage else [None] * len(mbs)
        if record_routing:
            self._assemble_recorded(outs, mbs)
        return self._from_last_stage(outs)

    def _assemble_recorded(self, outs: list, mbs: list[_MicroBatch]) -> None:
        local = [(self.replay.moe_layer_ids, mb.recorded_BTLK.cpu()) for mb in mbs]
        if self.groups.pp_size > 1:
            gathered: list = [None] * self.groups.pp_size
            dist.all_gather_object(gathered, local, group=self.groups.pp)
        else:
            gathered = [local]
        for i, out in enumerate(outs):
            if out is None:
                continue
            parts = sorted(
                (lid, t[:, :, j])
                for stage in gathered
                for lid_list, t in [stage[i]]
                for j, lid in enumerate(lid_list)
            )
            out.routed_experts_BTLK = torch.stack([p for _, p in parts], dim=2).to(self.groups.device)

    def _from_last_stage(self, outs: list):
        if self.groups.pp_size == 1:
            return outs
        src = dist.get_global_rank(self.groups.pp, self.groups.pp_size - 1)
        payload = [[to_device(o, torch.device("cpu")) for o in outs]] if self.groups.is_last_stage else [None]
        dist.broadcast_object_list(payload, src=src, group=self.groups.pp)
        return [to_device(o, self.groups.device) for o in payload[0]]

    def _forward_backward(
        self,
        batches: Sequence[TrainBatch],
        loss_fn: LossFn,
        *,
        require_replay: bool,
        keep_logprobs: bool = False,
    ) -> tuple[float, dict[str, float], list[ForwardOutput] | None]:
        """forward_backward, and with `keep_logprobs` each micro-batch's detached log-probs on every rank."""
        if not self.trainable:
            raise RuntimeError("this engine is forward-only (optimizer='none'): it cannot train")
        self.ddp.train()
        self.zero_grad()
        mbs = self._prepare_all(batches, record=False, require_replay=require_replay)
        store = self._run(
            mbs, loss_fn=loss_fn, forward_only=False, with_entropy=True, keep_logprobs=keep_logprobs
        )
        store = store if self.groups.is_last_stage else []
        kept = None
        if keep_logprobs:
            outs = [ForwardOutput(logprobs_BT=m.pop(_KEPT)) for m in store] or [None] * len(mbs)
            kept = self._from_last_stage(outs)
        return *self._reduce_metrics(store), kept

    def _reduce_metrics(self, store: list[dict]) -> tuple[float, dict[str, float]]:
        # [loss_sum, denominator, denominators that are not whole numbers >= 0], summed over every rank, so
        # that a bad denominator on one rank stops all of them here rather than leaving peers waiting.
        totals = torch.zeros(3, dtype=torch.float64, device=self.groups.device)
        if store:
            dens = torch.stack([m["denominator"] for m in store])
            totals[0] = torch.stack([m["loss_sum"] for m in store]).sum()
            totals[1] = dens.sum()
            totals[2] = ((dens != dens.round()) | (dens < 0)).sum()
        dist.all_reduce(totals, group=self.groups.world)
        if totals[2] > 0:
            dens_host = [float(m["denominator"]) for m in store]
            bad = [d for d in dens_host if d != int(d) or d < 0]
            raise ValueError(
                "LossOutput.denominator must be a non-negative whole number, got "
                + (f"{bad[0]}" if bad else "a bad one on another rank")
            )
        # Every TP peer of a last-stage rank computed the same numbers: count each replica once.
        totals /= self.groups.tp_size
        loss = float(totals[0] / totals[1]) if totals[1] > 0 else 0.0
        keys = sorted({k for m in store for k in m} - {"loss_sum", "denominator"})
        metrics = {k: sum(float(m[k]) for m in store if k in m) / len(store) for k in keys} if store else {}
        return loss, metrics

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._grad_divisor = None

    def named_grads(self) -> dict[str, torch.Tensor]:
        """This rank's reduced gradients of the step's loss by parameter name, after forward_backward."""
        inv = self._inverse_divisor()
        return {n: p.main_grad if inv is None else p.main_grad * inv for n, p in self._trainable()}

    def _inverse_divisor(self) -> torch.Tensor | None:
        """1 / the step's token count: main_grad holds the gradient of sum(loss_sum), not yet divided."""
        return None if self._grad_divisor is None else 1.0 / self._grad_divisor

    # ----------------------------------------------------------------- optimizer
    def _grad_sq_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense, expert) squared gradient norms, each reduced over the ranks that hold distinct parts."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        dense, expert = [], []
        for _, p in self._trainable():
            if not getattr(p, "allreduce", True):
                expert.append(p.main_grad)
            elif param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, self.groups.tp):
                dense.append(p.main_grad)
        dev = self.groups.device
        sums = []
        for grads, group in ((dense, self.groups.mp), (expert, self.groups.expt_mp)):
            sq = torch.zeros((), dtype=torch.float32, device=dev)
            if grads:
                sq = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
            dist.all_reduce(sq, group=group)
            sums.append(sq)
        return sums[0], sums[1]

    def _all_finite(self, sq: torch.Tensor) -> bool:
        flag = torch.tensor([0.0 if torch.isfinite(sq) else 1.0], device=self.groups.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.world)
        return bool(flag.item() == 0.0)

    def optimizer_step(self) -> StepResult:
        """Clip, set this step's LR, update. Non-finite gradients skip the update (result.skipped)."""
        self._before_optimizer_state()
        lr = lr_at(self.step_count, self.optim_cfg, self.total_steps)
        dense_sq, expert_sq = self._grad_sq_norms()
        sq = dense_sq + expert_sq
        inv = self._inverse_divisor()
        if inv is not None:
            sq = sq * inv * inv
        grad_norm = float(sq.sqrt())
        if not self._all_finite(sq):
            self.zero_grad()
            return StepResult(loss=float("nan"), grad_norm=grad_norm, lr=lr, skipped=True, num_microbatches=0)
        self._set_hyperparams(self.optimizer, lr)
        # One factor for the token-count division and the clipping, applied where the gradients are read.
        factor = self._clip_scale(grad_norm) * (inv if inv is not None else torch.ones((), device=sq.device))
        if self.megatron_optimizer:
            self._megatron_step(factor)
        else:
            self._cpu_step(factor)
        self.step_count += 1
        return StepResult(loss=float("nan"), grad_norm=grad_norm, lr=lr, skipped=False, num_microbatches=0)

    def _before_optimizer_state(self) -> None:
        for hook in self.optimizer_state_hooks:
            hook()

    def _clip_scale(self, grad_norm: float) -> float:
        clip = self.optim_cfg.grad_clip
        return clip / (grad_norm + 1e-6) if clip > 0 and grad_norm > clip else 1.0

    def _megatron_step(self, factor: torch.Tensor) -> None:
        # Megatron's own step would compute the norm again (without apex: one host sync per tensor) and clip
        # with two passes per tensor. The fused Adam kernel multiplies each gradient by 1 / grad_scale as it
        # reads it (the hook torch's AMP uses), so the factor costs no pass of its own.
        inner = self._torch_optimizers()
        fused = all(group.get("fused") for o in inner for group in o.param_groups)
        for o in inner:
            o.grad_scale = (1.0 / factor).float() if fused else None
        if not fused:
            torch._foreach_mul_(self._grad_tensors(), factor)
        self.optimizer.prepare_grads()
        self.optimizer.step_with_ready_grads()
        for o in inner:
            o.grad_scale = None

    def _cpu_step(self, factor: torch.Tensor) -> None:
        for _, p in self._trainable():
            # Megatron's DDP left the reduced gradient in main_grad; torch's optimizer reads .grad.
            p.grad = p.main_grad * factor
        self.optimizer.step()
        for _, p in self._trainable():
            p.grad = None

    @property
    def lr(self) -> float:
        return lr_at(self.step_count, self.optim_cfg, self.total_steps)

    # ----------------------------------------------------------------- offload
    def offload(self) -> None:
        """Move parameters, gradients and optimizer state off the accelerator (storage freed, views kept)."""
        self._before_optimizer_state()
        self._offloader.offload(self._offload_tensors(), drop=self._grad_tensors())
        if self.cuda:
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Bring back what `offload` moved; gradients come back zeroed."""
        self._offloader.onload()

    def _grad_tensors(self) -> list[torch.Tensor]:
        return [p.main_grad for _, p in self._trainable() if getattr(p, "main_grad", None) is not None]

    def _offload_tensors(self) -> list[torch.Tensor]:
        tensors = [p.data for p in self.module.parameters()] + [b for b in self.module.buffers()]
        for opt in self._torch_optimizers():
            for state in opt.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            for group in opt.param_groups:
                tensors += [p.data for p in group["params"]]
        return tensors

    def _torch_optimizers(self, optimizer=None) -> list[torch.optim.Optimizer]:
        optimizer = self.optimizer if optimizer is None else optimizer
        if optimizer is None:
            return []
        if not self.megatron_optimizer:
            return [optimizer]
        chained = getattr(optimizer, "chained_optimizers", [optimizer])
        return [o.optimizer for o in chained]

    @property
    def offloaded(self) -> bool:
        return self._offloader.active

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """This rank's model shard, optimizer state, step and expert placement (CPU tensors)."""
        self._before_optimizer_state()
        model = {
            k: v.detach().cpu().clone()
            for k, v in self.module.state_dict().items()
            if isinstance(v, torch.Tensor)
        }
        placement = {
            i: list(layer.experts.logical_expert_ids)
            for i, layer in enumerate(self.moe_layers)
            if hasattr(layer.experts, "logical_expert_ids")
        }
        return {
            "format": "tppo-megatron-engine-v1",
            "model": model,
            "optimizer": self._optimizer_state() if self.trainable else None,
            "step": self.step_count,
            "expert_placement": placement,
            "layout": (self.groups.tp_size, self.groups.pp_size, self.groups.ep_size, self.groups.dp_size),
        }

    def load_state_dict(self, sd: dict) -> None:
        self._before_optimizer_state()
        if sd.get("format") != "tppo-megatron-engine-v1":
            raise ValueError(f"not an engine checkpoint (format {sd.get('format')!r})")
        layout = (self.groups.tp_size, self.groups.pp_size, self.groups.ep_size, self.groups.dp_size)
        if tuple(sd["layout"]) != layout:
            raise ValueError(
                f"checkpoint layout (tp, pp, ep, dp) = {tuple(sd['layout'])}; this engine is {layout}"
            )
        placement = {
            i: list(layer.experts.logical_expert_ids)
            for i, layer in enumerate(self.moe_layers)
            if hasattr(layer.experts, "logical_expert_ids")
        }
        if {int(k): v for k, v in sd["expert_placement"].items()} != placement:
            raise ValueError(
                "checkpoint expert placement differs from this engine's; restore the placement first"
            )
        missing, unexpected = self.module.load_state_dict(sd["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        if self.trainable:
            if sd["optimizer"] is None:
                raise ValueError("checkpoint holds no optimizer state (saved for a forward-only engine)")
            self._load_optimizer_state(sd["optimizer"])
        self.step_count = int(sd["step"])

    def _optimizer_state(self) -> dict:
        if not self.megatron_optimizer:
            return {"torch": _cpu_copy(self.optimizer.state_dict())}
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        params, common = {}, []
        for i, opt in enumerate(chained):
            # An optimizer that has not stepped yet (the policy during the critic's warm-up) has no Adam state,
            # and Megatron's state_dict then fails on its missing step counters: only its main params are kept.
            stepped = len(_drop_empty_entries(opt.optimizer.state)) > 0
            for name, p in self._trainable():
                if p in opt.model_param_group_index_map:
                    tensors = opt._get_main_param_and_optimizer_states(p)
                    params[(i, name)] = {
                        k: v.detach().cpu().clone() for k, v in tensors.items() if isinstance(v, torch.Tensor)
                    }
            _drop_empty_entries(opt.optimizer.state)
            common.append(_cpu_copy(opt.state_dict()) if stepped else None)
        return {"common": common, "params": params}

    def _load_optimizer_state(self, state: dict) -> None:
        if not self.megatron_optimizer:
            self.optimizer.load_state_dict(state["torch"])
            return
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        named = dict(self._trainable())
        # fp32 models: Megatron's main params are views of parameters that require grad; copy into them untracked.
        with torch.no_grad():
            for i, opt in enumerate(chained):
                _drop_empty_entries(opt.optimizer.state)
                if state["common"][i] is None:  # saved before its first step: it starts again without state
                    opt.optimizer.state.clear()
                else:
                    opt.load_state_dict(state["common"][i])
                    unshare_adam_steps(opt.optimizer)
                    # A checkpoint saved before the switch to fused Adam brings host step counters.
                    use_fused_adam(opt.optimizer)
                for (j, name), tensors in state["params"].items():
                    if j == i:
                        opt._set_main_param_and_optimizer_states(named[name], tensors)
                _drop_empty_entries(opt.optimizer.state)
            for opt in chained:
                opt._copy_main_params_to_model_params()

    # ----------------------------------------------------------------- Hugging Face weights
    def export_hf(self, out_dir: str, **kwargs) -> None:
        """Write the model as a Hugging Face safetensors checkpoint (experts in logical order)."""
        from tppo.engine.convert import export_hf_checkpoint

        export_hf_checkpoint(self, out_dir, **kwargs)

    def iter_hf_weights(self, bucket_bytes: int = 256 << 20):
        """Buckets of (HF name, full tensor) of this stage's weights, logical expert order, for weight sync."""
        from tppo.engine.convert import iter_hf_weights

        return iter_hf_weights(self, bucket_bytes=bucket_bytes)


def end_values(batch: TrainBatch, v_BT: torch.Tensor) -> torch.Tensor:
    """The critic's value of the state after each sequence's last token: the output at that token (which the
    token-aligned values_BT drop), one per row of a padded batch, one per sequence of a packed one."""
    if batch.packed:
        return v_BT[0, batch.cu_seqlens[1:].long().to(v_BT.device) - 1]
    last_B = batch.valid_BT().long().sum(dim=1).clamp(min=1) - 1
    return v_BT.gather(1, last_B.to(v_BT.device)[:, None])[:, 0]
