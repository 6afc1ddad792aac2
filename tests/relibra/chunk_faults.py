"""Chunk planners that fail on purpose, importable by name in planner workers (tests only)."""

from __future__ import annotations

import multiprocessing
import os

from relibra.planners import _relibra_chunk


def _in_worker() -> bool:
    return multiprocessing.parent_process() is not None


def fail_in_worker(loads, prev, rng, ctx):
    if _in_worker():
        raise ValueError("chunk planner failed on purpose")
    return _relibra_chunk(loads, prev, rng, ctx)


def die_in_worker(loads, prev, rng, ctx):
    if _in_worker():
        os._exit(3)
    return _relibra_chunk(loads, prev, rng, ctx)
