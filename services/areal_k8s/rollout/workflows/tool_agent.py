"""`tool_agent`: the model answers, calling tools on the way (tools.py has the format and the tools). Each model
turn stops at the end of a tool call; the calls are run, their results appended as tool tokens (loss mask 0), and
the model goes on, until it answers without a call or `max_tool_calls` calls have run. The verifier scores the
final turn's text: the episode's one reward."""

from __future__ import annotations

import asyncio

from areal_k8s.common.config import ToolAgentConfig
from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.common.sandbox import SandboxLimits
from areal_k8s.rollout.workflows.api import Episode, EpisodeContext, RolloutWorkflow, status_name
from areal_k8s.rollout.workflows.tools import TOOL_CALL_END, Toolbox, parse_tool_calls

TOOL_INSTRUCTIONS = (
    'You may call tools by writing <tool_call>{{"name": NAME, "arguments": {{...}}}}</tool_call>; the results come '
    "back as <tool_response>...</tool_response>. Tools: {tools}.\n\n"
)


class ToolAgent(RolloutWorkflow):
    def __init__(self, config: ToolAgentConfig, limits: SandboxLimits):
        self.config = config
        self.toolbox = Toolbox(config.tools, limits, config.max_tool_output_chars)

    async def arun_episode(self, ctx: EpisodeContext) -> list[Episode]:
        conversation = ConversationFormat(ctx.tokenizer, ctx.job.rollout.prompt_template)
        if conversation.chat:  # the template describes the tools in its own way
            prompt_ids = conversation.first_prompt(ctx.group.prompt, tools=self.toolbox.schemas)
        else:
            described = "; ".join(
                f"{s['function']['name']}: {s['function']['description']}" for s in self.toolbox.schemas
            )
            prompt_ids = conversation.first_prompt(TOOL_INSTRUCTIONS.format(tools=described) + ctx.group.prompt)
        # A turn ends at its first complete tool call: the model sees the result before it goes on.
        sampling = {**ctx.sampling, "stop": [TOOL_CALL_END]}
        episodes = await asyncio.gather(
            *(self.episode(ctx, conversation, prompt_ids, sampling, i) for i in range(ctx.n_samples))
        )
        final_turns = [final for _, final in episodes]
        rids = [ctx.sample_id(i) for i in range(ctx.n_samples)]
        scores = await ctx.score(final_turns, rids)
        for (episode, _), score in zip(episodes, scores):
            episode.reward, episode.reward_status = score.reward, status_name(score)
        return [episode for episode, _ in episodes]

    async def episode(
        self, ctx: EpisodeContext, conversation: ConversationFormat, prompt_ids: list[int], sampling: dict, index: int
    ) -> tuple[Episode, str]:
        """The episode, and its final turn's text (what the verifier scores)."""
        episode, calls_left = Episode.start(prompt_ids), self.config.max_tool_calls
        for turn in range(self.config.max_tool_calls + 1):
            (sample,) = await ctx.generate([episode.token_ids], [f"{ctx.sample_id(index)}.t{turn}"], sampling)
            episode.add_model_tokens(sample)
            text = ctx.decode(sample.output_ids)
            calls = parse_tool_calls(text)[:calls_left]
            if not calls or sample.finish_reason == "length":
                break
            results = [await self.toolbox.run(call) for call in calls]
            calls_left -= len(calls)
            episode.add_environment_tokens(conversation.tool_turn(results, sample.output_ids))
        return episode, text
