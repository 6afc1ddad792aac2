"""Puts this folder on sys.path so the engine tests (and their worker processes) import engine_testing."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
