"""Load prompt datasets: our JSONL (`prompt`/`answer`), GSM8K's JSONL (`question`/`answer` ending in `#### N`), and
code problems with tests (code.py).

Every problem with the input is reported as one `DatasetError` line naming the file and line, so a bad job is
refused before any service starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from areal_k8s.common.config import CodeDatasetConfig, DatasetConfig
from areal_k8s.common.service import exit_invalid
from areal_k8s.data.code import CodeRecordError, is_code_record, parse_code_record

GSM8K_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_ANSWER_MARK = "####"
DEFAULT_VERIFIER = "math"
FORMATS = ("auto", "areal", "gsm8k", "code")

Format = Literal["auto", "areal", "gsm8k", "code"]


class DatasetError(ValueError):
    """Malformed dataset input; the message is one line: `file:line: problem`."""


@dataclass(frozen=True)
class DatasetItem:
    id: str
    prompt: str
    reference: str
    verifier: str


def load_dataset(path: str | Path, fmt: Format = "auto", code: CodeDatasetConfig | None = None) -> list[DatasetItem]:
    """Read a JSONL dataset; `auto` picks the format from the keys of the file's first record. `code` names the
    fields of code records (default: the common ones)."""
    code = code or CodeDatasetConfig()
    if fmt not in FORMATS:
        raise DatasetError(f"{path}: unknown dataset format {fmt!r} (expected one of {', '.join(FORMATS)})")
    path = Path(path)
    items: list[DatasetItem] = []
    first_line_of_id: dict[str, int] = {}
    for line_number, record in _records(path):
        where = f"{path}:{line_number}"
        if fmt == "auto":
            fmt = _detect_format(record, where, code)
        if fmt == "code":
            item = _parse_code(record, where, code)
        else:
            item = _parse_gsm8k(record, where) if fmt == "gsm8k" else _parse_areal(record, where)
        item_id = item.id or f"{path.stem}-{line_number}"
        if item_id in first_line_of_id:
            raise DatasetError(f"{where}: duplicate id {item_id!r} (first used on line {first_line_of_id[item_id]})")
        first_line_of_id[item_id] = line_number
        items.append(DatasetItem(item_id, item.prompt, item.reference, item.verifier))
    if not items:
        raise DatasetError(f"{path}:1: empty file: no JSON records")
    return items


def load_items(path: str, dataset: DatasetConfig) -> list[DatasetItem]:
    """`load_dataset` for a service starting up: a bad file ends the process with its one line (exit code 2)."""
    try:
        return load_dataset(path, dataset.format, dataset.code)
    except DatasetError as exc:
        exit_invalid(str(exc))


def _records(path: Path):
    """(line number, JSON object) for every non-blank line."""
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read dataset ({exc.strerror})") from None
    for line_number, raw in enumerate(raw_lines, start=1):
        where = f"{path}:{line_number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DatasetError(f"{where}: not valid UTF-8") from None
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: bad JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield line_number, record


def _detect_format(record: dict, where: str, code: CodeDatasetConfig) -> Format:
    if is_code_record(record, code):  # before gsm8k: APPS records have a `question` too
        return "code"
    if "question" in record:
        return "gsm8k"
    if "prompt" in record:
        return "areal"
    raise DatasetError(
        f"{where}: cannot tell the format: expected key 'prompt' (areal), 'question' (gsm8k) or one of "
        f"{code.tests_fields} (code), got {sorted(record)}"
    )


def _text_field(record: dict, key: str, where: str, *, allow_int: bool = False) -> str:
    if key not in record:
        raise DatasetError(f"{where}: missing key {key!r}")
    value = record[key]
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise DatasetError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DatasetError(f"{where}: {key!r} is empty")
    return value


def _optional_id(record: dict, where: str) -> str:
    """The record's own id, or "" when it has none (the caller then derives one from file and line)."""
    return _text_field(record, "id", where, allow_int=True) if "id" in record else ""


def _parse_areal(record: dict, where: str) -> DatasetItem:
    verifier = _text_field(record, "verifier", where) if "verifier" in record else DEFAULT_VERIFIER
    return DatasetItem(
        id=_optional_id(record, where),
        prompt=_text_field(record, "prompt", where),
        reference=_text_field(record, "answer", where, allow_int=True),
        verifier=verifier,
    )


def _parse_gsm8k(record: dict, where: str) -> DatasetItem:
    question = _text_field(record, "question", where)
    solution = _text_field(record, "answer", where)
    if GSM8K_ANSWER_MARK not in solution:
        raise DatasetError(f"{where}: GSM8K answer has no '{GSM8K_ANSWER_MARK} <number>' final line")
    reference = solution.rsplit(GSM8K_ANSWER_MARK, 1)[1].strip().replace(",", "")
    if not reference:
        raise DatasetError(f"{where}: GSM8K answer has nothing after '{GSM8K_ANSWER_MARK}'")
    return DatasetItem(
        id=_optional_id(record, where),
        prompt=question + GSM8K_INSTRUCTION,
        reference=reference,
        verifier=DEFAULT_VERIFIER,
    )


def _parse_code(record: dict, where: str, code: CodeDatasetConfig) -> DatasetItem:
    try:
        prompt, reference = parse_code_record(record, code)
    except CodeRecordError as exc:
        raise DatasetError(f"{where}: {exc}") from None
    return DatasetItem(id=_optional_id(record, where), prompt=prompt, reference=reference, verifier="code")
