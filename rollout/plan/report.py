"""Printing and JSON of plans, and `--validate`: measured whole engine steps against the model's prediction."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.plan.hardware import GB, ModelShape
from rollout.plan.profile import LayerTimes, StepPoint
from rollout.plan.search import Plan, Search, describe

VALIDATE_TOLERANCE = 0.15


def plan_row(p: Plan) -> dict[str, Any]:
    sh = p.shape
    return {
        "layout": sh.layout,
        "attention_workers": sh.num_attn,
        "attention_tp": sh.attn_tp,
        "expert_workers": sh.num_expert,
        "expert_tp": sh.expert_tp,
        "micro_batches": sh.num_micro,
        "gpus_per_group": sh.gpus,
        "groups": p.copies,
        "batch": p.batch,
        "micro_batch_rows": p.micro_batch,
        "t_a_ms": p.t_a_ms,
        "t_e_ms": p.t_e_ms,
        "t_c_ms": p.t_c_ms,
        "step_ms": p.step_ms,
        "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
        "sync_bytes_per_expert_gpu": p.sync_expert_bytes,
        "sync_bytes_per_attention_gpu": p.sync_attention_bytes,
        "balance_ta_te": p.balance,
        "pipeline_full": p.pipeline_full,
    }


def format_plan(p: Plan) -> str:
    sh = p.shape
    lines = [f"layout        {sh.layout}: {describe(sh)}; {p.copies} group(s) of {sh.gpus} GPU(s)"]
    if sh.layout == "disaggregated":
        lines.append(f"micro-batches m={sh.num_micro} of {p.micro_batch} rows per attention worker")
    lines += [
        f"batch         {p.batch} rows per group per step",
        f"T_a T_e T_c   {p.t_a_ms:.4f} {p.t_e_ms:.4f} {p.t_c_ms:.4f} ms per layer"
        + (
            f" (T_a/T_e balance {p.balance:.2f}, pipeline full: {p.pipeline_full})"
            if sh.layout == "disaggregated"
            else ""
        ),
        f"step          {p.step_ms:.3f} ms per token",
        f"throughput    {p.tokens_per_s_per_gpu:.1f} tokens/s per GPU",
        f"weight sync   {p.sync_expert_bytes * sh.expert_tp / GB:.2f} GB per expert-side worker "
        f"({p.sync_expert_bytes / GB:.2f} per GPU), {p.sync_attention_bytes * sh.attn_tp / GB:.2f} GB per "
        f"attention-side worker ({p.sync_attention_bytes / GB:.2f} per GPU)",
    ]
    return "\n".join(lines)


def format_table(plans: list[Plan], top: int) -> str:
    head = "| # | layout | n_a x tp_a | n_e x tp_e | m | batch | T_a | T_e | T_c | step ms | tok/s/GPU |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for i, p in enumerate(plans[:top]):
        sh = p.shape
        na = f"{sh.num_attn} x {sh.attn_tp}" if sh.layout == "disaggregated" else f"({sh.attn_tp})"
        ne = f"{sh.num_expert} x {sh.expert_tp}" if sh.layout == "disaggregated" else "-"
        lines.append(
            f"| {i + 1} | {sh.layout} | {na} | {ne} | {sh.num_micro} | {p.batch} | {p.t_a_ms:.3f} | "
            f"{p.t_e_ms:.3f} | {p.t_c_ms:.3f} | {p.step_ms:.2f} | {p.tokens_per_s_per_gpu:.1f} |"
        )
    return "\n".join(lines)


def search_meta(s: Search) -> dict[str, Any]:
    return {
        "model": dataclasses.asdict(s.model),
        "workload": dataclasses.asdict(s.workload),
        "cluster": {**dataclasses.asdict(s.cluster), "gpu": dataclasses.asdict(s.cluster.gpu)},
        "times": s.times.source,
        "times_note": s.times.note,
    }


# ---------------------------------------------------------------------------------------------- validate
@dataclass(frozen=True)
class Check:
    step: StepPoint
    predicted_ms: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_ms - self.step.step_ms) / self.step.step_ms

    @property
    def ok(self) -> bool:
        return abs(self.error) <= VALIDATE_TOLERANCE


def predict_replica_step(times: LayerTimes, model: ModelShape, step: StepPoint) -> float:
    """A one-GPU replica step of L = `num_layers` layers: L (T_a(b, C) + T_e(b)) + O(b), O the step's fixed cost
    (the fitted overhead, else the LM head's roofline)."""
    layer = times.attention.ms(step.batch, step.context, 1) + times.experts.ms(
        step.batch, model.num_experts, 1
    )
    return step.num_layers * layer + times.fixed_ms(model, step.batch, 1)


def validate(
    steps: tuple[StepPoint, ...], predict: Callable[[StepPoint], float], phases: tuple[str, ...] = ("decode",)
) -> list[Check]:
    """Each measured step of the given phases against `predict` (the replicas model times decode steps only;
    the ExpertPlex model, rollout/plan/shared.py, both phases)."""
    chosen = [st for st in steps if st.phase in phases]
    if not chosen:
        raise ValueError(f"--validate: the file has no {'/'.join(phases)} 'steps' rows to compare")
    return [Check(st, predict(st)) for st in chosen]


def format_checks(checks: list[Check]) -> str:
    lines = [
        "| phase | layers | batch | context | measured ms | predicted ms | error | within 15% |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        st = c.step
        lines.append(
            f"| {st.phase} | {st.num_layers} | {st.batch} | {st.context} | {st.step_ms:.3f} | "
            f"{c.predicted_ms:.3f} | {100 * c.error:+.1f}% | {'yes' if c.ok else 'NO'} |"
        )
    good = sum(c.ok for c in checks)
    lines.append(f"{good} of {len(checks)} rows within {100 * VALIDATE_TOLERANCE:.0f}%")
    return "\n".join(lines)


def check_row(c: Check) -> dict[str, Any]:
    return {**dataclasses.asdict(c.step), "predicted_ms": c.predicted_ms, "error": c.error, "ok": c.ok}
