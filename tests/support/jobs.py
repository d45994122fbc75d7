"""Jobs and tiny models for tests, written once: the fields a job file must have filled in, the rest as each test
says."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_k8s.common.config import JobConfig, parse_job
from support.tiny_models import build_tiny_qwen2


def job_config(name: str = "t", model: str | Path = "m", *, train: str = "t.jsonl", **sections: object) -> JobConfig:
    """A validated job: its name, model and training file, and the sections given (`dataset` merged over the
    training file; `run_dir` and any other field as given)."""
    dataset = {"train": train, **(sections.pop("dataset", None) or {})}
    return parse_job({"name": name, "model": str(model), "dataset": dataset, **sections})


def tiny_qwen2_fixture(folder: str, *, scope: str = "module", **build):
    """A fixture `model_path`: a tiny random Qwen2 with its tokenizer (tiny_models.build_tiny_qwen2(**build)), one per
    `scope`, in a fresh temporary folder named `folder`."""

    @pytest.fixture(scope=scope)
    def model_path(tmp_path_factory):
        return build_tiny_qwen2(tmp_path_factory.mktemp(folder), **build)

    return model_path
