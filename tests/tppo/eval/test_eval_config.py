"""configs/eval.yaml composes over EvalConfig: the defaults, the dataset group, typed values, and bad overrides
named before anything runs."""

from __future__ import annotations

import pytest

from recipes._hydra import compose
from recipes.eval import SCHEMA
from tppo.base.fields import ConfigError
from tppo.eval.evaluation import EvalConfig


def test_defaults_are_the_fields_conventions():
    cfg = compose("eval", ["checkpoint=/models/x"], schema=SCHEMA)
    assert isinstance(cfg, EvalConfig)
    assert (cfg.n, cfg.temperature, cfg.top_p, cfg.max_new_tokens) == (32, 0.6, 0.95, 32768)
    assert cfg.pass_ks == [1, 2, 4, 8, 16, 32]
    assert cfg.data.source == "dataset" and cfg.data.template == "math_chat" and cfg.data.reward == "math"
    assert cfg.data.path.endswith("aime_2024") and not cfg.data.shuffle


def test_dataset_group_and_typed_overrides():
    cfg = compose(
        "eval",
        ["data=aime2025", "n=8", "ks=[1,4]", "top_p=1.0", "data.path=/data/aime25.parquet"],
        schema=SCHEMA,
    )
    assert cfg.data.split == "test" and cfg.data.path == "/data/aime25.parquet"
    assert cfg.n == 8 and cfg.pass_ks == [1, 4] and isinstance(cfg.top_p, float)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("ks=[64]", "ks contains 64; every k must satisfy 1 <= k <= n=32"),
        ("top_p=0", "top_p=0.0 is not allowed: expected a value > 0 and <= 1"),
        ("device=tpu", "device='tpu' is not allowed"),
        ("n_samples=4", "unknown key 'n_samples': the top level has checkpoint, tokenizer"),
        ("data.answer=x", "unknown key 'data.answer'"),
    ],
)
def test_bad_overrides_are_named(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        compose("eval", [override], schema=SCHEMA)
