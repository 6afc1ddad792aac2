"""Under CI a missing ../shared/data stops the suite with one line (tests/conftest.py); elsewhere tests skip.

Checked on a copy of the suite's conftest in a tree that has no shared/ beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _pytest_in_a_tree_without_data(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    tests = tmp_path / "repo" / "tests"
    tests.mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", tests / "conftest.py")
    (tests / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    environ = {k: v for k, v in os.environ.items() if k != "CI"} | env
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        cwd=tests.parent,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_ci_run_without_the_shared_data_fails_at_once(tmp_path):
    done = _pytest_in_a_tree_without_data(tmp_path, CI="true")
    assert done.returncode != 0
    expected = (
        f"{tmp_path / 'shared' / 'data'} is missing: under CI the tests that read the real data would skip"
    )
    assert expected in done.stdout + done.stderr
    assert "1 passed" not in done.stdout


def test_outside_ci_the_suite_runs_without_the_shared_data(tmp_path):
    done = _pytest_in_a_tree_without_data(tmp_path)
    assert done.returncode == 0 and "1 passed" in done.stdout
