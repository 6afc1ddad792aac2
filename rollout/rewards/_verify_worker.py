"""The math-verify worker process behind `rollout.rewards.math.MathVerifier`, which starts it as a fresh interpreter
on the caller's sys.path that imports this module and calls `main()`.

Protocol, one line per message: the parent writes `[pred, gold]` as JSON on the worker's stdin; the worker writes
`ready` once math-verify is imported, then `1` or `0` per job on its stdout. A start-up failure exits non-zero with
the traceback on stderr, which the parent reports. The worker exits as soon as its stdin closes or (on Linux) its
parent dies, even in the middle of a verification, so a killed or crashed parent leaves no worker spinning in sympy.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import signal
import sys
import threading


def verify(pred: str, gold: str) -> bool:
    """math-verify equality of two extracted answers, with its signal-based timeouts off (the parent times us)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    from math_verify import verify as mv_verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=configs, parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=configs, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(mv_verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _read_jobs(jobs: queue.SimpleQueue) -> None:
    for line in sys.stdin.buffer:
        jobs.put(line)
    # The parent closed the pipe (close() or its own death): a job stuck in sympy must not outlive it.
    os._exit(0)


def _die_with_parent() -> None:
    # A verification can sit in one long C call that holds the GIL (a huge integer power), so the stdin reader
    # cannot run; on Linux the kernel kills us when the parent thread that started us ends.
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def main() -> None:
    _die_with_parent()
    # The parent owns our lifetime through the pipe; a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Replies go to a private copy of stdout so that anything sympy or math-verify prints cannot corrupt them.
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    import logging

    import math_verify  # noqa: F401 (imported before "ready" so start-up is not charged to a sample)

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_jobs, args=(jobs,), daemon=True).start()
    replies.write(b"ready\n")
    while True:
        pred, gold = json.loads(jobs.get())
        try:
            ok = verify(pred, gold)
        except Exception:  # a malformed answer is a wrong answer, never a crash
            ok = False
        replies.write(b"1\n" if ok else b"0\n")
