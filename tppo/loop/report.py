"""End-of-run report: the summary numbers and PNG plots (reward, response length, per-layer expert load)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# The per-step series the report keeps: (its name, the step metric it reads).
SERIES = (
    ("reward", "rollout/reward_mean"),
    ("length", "rollout/length_mean"),
    ("multi_window", "rollout/multi_window_fraction"),
    ("tokens_per_s", "rollout/tokens_per_s"),
    ("skew_static", "relibra/skew_static"),
    ("skew_planned", "relibra/skew_planned"),
    ("skew_executed", "relibra/exec_skew_measured"),
)


@dataclass
class History:
    """What the end-of-run report needs from the steps: a few metrics per step (NaN where a step had none) and
    the warm start's NLL per supervised step. Checkpointed with the run, so a resumed run reports every step."""

    series: dict[str, list[float]] = field(default_factory=dict)
    warm_start_nll: list[float] = field(default_factory=list)

    def remember(self, metrics: dict[str, float]) -> None:
        for key, metric in SERIES:
            self.series.setdefault(key, []).append(metrics.get(metric, float("nan")))

    def get(self, key: str) -> list[float]:
        return self.series.get(key, [])

    def state_dict(self) -> dict[str, Any]:
        return {
            "series": {k: list(v) for k, v in self.series.items()},
            "warm_start_nll": list(self.warm_start_nll),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.series = {k: list(v) for k, v in state["series"].items()}
        self.warm_start_nll = list(state["warm_start_nll"])


def summarize(history: History) -> dict[str, Any]:
    """Means over the first and last 20% of steps (reward), and over the run (the rest).

    truncated_fraction: the share of finished responses that T-PPO cut at least once (they needed more than
    one window); skew_*: mean max/mean expert pairs per EP rank over (micro-batch, layer), static placement vs
    the ReLibra plan (both priced by the simulator on the exact loads) and as the executor measured it in the
    policy update (every pair the experts computed, padding included).
    """
    rewards = np.asarray(history.get("reward"), dtype=float)
    k = max(1, len(rewards) // 5)

    def mean(key: str, values: np.ndarray | None = None) -> float:
        arr = np.asarray(history.get(key), dtype=float) if values is None else values
        finite = arr[np.isfinite(arr)]
        return float(finite.mean()) if finite.size else float("nan")

    return {
        "steps": len(rewards),
        "reward_first": mean("reward", rewards[:k]),
        "reward_last": mean("reward", rewards[-k:]),
        "truncated_fraction": mean("multi_window"),
        "tokens_per_s": mean("tokens_per_s"),
        "skew_static": mean("skew_static"),
        "skew_planned": mean("skew_planned"),
        "skew_executed": mean("skew_executed"),
    }


def write_plots(out_dir: str | Path, history: History, expert_load_LE: np.ndarray | None) -> list[Path]:
    """reward.png, length.png and (with routing) expert_load.png in `out_dir`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    written = []
    for key, title, ylabel in (
        ("reward", "Mean reward of finished responses", "reward"),
        ("length", "Mean length of finished responses", "tokens"),
    ):
        values = np.asarray(history.get(key), dtype=float)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(np.arange(len(values)), values, ".", alpha=0.4, label="per step")
        if len(values) >= 5:
            kernel = np.ones(5) / 5
            finite = np.where(np.isfinite(values), values, np.nanmean(values))
            ax.plot(
                np.arange(2, len(values) - 2), np.convolve(finite, kernel, mode="valid"), label="5-step mean"
            )
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.legend()
        fig.tight_layout()
        path = out / f"{key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    if expert_load_LE is not None and expert_load_LE.size:
        share = expert_load_LE / np.maximum(expert_load_LE.sum(axis=1, keepdims=True), 1)
        fig, ax = plt.subplots(figsize=(6, 1 + 0.5 * share.shape[0]))
        im = ax.imshow(share, aspect="auto", cmap="viridis")
        ax.set(title="Share of routed tokens per expert", xlabel="expert", ylabel="MoE layer")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        path = out / "expert_load.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
