"""The DeepSpeed ZeRO engine: a transformers model (policy, reference or critic) behind the Megatron engine's API.

    zero = BackendConfig("deepspeed", zero_stage=3, offload_param=True)
    engine = DeepSpeedEngine(model_cfg, optim_cfg, role="critic", zero=zero)
    outs = engine.forward(batches, with_entropy=True)              # per-token log-probs / values (no grad)
    result = engine.train_step(batches, loss_fn)                    # forward + backward + optimizer step
    engine.offload(); ...; engine.onload()
    engine.save(dir); engine.load(dir)                              # DeepSpeed's own (partitioned) checkpoint
    engine.iter_hf_weights(bucket)                                  # HF on-disk names, gathered under ZeRO-3

The model is transformers' own (`AutoModelForCausalLM` from `model_cfg.hf_path`, or random weights of the configured
shape without one; for the critic the same body,
`AutoModel`, with a scalar head v = h w^T on the final-normed hidden state, initialised N(0, init_std) like the
Megatron critic's `ValueHead`). Every rank is a data-parallel replica (no TP/PP/EP: those, and ReLibra, are the
Megatron engine's); ZeRO stage 2 or 3 partitions optimizer state and gradients (and parameters at stage 3), with
optional CPU offload of either.

The loss convention is the Megatron engine's: the gradient is that of sum(loss_sum) / sum(denominator) over all
micro-batches and ranks of the step. The step's denominator is known only after its last micro-batch, so each
backward runs on the raw loss_sum and the division happens in ZeRO's loss-scale slot at the step: DeepSpeed
averages gradients over the D data-parallel ranks and then divides them by its loss scale, set to
sum(denominator) / D, and reports the norm of the divided gradients (clipped the same way as the Megatron engine:
factor clip / (norm + 1e-6) when norm > clip). A non-finite norm skips the update (DeepSpeed's overflow path).

Departures from the Megatron engine: packed batches (cu_seqlens) are refused (transformers' SDPA path would attend
across sequences; the algorithm layer sends padded batches); every rank must run the same number of micro-batches
(ZeRO reduces and, at stage 3, gathers parameters inside every forward and backward; the engine checks);
checkpoints are directories written by DeepSpeed (`save` / `load`), not a state dict.

Legend: B sequences, T tokens, V vocabulary, H hidden, L MoE layers, K top-k, N = B*T tokens as a router sees them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tppo.engine.batch import ForwardOutput, LossOutput, StepResult, TrainBatch, replayed_ids, to_device
from tppo.engine.config import BackendConfig, ModelConfig, OptimConfig
from tppo.engine.convert import hf_config_dict, in_buckets
from tppo.engine.engine import end_values, lr_at
from tppo.engine.hf_replay import HFRoutingReplay
from tppo.engine.layout import RouterLayout
from tppo.engine.logprobs import aligned_logprobs, aligned_values
from tppo.engine.replay import check_routed_experts
from tppo.engine.steps import LossFn, TrainSteps

__all__ = ["DeepSpeedEngine", "DeepSpeedGroups", "ValueModel", "check_zero", "deepspeed_config"]

_LAYER = re.compile(r"^(.*?layers\.\d+)\.")


@dataclass
class DeepSpeedGroups:
    """The process groups a trainer worker reads: every rank is a data-parallel replica of the whole model."""

    world: dist.ProcessGroup
    dp_size: int
    dp_rank: int
    device: torch.device
    tp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.world


def check_zero(zero: BackendConfig) -> None:
    """Refuse ZeRO settings that cannot work, naming them."""
    if zero.offload_param and zero.zero_stage != 3:
        raise ValueError(
            f"offload_param=true needs zero_stage=3 (zero_stage={zero.zero_stage} keeps every parameter on each rank)"
        )


def deepspeed_config(zero: BackendConfig, optim: OptimConfig, *, bf16: bool) -> dict:
    """DeepSpeed's JSON config: one micro-batch per `backward` (the engine marks the step's boundary itself)."""
    stage: dict = {"stage": zero.zero_stage}
    if zero.offload_optimizer:
        stage["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if zero.offload_param:
        stage["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        # DeepSpeed keeps tensors under 1e5 elements (norms, biases) resident on the device by default; offloaded
        # parameters leave nothing there between calls.
        stage["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": stage,
        "bf16": {"enabled": bf16},
        # torch's AdamW (the Megatron engine's CPU optimizer), also under optimizer offload.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }


class ValueModel(torch.nn.Module):
    """The critic: a transformers decoder body and v = h w^T on its final-normed hidden state (Megatron's ValueHead)."""

    def __init__(self, body: torch.nn.Module, hidden_size: int, init_std: float, seed: int) -> None:
        super().__init__()
        self.model = body
        self.value_head = torch.nn.Linear(hidden_size, 1, bias=False, dtype=body.dtype)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            self.value_head.weight.copy_(torch.randn(1, hidden_size, generator=gen) * init_std)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        h_BTH = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        return self.value_head(h_BTH)


def _start_distributed(cuda: bool) -> None:
    """torch.distributed as the Megatron engine starts it (env rendezvous, or an in-memory world of one)."""
    from tppo.engine.parallel import start_torch_distributed

    start_torch_distributed("nccl" if cuda else "gloo", 300.0)
    # DeepSpeed asserts LOCAL_RANK is set (its launcher sets it); one device per rank.
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() % max(torch.cuda.device_count(), 1)))
    import deepspeed

    if not cuda:
        # On the CPU, init_distributed JIT-loads DeepSpeed's shared-memory all-reduce op under a file lock in the
        # torch extensions cache. A process killed while it holds the lock leaves the lock behind, and every later
        # start then waits on it forever. Only DeepSpeed's inference all-reduce uses that op (ZeRO training
        # reduces through torch.distributed), so it is not loaded.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")


class DeepSpeedEngine(TrainSteps):
    """A policy (log-probs) or critic (values) transformers model under DeepSpeed ZeRO, with the LR schedule."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        *,
        role: str = "policy",
        zero: BackendConfig | None = None,
        total_steps: int | None = None,
        seed: int = 0,
        optimizer: str = "auto",
    ) -> None:
        if role not in ("policy", "critic"):
            raise ValueError(f"role must be 'policy' or 'critic', got {role!r}")
        if optimizer not in ("auto", "none"):
            raise ValueError(f"optimizer must be 'auto' or 'none', got {optimizer!r}")
        self.model_cfg, self.optim_cfg, self.role, self.total_steps = model_cfg, optim_cfg, role, total_steps
        self.zero = zero or BackendConfig(engine="deepspeed")
        check_zero(self.zero)
        self.trainable = optimizer != "none"
        self.cuda = torch.cuda.is_available()
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[model_cfg.dtype]
        if self.dtype == torch.bfloat16 and not self.cuda:
            raise ValueError("model.dtype=bfloat16 needs CUDA; CPU runs train in float32")
        _start_distributed(self.cuda)
        world = dist.group.WORLD
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.groups = DeepSpeedGroups(world, dist.get_world_size(), dist.get_rank(), device)
        torch.manual_seed(seed)
        self.hf_model, model = self._build_model(seed)
        self.replay = HFRoutingReplay(model)
        self.num_moe_layers = self.replay.num_layers
        self.ds = self._initialize(model)
        self.step_count = 0
        self._offloaded = False
        self._store: list[dict] = []
        self._step_denominator = 0.0

    # ----------------------------------------------------------------- construction
    def _build_model(self, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
        """(the transformers model whose names the HF export uses, the module DeepSpeed wraps)."""
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        m = self.model_cfg
        cls = AutoModel if self.role == "critic" else AutoModelForCausalLM
        if m.hf_path:
            # The critic's body loads from a causal-LM checkpoint: transformers reports the unused lm_head loudly.
            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()
            try:
                hf = cls.from_pretrained(m.hf_path, dtype=self.dtype, attn_implementation="sdpa")
            finally:
                hf_logging.set_verbosity(verbosity)
        else:  # random weights of the configured shape (transformers' init at model.init_std), seeded
            config = AutoConfig.for_model(**hf_config_dict(m), initializer_range=m.init_std)
            torch.manual_seed(seed)
            hf = cls.from_config(config, dtype=self.dtype, attn_implementation="sdpa")
        hf.config.use_cache = False
        if self.role == "critic":
            return hf, ValueModel(hf, hf.config.hidden_size, m.init_std, seed)
        return hf, hf

    def _initialize(self, model: torch.nn.Module):
        import deepspeed

        config = deepspeed_config(self.zero, self.optim_cfg, bf16=self.dtype == torch.bfloat16)
        if not self.trainable:
            model.requires_grad_(False)
            if self.zero.zero_stage == 2:
                # Stage 2 shards optimizer state and gradients, which a forward-only engine has none of: replicate.
                config["zero_optimization"] = {"stage": 0}
            engine, *_ = deepspeed.initialize(model=model, config=config)
            return engine
        o = self.optim_cfg
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # As the Megatron engine's groups: no weight decay on biases and 1-D tensors (norms).
        groups = [
            {"params": [p for _, p in named if p.dim() > 1], "weight_decay": o.weight_decay},
            {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0},
        ]
        adamw = torch.optim.AdamW(
            groups, lr=lr_at(0, o, self.total_steps), betas=(o.beta1, o.beta2), eps=o.eps
        )
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw, config=config)
        return engine

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model (under ZeRO-3 its parameters are partitioned: gather them to read)."""
        return self.ds.module

    @property
    def router_layout(self) -> RouterLayout:
        """No expert parallelism: every micro-batch runs as it is (ReLibra's loads are counted the same way)."""
        return RouterLayout(ep=1)

    def run_shapes(self, batches: Sequence[TrainBatch]) -> list[tuple[int, int]]:
        return [b.shape for b in batches]

    # ----------------------------------------------------------------- batches
    def _prepare_all(
        self, batches: Sequence[TrainBatch], *, record: bool, require_replay: bool
    ) -> list[TrainBatch]:
        if not batches:
            raise ValueError("no micro-batches given")
        self._check_same_count(len(batches))
        ready = []
        for batch in batches:
            batch.validate()
            if batch.packed:
                raise ValueError("the DeepSpeed engine takes padded batches only (cu_seqlens given)")
            if record and batch.routed_experts_BTLK is not None:
                raise ValueError("a batch cannot both record routing and replay routed_experts_BTLK")
            if require_replay and batch.routed_experts_BTLK is None:
                raise ValueError("routing replay is required but the batch has no routed_experts_BTLK")
            if batch.routed_experts_BTLK is not None:
                self._check_routing(batch)
            batch = to_device(batch, self.groups.device)
            batch.payload = to_device(batch.payload, self.groups.device)
            ready.append(batch)
        return ready

    def _check_same_count(self, count: int) -> None:
        """ZeRO communicates inside every forward (stage 3) and backward: ranks must run the same micro-batches."""
        if self.groups.dp_size == 1:
            return
        both = torch.tensor([count, -count], device=self.groups.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.groups.world)
        if int(both[0]) != -int(both[1]):
            raise ValueError(
                f"data-parallel ranks were given different numbers of micro-batches ({-int(both[1])}.."
                f"{int(both[0])}); every rank of a ZeRO group must run the same number"
            )

    def _check_routing(self, batch: TrainBatch) -> None:
        m = self.model_cfg
        check_routed_experts(
            batch.routed_experts_BTLK,
            batch_shape=batch.shape,
            num_moe_layers=self.num_moe_layers,
            topk=self.replay.topk,
            num_experts=self.replay.num_experts,
            valid_BT=batch.valid_BT(),
        )
        if (self.replay.topk, self.replay.num_experts) != (m.moe_topk, m.num_experts):
            raise ValueError(
                f"the checkpoint routes top-{self.replay.topk} of {self.replay.num_experts} experts; the model "
                f"config says top-{m.moe_topk} of {m.num_experts}"
            )

    def _replay_NK(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Per MoE layer, the replayed ids [N, K] in the routers' (row-major) token order; padding spread evenly."""
        routed = replayed_ids(
            batch.routed_experts_BTLK, batch.valid_BT(), batch.shape, self.replay.num_experts
        )
        return [routed[:, :, layer].reshape(-1, self.replay.topk) for layer in range(self.num_moe_layers)]

    # ----------------------------------------------------------------- one micro-batch through the model
    def _run_model(self, batch: TrainBatch, *, record: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [B, T, V] or values [B, T, 1], the recorded ids [B, T, L, K] when `record`)."""
        if batch.routed_experts_BTLK is not None:
            routing = self.replay.replaying(self._replay_NK(batch))
        elif record:
            routing = self.replay.recording()
        else:
            routing = nullcontext()
        mask = batch.attention_mask_BT.long() if batch.attention_mask_BT is not None else None
        recorded = None
        with routing:
            out = self.ds(input_ids=batch.input_ids_BT, attention_mask=mask)
            if record:
                b, t = batch.shape
                recorded = torch.stack([ids.reshape(b, t, -1) for ids in self.replay.recorded()], dim=2)
        self.replay.clear()
        x = out if self.role == "critic" else out.logits
        return x, None if recorded is None else recorded.to(torch.int32)

    def _per_token(self, batch: TrainBatch, x_BTV: torch.Tensor, *, with_entropy: bool) -> ForwardOutput:
        """Outputs aligned with the tokens they score (tppo.engine.batch): position t from the output at t - 1."""
        if self.role == "critic":
            return aligned_values(batch, x_BTV[..., 0], end_values(batch, x_BTV[..., 0].float()))
        return aligned_logprobs(batch, x_BTV, with_entropy=with_entropy)

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

        Batches carrying routed_experts_BTLK are replayed; with `record_routing` the experts the routers chose come
        back in ForwardOutput.routed_experts_BTLK ([B, T, L, K], int32).
        """
        self._awake()
        self.ds.eval()
        outs = []
        for batch in self._prepare_all(batches, record=record_routing, require_replay=require_replay):
            x, recorded = self._run_model(batch, record=record_routing)
            out = self._per_token(batch, x, with_entropy=with_entropy)
            out.routed_experts_BTLK = recorded
            outs.append(out)
        return outs

    def _forward_backward(
        self,
        batches: Sequence[TrainBatch],
        loss_fn: LossFn,
        *,
        require_replay: bool,
        keep_logprobs: bool = False,
    ) -> tuple[float, dict[str, float], list[ForwardOutput] | None]:
        """forward_backward, and with `keep_logprobs` each micro-batch's detached log-probs."""
        if not self.trainable:
            raise RuntimeError("this engine is forward-only (optimizer='none'): it cannot train")
        self._awake()
        self.ds.train()
        ready = self._prepare_all(batches, record=False, require_replay=require_replay)
        self._store, kept = [], []
        for i, batch in enumerate(ready):
            x, _ = self._run_model(batch, record=False)
            out = self._per_token(batch, x, with_entropy=True)
            lo = loss_fn(out, batch)
            if keep_logprobs:
                kept.append(ForwardOutput(logprobs_BT=out.logprobs_BT.detach()))
            if not isinstance(lo, LossOutput):
                raise TypeError(f"the loss callable must return a LossOutput, got {type(lo).__name__}")
            den = torch.as_tensor(lo.denominator, dtype=torch.float64).reshape(())
            self._store.append(
                {"loss_sum": lo.loss_sum.detach().double().cpu(), "denominator": den, **lo.metrics}
            )
            # The step's boundary (ZeRO's final reduction) is its last micro-batch. A loss that does not reach the
            # model output (all masks zero) is tied to it with a zero weight, so every rank runs the same backward.
            self.ds.set_gradient_accumulation_boundary(i == len(ready) - 1)
            self.ds.backward(lo.loss_sum + 0.0 * x.float().sum(), scale_wrt_gas=False)
        return *self._reduce_metrics(self._store), (kept if keep_logprobs else None)

    def _reduce_metrics(self, store: list[dict]) -> tuple[float, dict[str, float]]:
        # [loss_sum, denominator, bad denominators] over every rank: a bad one anywhere stops all ranks here.
        dens = torch.stack([m["denominator"] for m in store])
        totals = torch.stack(
            [
                torch.stack([m["loss_sum"] for m in store]).sum(),
                dens.sum(),
                ((dens != dens.round()) | (dens < 0)).sum().double(),
            ]
        ).to(self.groups.device)
        dist.all_reduce(totals, group=self.groups.world)
        if totals[2] > 0:
            bad = [float(d) for d in dens if d != d.round() or d < 0]
            raise ValueError(
                "LossOutput.denominator must be a non-negative whole number, got "
                + (f"{bad[0]}" if bad else "a bad one on another rank")
            )
        self._step_denominator = float(totals[1])
        loss = float(totals[0] / totals[1]) if totals[1] > 0 else 0.0
        keys = sorted({k for m in store for k in m} - {"loss_sum", "denominator"})
        return loss, {k: sum(float(m[k]) for m in store if k in m) / len(store) for k in keys}

    def optimizer_step(self) -> StepResult:
        """Divide by the step's denominator, clip, set this step's LR, update; a non-finite norm skips it."""
        lr = lr_at(self.step_count, self.optim_cfg, self.total_steps)
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr
        # DeepSpeed averaged over the ranks; dividing by sum(denominator) / D leaves grad(sum loss_sum) / sum den.
        # As the Megatron engine, a step without tokens leaves the summed gradients as they are.
        den = self._step_denominator if self._step_denominator > 0 else 1.0
        self.ds.optimizer.override_loss_scale(den / self.groups.dp_size)
        try:
            self.ds.step()
        finally:
            self.ds.optimizer.override_loss_scale(1.0)
        norm = self.ds.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else float("nan")
        skipped = not torch.isfinite(torch.tensor(grad_norm)).item()
        if not skipped:
            self.step_count += 1
        return StepResult(loss=float("nan"), grad_norm=grad_norm, lr=lr, skipped=skipped, num_microbatches=0)

    @property
    def lr(self) -> float:
        return lr_at(self.step_count, self.optim_cfg, self.total_steps)

    # ----------------------------------------------------------------- offload
    def offload(self) -> None:
        """Move parameters and optimizer state to host memory (DeepSpeed's offload_states); no-op where they
        already live there (parameter offload, or a CPU run)."""
        if self._offloaded:
            return
        if self._movable():
            self.ds.offload_states(pin_memory=True)
            torch.cuda.empty_cache()
        self._offloaded = True

    def onload(self) -> None:
        if self._offloaded and self._movable():
            self.ds.reload_states()
        self._offloaded = False

    def _movable(self) -> bool:
        # DeepSpeed moves states only for an engine with a ZeRO optimizer and parameters not offloaded already.
        return self.cuda and self.trainable and not self.zero.offload_param

    def _awake(self) -> None:
        if self._offloaded:
            self.onload()

    @property
    def offloaded(self) -> bool:
        return self._offloaded

    # ----------------------------------------------------------------- checkpoints
    def save(self, path: str) -> None:
        """Every rank writes its ZeRO partition (DeepSpeed's checkpoint layout) and the step under `path`."""
        self._awake()
        self.ds.save_checkpoint(path, tag="engine", client_state={"step": self.step_count, "role": self.role})

    def load(self, path: str) -> None:
        """Restore weights, optimizer state and step from `save`'s directory (same ZeRO stage and world size)."""
        self._awake()
        loaded, client = self.ds.load_checkpoint(
            path, tag="engine", load_optimizer_states=self.trainable, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise ValueError(f"no DeepSpeed engine checkpoint under {path}")
        if client.get("role") != self.role:
            raise ValueError(f"checkpoint of a {client.get('role')!r} engine; this engine is a {self.role!r}")
        self.step_count = int(client["step"])

    # ----------------------------------------------------------------- Hugging Face weights
    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF on-disk name, full CPU tensor) one decoder layer at a time: transformers' fused experts are split
        back into per-expert tensors by its own conversion (what `save_pretrained` writes). Collective under
        ZeRO-3 (each layer's parameters are gathered): every rank must iterate in step."""
        from transformers.core_model_loading import revert_weight_conversion

        prefix = "model." if self.role == "critic" else ""
        for names in self._name_groups():
            group = {n: p for n, p in self.hf_model.named_parameters() if n in names}
            with self._gathered(list(group.values())):
                tensors = {n: p.detach().to("cpu", copy=True) for n, p in group.items()}
            for name, t in sorted(revert_weight_conversion(self.hf_model, tensors).items()):
                yield prefix + name, t

    def load_hf(self, path: str) -> None:
        """Copy a Hugging Face checkpoint's weights (a causal LM of this shape: e.g. the policy's export) into the
        model in place, one decoder layer at a time (gathered and re-partitioned under ZeRO-3). transformers
        reads the checkpoint, so its on-disk names are converted to the model's as in from_pretrained."""
        from transformers import AutoModelForCausalLM

        if self.role == "critic":
            raise ValueError("load_hf: a critic's value head has no Hugging Face counterpart; load a policy")
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(
                f"load_hf: {path} has no config.json; expected a Hugging Face checkpoint folder"
            )
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True
        )
        # transformers initialises what a checkpoint lacks at random: a reference must never start so.
        missing = sorted(info["missing_keys"])
        if missing:
            raise ValueError(
                f"load_hf: {path} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}"
            )
        source = model.state_dict()
        with torch.no_grad():
            for names in self._name_groups():
                group = [(n, p) for n, p in self.hf_model.named_parameters() if n in names]
                with self._gathered([p for _, p in group], modifier_rank=0):
                    for name, param in group:
                        param.copy_(source[name].to(param.dtype))

    def _name_groups(self) -> list[list[str]]:
        """The HF model's parameter names grouped by decoder layer (others alone), in model order."""
        groups: dict[str, list[str]] = {}
        for name, _ in self.hf_model.named_parameters():
            match = _LAYER.match(name)
            groups.setdefault(match.group(1) if match else name, []).append(name)
        return list(groups.values())

    def _gathered(self, params: list[torch.nn.Parameter], modifier_rank: int | None = None):
        """Under ZeRO-3 the full parameters for the block (with modifier_rank, that rank's changes are
        re-partitioned on exit); the parameters themselves otherwise."""
        if self.zero.zero_stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)

    def iter_hf_weights(self, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`iter_hf_tensors` in buckets of at most `bucket_bytes` (a larger tensor fills one alone)."""
        self._awake()
        yield from in_buckets(self.iter_hf_tensors(), bucket_bytes)

    def export_hf(self, out_dir: str) -> None:
        """Write the model as one HF safetensors file plus config.json (rank 0; every rank must call)."""
        from safetensors.torch import save_file

        tensors = dict(self.iter_hf_tensors())
        if self.groups.dp_rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            save_file(
                {n: t.contiguous() for n, t in tensors.items()}, os.path.join(out_dir, "model.safetensors")
            )
            self.hf_model.config.save_pretrained(out_dir)
        dist.barrier(group=self.groups.world)
