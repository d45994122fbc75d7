"""The `sampling` section: how rollouts are sampled."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from areal_k8s.common.config.section import Section


class SamplingConfig(Section):
    temperature: Annotated[float, Field(ge=0)] = Field(
        1.0, description="Sampling temperature for rollouts (0 = greedy)."
    )
    top_p: Annotated[float, Field(gt=0, le=1)] = Field(1.0, description="Nucleus sampling mass.")
    top_k: int = Field(-1, description="Top-k sampling; -1 disables it.")
    max_new_tokens: Annotated[int, Field(ge=1)] = Field(256, description="Generation budget per response.")
