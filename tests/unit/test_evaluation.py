"""Held-out evaluation on the rollout engines (issue 17, part 4): the evaluator's dealing, retries and refusals,
with scripted workers in place of the rollout service (the real path runs in every end-to-end test, which
evaluates at the start and the end of its run)."""

import asyncio

from support.jobs import job_config

from areal_k8s.common.trajectory import PromptGroup, Trajectory
from areal_k8s.data.dataset import DatasetItem
from areal_k8s.trainer.evaluation import Evaluator, evaluation_group, generated_by

JOB = job_config("eval", "m", sampling={"max_new_tokens": 9}, trainer={"eval_max_new_tokens": 5})
ITEMS = [DatasetItem(id=f"q{i}", prompt=f"{i}+{i}=", reference=str(2 * i), verifier="addition") for i in range(6)]


def sample(group: PromptGroup, version: int, reward: float) -> Trajectory:
    return Trajectory(
        group_id=group.group_id,
        token_ids=[1, 2, 3, 4],
        prompt_length=2,
        versions=[-1, -1, version, version],
        loss_mask=[False, False, True, True],
        reward=reward,
    )


class Worker:
    """A rollout worker as the evaluator sees it: answers each group as scripted, and records what it was sent."""

    def __init__(self, name: str, answer):
        self.name, self.answer, self.groups = name, answer, []

    def __repr__(self) -> str:
        return self.name

    async def generate(self, group, timeout):
        self.groups.append(group)
        return [self.answer(group)]


def reward_of(group) -> float:
    return float(int(group.prompt_id[1:]) % 2)  # items q1, q3, q5 right: accuracy 0.5


def test_an_item_is_one_greedy_sample_admitted_at_the_version_it_evaluates():
    group = evaluation_group(JOB, ITEMS[3], 7)
    assert (group.group_id, group.prompt_id, group.prompt, group.reference, group.verifier) == (
        "eval-v7-q3",
        "q3",
        "3+3=",
        "6",
        "addition",
    )
    assert (group.n_samples, group.admitted_version, group.sampling.temperature, group.sampling.max_new_tokens) == (
        1,
        7,
        0.0,
        5,
    )
    assert generated_by(sample(group, 7, 1.0), 7) and not generated_by(sample(group, 6, 1.0), 7)


def test_the_items_are_dealt_over_the_workers_and_a_failed_workers_share_dealt_again():
    healthy = Worker("healthy", lambda g: sample(g, 4, reward_of(g)))

    def dies(group):
        raise ConnectionError("worker gone")

    dying = Worker("dying", dies)
    stale = Worker("stale", lambda g: sample(g, 3, 1.0))  # its engine went back to older weights
    targets = [healthy, dying, stale]

    def serving():  # the dead and the stale worker leave the weight-update group after the first round
        return targets if not healthy.groups else [healthy]

    evaluator = Evaluator(JOB, ITEMS, serving, catch_up=lambda: asyncio.sleep(0))
    assert asyncio.run(evaluator.accuracy(4)) == 0.5
    assert len(dying.groups) == len(stale.groups) == 2  # a third of the six items each, first round
    assert sorted(g.prompt_id for g in healthy.groups) == [item.id for item in ITEMS]  # every item scored there


def test_with_no_engine_serving_the_version_it_catches_up_then_gives_the_evaluation_up():
    pushes = []

    async def catch_up():
        pushes.append(1)

    evaluator = Evaluator(JOB, ITEMS, lambda: [], catch_up=catch_up, wait_seconds=1.5)
    assert asyncio.run(evaluator.accuracy(2)) == -1.0
    assert pushes  # it asked for the weights to be pushed to workers outside the group while it waited


def test_a_worker_whose_engine_went_back_is_caught_up_before_its_items_are_dealt_again():
    """The only worker's engine restarted (back at its initial weights) while the worker stayed in the group: the
    evaluator has the current weights pushed to it (catch_up) instead of dealing it the items until it gives up, which
    once stalled a run's final evaluation for the whole `wait_seconds`."""
    caught_up = []

    def answer(group):
        if not caught_up:
            raise RuntimeError(
                "EngineWentBack: the engine sampled with weight version 0, older than the group's admission"
            )
        return sample(group, 4, reward_of(group))

    restarted = Worker("restarted", answer)

    async def catch_up():
        caught_up.append(1)

    evaluator = Evaluator(JOB, ITEMS, lambda: [restarted], catch_up=catch_up, wait_seconds=30)
    assert asyncio.run(evaluator.accuracy(4)) == 0.5
    assert len(caught_up) == 1 and len(restarted.groups) == 2 * len(ITEMS)  # one failed round, one scored
