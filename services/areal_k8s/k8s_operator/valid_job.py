"""An RLJob the operator can run, as validation.py hands it to the code that builds its children, and the error of
one it cannot. Apart from validation.py, which builds the children to check them: both import this."""

from __future__ import annotations

from dataclasses import dataclass

from areal_k8s.common.config import JobConfig
from areal_k8s.k8s_operator import names

ENGINE_URL = f"http://127.0.0.1:{names.ENGINE_PORT}"  # each rollout agent's engine runs in its own pod


class InvalidSpec(ValueError):
    """An RLJob the operator cannot run; `problems` are readable lines, each naming its field."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ValidJob:
    name: str
    namespace: str
    uid: str | None  # absent when rendering manifests for an RLJob not yet created
    generation: int | None
    spec: dict  # with the CRD's defaults applied
    config: JobConfig  # what the services read from the ConfigMap
