"""Reading a job file: its YAML, the job it is based on, `--set` overrides, and one readable line for whatever is
wrong with it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from areal_k8s.common.config.job import JobConfig


class JobFileError(ValueError):
    """A job file that cannot be used; the message is one readable line naming the field."""


def describe_validation_error(error: ValidationError, source: str) -> str:
    """The first problem, as `source: field.path: message (got value)`."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"]) or "(top level)"
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unknown field"
    elif first["type"] == "missing":
        message = "required field is missing"
    detail = "" if first["type"] in {"missing", "extra_forbidden"} else f" (got {first.get('input')!r})"
    more = len(error.errors()) - 1
    suffix = f" [+{more} more problem{'s' if more > 1 else ''}]" if more else ""
    return f"{source}: {field}: {message}{detail}{suffix}"


def parse_job(data: object, source: str = "job") -> JobConfig:
    if not isinstance(data, dict):
        raise JobFileError(f"{source}: expected a mapping of job fields, got {type(data).__name__}")
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise JobFileError(describe_validation_error(exc, source)) from None


def read_yaml_file(path: Path, what: str = "job file") -> object:
    """A YAML file's content, or JobFileError with one readable line (the file, and the line YAML stopped at)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read {what} ({exc.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise JobFileError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None


def apply_overrides(data: object, overrides: Sequence[str]) -> object:
    """A job file's mapping with `section.field=value` settings over it (a value is read as YAML: 2, true, [a, b]);
    the job is validated after, so a misspelt field is named as in the file."""
    for item in overrides:
        key, equals, text = item.partition("=")
        if not equals or not key:
            raise JobFileError(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.replicas=2")
        if not isinstance(data, dict):
            break  # parse_job names the problem
        *sections, field = key.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                raise JobFileError(f"--set {key}: {section} is a value, not a section")
        try:
            node[field] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise JobFileError(f"--set {item!r}: the value is not valid YAML") from None
    return data


def read_job_mapping(path: Path, within: tuple[Path, ...] = ()) -> object:
    """A job file's content over the job file its `base:` names (a path relative to it, itself possibly based on
    another): sections merge field by field, and the file's own values win, as `--set` does over the file."""
    data = read_yaml_file(path)
    if not isinstance(data, dict) or "base" not in data:
        return data
    base = path.parent / str(data.pop("base"))
    if base.resolve() in (*within, path.resolve()):
        raise JobFileError(f"{path}: its base {base} leads back to this file")
    return merged(read_job_mapping(base, (*within, path.resolve())), data)


def merged(base: object, over: object) -> object:
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{key: merged(base.get(key), value) for key, value in over.items()}}
    return over


def load_job_file(path: str | Path, project_root: Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Read (over its `base:`), validate and resolve a job file, `overrides` (`section.field=value`) set over it.
    Relative paths are taken against `project_root` (default: cwd)."""
    path = Path(path)
    data = apply_overrides(read_job_mapping(path), overrides)
    return parse_job(data, str(path) + (" with --set" if overrides else "")).resolve_paths(project_root or Path.cwd())
