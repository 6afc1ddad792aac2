"""The project's one metrics logger: namespaced scalar metrics to a local JSONL file, and to wandb when enabled.

Keys are `<namespace>/<name>` with the namespaces below, so dashboards group them the same way in every
run. The JSONL file is always written (one object per call: `{"step": s, "time": t, **metrics}`) and
flushed, so a killed run keeps everything it logged. wandb is imported only when it is used: `auto` means
online when an API key is configured and offline otherwise; `WANDB_MODE` in the environment wins, so GPU
machines without network set `WANDB_MODE=disabled`.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tppo.base.fields import spec

NAMESPACES = ("rollout", "tppo", "critic", "relibra", "perf", "eval", "mismatch", "train")
T = TypeVar("T")


@dataclass
class LoggingConfig:
    """Where metrics go. JSONL always; wandb `auto` = online with an API key, else offline."""

    wandb: str = spec("auto", choices=("auto", "online", "offline", "disabled"))
    project: str = "relibra-tppo"
    entity: str | None = None
    progress: bool = True


def check_key(key: str) -> None:
    """Raise ValueError unless `key` is `<namespace>/<name>` with a known namespace."""
    namespace, sep, name = key.partition("/")
    if not sep or not name or namespace not in NAMESPACES:
        raise ValueError(f"metric key {key!r} must be '<namespace>/<name>' with a namespace in {NAMESPACES}")


def wandb_mode(requested: str, environ: Mapping[str, str] = os.environ) -> str:
    """Resolve `auto` to online (API key present) or offline; an explicit WANDB_MODE in the environment wins."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    has_key = bool(environ.get("WANDB_API_KEY")) or (
        (Path.home() / ".netrc").is_file()
        and "api.wandb.ai" in (Path.home() / ".netrc").read_text(errors="ignore")
    )
    return "online" if has_key else "offline"


def _jsonable(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes metrics of one run to `<run_dir>/metrics.jsonl` and, if enabled, a wandb run resumed by id."""

    def __init__(
        self,
        run_dir: str | Path,
        cfg: LoggingConfig,
        run_name: str,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8")
        self._wandb = self._start_wandb(cfg, run_name, dict(config or {}))

    def _truncate_after(self, step: int) -> None:
        """Keep the records up to `step` so a resumed run appends where its checkpoint left off."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a line torn by a kill mid-write: its step is after the checkpoint anyway
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def _start_wandb(self, cfg: LoggingConfig, run_name: str, config: dict[str, Any]) -> Any:
        mode = wandb_mode(cfg.wandb)
        if mode == "disabled":
            return None
        try:
            import wandb
        except ImportError:
            if cfg.wandb in ("online", "offline"):
                raise RuntimeError(
                    f"logging.wandb={cfg.wandb} but the wandb package is not installed"
                ) from None
            warnings.warn("wandb is not installed: metrics go to metrics.jsonl only", stacklevel=2)
            return None
        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        return wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=run_name,
            id=run_id,
            resume="allow",
            mode=mode,
            dir=str(self.run_dir),
            config=config,
            settings=wandb.Settings(silent=True),
        )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key in metrics:
            check_key(key)
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k not in ("step", "time")}, step=step)

    def summary(self, values: Mapping[str, Any]) -> None:
        if self._wandb is not None:
            self._wandb.summary.update({k: _jsonable(v) for k, v in values.items()})

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def progress(
    items: Iterable[T], *, total: int | None = None, desc: str = "", enabled: bool = True, initial: int = 0
) -> Iterator[T]:
    """A progress bar over `items` (tqdm), or the plain iterable when disabled or not on a terminal-like stream."""
    if not enabled:
        yield from items
        return
    from tqdm.auto import tqdm

    yield from tqdm(items, total=total, desc=desc, initial=initial, dynamic_ncols=True)
