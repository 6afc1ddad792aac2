"""Composition of configs/ over the typed schema, and the decorator every recipe's main() uses.

A recipe is `@recipe("train")` over `main(cfg: ExperimentConfig)`. Composition errors (unknown key, wrong
type, an experiment that does not exist) are Hydra's own short messages; values out of range and rules that
join fields raise `ConfigError`, which ends the run with one line on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tppo.config import ConfigError, ExperimentConfig

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
SCHEMA_NAME = "experiment_schema"


def register_schema() -> None:
    """Make the typed schema available to the defaults lists of configs/ (idempotent)."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=ExperimentConfig)


def to_experiment(cfg: DictConfig) -> ExperimentConfig:
    """Convert Hydra's composed config to the dataclasses, once, and validate it."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0]) from err
    if not isinstance(obj, ExperimentConfig):
        raise ConfigError(f"composed config is a {type(obj).__name__}, not an ExperimentConfig")
    return obj.validate()


def compose(config_name: str = "train", overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Compose and validate a recipe's config without running it (tests, tools, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    for override in overrides:
        if problem := unknown_override_key(override):
            raise ConfigError(problem)
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return to_experiment(cfg)


def unknown_override_key(override: str) -> str | None:
    """Say what is wrong with `a.b=v` when `a.b` is no field of the schema (group choices pass through).

    Hydra would reject such a key too, but without naming the keys that exist; this names them and the
    closest match.
    """
    if override.startswith(("+", "~", "hydra.", "hydra/")) or "=" not in override:
        return None
    key = override.split("=", 1)[0]
    node: Any = ExperimentConfig
    path: list[str] = []
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            if not path and Path(CONFIG_DIR, part).is_dir():
                return None  # a config group choice such as model=tiny_mixtral or experiment=...
            where = ".".join(path) or "the top level"
            near = difflib.get_close_matches(part, list(fields), n=1)
            hint = f"; did you mean {'.'.join([*path, near[0]])}?" if near else ""
            return f"unknown key {key!r}: {where} has {', '.join(fields)}{hint}"
        path.append(part)
        node = fields[part].type if isinstance(fields[part].type, type) else _resolve(node, part)
    return None


def _resolve(owner: Any, name: str) -> Any:
    import typing

    return typing.get_type_hints(owner)[name]


def fail(message: str) -> None:
    """End the process with one clear line instead of a traceback."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


def recipe(config_name: str) -> Callable[[Callable[[ExperimentConfig], Any]], Callable[[], Any]]:
    """Turn `main(cfg: ExperimentConfig)` into a Hydra entry point composed from configs/<config_name>.yaml."""

    def wrap(main: Callable[[ExperimentConfig], Any]) -> Callable[[], Any]:
        register_schema()

        @hydra.main(config_path=CONFIG_DIR, config_name=config_name, version_base="1.3")
        @functools.wraps(main)
        def entry(cfg: DictConfig) -> Any:
            try:
                experiment = to_experiment(cfg)
            except ConfigError as err:
                fail(f"invalid configuration: {err}")
            return main(experiment)

        @functools.wraps(main)
        def checked() -> Any:
            for arg in sys.argv[1:]:
                if problem := unknown_override_key(arg):
                    fail(problem)
            return entry()

        return checked

    return wrap
