"""`single_turn`: RLVR's episode: the prompt, one response, the verifier's reward (the n responses of a group are
one batched request, so the engine shares the prompt's prefill)."""

from __future__ import annotations

from areal_k8s.common.prompts import encode_prompt
from areal_k8s.rollout.workflows.api import Episode, EpisodeContext, RolloutWorkflow, status_name


class SingleTurn(RolloutWorkflow):
    async def arun_episode(self, ctx: EpisodeContext) -> list[Episode]:
        prompt_ids = encode_prompt(ctx.tokenizer, ctx.group.prompt, ctx.job.rollout.prompt_template)
        rids = [ctx.sample_id(i) for i in range(ctx.n_samples)]
        samples = await ctx.generate([prompt_ids] * len(rids), rids)
        episodes = [Episode.start(prompt_ids) for _ in samples]
        for episode, sample in zip(episodes, samples):
            episode.add_model_tokens(sample)
        scores = await ctx.score([ctx.decode(sample.output_ids) for sample in samples], rids)
        for episode, score in zip(episodes, scores):
            episode.reward, episode.reward_status = score.reward, status_name(score)
        return episodes
