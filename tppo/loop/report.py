"""End-of-run report: the summary numbers and PNG plots (reward, response length, per-layer expert load)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def summarize(history: dict[str, list[float]]) -> dict[str, Any]:
    """Means over the first and last 20% of steps (reward), and over the run (the rest).

    truncated_fraction: the share of finished responses that T-PPO cut at least once (they needed more than
    one window); skew_*: mean max/mean expert pairs per EP rank over (micro-batch, layer), static placement vs
    the ReLibra plan (both priced by the simulator on the exact loads) and as the executor measured it in the
    policy update (every pair the experts computed, padding included).
    """
    rewards = np.asarray(history.get("reward", []), dtype=float)
    k = max(1, len(rewards) // 5)

    def mean(key: str, values: np.ndarray | None = None) -> float:
        arr = np.asarray(history.get(key, []), dtype=float) if values is None else values
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


def write_plots(
    out_dir: str | Path, history: dict[str, list[float]], expert_load_LE: np.ndarray | None
) -> list[Path]:
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
        values = np.asarray(history.get(key, []), dtype=float)
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
