"""`multi_turn`: the model answers, the verifier scores the answer; below `success_threshold` the environment says
so (`feedback`, a user turn) and the model answers again, up to `max_turns`. Each turn's answer is scored alone;
the episode's reward is the last turn's or the sum over turns, a turn t's reward discounted by γ^t."""

from __future__ import annotations

import asyncio

from areal_k8s.common.config import MultiTurnConfig
from areal_k8s.common.prompts import ConversationFormat
from areal_k8s.rollout.workflows.api import Episode, EpisodeContext, RolloutWorkflow, status_name


class MultiTurn(RolloutWorkflow):
    def __init__(self, config: MultiTurnConfig):
        self.config = config

    async def arun_episode(self, ctx: EpisodeContext) -> list[Episode]:
        conversation = ConversationFormat(ctx.tokenizer, ctx.job.rollout.prompt_template)
        prompt_ids = conversation.first_prompt(ctx.group.prompt)
        return list(
            await asyncio.gather(*(self.episode(ctx, conversation, prompt_ids, i) for i in range(ctx.n_samples)))
        )

    async def episode(
        self, ctx: EpisodeContext, conversation: ConversationFormat, prompt_ids: list[int], index: int
    ) -> Episode:
        config, episode = self.config, Episode.start(prompt_ids)
        rewards: list[float] = []
        for turn in range(config.max_turns):
            rid = f"{ctx.sample_id(index)}.t{turn}"
            (sample,) = await ctx.generate([episode.token_ids], [rid])
            episode.add_model_tokens(sample)
            (score,) = await ctx.score([ctx.decode(sample.output_ids)], [rid])
            rewards.append(score.reward)
            episode.reward_status = status_name(score)
            if score.reward >= config.success_threshold or turn == config.max_turns - 1:
                break
            episode.add_environment_tokens(
                conversation.user_turn(config.feedback.replace("{reward}", f"{score.reward:g}"), sample.output_ids)
            )
        discounted = [reward * config.turn_discount**turn for turn, reward in enumerate(rewards)]
        episode.reward = discounted[-1] if config.reward == "last" else sum(discounted)
        return episode
