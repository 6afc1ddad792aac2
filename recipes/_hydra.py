"""Composition of configs/ over the typed schema, and the decorator every recipe's main() uses.

A recipe is `@recipe("train")` over `main(cfg: ExperimentConfig)`; a recipe with its own top-level schema
passes it, e.g. `@recipe("eval", schema=Schema("eval_schema", EvalConfig))` over `main(cfg: EvalConfig)` (the
YAML's defaults list starts with the schema's name). Composition errors (unknown key, wrong type, an
experiment that does not exist) are Hydra's own short messages; values out of range and rules that join fields
raise `ConfigError`, which ends the run with one line on stderr and exit status 2 (`fail`; TPPO_DEBUG=1 shows
the traceback instead).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from tppo.config import ConfigError, ExperimentConfig

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
SCHEMA_NAME = "experiment_schema"


@dataclass(frozen=True)
class Schema:
    """A top-level typed schema: the ConfigStore `name` a recipe's YAML starts its defaults list with, and the
    dataclass (`node`) whose `validate()` returns the checked object."""

    name: str
    node: type


EXPERIMENT = Schema(SCHEMA_NAME, ExperimentConfig)


def register_schema(schema: Schema = EXPERIMENT) -> None:
    """Make the typed schema available to the defaults lists of configs/ (idempotent)."""
    ConfigStore.instance().store(name=schema.name, node=schema.node)


def to_config(cfg: DictConfig, schema: Schema) -> Any:
    """Convert Hydra's composed config to the schema's dataclasses, once, and validate it."""
    if "hydra" in cfg:  # a config composed with return_hydra_config: drop Hydra's own node, keep the schema
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0]) from err
    if not isinstance(obj, schema.node):
        raise ConfigError(f"composed config is a {type(obj).__name__}, not an {schema.node.__name__}")
    return obj.validate()


def to_experiment(cfg: DictConfig) -> ExperimentConfig:
    """Convert Hydra's composed config to the dataclasses, once, and validate it."""
    return to_config(cfg, EXPERIMENT)


def compose(config_name: str = "train", overrides: Sequence[str] = (), schema: Schema = EXPERIMENT) -> Any:
    """Compose and validate a recipe's config without running it (tests, tools, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    for override in overrides:
        if problem := unknown_override_key(override, schema.node):
            raise ConfigError(problem)
    register_schema(schema)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    return to_config(cfg, schema)


def unknown_override_key(override: str, root: type = ExperimentConfig) -> str | None:
    """Say what is wrong with `a.b=v` (or `+a.b=v`) when `a.b` is no field of the schema (group choices pass
    through).

    Hydra would reject such a key too, but without naming the keys that exist; this names them and the
    closest match.
    """
    # `+key=v` / `++key=v` add or force a key: a typo there would be dropped without a word, so check it too.
    override = override.lstrip("+")
    if override.startswith(("~", "hydra.", "hydra/")) or "=" not in override:
        return None
    key = override.split("=", 1)[0]
    if "@" in key:  # group@package: a config group placed elsewhere
        return None
    node: Any = root
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
    """End the process with one clear line instead of a traceback; with TPPO_DEBUG=1 in the environment,
    called while an exception is handled, re-raise it (the traceback) instead."""
    if os.environ.get("TPPO_DEBUG") and sys.exc_info()[1] is not None:
        raise  # the exception the caller is handling
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


def recipe(
    config_name: str, schema: Schema = EXPERIMENT
) -> Callable[[Callable[[Any], Any]], Callable[[], Any]]:
    """Turn `main(cfg)` into a Hydra entry point composed from configs/<config_name>.yaml over `schema`
    (`main(cfg: ExperimentConfig)` by default)."""

    def wrap(main: Callable[[Any], Any]) -> Callable[[], Any]:
        register_schema(schema)

        @hydra.main(config_path=CONFIG_DIR, config_name=config_name, version_base="1.3")
        @functools.wraps(main)
        def entry(cfg: DictConfig) -> Any:
            try:
                typed = to_config(cfg, schema)
            except ConfigError as err:
                fail(f"invalid configuration: {err}")
            return main(typed)

        @functools.wraps(main)
        def checked() -> Any:
            for arg in sys.argv[1:]:
                if problem := unknown_override_key(arg, schema.node):
                    fail(problem)
            return entry()

        return checked

    return wrap
