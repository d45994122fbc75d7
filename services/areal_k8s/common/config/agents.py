"""The `agents` section: the agent runners, which play the `agent` workflow's episodes with the user's own program."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from areal_k8s.common.config.section import Section


class AgentsConfig(Section):
    command: list[str] = Field(
        min_length=1,
        description="The agent program, as an argument list (`[python, agent.py]`). Mode `episode`: run once per "
        "episode with OPENAI_BASE_URL and OPENAI_API_KEY set to the episode's session, AREAL_EPISODE_PROMPT its "
        "prompt, AREAL_EPISODE_FILE a JSON file of the claimed episode and AREAL_REWARD_FILE where it may write its "
        "reward (a number; none: the job's verifier scores its last reply). It needs nothing of this project "
        "(docs/agents.md).",
    )
    mode: Literal["episode", "serve"] = Field(
        "episode",
        description="`episode`: a run of `command` per episode. `serve`: one long-lived run per slot, reading an "
        "episode as a JSON line on stdin (its session's base_url and api_key among its fields) and answering each "
        'with a JSON line on stdout (`{"episode_id": ...}`, with an optional `reward`): the start of the program '
        "(an interpreter, its imports) is paid once, not per episode (docs/agents.md).",
    )
    replicas: Annotated[int, Field(ge=1)] = Field(
        1, description="Agent runners (processes locally, pods on Kubernetes)."
    )
    episodes_per_replica: Annotated[int, Field(ge=1)] = Field(
        4, description="Episodes a runner plays at once (its slots), each slot its own run of `command`."
    )
    working_dir: str | None = Field(
        None, description="The directory `command` runs in; default: where `arealctl run` runs (a pod: its image's)."
    )
    image: str | None = Field(
        None, description="RLJob: the runner pods' image (it must hold `command` and its Python); default: the job's."
    )
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description="RLJob: the runner container's resources (Kubernetes ResourceRequirements: requests, limits).",
    )
