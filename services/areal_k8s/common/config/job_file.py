"""Reading a job file: its YAML, the job it is based on, `--set` overrides, and one readable line for whatever is
wrong with it."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from areal_k8s.common.config.job import JobConfig


class JobFileError(ValueError):
    """A job file that cannot be used; the message is one readable line naming the field."""


def fields_at(model: type[BaseModel] | None, loc: tuple) -> list[str]:
    """The field names the mapping at `loc` (a path into `model`'s input) may hold; [] where it is not a model."""
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        model = submodel(model.model_fields[part].annotation)
    return list(model.model_fields) if model else []


def submodel(annotation) -> type[BaseModel] | None:
    """The model a field's annotation holds (`Section`, `Section | None`, `Annotated[Section, ...]`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in typing.get_args(annotation) if (m := submodel(arg))), None)


def describe_problem(problem: dict, model: type[BaseModel] | None) -> str:
    """`field.path: message (got value)`; an unknown field with the closest known names of its section."""
    loc = problem["loc"]
    field = ".".join(str(part) for part in loc) or "(top level)"
    kind = problem["type"]
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), fields_at(model, loc[:-1]), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(name) for name in close)}?)" if close else ""
        return f"{field}: unknown field{hint}"
    if kind == "missing":
        return f"{field}: required field is missing"
    if not loc:  # a rule across sections: its message names the fields, and the input is the whole job
        return f"{field}: {problem['msg']}"
    return f"{field}: {problem['msg']} (got {problem.get('input')!r})"


def describe_validation_error(error: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    """Every problem in one line, `source: field.path: message (got value)`, several joined by `; `; `model` (the
    validated class) names the fields an unknown one may have meant."""
    problems = [describe_problem(problem, model) for problem in error.errors()]
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return f"{source}: {len(problems)} problems: " + "; ".join(problems)


def parse_job(data: object, source: str = "job") -> JobConfig:
    if not isinstance(data, dict):
        raise JobFileError(f"{source}: expected a mapping of job fields, got {type(data).__name__}")
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise JobFileError(describe_validation_error(exc, source, JobConfig)) from None


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
