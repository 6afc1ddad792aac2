"""Math answer verification: `score(response, answer) -> 1.0 | 0.0` and `score_batch` for many responses.

The response's final answer is its last `\\boxed{...}` (or `\\fbox{...}`, braces balanced), else the last clearly
marked final answer ("final answer is X", "Final Answer: X", "answer: X", "#### X"); without either it scores
0.0. Equality is math-verify's (sympy-based: 1,000 = 1000, 1/2 = 0.5 = \\frac{1}{2}, $18 = 18, units text ignored).

Hangs and crashes: math-verify's own timeouts use signals, which fail off the main thread, and sympy can run
forever on adversarial input (9^{9^{9^9}}). So its timeouts are disabled and every verification runs in a worker
process of a small pool (spawned, so it is safe next to threads, torch and Ray); the parent waits on a pipe with
a hard deadline per sample, kills the worker on expiry (score 0.0) and starts a fresh one. A response is never
parsed in the parent beyond a linear scan for the answer, and answers longer than `MAX_ANSWER_CHARS` score 0.0.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import re
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait

MAX_ANSWER_CHARS = 1000
DEFAULT_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0
_MARKERS = re.compile(
    r"(?:final\s+answer\s*(?:is|:)|the\s+answer\s+is|answer\s*:|####)\s*(.+?)\s*(?:$|\n)", re.IGNORECASE
)


def extract_final_answer(response: str) -> str | None:
    """The last \\boxed{...}/\\fbox{...} content (balanced braces), else the last marked final answer, else None."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    marked = None
    for m in _MARKERS.finditer(response):
        marked = m.group(1)
    if marked is None:
        return None
    marked = marked.strip().rstrip(".").strip()
    return marked.strip("$").strip() or None


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    while start >= 0:
        brace = text.find("{", start)
        if brace >= 0 and text[start:brace].strip() in ("\\boxed", "\\fbox"):
            depth = 0
            for i in range(brace, len(text)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[brace + 1 : i]
        # unbalanced or not a box command: try an earlier occurrence
        start = max(text.rfind("\\boxed", 0, start), text.rfind("\\fbox", 0, start))
    return None


# --------------------------------------------------------------------------------------------- worker side
def _verify_in_worker(pred: str, gold: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=configs, parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=configs, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _worker_main(conn: Connection) -> None:
    import logging

    import math_verify  # noqa: F401 (imported before "ready" so start-up is not charged to a sample)

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        key, pred, gold = job
        try:
            ok = _verify_in_worker(pred, gold)
        except Exception:  # a malformed answer is a wrong answer, never a crash
            ok = False
        conn.send((key, ok))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.job: int | None = None
        self.deadline = 0.0
        self.ready = False

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> bool:
        if not self.ready and self.conn.poll(timeout_s):
            try:
                self.ready = self.conn.recv() == "ready"
            except (EOFError, OSError):
                self.ready = False
        return self.ready

    def stop(self, kill: bool) -> None:
        if kill:
            self.process.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                self.process.kill()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class MathVerifier:
    """A pool of verification processes with a hard per-sample time limit (see the module docstring)."""

    def __init__(self, num_workers: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: expected >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: expected > 0")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []

    def verify_many(
        self, preds: Sequence[str], golds: Sequence[str], timeout_s: float | None = None
    ) -> list[bool]:
        """Verify pred[i] against gold[i] for all i, `num_workers` at a time; a sample over the limit is False.
        The limit counts from when a started worker takes the sample (start-up is not charged to it)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        results = [False] * len(preds)
        pending = list(range(len(preds)))[::-1]
        while len(self._workers) < min(self.num_workers, len(preds)):
            self._workers.append(_Worker(self._ctx))
        busy: dict[Connection, _Worker] = {}
        while pending or busy:
            for w in list(self._workers):
                if w.job is None and pending:
                    if not w.wait_ready():
                        raise RuntimeError(f"math verification worker did not start in {STARTUP_TIMEOUT_S} s")
                    w.job = pending.pop()
                    w.conn.send((w.job, preds[w.job], golds[w.job]))
                    w.deadline = time.monotonic() + limit
                    busy[w.conn] = w
            soonest = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, soonest - time.monotonic())):
                w = busy.pop(conn)
                try:
                    key, ok = conn.recv()
                except (EOFError, OSError):  # the worker died (e.g. out of memory): a wrong answer
                    self._replace(w, kill=True)
                    continue
                results[key] = ok
                w.job = None
            now = time.monotonic()
            for conn, w in list(busy.items()):
                if now >= w.deadline:
                    busy.pop(conn)
                    self.num_timeouts += 1
                    self._replace(w, kill=True)
        return results

    def _replace(self, worker: _Worker, kill: bool) -> None:
        worker.stop(kill=kill)
        self._workers[self._workers.index(worker)] = _Worker(self._ctx)

    def close(self) -> None:
        for w in self._workers:
            w.stop(kill=False)
        self._workers = []

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default: MathVerifier | None = None


def default_verifier() -> MathVerifier:
    """The process-wide pool used by `score` and `score_batch` (created on first use, closed at exit)."""
    global _default
    if _default is None:
        _default = MathVerifier(num_workers=max(1, min(4, (mp.cpu_count() or 2) // 2)))
        atexit.register(_default.close)
    return _default


def score_batch(
    responses: Sequence[str],
    answers: Sequence[str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    verifier: MathVerifier | None = None,
) -> list[float]:
    """1.0 / 0.0 per (response, reference answer) pair; see `score`."""
    if len(responses) != len(answers):
        raise ValueError(
            f"responses ({len(responses)}) and answers ({len(answers)}) must have the same length"
        )
    preds: list[str] = []
    golds: list[str] = []
    index: list[int] = []
    for i, (response, answer) in enumerate(zip(responses, answers)):
        if not isinstance(response, str) or not isinstance(answer, str):
            raise ValueError(
                f"pair {i}: response and answer must be str, got {type(response).__name__} and "
                f"{type(answer).__name__}"
            )
        pred = extract_final_answer(response)
        if pred is not None and pred.strip() and len(pred) <= MAX_ANSWER_CHARS:
            preds.append(pred)
            golds.append(answer)
            index.append(i)
    scores = [0.0] * len(responses)
    if preds:
        ok = (verifier or default_verifier()).verify_many(preds, golds, timeout_s)
        for i, good in zip(index, ok):
            scores[i] = 1.0 if good else 0.0
    return scores


def score(response: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 when the response's final answer (last \\boxed{...}, else a marked final answer) equals `answer`
    mathematically (math-verify), else 0.0; at most `timeout_s` seconds of verification, never raises on a
    malformed or adversarial response."""
    return score_batch([response], [answer], timeout_s)[0]
