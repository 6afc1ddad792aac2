"""The engine's weight tensors and the map from Hugging Face parameter names onto them.

Layout (chosen for the decode kernels, not the checkpoint): q, k and v projections are fused into one matrix
(`qkv`), each expert's gate and up projections into one `[E, 2F, H]` tensor (gate rows first, the layout
transformers uses in memory) fed to `torch._grouped_mm` transposed, down projections `[E, H, F]`.

Accepted names: the hub's on-disk per-expert names (`mlp.experts.{e}.gate_proj.weight` for Qwen3-MoE,
`block_sparse_moe.experts.{e}.w1/w2/w3.weight` for Mixtral; what transformers' `save_pretrained` writes) and
transformers' fused in-memory names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, Mixtral's `mlp.gate`).
Every name resolves to "units" (one per hub tensor, per expert) so a full load can prove nothing was missed.
Loading copies into the existing tensors, never rebinds them: captured CUDA graphs stay valid after a weight sync.

Legend: V vocab, H hidden, Q q heads x head dim, C fused q+k+v width, E experts, F expert (or dense) FFN width,
D head dim.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.model_spec import MoeModelSpec

Source = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerWeights:
    """One decoder layer. Exactly one of (router, experts) or (dense MLP) is set."""

    input_norm_H: torch.Tensor
    post_norm_H: torch.Tensor
    qkv_CH: torch.Tensor
    o_HQ: torch.Tensor
    qkv_bias_C: torch.Tensor | None = None
    o_bias_H: torch.Tensor | None = None
    q_norm_D: torch.Tensor | None = None
    k_norm_D: torch.Tensor | None = None
    router_EH: torch.Tensor | None = None
    gate_up_EFH: torch.Tensor | None = None
    down_EHF: torch.Tensor | None = None
    dense_gate_up_FH: torch.Tensor | None = None
    dense_down_HF: torch.Tensor | None = None


@dataclass
class ModelWeights:
    """A model's tensors, or one worker's part of them (the disaggregated layout): the experts `experts` (local
    index e - experts.start) and, when `dense`, everything else; tensors a worker does not hold have no elements."""

    embed_VH: torch.Tensor
    final_norm_H: torch.Tensor
    lm_head_VH: torch.Tensor
    layers: list[LayerWeights]
    experts: range = range(0)
    dense: bool = True

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed_VH, self.final_norm_H, self.lm_head_VH]
        for layer in self.layers:
            out += [t for t in vars(layer).values() if t is not None]
        return out

    def num_bytes(self) -> int:
        seen, total = set(), 0
        for t in self.tensors():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def allocate(
    spec: MoeModelSpec,
    device: torch.device,
    dtype: torch.dtype,
    experts: range | None = None,
    dense: bool = True,
) -> ModelWeights:
    """Uninitialised tensors in the engine's layout (filled by `load_checkpoint` or `init_random`): the experts
    `experts` (all by default) and, when `dense`, every other tensor. An attention worker of the disaggregated
    layout holds no expert (`experts=range(0)`), an expert worker only its experts (`dense=False`)."""
    experts = range(spec.num_experts) if experts is None else experts
    if experts.step != 1 or experts.start < 0 or experts.stop > spec.num_experts:
        raise ValueError(f"experts={experts}: expected a contiguous range within [0, {spec.num_experts})")

    def new(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, device=device, dtype=dtype)

    def held(*shape: int) -> torch.Tensor:
        return new(*shape) if dense else new(0)

    h, c = spec.hidden_size, spec.q_size + 2 * spec.kv_size
    layers = []
    for is_moe in spec.moe_layers:
        layer = LayerWeights(
            input_norm_H=held(h), post_norm_H=held(h), qkv_CH=held(c, h), o_HQ=held(h, spec.q_size)
        )
        if spec.attention_bias:
            layer.qkv_bias_C, layer.o_bias_H = held(c), held(h)
        if spec.qk_norm:
            layer.q_norm_D, layer.k_norm_D = held(spec.head_dim), held(spec.head_dim)
        if is_moe:
            e, f = len(experts), spec.moe_ffn_size
            layer.router_EH = held(spec.num_experts, h)
            layer.gate_up_EFH, layer.down_EHF = new(e, 2 * f, h), new(e, h, f)
        else:
            f = spec.dense_ffn_size
            layer.dense_gate_up_FH, layer.dense_down_HF = held(2 * f, h), held(h, f)
        layers.append(layer)
    embed = held(spec.vocab_size, h)
    lm_head = embed if spec.tie_word_embeddings else held(spec.vocab_size, h)
    return ModelWeights(
        embed_VH=embed, final_norm_H=held(h), lm_head_VH=lm_head, layers=layers, experts=experts, dense=dense
    )


def init_random(weights: ModelWeights, std: float = 0.02, seed: int = 0) -> None:
    """Normal(0, std) matrices and unit norms (as transformers initialises), on the weights' own device."""
    gen = torch.Generator(device=weights.embed_VH.device).manual_seed(seed)
    for t in weights.tensors():
        if t.dim() == 1:
            t.fill_(1.0)
        else:
            for chunk in t.view(-1, t.shape[-1]).split(4096):
                chunk.normal_(0.0, std, generator=gen)


class WeightMap:
    """Resolves Hugging Face parameter names to (unit, target view, source slicer) triples for one model."""

    _LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    def __init__(self, spec: MoeModelSpec, weights: ModelWeights) -> None:
        self.spec = spec
        self.weights = weights

    def expected_units(self) -> set[str]:
        """Every hub tensor name (per expert) of the tensors these weights hold, the set a full checkpoint load
        must cover."""
        s, w = self.spec, self.weights
        experts = {
            self._expert_unit(i, e, part)
            for i, is_moe in enumerate(s.moe_layers)
            if is_moe
            for e in w.experts
            for part in ("gate", "up", "down")
        }
        return experts | self._dense_units() if w.dense else experts

    def _not_held(self, what: str) -> ValueError:
        held = self.weights.experts
        where = f"this worker holds experts [{held.start}, {held.stop})" if held else "this worker holds none"
        return ValueError(f"load_weights: {what} belongs to another expert worker ({where})")

    def holds(self, name: str) -> bool:
        """Whether these weights hold any of the name's tensors (a worker of the disaggregated layout loads its
        part of a checkpoint)."""
        w = self.weights
        if not is_expert_weight(name):
            return w.dense
        e = expert_of(name)
        return len(w.experts) > 0 if e is None else e in w.experts

    def _dense_units(self) -> set[str]:
        s = self.spec
        units = {"model.embed_tokens.weight", "model.norm.weight"}
        if not s.tie_word_embeddings:
            units.add("lm_head.weight")
        for i, is_moe in enumerate(s.moe_layers):
            p = f"model.layers.{i}."
            units |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
            units |= {f"{p}self_attn.{n}_proj.weight" for n in "qkvo"}
            if s.attention_bias:
                units |= {f"{p}self_attn.{n}_proj.bias" for n in "qkvo"}
            if s.qk_norm:
                units |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
            if is_moe:
                units.add(self._moe_prefix(i) + "gate.weight")
            else:
                units |= {f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        return units

    def _moe_prefix(self, i: int) -> str:
        return f"model.layers.{i}." + ("block_sparse_moe." if self.spec.arch == "mixtral" else "mlp.")

    def _expert_unit(self, i: int, e: int, part: str) -> str:
        if self.spec.arch == "mixtral":
            return (
                f"{self._moe_prefix(i)}experts.{e}.{ {'gate': 'w1', 'up': 'w3', 'down': 'w2'}[part] }.weight"
            )
        return f"{self._moe_prefix(i)}experts.{e}.{part}_proj.weight"

    def resolve(self, name: str) -> list[tuple[str, torch.Tensor, Source]]:
        """(unit, target, source) of every unit the name holds here; KeyError for a name of no such model,
        ValueError for a tensor of the model that this worker does not hold."""
        hits = self._resolve(name)
        if not self.weights.dense and any(not _is_expert(unit) for unit, _, _ in hits):
            raise ValueError(
                f"load_weights: {name!r} is held by the attention workers; this expert worker holds experts "
                f"[{self.weights.experts.start}, {self.weights.experts.stop}) only"
            )
        return hits

    def _resolve(self, name: str) -> list[tuple[str, torch.Tensor, Source]]:
        w, s = self.weights, self.spec
        whole: Source = lambda t: t  # noqa: E731
        if name == "model.embed_tokens.weight":
            return [(name, w.embed_VH, whole)]
        if name == "model.norm.weight":
            return [(name, w.final_norm_H, whole)]
        if name == "lm_head.weight":
            return [(name, w.lm_head_VH, whole)]
        m = self._LAYER.match(name)
        if m is None or int(m.group(1)) >= s.num_layers:
            raise KeyError(name)
        i, rest = int(m.group(1)), m.group(2)
        layer = w.layers[i]
        hits = self._resolve_attention(i, layer, rest) or self._resolve_mlp(i, layer, rest)
        if not hits:
            raise KeyError(name)
        return hits

    def _resolve_attention(
        self, i: int, layer: LayerWeights, rest: str
    ) -> list[tuple[str, torch.Tensor, Source]]:
        s, p = self.spec, f"model.layers.{i}."
        whole: Source = lambda t: t  # noqa: E731
        if rest == "input_layernorm.weight":
            return [(p + rest, layer.input_norm_H, whole)]
        if rest == "post_attention_layernorm.weight":
            return [(p + rest, layer.post_norm_H, whole)]
        bounds = {
            "q": (0, s.q_size),
            "k": (s.q_size, s.q_size + s.kv_size),
            "v": (s.q_size + s.kv_size, None),
        }
        m = re.fullmatch(r"self_attn\.([qkvo])_proj\.(weight|bias)", rest)
        if m:
            which, kind = m.groups()
            if which == "o":
                target = layer.o_HQ if kind == "weight" else layer.o_bias_H
            else:
                lo, hi = bounds[which]
                full = layer.qkv_CH if kind == "weight" else layer.qkv_bias_C
                target = None if full is None else full[lo:hi]
            return [] if target is None else [(p + rest, target, whole)]
        if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and s.qk_norm:
            return [(p + rest, layer.q_norm_D if rest.startswith("self_attn.q") else layer.k_norm_D, whole)]
        return []

    def _resolve_mlp(self, i: int, layer: LayerWeights, rest: str) -> list[tuple[str, torch.Tensor, Source]]:
        s, p = self.spec, f"model.layers.{i}."
        whole: Source = lambda t: t  # noqa: E731
        if layer.gate_up_EFH is None:  # dense layer
            f = s.dense_ffn_size
            parts = {
                "mlp.gate_proj.weight": layer.dense_gate_up_FH[:f],
                "mlp.up_proj.weight": layer.dense_gate_up_FH[f:],
                "mlp.down_proj.weight": layer.dense_down_HF,
            }
            return [(p + rest, parts[rest], whole)] if rest in parts else []
        f = s.moe_ffn_size
        moe = r"(?:block_sparse_moe|mlp)" if s.arch == "mixtral" else r"mlp"
        if re.fullmatch(moe + r"\.gate\.weight", rest):
            return [(self._moe_prefix(i) + "gate.weight", layer.router_EH, whole)]
        m = re.fullmatch(moe + r"\.experts\.(\d+)\.(\w+)\.weight", rest)
        if m:
            e, proj = int(m.group(1)), m.group(2)
            part = {
                "gate_proj": "gate",
                "up_proj": "up",
                "down_proj": "down",
                "w1": "gate",
                "w3": "up",
                "w2": "down",
            }.get(proj)
            if part is None or e >= s.num_experts:
                return []
            if e not in self.weights.experts:
                raise self._not_held(f"expert {e} of layer {i}")
            local = e - self.weights.experts.start
            target = {
                "gate": layer.gate_up_EFH[local, :f],
                "up": layer.gate_up_EFH[local, f:],
                "down": layer.down_EHF[local],
            }
            return [(self._expert_unit(i, e, part), target[part], whole)]
        # fused tensors of all experts: the held experts' slices
        start = self.weights.experts.start
        if re.fullmatch(moe + r"\.experts\.(gate_up|down)_proj", rest) and not self.weights.experts:
            raise self._not_held(f"{rest} of layer {i}")
        if re.fullmatch(moe + r"\.experts\.gate_up_proj", rest):
            return [
                hit
                for e in self.weights.experts
                for hit in (
                    (
                        self._expert_unit(i, e, "gate"),
                        layer.gate_up_EFH[e - start, :f],
                        lambda t, e=e: t[e, :f],
                    ),
                    (
                        self._expert_unit(i, e, "up"),
                        layer.gate_up_EFH[e - start, f:],
                        lambda t, e=e: t[e, f:],
                    ),
                )
            ]
        if re.fullmatch(moe + r"\.experts\.down_proj", rest):
            return [
                (self._expert_unit(i, e, "down"), layer.down_EHF[e - start], lambda t, e=e: t[e])
                for e in self.weights.experts
            ]
        return []

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy every (hf_name, tensor) into place; returns the units written. Unknown names or shapes raise."""
        written: set[str] = set()
        with torch.no_grad():
            for name, tensor in named_tensors:
                try:
                    hits = self.resolve(name)
                except KeyError:
                    raise ValueError(
                        f"load_weights: unknown parameter name {name!r} for a {self.spec.arch} "
                        f"model with {self.spec.num_layers} layers"
                    ) from None
                self._check_shape(name, tensor, hits)
                for unit, target, source in hits:
                    target.copy_(source(tensor))
                    written.add(unit)
        return written

    @staticmethod
    def _check_shape(name: str, tensor: torch.Tensor, hits: list[tuple[str, torch.Tensor, Source]]) -> None:
        for _, target, source in hits:
            got = tuple(source(tensor).shape)
            if got != tuple(target.shape):
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected a tensor whose "
                    f"slice has shape {tuple(target.shape)} (got {got})"
                )


_EXPERT_UNIT = re.compile(r"\.experts\.(\d+)\.")


def _is_expert(unit: str) -> bool:
    """Whether a unit name (one hub tensor) is an expert's weight."""
    return _EXPERT_UNIT.search(unit) is not None


def expert_of(name: str) -> int | None:
    """The expert of a per-expert parameter name (`...experts.{e}....`), None for any other name."""
    m = _EXPERT_UNIT.search(name)
    return int(m.group(1)) if m else None


def is_expert_weight(name: str) -> bool:
    """Whether a Hugging Face parameter name holds expert weights (per-expert or fused): the tensors the weight
    sync sends to the expert workers of the disaggregated layout."""
    return _is_expert(name) or re.search(r"\.experts\.(gate_up_proj|down_proj)$", name) is not None


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors shards of a checkpoint folder (through the index file when there is one)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"path={str(path)!r}: no *.safetensors files; expected a Hugging Face checkpoint"
        )
    return files


def iter_checkpoint(
    path: str | Path, keep: Callable[[str], bool] = lambda name: True
) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard whose name `keep` accepts, one tensor in memory at a time
    (the others are never read)."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keep(name):
                    yield name, f.get_tensor(name)


def load_checkpoint(weight_map: WeightMap, path: str | Path) -> None:
    """Load a whole checkpoint and fail if any needed tensor is missing (no silently random expert)."""
    written = weight_map.load(iter_checkpoint(path, keep=weight_map.holds))
    missing = weight_map.expected_units() - written
    if weight_map.spec.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ValueError(
            f"checkpoint {str(path)!r} lacks {len(missing)} tensors the model needs, e.g. {shown}"
        )
