"""Prompt data: rows with a problem and a reference answer, from JSONL / Parquet files (through the `datasets`
library) or a hub dataset name, or the built-in synthetic addition task; rendered by a named template and
tokenized into typed `PromptRecord`s; `PromptSampler` serves them in a seeded, resumable order.

    tok = load_tokenizer(cfg.tokenizer)
    records = load_prompts(cfg, tok)                 # list[PromptRecord] (DataConfig from rollout.config)
    sampler = PromptSampler(records, seed=0)
    batch = sampler.next_batch(64)                   # record.prompt_token_ids -> engine, record.answer -> reward
    state = sampler.state_dict(); sampler.load_state_dict(state)

A malformed row (missing field, wrong type, invalid JSON) raises `DataError` naming the file and the 1-based row
(for JSONL: the line); nothing is skipped silently. `datasets` is imported only when loading files.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.config import DataConfig
from rollout.tokenizer import Message, Tokenizer
from tppo.base.registry import Registry

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
FILE_TYPES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """A dataset row is malformed; the message names the file and the row."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: its id, the raw problem, the reference answer, the rendered prompt and its token ids, and the
    row's worked solution when `load_prompts` was asked for one (a demonstration for a supervised warm start)."""

    id: str
    problem: str
    answer: str
    prompt_token_ids: list[int]
    source: str
    solution: str | None = None


# A template maps a problem to either plain text (tokenized as is) or chat messages (rendered by the tokenizer's
# chat template).
Template = Callable[[str], "str | list[Message]"]
TEMPLATES: Registry[Template] = Registry("prompt template")


@TEMPLATES.register("plain")
def plain_template(problem: str) -> str:
    return problem


@TEMPLATES.register("math_boxed")
def math_boxed_template(problem: str) -> str:
    return f"{problem}\n{BOXED_INSTRUCTION}"


@TEMPLATES.register("math_chat")
def math_chat_template(problem: str) -> list[Message]:
    return [{"role": "user", "content": f"{problem}\n{BOXED_INSTRUCTION}"}]


@TEMPLATES.register("chat")
def chat_template(problem: str) -> list[Message]:
    return [{"role": "user", "content": problem}]


def render(template: str, problem: str, tokenizer: Tokenizer) -> list[int]:
    out = TEMPLATES.get(template)(problem)
    return tokenizer.encode(out) if isinstance(out, str) else tokenizer.apply_chat_template(out)


# --------------------------------------------------------------------------------------------- file rows
def data_files(path: str | Path) -> list[Path]:
    """The JSONL/JSON/Parquet files of a file or folder path, sorted."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in FILE_TYPES)
    bad = [f for f in files if f.suffix not in FILE_TYPES]
    if not files or bad:
        raise DataError(
            f"path={str(path)!r}: expected .jsonl, .json or .parquet files, found "
            f"{[str(f) for f in bad] or 'none'}"
        )
    return files


def _jsonl_line_numbers(file: Path) -> list[int]:
    """1-based line numbers of the non-blank lines (the rows `datasets` reads), in order."""
    with file.open(encoding="utf-8") as f:
        return [i for i, line in enumerate(f, start=1) if line.strip()]


def _scan_jsonl(file: Path, required: Sequence[str]) -> None:
    """Find the first malformed line of a JSONL file that `datasets` refused (invalid JSON, not an object, a
    value of a wrong type); raise DataError naming it."""
    with file.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{file}: row {n}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{file}: row {n}: expected a JSON object, got {type(row).__name__}")
            for key in required:
                if key in row:
                    _check_value(file, n, key, row[key])


def _load_file(file: Path, required: Sequence[str]) -> tuple[list[dict[str, Any]], list[int]]:
    import datasets

    try:
        with _quiet_datasets():
            table = datasets.load_dataset(FILE_TYPES[file.suffix], data_files=str(file), split="train")
    except Exception as err:  # pyarrow refuses mixed types or broken JSON: find and name the row
        if file.suffix in (".jsonl", ".json"):
            _scan_jsonl(file, required)
        raise DataError(f"{file}: cannot be read as a dataset: {err}") from err
    rows = table.to_list()
    numbers = _jsonl_line_numbers(file) if file.suffix == ".jsonl" else list(range(1, len(rows) + 1))
    if len(numbers) != len(rows):
        numbers = list(range(1, len(rows) + 1))
    return rows, numbers


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Reading a local file: no progress bars, and no log line of its own on a parse failure (it counts rows
    from 0, by chunk), since the DataError raised then names the file and the row."""
    import datasets

    level, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _check_value(file: Path | str, row: int, key: str, value: Any) -> str:
    if value is None:
        raise DataError(f"{file}: row {row}: field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise DataError(
            f"{file}: row {row}: field {key!r} has type {type(value).__name__}, expected str or int"
        )
    text = str(value)
    if not text.strip():
        raise DataError(f"{file}: row {row}: field {key!r} is empty")
    return text


def _records_from_rows(
    rows: list[dict[str, Any]],
    numbers: list[int],
    source: str,
    cfg: DataConfig,
    tokenizer: Tokenizer,
    solution_key: str | None = None,
) -> list[PromptRecord]:
    out = []
    for row, n in zip(rows, numbers):
        problem = _check_value(source, n, cfg.prompt_key, row.get(cfg.prompt_key))
        answer = _check_value(source, n, cfg.answer_key, row.get(cfg.answer_key))
        rid = row.get(cfg.id_key)
        rid = f"{Path(source).name}:{n}" if rid is None else _check_value(source, n, cfg.id_key, rid)
        ids = render(cfg.template, problem, tokenizer)
        if len(ids) > cfg.max_prompt_length:
            raise DataError(
                f"{source}: row {n}: prompt has {len(ids)} tokens, more than max_prompt_length="
                f"{cfg.max_prompt_length}"
            )
        solution = row.get(solution_key) if solution_key else None
        if solution is not None:
            solution = _check_value(source, n, solution_key, solution)
        out.append(PromptRecord(rid, problem, answer, ids, f"{source}:{n}", solution))
    return out


def load_prompts(
    cfg: DataConfig,
    tokenizer: Tokenizer,
    *,
    num_synthetic: int = 1000,
    seed: int = 0,
    solution_key: str | None = None,
) -> list[PromptRecord]:
    """Every prompt of the configured source, in file order (see the module docstring). With `solution_key`, a
    row's value under that key (absent or null: None) becomes the record's `solution`."""
    TEMPLATES.get(cfg.template)  # unknown template names fail before any loading
    if cfg.source == "synthetic":
        return synthetic_addition(num_synthetic, tokenizer, seed=seed, template=cfg.template)
    if cfg.path is None:
        raise DataError("data.path is None; expected a JSONL/Parquet file or folder, or a hub dataset name")
    required = (cfg.prompt_key, cfg.answer_key)
    if Path(cfg.path).exists():
        records = []
        for file in data_files(cfg.path):
            rows, numbers = _load_file(file, required)
            records += _records_from_rows(rows, numbers, str(file), cfg, tokenizer, solution_key)
        return records
    if _looks_local(cfg.path):
        raise DataError(
            f"data.path={cfg.path!r} does not exist; set data.path to an existing JSONL/Parquet file or "
            "folder"
        )
    import datasets

    try:
        rows = datasets.load_dataset(cfg.path, split=cfg.split).to_list()
    except Exception as err:  # the hub's errors have no common base: name the path and the first line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(
            f"data.path={cfg.path!r} is no local file or folder, and as a hub dataset (split "
            f"{cfg.split!r}) it cannot be loaded: {first}"
        ) from err
    source = f"{cfg.path}[{cfg.split}]"
    return _records_from_rows(rows, list(range(1, len(rows) + 1)), source, cfg, tokenizer, solution_key)


def _looks_local(path: str) -> bool:
    """A path no hub name could be: absolute, relative to here or home, or ending in a data file's suffix."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix in FILE_TYPES


# --------------------------------------------------------------------------------------------- synthetic task
def synthetic_addition(
    num: int, tokenizer: Tokenizer, *, seed: int = 0, max_operand: int = 99, template: str = "plain"
) -> list[PromptRecord]:
    """The built-in verifiable task: "a+b=" with answer str(a + b), operands uniform in [0, max_operand]."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        problem = f"{a}+{b}="
        out.append(
            PromptRecord(
                f"add-{seed}-{i}",
                problem,
                str(a + b),
                render(template, problem, tokenizer),
                f"synthetic:{seed}:{i}",
            )
        )
    return out


# --------------------------------------------------------------------------------------------- order
class PromptSampler:
    """Serves records in epochs, each a fresh permutation (seed, epoch) when shuffling; resumable exactly."""

    def __init__(self, records: Sequence[PromptRecord], seed: int = 0, shuffle: bool = True) -> None:
        if not records:
            raise ValueError("records is empty; expected at least one prompt")
        self.records = list(records)
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptRecord]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.records[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state has seed {state['seed']}, this sampler {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
