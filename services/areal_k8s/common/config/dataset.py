"""The `dataset` section: where the prompts are and how their records are read."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from areal_k8s.common.config.section import Section


class CodeDatasetConfig(Section):
    prompt_fields: list[str] = Field(
        ["question", "problem", "prompt"],
        min_length=1,
        description="Code datasets: the problem statement is the first of these keys a record has.",
    )
    tests_fields: list[str] = Field(
        ["tests", "input_output", "test_list", "public_test_cases"],
        min_length=1,
        description="Code datasets: the tests are the first of these keys a record has (JSON, or JSON text): "
        "stdin/stdout cases, APPS' inputs/outputs (with `fn_name`: call-based), or assert statements.",
    )
    instruction: str = Field(
        "\n\nAnswer with a complete Python program in a ```python code block.",
        description="Code datasets: appended to every problem.",
    )


class DatasetConfig(Section):
    train: str = Field(
        description="Training prompts: JSONL with `prompt`/`answer` (areal), `question`/`answer` (GSM8K), "
        "or a problem and its tests (code)."
    )
    eval: str | None = Field(None, description="Held-out JSONL in the same formats; greedy accuracy is measured on it.")
    format: Literal["auto", "areal", "gsm8k", "code"] = Field(
        "auto", description="Record format; `auto` decides per file (a record with one of `code.tests_fields` is code)."
    )
    code: CodeDatasetConfig = Field(
        default_factory=CodeDatasetConfig, description="How code datasets' records are read."
    )
    eval_limit: Annotated[int, Field(ge=1)] = Field(256, description="At most this many held-out items are evaluated.")
    shuffle: bool = Field(True, description="Shuffle the training prompts every epoch (deterministic by `seed`).")
