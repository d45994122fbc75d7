import json
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_k8s.data.dataset import load_dataset
from areal_k8s.demo import task

operands = st.integers(min_value=0, max_value=10**15)


@given(operands, operands)
def test_solution_scores_one_against_its_own_answer(left, right):
    problem = task.Problem(left, right)
    solution = task.solution_text(problem)
    assert task.extract_answer(solution) == str(left + right) == problem.answer
    assert task.score(solution, problem.answer) == 1.0


@given(operands, operands)
def test_scratchpad_columns_are_correct_and_least_significant_first(left, right):
    problem = task.Problem(left, right)
    scratchpad = task.solution_text(problem).split(task.ANSWER_START)[0]
    entries = scratchpad.split(task.COLUMN_SEPARATOR)
    assert len(entries) == max(len(str(left)), len(str(right)))
    carry = 0
    for column, entry in enumerate(entries):
        digits, total = entry.split("=")
        a, b, carry_in = (int(d) for d in digits.split("+"))
        assert (a, b) == (left // 10**column % 10, right // 10**column % 10)
        assert carry_in == carry and int(total) == a + b + carry_in and len(total) == 2
        carry = int(total) // 10


@given(operands, operands, st.integers(min_value=1, max_value=10**6))
def test_wrong_answers_score_zero(left, right, offset):
    problem = task.Problem(left, right)
    wrong = task.solution_text(task.Problem(left + offset, right))
    assert task.score(wrong, problem.answer) == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "",
        "garbage",
        "1+2+0=03",  # truncated before the answer
        "1+2+0=03|3",  # truncated before the end marker
        "1+2+0=03|.",  # empty answer
        "1+2+0=03|3a.",  # not a number
        "|٣.",  # a non-ASCII digit
        "|-3.",
    ],
)
def test_extract_answer_rejects_incomplete_responses(response):
    assert task.extract_answer(response) is None
    assert task.score(response, "3") == 0.0


def test_the_last_answer_counts():
    assert task.extract_answer("|4.|7.") == "7"
    assert task.score("|03.", "3") == 0.0  # exact match: no normalisation of leading zeros


@given(st.text(), st.text())
def test_score_and_extract_never_raise(response, reference):
    assert task.score(response, reference) in (0.0, 1.0)
    answer = task.extract_answer(response)
    assert answer is None or answer.isdigit()


@given(st.text(alphabet=task.ALPHABET, max_size=60))
def test_prompt_and_solution_stay_in_the_alphabet(noise):
    problem = task.make_problem(random.Random(noise))
    assert set(task.prompt_text(problem) + task.solution_text(problem)) <= set(task.ALPHABET)


def test_non_string_inputs_score_zero():
    assert task.extract_answer(None) is None
    assert task.score(b"|3.", "3") == 0.0


def test_digit_counts_are_long_tailed():
    rng = random.Random(0)
    digits = [len(str(task.make_problem(rng).left)) for _ in range(20000)]
    distribution = task.DEFAULT_DIGITS
    median = statistics.median(digits)
    # most operands are short, yet the longest ones are several times the median and not vanishingly rare
    assert median <= distribution.min_digits + 1
    assert max(digits) == distribution.max_digits >= 3 * median
    assert 0.005 < sum(d >= 2 * median + 2 for d in digits) / len(digits) < 0.2
    counts = [digits.count(d) for d in distribution.digit_counts]
    assert counts == sorted(counts, reverse=True)


def test_digit_distribution_validates_its_range():
    with pytest.raises(ValueError):
        task.DigitDistribution(min_digits=5, max_digits=2)
    with pytest.raises(ValueError):
        task.DigitDistribution(tail_exponent=-1)


def test_write_dataset_is_deterministic_and_loadable(tmp_path):
    first = task.write_dataset(tmp_path / "a.jsonl", 200, seed=7)
    second = task.write_dataset(tmp_path / "b.jsonl", 200, seed=7, id_prefix="a")
    other = task.write_dataset(tmp_path / "c.jsonl", 200, seed=8)
    assert first == second != other
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert records[0] == {"id": "a-1", "prompt": task.prompt_text(first[0]), "answer": first[0].answer, "verifier": "addition"}
    items = load_dataset(tmp_path / "a.jsonl")
    assert len({item.prompt for item in items}) == 200
    assert all(item.verifier == task.VERIFIER for item in items)


def test_excluded_prompts_keep_splits_disjoint(tmp_path):
    held_out = task.write_dataset(tmp_path / "eval.jsonl", 100, seed=1)
    train = task.write_dataset(
        tmp_path / "train.jsonl", 500, seed=2, exclude=frozenset(task.prompt_text(p) for p in held_out)
    )
    assert not {task.prompt_text(p) for p in held_out} & {task.prompt_text(p) for p in train}


def test_impossible_request_fails_instead_of_looping(tmp_path):
    single_digit = task.DigitDistribution(min_digits=1, max_digits=1)
    with pytest.raises(ValueError, match="distinct problems"):
        task.write_dataset(tmp_path / "x.jsonl", 101, seed=0, digits=single_digit)
