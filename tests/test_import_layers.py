"""The layer rules (pyproject's [tool.importlinter], run by `make test`) hold for the tree, and each kind of wrong
arrow planted in a copy of the packages fails the check with the contract that forbids it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tppo", "relibra", "rollout", "recipes")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess:
    # The copy must be what is analysed, not the installed tree: its folder goes first on the path.
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _copy(tmp_path: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_every_layer_rule(tmp_path):
    result = _lint(_copy(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("tppo/algo/losses.py", "import ray", "the algorithm is pure"),
        ("tppo/algo/advantages.py", "import megatron.core", "the algorithm is pure"),
        ("tppo/engine/batch.py", "import tppo.algo.pool", "tppo layers"),
        ("tppo/cluster/roles.py", "import tppo.config", "tppo layers"),
        ("tppo/engine/engine.py", "import relibra.plan", "the engine: no Ray, no relibra"),
        ("tppo/base/fields.py", "import rollout.params", "tppo.base imports no project module"),
        ("rollout/data.py", "import tppo.loop.run", "relibra and rollout import tppo.base"),
        ("relibra/plan.py", "import tppo.engine.batch", "relibra and rollout import tppo.base"),
        ("tppo/loop/run.py", "import omegaconf", "only recipes/ holds Hydra"),
    ],
)
def test_a_planted_wrong_import_fails_the_check(tmp_path, module, line, contract):
    root = _copy(tmp_path)
    path = root / module
    path.write_text(path.read_text() + f"\n{line}  # planted\n")
    result = _lint(root)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken and module.replace("/", ".").removesuffix(".py") in broken, result.stdout
