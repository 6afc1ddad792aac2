"""Puts this folder on sys.path (the recipe tests share recipe_testlib) and runs the default recipe once for the
tests that read or resume a finished run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from recipe_testlib import run, train_cmd


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> Path:
    """The default recipe's 5 steps (`train_cmd`); a test that writes into the run directory works on a copy."""
    root = tmp_path_factory.mktemp("default")
    done = run(train_cmd(root, "default"))
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "default"
