"""The job-file reference (docs/job-file.md), generated from the schema."""

from __future__ import annotations

import yaml
from pydantic import BaseModel

from areal_k8s.common.config.job import JobConfig


def reference_markdown() -> str:
    """The job-file reference (docs/job-file.md) generated from the schema, so documentation and code cannot drift."""
    rows = ["| field | default | description |", "| --- | --- | --- |"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            annotation = info.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            if info.is_required():
                default = "required"
            else:
                value = info.get_default(call_default_factory=True)
                default = (
                    "—"
                    if value is None
                    else f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"
                )
            rows.append(f"| `{prefix}{name}` | {default} | {info.description or ''} |")

    walk(JobConfig, "")
    return "\n".join(rows) + "\n"
