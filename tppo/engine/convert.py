"""Hugging Face safetensors <-> Megatron-Core weights for Qwen3-MoE and Mixtral, streamed layer by layer.

Loading: every rank reads, from the (possibly sharded) safetensors files, only the tensors of its pipeline
stage and, for MoE layers, only the experts its slots hold (`GroupedExperts.logical_expert_ids`), and
slices them for its tensor-parallel rank. Shapes are checked before reading: a missing or mis-shaped
tensor raises ValueError naming the tensor, the file set and the expected shape.

Export: tensors are rebuilt in Hugging Face layout one layer at a time (tensor-parallel shards gathered,
experts gathered over expert-parallel ranks and put in LOGICAL order whatever the placement), so a
process never holds more than one layer's full tensors. `iter_hf_weights` yields them in buckets for
syncing a rollout engine; `export_hf_checkpoint` writes size-bounded shards plus the index.

Megatron layouts: linear_qkv rows are grouped per key/value head g: [q heads of g; k_g; v_g];
linear_fc1 (dense SwiGLU) is [gate; up] per TP rank; GroupedExperts.weight1[e] = [gate; up],
weight2[e] = down.

Legend: V vocabulary, H hidden, D head dim, F FFN size, E experts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from tppo.engine.config import ModelConfig

__all__ = [
    "HF_ARCHS",
    "HFReader",
    "export_hf_checkpoint",
    "hf_config_dict",
    "iter_hf_tensors",
    "iter_hf_weights",
    "load_hf_checkpoint",
    "model_config_from_hf",
]

HF_ARCHS = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}
_ARCH_TO_HF = {v: k for k, v in HF_ARCHS.items()}


# --------------------------------------------------------------------------------------------- config
def model_config_from_hf(path: str, base: ModelConfig | None = None) -> ModelConfig:
    """A ModelConfig with the architecture fields of the HF checkpoint at `path` (others from `base`)."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHS[a] for a in archs if a in HF_ARCHS), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or hf.get('model_type')!r} in {path}; "
            f"supported: {', '.join(sorted(HF_ARCHS))}"
        )
    _check_hf_features(hf, path)
    heads = hf["num_attention_heads"]
    rope = hf.get("rope_parameters") or {}
    fields = dict(
        arch=arch,
        hf_path=path,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        num_experts=hf.get("num_experts") or hf.get("num_local_experts"),
        moe_topk=hf["num_experts_per_tok"],
        rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        shared_expert_ffn_hidden_size=0,
    )
    if arch == "qwen3_moe":
        fields.update(
            moe_ffn_hidden_size=hf["moe_intermediate_size"],
            ffn_hidden_size=hf["intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            first_k_dense=_leading_dense(hf, path),
        )
    else:
        fields.update(
            moe_ffn_hidden_size=hf["intermediate_size"],
            ffn_hidden_size=hf["intermediate_size"],
            norm_topk_prob=True,
            first_k_dense=0,
        )
    return replace(base or ModelConfig(), **fields)


def _check_hf_features(hf: dict, path: str) -> None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"{path}: rope type {rope_type!r} is not supported (only default RoPE)")
    if hf.get("attention_bias"):
        raise ValueError(f"{path}: attention biases are not supported")
    if hf.get("use_sliding_window") or (hf.get("model_type") == "mixtral" and hf.get("sliding_window")):
        raise ValueError(f"{path}: sliding-window attention is not supported")


def _leading_dense(hf: dict, path: str) -> int:
    dense = sorted(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise ValueError(f"{path}: decoder_sparse_step={step} is not supported (only 1)")
    if dense != list(range(len(dense))):
        raise ValueError(f"{path}: mlp_only_layers={dense} must be the leading layers 0..k-1")
    return len(dense)


_ARCH_FIELDS = (
    "arch",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "moe_ffn_hidden_size",
    "num_experts",
    "moe_topk",
    "norm_topk_prob",
    "first_k_dense",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "shared_expert_ffn_hidden_size",
)


def check_config_matches(m: ModelConfig, path: str) -> None:
    """Raise ValueError listing the architecture fields where `m` differs from the checkpoint at `path`."""
    hf = model_config_from_hf(path)
    fields = _ARCH_FIELDS + (("ffn_hidden_size",) if hf.first_k_dense else ())
    diffs = [
        f"{f}: model {getattr(m, f)!r} vs checkpoint {getattr(hf, f)!r}"
        for f in fields
        if getattr(m, f) != getattr(hf, f)
    ]
    if diffs:
        raise ValueError(f"model config does not match the checkpoint {path}: " + "; ".join(diffs))


def hf_config_dict(m: ModelConfig, dtype: str = "float32") -> dict:
    """A Hugging Face config.json for `m`."""
    if m.arch not in _ARCH_TO_HF:
        raise ValueError(f"unsupported architecture {m.arch!r}; supported: {', '.join(sorted(_ARCH_TO_HF))}")
    common = dict(
        architectures=[_ARCH_TO_HF[m.arch]],
        model_type=m.arch,
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups,
        head_dim=m.head_dim,
        num_experts_per_tok=m.moe_topk,
        rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        hidden_act="silu",
        torch_dtype=dtype,
        attention_dropout=0.0,
    )
    if m.arch == "qwen3_moe":
        common.update(
            num_experts=m.num_experts,
            moe_intermediate_size=m.moe_ffn_hidden_size,
            intermediate_size=m.ffn_hidden_size,
            norm_topk_prob=m.norm_topk_prob,
            mlp_only_layers=list(range(m.first_k_dense)),
            decoder_sparse_step=1,
            attention_bias=False,
            use_sliding_window=False,
        )
    else:
        common.update(
            num_local_experts=m.num_experts, intermediate_size=m.moe_ffn_hidden_size, sliding_window=None
        )
    return common


# --------------------------------------------------------------------------------------------- names
def _expert_name(m: ModelConfig, layer: int, expert: int, part: str) -> str:
    """part in gate/up/down."""
    if m.arch == "qwen3_moe":
        return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
    return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{dict(gate='w1', up='w3', down='w2')[part]}.weight"


def _router_name(m: ModelConfig, layer: int) -> str:
    block = "mlp" if m.arch == "qwen3_moe" else "block_sparse_moe"
    return f"model.layers.{layer}.{block}.gate.weight"


def _layer_names(m: ModelConfig, layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}."
    names = {
        "q": p + "self_attn.q_proj.weight",
        "k": p + "self_attn.k_proj.weight",
        "v": p + "self_attn.v_proj.weight",
        "o": p + "self_attn.o_proj.weight",
        "ln1": p + "input_layernorm.weight",
        "ln2": p + "post_attention_layernorm.weight",
    }
    if m.arch == "qwen3_moe":
        names.update(qn=p + "self_attn.q_norm.weight", kn=p + "self_attn.k_norm.weight")
    return names


def _dense_names(layer: int) -> dict[str, str]:
    p = f"model.layers.{layer}.mlp."
    return {"gate": p + "gate_proj.weight", "up": p + "up_proj.weight", "down": p + "down_proj.weight"}


# --------------------------------------------------------------------------------------------- reading
class HFReader:
    """Lazy access to the tensors of a safetensors checkpoint (single file or index + shards)."""

    def __init__(self, path: str) -> None:
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            from safetensors import safe_open

            with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ValueError(f"{path} holds no model.safetensors or model.safetensors.index.json")
        self._files: dict[str, object] = {}

    def _file(self, name: str):
        from safetensors import safe_open

        fname = self.weight_map[name]
        if fname not in self._files:
            self._files[fname] = safe_open(os.path.join(self.path, fname), "pt")
        return self._files[fname]

    def dtypes(self) -> dict[str, torch.dtype]:
        """The stored dtype of every tensor (read from the headers, no data)."""
        table = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
        return {
            name: table.get(self._file(name).get_slice(name).get_dtype(), torch.float32)
            for name in self.weight_map
        }

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor `name`, which must exist with `shape`."""
        if name not in self.weight_map:
            raise ValueError(f"checkpoint {self.path} has no tensor {name!r} (expected shape {tuple(shape)})")
        got = tuple(self._file(name).get_slice(name).get_shape())
        if got != tuple(shape):
            raise ValueError(f"tensor {name!r} in {self.path} has shape {got}; expected {tuple(shape)}")
        return self._file(name).get_tensor(name)

    def close(self) -> None:
        self._files.clear()


@dataclass
class _Ctx:
    """What conversion needs about the model on this rank."""

    m: ModelConfig
    params: dict[str, torch.nn.Parameter]
    offset: int
    num_local_layers: int
    tp_size: int
    tp_rank: int
    tp_group: object
    ep_group: object
    pre_process: bool
    post_process: bool
    value_head: bool
    moe_experts: dict[int, object]  # local layer -> experts module


def _ctx(built, groups) -> _Ctx:
    from tppo.engine.model import RoutedMoELayer

    experts = {
        i: layer.mlp.experts
        for i, layer in enumerate(built.model.decoder.layers)
        if isinstance(layer.mlp, RoutedMoELayer)
    }
    return _Ctx(
        m=built.model_cfg,
        params=dict(built.model.named_parameters()),
        offset=built.layer_offset,
        num_local_layers=built.num_local_layers,
        tp_size=groups.tp_size,
        tp_rank=groups.tp_rank,
        tp_group=groups.tp,
        ep_group=groups.ep,
        pre_process=built.model.pre_process,
        post_process=built.model.post_process,
        value_head=built.value_head,
        moe_experts=experts,
    )


def _chunk(t: torch.Tensor, dim: int, c: _Ctx) -> torch.Tensor:
    return t.chunk(c.tp_size, dim=dim)[c.tp_rank]


def _qkv_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """[q heads of group g; k_g; v_g] for g = 0..G-1 (rows), from HF's separate q/k/v projections."""
    g, d = m.num_query_groups, m.head_dim
    per = m.num_attention_heads // g
    h = q.shape[-1]
    return torch.cat([q.view(g, per * d, h), k.view(g, d, h), v.view(g, d, h)], dim=1).reshape(-1, h)


def _qkv_hf(qkv: torch.Tensor, m: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = m.num_query_groups, m.head_dim
    per = m.num_attention_heads // g
    grouped = qkv.view(g, (per + 2) * d, -1)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, qkv.shape[-1]), k.reshape(-1, qkv.shape[-1]), v.reshape(-1, qkv.shape[-1])


def _put(c: _Ctx, name: str, value: torch.Tensor) -> None:
    param = c.params[name]
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"converted tensor for {name} has shape {tuple(value.shape)}; the model's parameter "
            f"has {tuple(param.shape)} (tensor-parallel slicing mismatch)"
        )
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype))


def _load_layer(c: _Ctx, r: HFReader, local: int) -> None:
    m, i = c.m, c.offset + local
    n, p = _layer_names(m, i), f"decoder.layers.{local}."
    hd, hid = m.head_dim, m.hidden_size
    q = r.get(n["q"], (m.num_attention_heads * hd, hid))
    k = r.get(n["k"], (m.num_query_groups * hd, hid))
    v = r.get(n["v"], (m.num_query_groups * hd, hid))
    _put(c, p + "self_attention.linear_qkv.weight", _chunk(_qkv_megatron(q, k, v, m), 0, c))
    _put(
        c,
        p + "self_attention.linear_proj.weight",
        _chunk(r.get(n["o"], (hid, m.num_attention_heads * hd)), 1, c),
    )
    _put(c, p + "input_layernorm.weight", r.get(n["ln1"], (hid,)))
    _put(c, p + "pre_mlp_layernorm.weight", r.get(n["ln2"], (hid,)))
    if m.arch == "qwen3_moe":
        _put(c, p + "self_attention.q_layernorm.weight", r.get(n["qn"], (hd,)))
        _put(c, p + "self_attention.k_layernorm.weight", r.get(n["kn"], (hd,)))
    if local in c.moe_experts:
        _load_moe(c, r, local)
    else:
        d, f = _dense_names(i), m.ffn_hidden_size
        gate, up = r.get(d["gate"], (f, hid)), r.get(d["up"], (f, hid))
        _put(c, p + "mlp.linear_fc1.weight", torch.cat([_chunk(gate, 0, c), _chunk(up, 0, c)]))
        _put(c, p + "mlp.linear_fc2.weight", _chunk(r.get(d["down"], (hid, f)), 1, c))


def _load_moe(c: _Ctx, r: HFReader, local: int) -> None:
    m, i, p = c.m, c.offset + local, f"decoder.layers.{local}.mlp."
    hid, f = m.hidden_size, m.moe_ffn_hidden_size
    _put(c, p + "router.weight", r.get(_router_name(m, i), (m.num_experts, hid)))
    experts = c.moe_experts[local]
    if not hasattr(experts, "logical_expert_ids"):
        _load_sequential_experts(c, r, local, experts)
        return
    with torch.no_grad():
        for slot, e in enumerate(experts.logical_expert_ids):
            gate = r.get(_expert_name(m, i, e, "gate"), (f, hid))
            up = r.get(_expert_name(m, i, e, "up"), (f, hid))
            experts.weight1[slot].copy_(torch.cat([gate, up]).to(experts.weight1.dtype))
            experts.weight2[slot].copy_(
                r.get(_expert_name(m, i, e, "down"), (hid, f)).to(experts.weight2.dtype)
            )


def _load_sequential_experts(c: _Ctx, r: HFReader, local: int, experts) -> None:
    """Megatron's SequentialMLP (test reference): local expert j is logical expert ep_rank * E_local + j."""
    m, i = c.m, c.offset + local
    hid, f = m.hidden_size, m.moe_ffn_hidden_size
    first = dist.get_rank(c.ep_group) * experts.num_local_experts if dist.is_initialized() else 0
    with torch.no_grad():
        for j, mlp in enumerate(experts.local_experts):
            e = first + j
            gate = r.get(_expert_name(m, i, e, "gate"), (f, hid))
            up = r.get(_expert_name(m, i, e, "up"), (f, hid))
            mlp.linear_fc1.weight.copy_(torch.cat([gate, up]).to(mlp.linear_fc1.weight.dtype))
            mlp.linear_fc2.weight.copy_(
                r.get(_expert_name(m, i, e, "down"), (hid, f)).to(mlp.linear_fc2.weight.dtype)
            )


def load_hf_weights(built, groups, path: str) -> None:
    """Load the HF checkpoint at `path` into this rank's part of `built` (stage layers, own experts, TP slice)."""
    m = built.model_cfg
    if m.shared_expert_ffn_hidden_size:
        raise ValueError(
            f"{_ARCH_TO_HF.get(m.arch, m.arch)} checkpoints have no shared expert; "
            "set shared_expert_ffn_hidden_size=0 to load one"
        )
    check_config_matches(m, path)
    c, r = _ctx(built, groups), HFReader(path)
    try:
        vh = (m.vocab_size, m.hidden_size)
        if c.pre_process:
            _put(c, "embedding.word_embeddings.weight", _chunk(r.get("model.embed_tokens.weight", vh), 0, c))
        for local in range(c.num_local_layers):
            _load_layer(c, r, local)
        if c.post_process:
            _put(c, "decoder.final_layernorm.weight", r.get("model.norm.weight", (m.hidden_size,)))
            if not c.value_head and "output_layer.weight" in c.params:
                name = "model.embed_tokens.weight" if m.tie_word_embeddings else "lm_head.weight"
                _put(c, "output_layer.weight", _chunk(r.get(name, vh), 0, c))
    finally:
        r.close()


def load_hf_checkpoint(engine, path: str) -> None:
    """Load HF weights into an engine (before its optimizer is built)."""
    load_hf_weights(engine.built, engine.groups, path)


# --------------------------------------------------------------------------------------------- export
def _gather_tp(t: torch.Tensor, dim: int, c: _Ctx) -> torch.Tensor:
    if c.tp_size == 1:
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(c.tp_size)]
    dist.all_gather(parts, t.detach().contiguous(), group=c.tp_group)
    return torch.cat(parts, dim=dim)


def _gather_tp_parts(t: torch.Tensor, c: _Ctx) -> list[torch.Tensor]:
    if c.tp_size == 1:
        return [t.detach()]
    parts = [torch.empty_like(t) for _ in range(c.tp_size)]
    dist.all_gather(parts, t.detach().contiguous(), group=c.tp_group)
    return parts


def _layer_tensors(c: _Ctx, local: int) -> Iterator[tuple[str, torch.Tensor]]:
    m, i = c.m, c.offset + local
    n, p = _layer_names(m, i), f"decoder.layers.{local}."
    yield n["ln1"], c.params[p + "input_layernorm.weight"].detach()
    q, k, v = _qkv_hf(_gather_tp(c.params[p + "self_attention.linear_qkv.weight"], 0, c), m)
    yield n["q"], q
    yield n["k"], k
    yield n["v"], v
    if m.arch == "qwen3_moe":
        yield n["qn"], c.params[p + "self_attention.q_layernorm.weight"].detach()
        yield n["kn"], c.params[p + "self_attention.k_layernorm.weight"].detach()
    yield n["o"], _gather_tp(c.params[p + "self_attention.linear_proj.weight"], 1, c)
    yield n["ln2"], c.params[p + "pre_mlp_layernorm.weight"].detach()
    if local in c.moe_experts:
        yield _router_name(m, i), c.params[p + "mlp.router.weight"].detach()
        yield from _expert_tensors(c, local)
    else:
        d = _dense_names(i)
        halves = [part.chunk(2, dim=0) for part in _gather_tp_parts(c.params[p + "mlp.linear_fc1.weight"], c)]
        yield d["gate"], torch.cat([h[0] for h in halves])
        yield d["up"], torch.cat([h[1] for h in halves])
        yield d["down"], _gather_tp(c.params[p + "mlp.linear_fc2.weight"], 1, c)


def _all_experts(c: _Ctx, experts) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(logical ids, W1 [E, 2F, H], W2 [E, H, F]) of every slot of the layer over the EP group."""
    ids = torch.tensor(experts.logical_expert_ids, dtype=torch.long, device=experts.weight1.device)
    w1, w2 = experts.weight1.detach(), experts.weight2.detach()
    ep = dist.get_world_size(c.ep_group) if dist.is_initialized() else 1
    if ep == 1:
        return ids.tolist(), w1, w2
    gathered = []
    for t in (ids, w1, w2):
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous(), group=c.ep_group)
        gathered.append(torch.cat(parts))
    return gathered[0].tolist(), gathered[1], gathered[2]


def _expert_tensors(c: _Ctx, local: int) -> Iterator[tuple[str, torch.Tensor]]:
    m, i = c.m, c.offset + local
    ids, w1, w2 = _all_experts(c, c.moe_experts[local])
    if sorted(ids) != list(range(m.num_experts)):
        raise ValueError(
            f"layer {i}: expert slots hold logical experts {sorted(ids)}; every expert "
            f"0..{m.num_experts - 1} must have exactly one home slot"
        )
    slot_of = {e: s for s, e in enumerate(ids)}
    f = m.moe_ffn_hidden_size
    for e in range(m.num_experts):
        s = slot_of[e]
        yield _expert_name(m, i, e, "gate"), w1[s, :f]
        yield _expert_name(m, i, e, "up"), w1[s, f:]
        yield _expert_name(m, i, e, "down"), w2[s]


def iter_hf_tensors(built, groups) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of this pipeline stage's weights, layer by layer, experts in logical order.

    Collective over the stage's TP and EP ranks: every rank of the stage must iterate in step; each gets
    the same full tensors.
    """
    c = _ctx(built, groups)
    m = c.m
    for local, experts in c.moe_experts.items():
        if not hasattr(experts, "logical_expert_ids"):
            raise ValueError(f"decoder layer {c.offset + local}: export needs GroupedExperts")
    if c.pre_process:
        yield "model.embed_tokens.weight", _gather_tp(c.params["embedding.word_embeddings.weight"], 0, c)
    for local in range(c.num_local_layers):
        yield from _layer_tensors(c, local)
    if c.post_process:
        yield "model.norm.weight", c.params["decoder.final_layernorm.weight"].detach()
        if not c.value_head and not m.tie_word_embeddings:
            yield "lm_head.weight", _gather_tp(c.params["output_layer.weight"], 0, c)


def iter_hf_weights(engine, bucket_bytes: int = 256 << 20) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`iter_hf_tensors` grouped into buckets of at most `bucket_bytes` (a larger tensor fills one alone)."""
    return in_buckets(iter_hf_tensors(engine.built, engine.groups), bucket_bytes)


def in_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs in order, grouped into lists of at most `bucket_bytes` (a larger tensor fills one
    alone): the weight sync's unit."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def _is_writer(groups) -> bool:
    return groups.tp_rank == 0 and groups.ep_rank == 0 and groups.dp_rank == 0


def export_hf_weights(
    built,
    groups,
    out_dir: str,
    *,
    dtype: torch.dtype | dict[str, torch.dtype] | None = None,
    max_shard_bytes: int = 2 << 30,
    config: dict | None = None,
) -> None:
    """Write the model as an HF safetensors checkpoint: shards of at most `max_shard_bytes`, index, config.

    `dtype`: one dtype for every tensor, a per-name map (e.g. the source checkpoint's dtypes, for an exact
    round trip), or None for the parameters' own dtype. Collective over all ranks of the model. One writer per pipeline stage saves its stage's shards; global
    rank 0 names them model-0000i-of-0000n.safetensors and writes the index and config.json (the files must
    land on one shared filesystem).
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    writer, stage = _is_writer(groups), groups.pp_rank
    weight_map: dict[str, str] = {}
    shard, size, files = {}, 0, []

    def flush():
        nonlocal shard, size
        if shard and writer:
            fname = f"stage{stage:03d}-{len(files):05d}.safetensors.tmp"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update(dict.fromkeys(shard, fname))
        shard, size = {}, 0

    for name, t in iter_hf_tensors(built, groups):
        want = dtype.get(name, t.dtype) if isinstance(dtype, dict) else (dtype or t.dtype)
        t = t.to(dtype=want).contiguous().cpu().clone()
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = t
        size += nbytes
    flush()
    default = dtype if isinstance(dtype, torch.dtype) else built.config.params_dtype
    config = config or hf_config_dict(built.model_cfg, str(default).replace("torch.", ""))
    _finish_export(out_dir, weight_map, files, groups, config)


def _finish_export(out_dir: str, weight_map: dict, files: list[str], groups, config: dict) -> None:
    parts = [(groups.pp_rank, files, weight_map)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, parts[0])
        parts = [p for p in gathered if p[1]]
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    ordered = [f for _, fs, _ in sorted(parts, key=lambda p: p[0]) for f in fs]
    total = len(ordered)
    rename = {f: f"model-{k + 1:05d}-of-{total:05d}.safetensors" for k, f in enumerate(ordered)}
    full_map: dict[str, str] = {}
    for _, _, wm in parts:
        full_map.update({name: rename[f] for name, f in wm.items()})
    for old, new in rename.items():
        os.replace(os.path.join(out_dir, old), os.path.join(out_dir, new))
    sizes = sum(os.path.getsize(os.path.join(out_dir, f)) for f in rename.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {"total_size": sizes}, "weight_map": dict(sorted(full_map.items()))}, f, indent=2
        )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def export_hf_checkpoint(engine, out_dir: str, **kwargs) -> None:
    export_hf_weights(engine.built, engine.groups, out_dir, **kwargs)


def copy_hf_side_files(src: str, dst: str) -> None:
    """Copy config.json, generation config and tokenizer files of a checkpoint (not the weights)."""
    for name in os.listdir(src):
        if name.endswith((".safetensors", ".bin", ".pt")) or name == "model.safetensors.index.json":
            continue
        full = os.path.join(src, name)
        if os.path.isfile(full):
            shutil.copy2(full, os.path.join(dst, name))


# --------------------------------------------------------------------------------------------- round trip
def _convert_rank(src: str, dst: str, ep: int, max_shard_bytes: int) -> None:
    from tppo.engine.config import ParallelConfig
    from tppo.engine.model import build_model
    from tppo.engine.parallel import init_parallel

    parallel = ParallelConfig(expert_parallel=ep)
    groups = init_parallel(parallel)
    m = replace(model_config_from_hf(src), dtype="float32")
    built = build_model(
        m,
        parallel,
        pp_rank=groups.pp_rank,
        pp_size=groups.pp_size,
        cuda=groups.device.type == "cuda",
        dtype=torch.float32,
        perform_initialization=False,
    )
    load_hf_weights(built, groups, src)
    reader = HFReader(src)
    dtypes = reader.dtypes()
    reader.close()
    export_hf_weights(built, groups, dst, dtype=dtypes, max_shard_bytes=max_shard_bytes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        copy_hf_side_files(src, dst)


def _convert_worker(rank: int, world: int, port: int, src: str, dst: str, max_shard_bytes: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    _convert_rank(src, dst, world, max_shard_bytes)
    from tppo.engine.parallel import destroy_parallel

    destroy_parallel()


def convert_checkpoint(src: str, dst: str, *, ep: int = 1, max_shard_bytes: int = 2 << 30) -> None:
    """HF -> Megatron -> HF: load `src` into a Megatron model with `ep` expert-parallel ranks (each reading
    only its experts) and write it back to `dst` with the source dtypes, side files copied."""
    if ep < 1:
        raise ValueError(f"ep must be >= 1, got {ep}")
    model_config_from_hf(src)  # fail early on unsupported architectures
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("--to-hf must differ from --from-hf")
    if ep == 1:
        _convert_rank(src, dst, 1, max_shard_bytes)
        return
    import torch.multiprocessing as mp

    from tppo.engine.parallel import reserved_port

    with reserved_port() as port:
        mp.start_processes(
            _convert_worker,
            args=(ep, port, src, dst, max_shard_bytes),
            nprocs=ep,
            join=True,
            start_method="spawn",
        )
