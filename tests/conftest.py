"""Suite-wide checks. Tests that read the real data in ../shared/data (AIME, GSM8K, Qwen3 routing logs) skip
without it on a developer's machine; under CI (CI=true) a missing folder would silently drop those tests, so the
run stops at once instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def pytest_sessionstart(session: pytest.Session) -> None:
    under_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if under_ci and not SHARED_DATA.is_dir():
        raise pytest.UsageError(
            f"{SHARED_DATA} is missing: under CI the tests that read the real data would skip; the suite needs it"
        )
