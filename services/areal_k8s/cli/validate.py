"""`arealctl validate`: a job file (its fields, then the model, tokenizer and datasets it names on this machine) or an
RLJob manifest (the operator's own checks), every problem found in one line."""

from __future__ import annotations

from pathlib import Path

from areal_k8s.common.config import JobConfig, JobFileError, load_job_file, read_yaml_file
from areal_k8s.common.prompts import (
    ModelDirectoryError,
    check_model_dir,
    check_tokenizer_dir,
    encode_prompt,
    load_tokenizer,
    model_context,
)
from areal_k8s.data.dataset import DatasetError, DatasetItem, load_dataset


def path_problems(job: JobConfig) -> list[str]:
    """What a run of `job` on this machine would stop at: a model or tokenizer directory it cannot open, a dataset
    file missing or not in a format it reads, a response budget that does not fit the model's context after the
    longest prompt."""
    problems, datasets = file_problems(job)
    return problems or context_problems(job, datasets)


def file_problems(job: JobConfig) -> tuple[list[str], dict[str, list[DatasetItem]]]:
    """The model, tokenizer and dataset files' problems, and the datasets read."""
    problems = []
    datasets: dict[str, list[DatasetItem]] = {}
    checks = [("model", check_model_dir, job.model)]
    if job.tokenizer:
        checks.append(("tokenizer", check_tokenizer_dir, job.tokenizer))
    for field, check, path in checks:
        try:
            check(path)
        except ModelDirectoryError as exc:
            problems.append(f"{field}: {exc}")
    for field, path in (("dataset.train", job.dataset.train), ("dataset.eval", job.dataset.eval)):
        if path is None:
            continue
        if not Path(path).is_file():
            problems.append(f"{field}: dataset file not found: {path}")
            continue
        try:
            datasets[field] = load_dataset(path, job.dataset.format, job.dataset.code)
        except DatasetError as exc:
            problems.append(f"{field}: {exc}")
    return problems, datasets


def context_problems(job: JobConfig, datasets: dict[str, list[DatasetItem]]) -> list[str]:
    """The response budget against the model's context, after the longest prompt of `datasets`."""
    own_context = model_context(job.model)
    if own_context is None and job.context_length is None:
        return []  # no context to fit: the tokenizer need not be loaded
    return job.context_problems(own_context, longest_prompt(job, datasets))


def longest_prompt(job: JobConfig, datasets: dict[str, list[DatasetItem]]) -> tuple[int, str] | None:
    """(tokens, where) of the longest prompt the datasets give, rendered as the rollout workers render it."""
    tokenizer = load_tokenizer(job.tokenizer_path)
    longest = None
    for field, items in datasets.items():
        for item in items:
            tokens = len(encode_prompt(tokenizer, item.prompt, job.rollout.prompt_template))
            if longest is None or tokens > longest[0]:
                longest = (tokens, f"{field} item {item.id}")
    return longest


def problems_line(source: Path, problems: list[str]) -> JobFileError:
    count = f"{len(problems)} problems: " if len(problems) > 1 else ""
    return JobFileError(f"{source}: {count}" + "; ".join(problems))


def check_budget_at_start(job: JobConfig, source: Path) -> None:
    """`arealctl run`'s start: JobFileError in one line if the response budget does not fit the model's context. A
    model, tokenizer or dataset that cannot be read is left to the start itself, which names it as every run does."""
    problems, datasets = file_problems(job)
    found = [] if problems else context_problems(job, datasets)
    if found:
        raise problems_line(source, found)


def validate_job_file(path: Path, overrides: list[str]) -> str:
    """The ok line for a job file whose fields and paths are good; JobFileError listing every problem otherwise."""
    job = load_job_file(path, overrides=overrides)
    problems = path_problems(job)
    if problems:
        raise problems_line(path, problems)
    return f"{path}: ok (job {job.name}, {job.algorithm.total_steps} steps, η = {job.algorithm.max_staleness})"


def validate_rljob(path: Path, rljob: dict) -> str:
    """The ok line for an RLJob the operator would run; JobFileError listing every problem otherwise. Its paths are
    inside the pods, so they are not looked for here."""
    from areal_k8s.k8s_operator.validation import InvalidSpec, validate

    try:
        job = validate(rljob)
    except InvalidSpec as exc:
        raise problems_line(path, exc.problems) from None
    a = job.config.algorithm
    return (
        f"{path}: ok (RLJob {job.name}, {a.total_steps} steps, η = {a.max_staleness}; its paths are inside the pods "
        "and not checked here)"
    )


def validate_file(path: Path, overrides: list[str]) -> str:
    data = read_yaml_file(path)
    if isinstance(data, dict) and data.get("kind") == "RLJob":
        if overrides:
            raise JobFileError(f"{path}: --set applies to job files, not to an RLJob manifest")
        return validate_rljob(path, data)
    return validate_job_file(path, overrides)
