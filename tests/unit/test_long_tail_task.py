"""The long-tail task (demo/long_tail.py), its `running_sum` verifier, its asset build and its example job."""

import importlib.util
import json
import random
import statistics
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from areal_k8s.common.config import load_job_file
from areal_k8s.data.dataset import load_dataset
from areal_k8s.demo import long_tail, task
from areal_k8s.demo.long_tail_build import LongTailBuildConfig, longest_problem, warmup_examples
from areal_k8s.reward.running_sum_verifier import ENTRY_SEPARATOR, parse_prompt, score, worked_entries

ROOT = Path(__file__).resolve().parents[2]
problems = st.builds(
    long_tail.Problem,
    start=st.integers(min_value=0, max_value=long_tail.MAX_START),
    term=st.integers(min_value=1, max_value=long_tail.MAX_TERM),
    count=st.integers(min_value=1, max_value=long_tail.MAX_STEPS),
)


def quantile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@given(problems)
def test_the_worked_solution_and_the_bare_answer_both_verify(problem):
    prompt = long_tail.prompt_text(problem)
    assert parse_prompt(prompt) == long_tail.Prompt(problem.start, problem.term, problem.count)
    assert len(prompt) == 9  # fixed width: the first entry finds start, term and count at fixed places
    assert score(prompt, long_tail.solution_text(problem), problem.answer) == 1.0
    assert score(prompt, long_tail.shortcut_text(problem), problem.answer) == 1.0


@given(problems)
def test_the_work_is_one_fixed_width_entry_per_addition_counting_down(problem):
    work, answer = long_tail.solution_text(problem).split("|")
    fields = work.split(ENTRY_SEPARATOR)  # each entry is two fields: the additions left, then the addition
    assert len(fields) == 2 * problem.steps and answer == problem.answer + "."
    total = problem.start
    for index, (left, addition) in enumerate(zip(fields[0::2], fields[1::2])):
        assert left == f"{problem.count - index:02d}"
        assert addition == f"{total:03d}+{problem.term}={total + problem.term:03d}"
        total += problem.term
    assert str(total) == problem.answer and left == "01"


@given(problems, st.integers(min_value=1, max_value=100))
def test_a_wrong_answer_scores_zero_with_or_without_work(problem, offset):
    prompt, wrong = long_tail.prompt_text(problem), str(int(problem.answer) + offset)
    assert score(prompt, long_tail.solution_text(problem), wrong) == 0.0
    assert score(prompt, long_tail.shortcut_text(problem), wrong) == 0.0


@given(problems, st.data())
def test_a_right_answer_reached_by_wrong_work_scores_zero(problem, data):
    prompt = long_tail.prompt_text(problem)
    entries = worked_entries(problem)
    index = data.draw(st.integers(min_value=0, max_value=len(entries) - 1))
    broken = {
        "a step skipped": entries[:index] + entries[index + 1 :] if len(entries) > 1 else ["garbage"],
        "a step repeated": entries[: index + 1] + entries[index:],
        "a total changed": [*entries[:index], entries[index][:-1] + str((int(entries[index][-1]) + 1) % 10)],
        "a count changed": [*entries[:index], str((int(entries[index][0]) + 1) % 10) + entries[index][1:]],
    }
    for kind, changed in broken.items():
        response = ENTRY_SEPARATOR.join(changed) + long_tail.shortcut_text(problem)
        assert score(prompt, response, problem.answer) == 0.0, kind


@pytest.mark.parametrize(
    "response",
    [
        "",
        "garbage",
        "02,017+1=018,01,018+1=019",  # no answer
        "02,017+1=018,01,018+1=019|19",  # truncated before the end marker
        "02,017+1=018,01,018+1=019|.",  # empty answer
        "|019.",  # zero-padded answer
        "2,17+1=18,1,18+1=19|19.",  # unpadded count and totals
        "017+1=018,018+1=019|19.",  # no counts
        "02,017+1=018,01,018+1=019,|19.",  # a trailing separator
        "02,017+1=018, 01,018+1=019|19.",  # a space
        "|7.|19.x",  # text after the answer is ignored, but the work before the last answer is not work
    ],
)
def test_malformed_responses_score_zero(response):
    assert score("017+1,02=", response, "19") == 0.0


def test_work_against_a_prompt_that_is_not_the_tasks_scores_zero():
    not_the_tasks = ("3+8+1=", "17+1,02=", "017+1,2=", "017+0,02=", "017+1,00=", f"{long_tail.MAX_START + 1}+1,01=")
    for prompt in not_the_tasks:
        assert parse_prompt(prompt) is None
        assert score(prompt, "01,017+1=018|18.", "18") == 0.0
    assert score("17+1,2=", "|18.", "18") == 1.0  # a bare answer is scored on the answer alone


@given(st.text(), st.text(), st.text())
def test_score_never_raises(prompt, response, reference):
    assert score(prompt, response, reference) in (0.0, 1.0)


@given(problems)
def test_prompts_and_solutions_stay_in_the_demo_tokenizers_alphabet(problem):
    text = long_tail.prompt_text(problem) + long_tail.solution_text(problem) + long_tail.shortcut_text(problem)
    assert set(text) <= set(task.ALPHABET)


def test_worked_solution_lengths_are_heavy_tailed_by_construction():
    rng = random.Random(0)
    problems = [long_tail.make_problem(rng) for _ in range(20000)]
    steps = [p.steps for p in problems]
    lengths = [len(long_tail.solution_text(p)) + 1 for p in problems]  # + <eos>: tokens, one per character
    assert statistics.median(steps) == long_tail.DEFAULT_STEPS.median_steps
    assert 7 <= quantile(lengths, 0.99) / quantile(lengths, 0.5) <= 11
    assert quantile(lengths, 0.9) >= 3 * quantile(lengths, 0.5)
    assert max(steps) == long_tail.DEFAULT_STEPS.max_steps
    # the long ones are rarer: each doubling of the step count beyond the median is drawn less often
    bands = [sum(lo <= s < 2 * lo for s in steps) for lo in (5, 10, 20, 40)]
    assert bands == sorted(bands, reverse=True) and bands[-1] > 0


def test_the_step_distribution_validates_its_parameters():
    for bad in ({"max_steps": 0}, {"max_steps": long_tail.MAX_STEPS + 1}, {"median_steps": 0.5}, {"sigma": -1}):
        with pytest.raises(ValueError):
            long_tail.StepDistribution(**bad)
    assert long_tail.MAX_START + long_tail.MAX_TERM * long_tail.MAX_STEPS < 1000  # every total fits three digits
    always_one = long_tail.StepDistribution(median_steps=1, sigma=0.0)
    assert {long_tail.make_problem(random.Random(seed), always_one).steps for seed in range(50)} == {1}


def test_write_dataset_is_deterministic_loadable_and_keeps_splits_disjoint(tmp_path):
    held_out = long_tail.write_dataset(tmp_path / "eval.jsonl", 100, seed=1)
    train = long_tail.write_dataset(
        tmp_path / "train.jsonl", 500, seed=2, exclude=frozenset(long_tail.prompt_text(p) for p in held_out)
    )
    assert long_tail.write_dataset(tmp_path / "again.jsonl", 100, seed=1) == held_out
    assert not {long_tail.prompt_text(p) for p in held_out} & {long_tail.prompt_text(p) for p in train}
    first = json.loads((tmp_path / "train.jsonl").read_text().splitlines()[0])
    assert first == {
        "id": "train-1",
        "prompt": long_tail.prompt_text(train[0]),
        "answer": train[0].answer,
        "verifier": "running_sum",
    }
    items = load_dataset(tmp_path / "train.jsonl")
    assert len({item.prompt for item in items}) == 500 and {item.verifier for item in items} == {long_tail.VERIFIER}
    with pytest.raises(ValueError, match="distinct problems"):
        one_step_sums = (long_tail.MAX_START + 1) * long_tail.MAX_TERM
        long_tail.write_dataset(
            tmp_path / "x.jsonl", one_step_sums + 1, seed=0, steps=long_tail.StepDistribution(1, 0.0)
        )


def test_the_warm_up_mixes_in_bare_answers_at_the_configured_share():
    problems = long_tail.make_problems(4000, seed=0)
    examples = warmup_examples(problems, shortcut_fraction=0.2, seed=0)
    bare = sum(solution == long_tail.shortcut_text(p) for (_, solution), p in zip(examples, problems))
    assert 0.17 < bare / len(problems) < 0.23
    assert warmup_examples(problems, 0.2, seed=0) == examples
    assert all(
        solution == long_tail.solution_text(p) for (_, solution), p in zip(warmup_examples(problems, 0.0, 0), problems)
    )


def test_the_build_config_leaves_room_for_the_longest_prompt_and_solution():
    config = LongTailBuildConfig()
    longest = longest_problem(config.max_steps)
    assert len(long_tail.prompt_text(longest)) + len(long_tail.solution_text(longest)) + 2 <= config.max_positions
    with pytest.raises(ValueError, match="max_positions"):
        LongTailBuildConfig(max_positions=512)
    with pytest.raises(ValueError, match="shortcut_fraction"):
        LongTailBuildConfig(shortcut_fraction=1.5)


def test_the_example_job_runs_the_task_without_cutting_a_worked_solution():
    path = ROOT / "examples" / "long-tail.yaml"
    job = load_job_file(path)
    assert job.reward.verifier == long_tail.VERIFIER
    assets = (ROOT / ".cache" / "long-tail").resolve()  # where `make long-tail-assets` builds them
    assert (Path(job.model), Path(job.dataset.train)) == (assets / "model", assets / "train.jsonl")
    config = LongTailBuildConfig()
    longest = longest_problem(config.max_steps)
    prompt_tokens = len(long_tail.prompt_text(longest)) + 1  # <bos>
    assert len(long_tail.solution_text(longest)) + 1 <= job.sampling.max_new_tokens
    assert prompt_tokens + job.sampling.max_new_tokens <= config.max_positions
    assert yaml.safe_load(path.read_text())["name"] == "long-tail"


def load_bench(name: str):
    """bench/<name>.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_synchronous_round_is_timed_from_its_decode_steps():
    timing = load_bench("long_tail_lengths").round_timing
    # ten rows: nine finish at the second step, the straggler decodes alone for three more
    straggler = timing([(1.0, 10, 0), (1.0, 10, 9), (1.0, 1, 9), (1.0, 1, 9), (1.0, 1, 10)], rows=10)
    assert straggler == {
        "cpu_seconds": 5.0,
        "decode_steps": 5,
        "last_10pct_share_of_round": 0.6,
        "idle_share": 0.54,
        "idle_share_in_last_10pct": 0.9,
        "capacity_unused": 0.54,
        "capacity_unused_in_last_10pct": 0.9,
    }
    together = timing([(1.0, 10, 0), (1.0, 10, 0), (1.0, 10, 10)], rows=10)
    assert together["last_10pct_share_of_round"] == together["idle_share"] == together["capacity_unused"] == 0.0
