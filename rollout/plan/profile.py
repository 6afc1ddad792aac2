"""Per-layer times of one GPU: read from a profile JSON (`rollout-profile/4`, `/3`, `/2` or `/1`, written by
`bench/rollout_disagg.py --profile`) and fitted, or built from the roofline of a GPU preset.

Schema /3 adds what the ExpertPlex planner (rollout/plan/shared.py) needs to be checked on one GPU: the expert
path the engine ran (`expert_kernel`), `prefill_attention` rows (one layer's attention for `seqs` prompts of
`length` tokens from position 0), a `phase` on `experts` rows (decode: every token a decode row; prefill: none)
and on `steps` and `overhead` rows (prefill steps: `batch` prompts of `context` tokens). Schema /4 times each
overhead point's step with one layer and with two: `layer_ms` (the second minus the first) is what a layer adds
inside a step, `parts_ms` its passes timed alone, and `ms` the step extrapolated to no layers.

Fits (non-negative least squares on relative error, so that 0.05 ms and 5 ms points weigh alike and every slope
stays >= 0, which keeps times monotone in the batch and the binary search of the planner exact):
- attention: T_a(b, C) = a0 + a1 b + a2 b C. Decode attention reads each row's C cached positions (b C KV
  bytes: the a2 term) and runs per-row projections, norms and the router (a1 b); a0 is the weight read and the
  launch floor. With TP over g GPUs the row terms split (b / g; the KV term over min(g, KV heads)); a0 stays,
  which is conservative.
- experts, form "touched" (the default): T_e(t) = e0 + e1 D(t) + e2 t K with D(t) = E (1 - (1 - K/E)^t) the
  experts t tokens touch: a fine-grained MoE re-reads nearly every expert per micro-batch, so the time follows
  the weight bytes touched (e1) before the FLOPs (e2). Form "linear" is MegaScale-Infer's T_e = k3 t + k4.
  A worker holding E_w of the E experts scales the D and t K terms by E_w / E (and by 1 / g under TP).
- step overhead: O(t) = o0 + o1 t, the fixed cost of one step computing t tokens (b decode rows, or a prefill
  step's prompt tokens) beyond its L layers (embedding, final norm + LM head, sampling, host copies and the
  step's one sync), fitted by NNLS on absolute error (the rows are differences of measurements, so a few may be
  ~0 or slightly negative) to the profile's "overhead" rows of the phase (schema /2). So a step is predicted as
  L (T_a + T_e [+ 2 T_c]) + O(b) (rollout/plan/search.py). O is measured on one GPU and kept whole under TP
  (conservative, like a0). A profile without overhead rows (schema /1, or the section skipped) and the analytic
  roofline keep the former fixed cost, the LM head's roofline alone (LayerTimes.note says so).
- in-step scale (schema /4): a pass timed alone is not what it adds inside a step (on an H100 a 512-token
  prefill layer's passes took 0.66 ms alone, ~0.48 ms as one layer of a 4-layer step; decode layers ~10% more
  in the step). r(t) = layer_ms / parts_ms of the overhead rows at t tokens, interpolated linearly in log2 t
  (constant past the ends), multiplies every attention, prefill attention and experts row of its phase before
  the fits (in_step), so that L layers and O add up to the step.

Legend: b decode rows, C context, t tokens, E experts, K top-k, E_w experts of one worker, g TP degree.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rollout.plan.hardware import GpuSpec, ModelShape
from rollout.plan.perf import distinct_experts, roofline_ms

SCHEMA = "rollout-profile/4"
# /1: no "overhead" section, times of one graph per layer part; /2: no prefill rows, no phases; /3: no two-layer
# steps in the overhead rows
SCHEMAS = ("rollout-profile/1", "rollout-profile/2", "rollout-profile/3", SCHEMA)
PHASES = ("decode", "prefill")
MODEL_KEYS = ("hidden_size", "num_experts", "top_k", "moe_ffn", "num_heads", "num_kv_heads", "head_dim")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
EXPERT_FORMS = ("touched", "linear")


@dataclass(frozen=True)
class AttentionPoint:
    batch: int
    context: int
    ms: float


@dataclass(frozen=True)
class PrefillPoint:
    """One layer's attention (and router) for `seqs` prompts of `length` tokens, all from position 0."""

    seqs: int
    length: int
    ms: float


@dataclass(frozen=True)
class ExpertPoint:
    tokens: int
    ms: float
    phase: str = "decode"  # which of the persistent kernel's tile sizes the pass used


@dataclass(frozen=True)
class StepPoint:
    """A whole engine step of `num_layers` layers: decode (`batch` rows at `context` positions) or prefill
    (`batch` prompts of `context` tokens from position 0)."""

    layout: str
    batch: int
    context: int
    num_layers: int
    step_ms: float
    phase: str = "decode"


@dataclass(frozen=True)
class OverheadPoint:
    """A step's fixed cost at `batch` rows (ms may be <= 0 from noise); a prefill step's (schema /3) at `batch`
    prompts of `context` tokens. Up to /3 a one-layer step minus its layer's passes timed alone; from /4 the step
    extrapolated to no layers, with `layer_ms` (what one layer adds inside the step) and `parts_ms` (its passes
    timed alone)."""

    batch: int
    context: int
    ms: float
    phase: str = "decode"
    layer_ms: float | None = None
    parts_ms: float | None = None

    @property
    def tokens(self) -> int:
        """The tokens the step computes: its decode rows, or its prompts' tokens."""
        return self.batch * self.context if self.phase == "prefill" else self.batch


@dataclass(frozen=True)
class Profile:
    source: str
    device: str
    copy_GBps: float | None
    model: ModelShape
    attention: tuple[AttentionPoint, ...]
    experts: tuple[ExpertPoint, ...]
    steps: tuple[StepPoint, ...]
    overhead: tuple[OverheadPoint, ...] = ()
    prefill_attention: tuple[PrefillPoint, ...] = ()
    expert_kernel: str | None = None  # the expert path the profiled engine ran (schema /3)


# ------------------------------------------------------------------------------------------- reading
def load_profile(path: str | Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"profile {path}: not JSON ({err})") from err
    return parse_profile(data, str(path))


def parse_profile(data: Any, where: str) -> Profile:
    if not isinstance(data, dict) or data.get("schema") not in SCHEMAS:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"profile {where}: schema={got!r}; expected one of {list(SCHEMAS)}")
    return Profile(
        source=where,
        device=str(data.get("device", "?")),
        copy_GBps=data.get("copy_GBps"),
        model=_model(data, where),
        attention=tuple(
            AttentionPoint(**_row(r, ("batch", "context", "ms"), "attention", i, where))
            for i, r in enumerate(_list(data, "attention", where))
        ),
        experts=tuple(
            ExpertPoint(
                **_row(r, ("tokens", "ms"), "experts", i, where), phase=_phase(r, "experts", i, where)
            )
            for i, r in enumerate(_list(data, "experts", where))
        ),
        steps=tuple(_step(r, i, where) for i, r in enumerate(_list(data, "steps", where))),
        overhead=tuple(_overhead(r, i, where) for i, r in enumerate(_list(data, "overhead", where))),
        prefill_attention=tuple(
            PrefillPoint(**_row(r, ("seqs", "length", "ms"), "prefill_attention", i, where))
            for i, r in enumerate(_list(data, "prefill_attention", where))
        ),
        expert_kernel=data.get("expert_kernel"),
    )


def _list(data: dict, key: str, where: str) -> list:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"profile {where}: {key!r} is {type(value).__name__}; expected a list of rows")
    return value


def _row(row: Any, keys: tuple[str, ...], section: str, i: int, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ValueError(f"profile {where}: {section}[{i}] is not an object")
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"profile {where}: {section}[{i}] lacks {missing}; expected keys {list(keys)}")
    out = {k: float(row[k]) if k.endswith("ms") else int(row[k]) for k in keys}
    if any(v <= 0 for v in out.values()):
        raise ValueError(f"profile {where}: {section}[{i}] = {row}: values must be > 0")
    return out


def _phase(row: dict, section: str, i: int, where: str) -> str:
    phase = row.get("phase", "decode")
    if phase not in PHASES:
        raise ValueError(f"profile {where}: {section}[{i}] phase={phase!r}; expected one of {list(PHASES)}")
    return phase


def _step(row: Any, i: int, where: str) -> StepPoint:
    nums = _row(row, ("batch", "context", "num_layers", "step_ms"), "steps", i, where)
    layout = row.get("layout", "replicas")
    if layout != "replicas":
        raise ValueError(f"profile {where}: steps[{i}] layout={layout!r}; only 'replicas' steps are modelled")
    return StepPoint(layout=layout, **nums, phase=_phase(row, "steps", i, where))


def _overhead(row: Any, i: int, where: str) -> OverheadPoint:
    """An overhead row: batch and context > 0; ms any finite number (a difference of two measurements); with
    layer_ms (schema /4), layer_ms finite too (a difference) and its parts attention_ms + experts_ms > 0."""
    if not isinstance(row, dict) or any(k not in row for k in ("batch", "context", "ms")):
        raise ValueError(f"profile {where}: overhead[{i}] = {row}; expected keys ['batch', 'context', 'ms']")
    layer = parts = None
    if "layer_ms" in row:
        if "attention_ms" not in row or "experts_ms" not in row:
            raise ValueError(
                f"profile {where}: overhead[{i}] = {row}: layer_ms without attention_ms, experts_ms"
            )
        layer, parts = float(row["layer_ms"]), float(row["attention_ms"]) + float(row["experts_ms"])
        if not (np.isfinite(layer) and parts > 0):
            raise ValueError(
                f"profile {where}: overhead[{i}] = {row}: layer_ms must be finite, its parts > 0"
            )
    point = OverheadPoint(
        int(row["batch"]),
        int(row["context"]),
        float(row["ms"]),
        _phase(row, "overhead", i, where),
        layer,
        parts,
    )
    if point.batch <= 0 or point.context <= 0 or not np.isfinite(point.ms):
        raise ValueError(f"profile {where}: overhead[{i}] = {row}: batch, context must be > 0, ms finite")
    return point


def _model(data: dict, where: str) -> ModelShape:
    m = data.get("model")
    if not isinstance(m, dict) or any(k not in m for k in MODEL_KEYS):
        have = sorted(m) if isinstance(m, dict) else m
        raise ValueError(f"profile {where}: 'model' = {have}; expected keys {list(MODEL_KEYS)}")
    dtype = str(data.get("dtype", "bfloat16"))
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"profile {where}: dtype={dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    nbytes = DTYPE_BYTES[dtype]
    return ModelShape(
        name=f"profile:{Path(where).name}",
        hidden_size=int(m["hidden_size"]),
        num_experts=int(m["num_experts"]),
        top_k=int(m["top_k"]),
        moe_ffn=int(m["moe_ffn"]),
        num_layers=int(m.get("num_layers", 1)),
        num_heads=int(m["num_heads"]),
        num_kv_heads=int(m["num_kv_heads"]),
        head_dim=int(m["head_dim"]),
        vocab_size=int(m.get("vocab_size", 0)),
        weight_bytes=nbytes,
        kv_bytes=nbytes,
        act_bytes=nbytes,
    )


# ------------------------------------------------------------------------------------------- fitting
def nnls(a_NP: np.ndarray, y_N: np.ndarray) -> np.ndarray:
    """min ||A x - y|| subject to x >= 0, exactly, for the few (P <= 4) columns the fits have.

    The optimum is the unconstrained least-squares solution on its own support (its positive set), so the best
    non-negative solution over all 2^P supports is the answer."""
    num_cols = a_NP.shape[1]
    best, best_err = np.zeros(num_cols), float(np.sum(y_N**2))
    for size in range(1, num_cols + 1):
        for cols in itertools.combinations(range(num_cols), size):
            sol = np.linalg.lstsq(a_NP[:, cols], y_N, rcond=None)[0]
            if np.any(sol < 0):
                continue
            err = float(np.sum((a_NP[:, cols] @ sol - y_N) ** 2))
            if err < best_err - 1e-15:
                best, best_err = np.zeros(num_cols), err
                best[list(cols)] = sol
    return best


def relative_nnls(a_NP: np.ndarray, y_N: np.ndarray) -> np.ndarray:
    """NNLS on relative error: every row divided by its measured value."""
    return nnls(a_NP / y_N[:, None], np.ones_like(y_N))


def attention_features(batch: float, context: float) -> np.ndarray:
    return np.array([1.0, batch, batch * context])


def expert_features(tokens: float, num_experts: int, top_k: int, form: str) -> np.ndarray:
    if form == "linear":
        return np.array([1.0, 0.0, tokens * top_k])
    return np.array([1.0, distinct_experts(tokens, num_experts, top_k), tokens * top_k])


# ------------------------------------------------------------------------------------- layer time models
class AttentionTime(Protocol):
    def ms(self, batch: float, context: float, tp: int) -> float: ...


class ExpertTime(Protocol):
    def ms(self, tokens: float, num_local: int, tp: int) -> float: ...


@dataclass(frozen=True)
class FittedAttention:
    """T_a = a0 + a1 b / g + a2 b C / min(g, KV heads) (see the module docstring)."""

    coef: tuple[float, float, float]
    num_kv_heads: int

    def ms(self, batch: float, context: float, tp: int) -> float:
        a0, a1, a2 = self.coef
        return a0 + a1 * batch / tp + a2 * batch * context / max(1, min(tp, self.num_kv_heads))


@dataclass(frozen=True)
class FittedExperts:
    """T_e = e0 + (e1 D(t) + e2 t K) (E_w / E) / g (see the module docstring)."""

    form: str
    coef: tuple[float, float, float]
    num_experts: int
    top_k: int

    def ms(self, tokens: float, num_local: int, tp: int) -> float:
        e0, e1, e2 = self.coef
        f = expert_features(tokens, self.num_experts, self.top_k, self.form)
        return float(e0 + (e1 * f[1] + e2 * f[2]) * num_local / self.num_experts / tp)


@dataclass(frozen=True)
class RooflineAttention:
    """Bytes: the layer's attention weights and b C cached K/V; FLOPs: 2 b (weights) + 4 b C (q width)."""

    model: ModelShape
    gpu: GpuSpec

    def ms(self, batch: float, context: float, tp: int) -> float:
        m = self.model
        kv = batch * context * 2 * m.num_kv_heads * m.head_dim * m.kv_bytes / m.kv_shards(tp)
        weights = m.attention_params_per_layer * m.weight_bytes / tp
        flops = (
            2 * batch * m.attention_params_per_layer + 4 * batch * context * m.num_heads * m.head_dim
        ) / tp
        return roofline_ms(weights + kv, flops, self.gpu.peak_flops, self.gpu.mem_bandwidth)


@dataclass(frozen=True)
class RooflineExperts:
    """Bytes: the experts a micro-batch touches, D(t) E_w / E of them; FLOPs: 2 (3 h f) per routed token."""

    model: ModelShape
    gpu: GpuSpec

    def ms(self, tokens: float, num_local: int, tp: int) -> float:
        m = self.model
        share = num_local / m.num_experts
        touched = distinct_experts(tokens, m.num_experts, m.top_k) * share
        flops = 2 * m.expert_params * tokens * m.top_k * share / tp
        return roofline_ms(
            touched * m.expert_params * m.weight_bytes / tp,
            flops,
            self.gpu.peak_flops,
            self.gpu.mem_bandwidth,
        )


@dataclass(frozen=True)
class FittedOverhead:
    """O(b) = o0 + o1 b (see the module docstring)."""

    coef: tuple[float, float]

    def ms(self, batch: float) -> float:
        o0, o1 = self.coef
        return o0 + o1 * batch


@dataclass(frozen=True)
class LayerTimes:
    """What the planner reads: one layer's attention and expert times, the step's fixed cost (the fitted overhead
    O(b), else the LM head's roofline), where they came from, and a note when the overhead is missing."""

    attention: AttentionTime
    experts: ExpertTime
    head_gpu: GpuSpec
    source: str
    overhead: FittedOverhead | None = None
    note: str | None = None

    def fixed_ms(self, model: ModelShape, batch: float, tp: int) -> float:
        """A step's cost beyond its layers: O(b) when fitted (whole under TP), else head_ms."""
        if self.overhead is not None:
            return self.overhead.ms(batch)
        return self.head_ms(model, batch, tp)

    def head_ms(self, model: ModelShape, batch: float, tp: int) -> float:
        """LM head of one step (roofline: the V h weights read once, 2 b V h FLOPs), split over TP."""
        params = model.vocab_size * model.hidden_size
        return roofline_ms(
            params * model.weight_bytes / tp,
            2 * batch * params / tp,
            self.head_gpu.peak_flops,
            self.head_gpu.mem_bandwidth,
        )


def fit_attention(points: tuple[AttentionPoint, ...], num_kv_heads: int) -> FittedAttention:
    if len(points) < 3:
        raise ValueError(f"profile: {len(points)} attention rows; the fit a0 + a1 b + a2 b C needs >= 3")
    a = np.stack([attention_features(p.batch, p.context) for p in points])
    coef = relative_nnls(a, np.array([p.ms for p in points]))
    return FittedAttention((float(coef[0]), float(coef[1]), float(coef[2])), num_kv_heads)


def fit_experts(points: tuple[ExpertPoint, ...], model: ModelShape, form: str) -> FittedExperts:
    if form not in EXPERT_FORMS:
        raise ValueError(f"expert fit form={form!r}; expected one of {EXPERT_FORMS}")
    if len(points) < 2:
        raise ValueError(f"profile: {len(points)} experts rows; the fit needs >= 2")
    a = np.stack([expert_features(p.tokens, model.num_experts, model.top_k, form) for p in points])
    coef = relative_nnls(a, np.array([p.ms for p in points]))
    return FittedExperts(
        form, (float(coef[0]), float(coef[1]), float(coef[2])), model.num_experts, model.top_k
    )


def decode_points(points: tuple[ExpertPoint, ...]) -> tuple[ExpertPoint, ...]:
    return tuple(p for p in points if p.phase == "decode")


def fit_overhead(points: tuple[OverheadPoint, ...]) -> FittedOverhead:
    """O(t) = o0 + o1 t over the rows' tokens by NNLS on absolute error; o0 = max(0, mean) alone when the rows
    have one size."""
    if not points:
        raise ValueError("profile: no overhead rows to fit")
    batch_N = np.array([p.tokens for p in points], dtype=float)
    ms_N = np.array([p.ms for p in points])
    if len(set(batch_N.tolist())) < 2:
        return FittedOverhead((max(0.0, float(ms_N.mean())), 0.0))
    coef = nnls(np.stack([np.ones_like(batch_N), batch_N], axis=1), ms_N)
    return FittedOverhead((float(coef[0]), float(coef[1])))


@dataclass(frozen=True)
class InStepScale:
    """r(t): what a layer of t tokens adds inside a step over its passes timed alone, linear in log2 t between
    the measured sizes and constant past them."""

    log2_tokens: tuple[float, ...]
    ratio: tuple[float, ...]

    def at(self, tokens: float) -> float:
        return float(np.interp(np.log2(max(tokens, 1.0)), self.log2_tokens, self.ratio))


def fit_in_step(points: tuple[OverheadPoint, ...]) -> InStepScale | None:
    """r at each size the rows with a two-layer step measured (the mean where several share it), or None. A row
    whose layer_ms is <= 0 (a layer smaller than the noise of two steps: toy models on a CPU) gives no ratio."""
    by_tokens: dict[int, list[float]] = defaultdict(list)
    for p in points:
        if p.layer_ms is not None and p.parts_ms is not None and p.layer_ms > 0:
            by_tokens[p.tokens].append(p.layer_ms / p.parts_ms)
    if not by_tokens:
        return None
    sizes = sorted(by_tokens)
    return InStepScale(
        tuple(float(np.log2(t)) for t in sizes), tuple(float(np.mean(by_tokens[t])) for t in sizes)
    )


def in_step(profile: Profile) -> Profile:
    """The profile's passes as they cost inside a step: each attention, prefill attention and experts row times
    r(t) of its phase (t: decode rows; a prefill pass's tokens), where its overhead rows measured r; the rows
    as they are for a phase without (schema < /4)."""
    scale = {ph: fit_in_step(tuple(p for p in profile.overhead if p.phase == ph)) for ph in PHASES}

    def times(phase: str, tokens: float, ms: float) -> float:
        r = scale[phase]
        return ms * r.at(tokens) if r is not None else ms

    return replace(
        profile,
        attention=tuple(replace(p, ms=times("decode", p.batch, p.ms)) for p in profile.attention),
        prefill_attention=tuple(
            replace(p, ms=times("prefill", p.seqs * p.length, p.ms)) for p in profile.prefill_attention
        ),
        experts=tuple(replace(p, ms=times(p.phase, p.tokens, p.ms)) for p in profile.experts),
    )


def analytic_times(model: ModelShape, gpu: GpuSpec) -> LayerTimes:
    source = (
        f"analytic roofline of {gpu.name} ({gpu.mem_bandwidth / 1e12:.2f} TB/s, {gpu.peak_flops / 1e12:.0f} "
        f"TFLOP/s, {gpu.memory_bytes / 1e9:.0f} GB; no --profile): experts by weight bytes touched"
    )
    return LayerTimes(RooflineAttention(model, gpu), RooflineExperts(model, gpu), gpu, source)


def fitted_times(profile: Profile, gpu: GpuSpec, form: str) -> LayerTimes:
    """Fits of the profile's in-step times; the LM head keeps the roofline, with the profile's copy bandwidth
    when it has one."""
    profile = in_step(profile)
    attention = fit_attention(profile.attention, profile.model.num_kv_heads)
    # the replicas model times decode steps: prefill-phase passes (schema /3) use other tiles
    experts = fit_experts(decode_points(profile.experts), profile.model, form)
    head_gpu = gpu
    if profile.copy_GBps:
        head_gpu = GpuSpec(
            gpu.name, gpu.peak_flops, profile.copy_GBps * 1e9, gpu.memory_bytes, gpu.nvlink_bandwidth
        )
    a0, a1, a2 = attention.coef
    e0, e1, e2 = experts.coef
    source = (
        f"profile {profile.source} ({profile.device}): T_a = {a0:.4f} + {a1:.2e} b + {a2:.2e} b C ms; "
        f"T_e ({form}) = {e0:.4f} + {e1:.2e} D(t) + {e2:.2e} t K ms"
    )
    overhead_rows = tuple(p for p in profile.overhead if p.phase == "decode")  # the replicas model's steps
    if not overhead_rows:
        note = (
            f"profile {profile.source} has no 'overhead' rows (schema /1 or the section was skipped): the step's "
            "fixed cost is the LM head's roofline alone (embedding, sampling, host copies and sync taken as 0)"
        )
        source += "; step fixed cost: LM head roofline"
        return LayerTimes(attention, experts, head_gpu, source, note=note)
    overhead = fit_overhead(overhead_rows)
    o0, o1 = overhead.coef
    source += f"; O = {o0:.4f} + {o1:.2e} b ms per step"
    return LayerTimes(attention, experts, head_gpu, source, overhead)
