"""Math answer verification: `score(response, answer) -> 1.0 | 0.0` and `score_batch` for many responses.

The response's final answer is its last `\\boxed{...}` (or `\\fbox{...}`, braces balanced), else the last clearly
marked final answer ("final answer is X", "Final Answer: X", "answer: X", "#### X"); without either it scores
0.0. Only the last `RESPONSE_TAIL_CHARS` characters are examined (the final answer ends even a 100k-character
chain of thought), in linear time, so extraction takes milliseconds on any input and runs in the caller. Equality
is math-verify's (sympy-based: 1,000 = 1000, 1/2 = 0.5 = \\frac{1}{2}, $18 = 18, units text ignored). Answers
longer than `MAX_ANSWER_CHARS` score 0.0.

Hangs, crashes and threads: math-verify's own timeouts use signals, which fail off the main thread, and sympy can
run forever on adversarial input (9^{9^{9^9}}). So its timeouts are disabled and every verification runs in a
worker process: a fresh interpreter on the caller's sys.path that runs `rollout.rewards._verify_worker` and never
re-imports the caller's `__main__` (scripts on stdin or without a main guard work). Each `MathVerifier` has one
dispatcher thread that owns its workers; callers on any thread queue their samples and wait for the answers. The
dispatcher gives a sample to an idle worker with a hard deadline, kills the worker on expiry (score 0.0) and
starts a fresh one whose start-up is not charged to the next sample. A worker that fails to start fails the
waiting calls at once with a RuntimeError carrying its stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait

MAX_ANSWER_CHARS = 1000
RESPONSE_TAIL_CHARS = 65_536
DEFAULT_TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0
_WORKER_MODULE = "rollout.rewards._verify_worker"
# A fresh interpreter that takes the caller's sys.path (as multiprocessing's spawn does, so it imports the same
# math-verify) and then runs our worker module, never the caller's __main__. -P keeps its working directory off
# sys.path until then.
_WORKER_BOOT = f"import sys; sys.path[:] = sys.argv[1:]; from {_WORKER_MODULE} import main; main()"
_STDERR_TAIL_BYTES = 4000
# Box openings and bare braces in one pattern, so that one left-to-right pass pairs every brace with a stack.
_BOX_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
# Markers only: the answer is the rest of the line, cut with str.find. A lazy `(.+?)\s*$` group after the marker
# backtracks quadratically over a long run of spaces.
_MARKER = re.compile(r"final\s+answer\s*(?:is|:)|the\s+answer\s+is|answer\s*:|####", re.IGNORECASE)
_NON_SPACE = re.compile(r"\S")
_log = logging.getLogger(__name__)


def extract_final_answer(response: str) -> str | None:
    """The last \\boxed{...}/\\fbox{...} content (balanced braces), else the last marked final answer, else None.
    Looks at the last `RESPONSE_TAIL_CHARS` characters only; linear in those."""
    tail = response[-RESPONSE_TAIL_CHARS:]
    boxed = _last_boxed(tail)
    if boxed is not None:
        return boxed
    marked = _last_marked(tail)
    if marked is None:
        return None
    return marked.rstrip(".").strip().strip("$").strip() or None


def _last_boxed(text: str) -> str | None:
    open_braces: list[tuple[int, bool]] = []  # (content start, opened by a box command)
    best: tuple[int, int] | None = None
    for m in _BOX_OR_BRACE.finditer(text):
        if m.group()[-1] == "{":
            open_braces.append((m.end(), len(m.group()) > 1))
        elif open_braces:
            start, is_box = open_braces.pop()
            if is_box and (best is None or start > best[0]):
                best = (start, m.start())
    return None if best is None else text[best[0] : best[1]]


def _last_marked(text: str) -> str | None:
    found, pos = None, 0
    while (marker := _MARKER.search(text, pos)) is not None:
        first = _NON_SPACE.search(text, marker.end())
        if first is None:
            # Nothing after the last marker: blank (no answer) unless only line breaks follow, which leave the
            # previous marker's answer standing, as the single regex that found answers before did.
            return found if text[marker.end() :].strip("\n") == "" else ""
        end = text.find("\n", first.start())
        end = len(text) if end < 0 else end
        found, pos = text[first.start() : end].rstrip(), end
    return found


# ------------------------------------------------------------------------------------------- worker processes
@dataclass(eq=False)
class _Job:
    pred: str
    gold: str
    limit_s: float
    future: Future = field(default_factory=Future)


class _Worker:
    """One worker process (protocol in rollout.rewards._verify_worker), at most one job at a time."""

    def __init__(self) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process; closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", _WORKER_BOOT, *sys.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self.ready = False
        self.job: _Job | None = None
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S
        self._partial = b""
        self.stderr_tail = ""  # its last lines, once stopped

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def submit(self, job: _Job) -> bool:
        try:
            self.proc.stdin.write(json.dumps([job.pred, job.gold]).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # it died while idle
            return False
        self.job, self.deadline = job, time.monotonic() + job.limit_s
        return True

    def read_lines(self) -> list[bytes] | None:
        """The complete lines that have arrived (call when readable); None once the worker has exited."""
        data = os.read(self.fileno(), 65536)
        if not data:
            return None
        *lines, self._partial = (self._partial + data).split(b"\n")
        return lines

    def stop(self, kill: bool) -> None:
        if not kill:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.proc.stdin.close()  # the worker exits on end of input
                self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        # pread leaves alone the file offset that the child wrote at.
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        tail = os.pread(fd, min(size, _STDERR_TAIL_BYTES), max(0, size - _STDERR_TAIL_BYTES))
        self.stderr_tail = tail.decode(errors="replace").strip() or "(nothing on stderr)"
        for f in (self.proc.stdin, self.proc.stdout, self._stderr):
            with contextlib.suppress(OSError):
                f.close()

    def start_failure(self, what: str) -> RuntimeError:
        """The error for a worker that failed to start (call after stop)."""
        return RuntimeError(
            f"math verification worker ({_WORKER_MODULE} in {sys.executable}) {what}; its stderr:\n"
            f"{self.stderr_tail}"
        )


class MathVerifier:
    """A pool of verification processes with a hard per-sample time limit, usable from any thread (see the
    module docstring). `close()` stops the workers and fails the calls still waiting; a later call restarts."""

    def __init__(self, num_workers: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: expected >= 1")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: expected > 0")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._thread: threading.Thread | None = None
        self._closing = False
        # A pipe that interrupts the dispatcher's wait when work arrives; one per dispatcher run.
        self._wake_r = self._wake_w = -1

    def verify_many(
        self, preds: Sequence[str], golds: Sequence[str], timeout_s: float | None = None
    ) -> list[bool]:
        """Verify pred[i] against gold[i] for all i, `num_workers` at a time; a sample over the limit is False.
        The limit counts from when a started worker takes the sample (queueing and start-up are not charged)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        jobs = [_Job(p, g, limit) for p, g in zip(preds, golds, strict=True)]
        if jobs:
            self._submit(jobs)
        return [job.future.result() for job in jobs]

    def _submit(self, jobs: list[_Job]) -> None:
        if os.getpid() != self._pid:  # forked: the parent's thread and workers are not ours
            self._reset()
        with self._lock:
            self._queue.extend(jobs)
            if self._thread is None:
                self._closing = False
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_w, False)
                self._thread = threading.Thread(target=self._dispatch, name="math-verify", daemon=True)
                self._thread.start()
        self._wake()

    def _wake(self) -> None:
        with self._lock, contextlib.suppress(BlockingIOError):  # full: a wake-up is pending anyway
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")

    # ------------------------------------------------------------------ dispatcher thread (owns the workers)
    def _dispatch(self) -> None:
        workers: list[_Worker] = []
        error: BaseException = RuntimeError("the math verifier was closed")
        try:
            while self._step(workers):
                pass
        except BaseException as exc:  # never leave a caller waiting on a dead dispatcher
            error = exc
        finally:
            with self._lock:
                orphans = list(self._queue) + [w.job for w in workers if w.job is not None]
                self._queue.clear()
                self._thread = None
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
            for w in workers:
                w.stop(kill=True)
            for job in orphans:
                job.future.set_exception(error)

    def _step(self, workers: list[_Worker]) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._assign(workers)
            num_busy = sum(w.job is not None for w in workers)
            num_missing = min(self.num_workers, num_busy + len(self._queue)) - len(workers)
        workers.extend(_Worker() for _ in range(num_missing))
        deadlines = [w.deadline for w in workers if w.job is not None or not w.ready]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for ready in wait([self._wake_r, *workers], timeout=timeout):
            if ready == self._wake_r:
                os.read(self._wake_r, 4096)
            else:
                self._read(ready, workers)
        self._expire(workers)
        return True

    def _assign(self, workers: list[_Worker]) -> None:
        for w in workers:
            if w.ready and w.job is None and self._queue:
                job = self._queue.popleft()
                if not w.submit(job):
                    self._queue.appendleft(job)
                    w.ready = False  # its end of file comes next and retires it

    def _read(self, w: _Worker, workers: list[_Worker]) -> None:
        lines = w.read_lines()
        if lines is None:
            self._retire(w, workers)
            return
        for line in lines:
            if line == b"ready":
                w.ready = True
            elif w.job is not None:
                w.job.future.set_result(line == b"1")
                w.job = None

    def _retire(self, w: _Worker, workers: list[_Worker]) -> None:
        workers.remove(w)
        w.stop(kill=False)  # it is exiting: wait for its exit code
        if w.job is not None:  # died mid-sample (out of memory, a crash in sympy): a wrong answer
            _log.warning("math verification worker died (exit code %s): %s", w.proc.returncode, w.stderr_tail)
            w.job.future.set_result(False)
        elif not w.ready:
            self._fail_queued(w.start_failure(f"exited with code {w.proc.returncode} before it was ready"))

    def _expire(self, workers: list[_Worker]) -> None:
        now = time.monotonic()
        for w in [w for w in workers if now >= w.deadline and (w.job is not None or not w.ready)]:
            workers.remove(w)
            w.stop(kill=True)
            if w.job is not None:
                self.num_timeouts += 1
                w.job.future.set_result(False)
            else:
                self._fail_queued(w.start_failure(f"did not start in {STARTUP_TIMEOUT_S} s"))

    def _fail_queued(self, error: RuntimeError) -> None:
        with self._lock:
            failed = list(self._queue)
            self._queue.clear()
        for job in failed:
            job.future.set_exception(error)

    def close(self) -> None:
        """Stop the workers; calls still waiting get a RuntimeError."""
        with self._lock:
            thread, self._closing = self._thread, True
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=30)

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """The process-wide pool used by `score` and `score_batch` (created on first use, closed at exit)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier(num_workers=max(1, min(4, (os.cpu_count() or 2) // 2)))
            atexit.register(_default.close)
        return _default


def score_batch(
    responses: Sequence[str],
    answers: Sequence[str],
    timeout_s: float = DEFAULT_TIMEOUT_S,
    verifier: MathVerifier | None = None,
) -> list[float]:
    """1.0 / 0.0 per (response, reference answer) pair; see `score`. Safe to call from any thread."""
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
    mathematically (math-verify), else 0.0; at most `timeout_s` seconds of verification once a worker takes it,
    never raises on a malformed or adversarial response. Safe to call from any thread."""
    return score_batch([response], [answer], timeout_s)[0]
