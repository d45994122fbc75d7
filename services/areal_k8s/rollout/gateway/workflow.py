"""`agent`: each of a group's episodes is played by an agent program over the gateway's OpenAI API (sessions.py):
the workflow offers them, waits until every one has ended, and has the verifier score those the agent ended
without a reward. The staleness bound, interruption at weight pushes, the policies and the stream apply as to every
other workflow's episodes."""

from __future__ import annotations

import asyncio

from areal_k8s.common.config import JobConfig
from areal_k8s.common.metrics import RolloutMetrics
from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.rollout.gateway.sessions import SessionBook
from areal_k8s.rollout.workflows.api import Episode, EpisodeContext, RolloutWorkflow, status_name


def model_context_length(model_path: str) -> int:
    """The positions the model takes (its config's max_position_embeddings), as the CPU engine reads it."""
    from transformers import AutoConfig  # imported here: seconds to import, and only this workflow needs it

    config = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None) or 2**31 - 1


class AgentWorkflow(RolloutWorkflow):
    def __init__(self, book: SessionBook):
        self.book = book

    @classmethod
    def for_job(cls, job: JobConfig, metrics: RolloutMetrics | None = None) -> AgentWorkflow:
        return cls(SessionBook(job.rollout.agent, job.name, model_context_length(job.model), metrics))

    async def arun_episode(self, ctx: EpisodeContext) -> list[Episode]:
        if not ConversationFormat(ctx.tokenizer, "chat").chat:
            raise ValueError("workflow agent: the tokenizer has no chat template to render the agents' messages with")
        try:
            async with asyncio.TaskGroup() as plays:  # one episode failing ends the others' sessions too
                tasks = [plays.create_task(self.book.play(ctx, index)) for index in range(ctx.n_samples)]
        except ExceptionGroup as failed:  # the worker reports the first reason, as from any workflow
            raise failed.exceptions[0] from None
        outcomes = [task.result() for task in tasks]
        unscored = [index for index, outcome in enumerate(outcomes) if outcome.reward is None]
        if unscored:
            scores = await ctx.score([outcomes[i].final_text for i in unscored], [ctx.sample_id(i) for i in unscored])
            for index, score in zip(unscored, scores):
                outcomes[index].reward = score.reward
                outcomes[index].episode.reward_status = status_name(score)
        for outcome in outcomes:
            outcome.episode.reward = outcome.reward
        return [outcome.episode for outcome in outcomes]
