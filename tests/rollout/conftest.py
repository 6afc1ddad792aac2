"""Puts this folder on sys.path so the rollout tests can import their shared helpers (rollout_testlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
