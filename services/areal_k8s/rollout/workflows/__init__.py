"""Rollout workflows: what one prompt group's episodes are (api.py has the interface). `load_workflow` makes the
job's: a built-in by name (`agent`'s is in rollout/gateway/), or a user's `package.module:Class` with
`rollout.workflow_args`."""

from __future__ import annotations

import importlib
import inspect

from areal_k8s.common.config import JobConfig
from areal_k8s.common.metrics import RolloutMetrics
from areal_k8s.common.sandbox import SandboxError, limits_from_config
from areal_k8s.rollout.workflows.api import Episode, EpisodeContext, RolloutWorkflow
from areal_k8s.rollout.workflows.multi_turn import MultiTurn
from areal_k8s.rollout.workflows.single_turn import SingleTurn
from areal_k8s.rollout.workflows.tool_agent import ToolAgent

__all__ = ["Episode", "EpisodeContext", "RolloutWorkflow", "WorkflowError", "load_workflow"]


class WorkflowError(ValueError):
    """The job's workflow cannot be made; the message is one line naming rollout.workflow."""


def load_workflow(job: JobConfig, metrics: RolloutMetrics | None = None) -> RolloutWorkflow:
    rollout = job.rollout
    if rollout.workflow == "agent":
        from areal_k8s.rollout.gateway.workflow import AgentWorkflow  # it imports this package's api

        return AgentWorkflow.for_job(job, metrics)
    if rollout.workflow == "single_turn":
        return SingleTurn()
    if rollout.workflow == "multi_turn":
        return MultiTurn(rollout.multi_turn)
    if rollout.workflow == "tool_agent":
        try:
            agent = ToolAgent(rollout.tool_agent, limits_from_config(job.reward.code))
            agent.toolbox.check()  # at start: a pod whose seccomp or AppArmor profile refuses bubblewrap fails here
            return agent
        except SandboxError as exc:
            raise WorkflowError(f"rollout.workflow tool_agent: the python tool's sandbox cannot start: {exc}") from None
    return load_user_workflow(rollout.workflow, rollout.workflow_args)


def load_user_workflow(name: str, args: dict) -> RolloutWorkflow:
    where = f"rollout.workflow {name!r}"
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while it loads
        raise WorkflowError(f"{where}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    cls = getattr(module, class_name, None)
    if not (inspect.isclass(cls) and issubclass(cls, RolloutWorkflow)):
        what = "has no" if cls is None else "has a non-RolloutWorkflow"
        raise WorkflowError(
            f"{where}: module {module_name!r} {what} {class_name!r} (a subclass of "
            "areal_k8s.rollout.workflows.RolloutWorkflow)"
        )
    try:
        return cls(**args)
    except TypeError as exc:
        raise WorkflowError(f"{where}: cannot be made with rollout.workflow_args {args}: {exc}") from None
