"""User workflows for tests/service/test_workflows.py, named "support.workflow_fixtures:<Class>" (tests/ is on
sys.path)."""

from areal_k8s.rollout.workflows import Episode, EpisodeContext, RolloutWorkflow


class Repeat(RolloutWorkflow):
    """Each episode: the prompt, then `times` model turns with `separator`'s tokens (environment) between them;
    scored on the last turn."""

    def __init__(self, times: int, separator: str = "\n"):
        self.times, self.separator = times, separator

    async def arun_episode(self, ctx: EpisodeContext) -> list[Episode]:
        episodes = [Episode.start(ctx.tokenizer.encode(ctx.group.prompt)) for _ in range(ctx.n_samples)]
        for turn in range(self.times):
            if turn:
                for episode in episodes:
                    episode.add_environment_tokens(ctx.tokenizer.encode(self.separator))
            rids = [f"{ctx.sample_id(i)}.t{turn}" for i in range(ctx.n_samples)]
            samples = await ctx.generate([e.token_ids for e in episodes], rids)
            for episode, sample in zip(episodes, samples):
                episode.add_model_tokens(sample)
        scores = await ctx.score(
            [ctx.decode(s.output_ids) for s in samples], [ctx.sample_id(i) for i in range(ctx.n_samples)]
        )
        for episode, score in zip(episodes, scores):
            episode.reward = score.reward
        return episodes


class NotAWorkflow:
    async def arun_episode(self, ctx):
        return []
