import json
import os
import random
import shutil
import statistics
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_k8s.data.dataset import load_dataset
from areal_k8s.demo import task
from areal_k8s.reward.addition_verifier import ANSWER_START, extract_answer, score

operands = st.integers(min_value=0, max_value=10**15)


@given(operands, operands)
def test_solution_scores_one_against_its_own_answer(left, right):
    problem = task.Problem(left, right)
    solution = task.solution_text(problem)
    assert extract_answer(solution) == str(left + right) == problem.answer
    assert score(solution, problem.answer) == 1.0


@given(operands, operands)
def test_scratchpad_columns_are_correct_and_least_significant_first(left, right):
    problem = task.Problem(left, right)
    scratchpad = task.solution_text(problem).split(ANSWER_START)[0]
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
    assert score(wrong, problem.answer) == 0.0


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
    assert extract_answer(response) is None
    assert score(response, "3") == 0.0


def test_the_last_answer_counts():
    assert extract_answer("|4.|7.") == "7"
    assert score("|03.", "3") == 0.0  # exact match: no normalisation of leading zeros


@given(st.text(), st.text())
def test_score_and_extract_never_raise(response, reference):
    assert score(response, reference) in (0.0, 1.0)
    answer = extract_answer(response)
    assert answer is None or answer.isdigit()


@given(st.text(alphabet=task.ALPHABET, max_size=60))
def test_prompt_and_solution_stay_in_the_alphabet(noise):
    problem = task.make_problem(random.Random(noise))
    assert set(task.prompt_text(problem) + task.solution_text(problem)) <= set(task.ALPHABET)


def test_non_string_inputs_score_zero():
    assert extract_answer(None) is None
    assert score(b"|3.", "3") == 0.0


def test_problem_lengths_are_long_tailed():
    rng = random.Random(0)
    problems = [task.make_problem(rng) for _ in range(20000)]
    columns = [max(len(str(p.left)), len(str(p.right))) for p in problems]
    distribution = task.DEFAULT_DIGITS
    counts = [columns.count(c) for c in distribution.column_counts]
    assert counts == sorted(counts, reverse=True)
    # most sums are short, yet the longest responses are several times the median and not vanishingly rare
    lengths = sorted(len(task.solution_text(p)) for p in problems)
    median = statistics.median(lengths)
    assert statistics.median(columns) == distribution.min_digits
    assert lengths[-1] >= 3.5 * median
    assert 0.01 < sum(length >= 2 * median for length in lengths) / len(lengths) < 0.2
    # the other operand is never longer than the column count
    assert all(min(len(str(p.left)), len(str(p.right))) <= c for p, c in zip(problems, columns))


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
    expected = {"id": "a-1", "prompt": task.prompt_text(first[0]), "answer": first[0].answer, "verifier": "addition"}
    assert records[0] == expected
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


# --- asset build (tiny sizes, a handful of SFT steps) ---

TINY_BUILD = {
    "train_size": 64,
    "eval_size": 8,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "sft_target_accuracy": 1.0,  # never reached by a 3-step warm-up: it runs to sft_max_steps
    "sft_first_check": 2,
    "sft_check_every": 1,
    "sft_max_steps": 3,
    "sft_probe_size": 8,
    "sft_batch_size": 8,
    "sft_warmup_steps": 1,
    "eval_max_new_tokens": 12,
    "eval_batch_size": 8,
}


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    from areal_k8s.demo.build import build_demo_assets

    out = tmp_path_factory.mktemp("demo")
    return out, build_demo_assets(out, seed=3, **TINY_BUILD)


def test_build_writes_model_tokenizer_data_and_manifest(tiny_assets):
    out, manifest = tiny_assets
    assert (out / "model" / "model.safetensors").is_file()
    assert (out / "model" / "tokenizer.json").is_file()
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["seed"] == manifest["params"]["seed"] == 3
    assert {key: manifest["params"][key] for key in TINY_BUILD} == TINY_BUILD
    assert manifest["sft_steps"] == 3 and manifest["sft_seconds"] >= 0
    assert 0.0 <= manifest["base_greedy_accuracy"] <= 1.0
    train, held_out = load_dataset(out / manifest["train"]), load_dataset(out / manifest["eval"])
    assert (len(train), len(held_out)) == (64, 8)
    assert not {item.prompt for item in train} & {item.prompt for item in held_out}
    assert {item.verifier for item in train + held_out} == {task.VERIFIER}


def test_tokenizer_round_trips_after_reload(tiny_assets):
    from transformers import AutoTokenizer

    out, _ = tiny_assets
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    problem = task.Problem(90417, 385)
    text = task.prompt_text(problem) + task.solution_text(problem)
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    specials = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in specials and len(specials) == 3
    assert tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_reloaded_tokenizer_encodes_like_the_built_one(tiny_assets):
    # transformers 5 loads any tokenizer saved beside a qwen2 config as Qwen2Tokenizer, which swaps in its own
    # pre-tokenizer and a merge-free BPE over our vocabulary; on the task alphabet the ids must not change.
    from transformers import AutoTokenizer

    from areal_k8s.demo.build import build_tokenizer

    out, _ = tiny_assets
    reloaded, built = AutoTokenizer.from_pretrained(out / "model"), build_tokenizer()
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(task.ALPHABET) for _ in range(rng.randint(0, 40)))
        assert reloaded(text)["input_ids"] == built(text)["input_ids"]


def test_model_reloads_with_auto_class_and_matches_config(tiny_assets):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = tiny_assets
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tokenizer)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 1)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokenizer("12+3=")["input_ids"]])).logits
    assert logits.shape == (1, 6, len(tokenizer)) and torch.isfinite(logits).all()


def test_build_is_idempotent(tiny_assets):
    from areal_k8s.demo.build import build_demo_assets

    out, manifest = tiny_assets
    weights = out / "model" / "model.safetensors"
    modified = weights.stat().st_mtime_ns
    assert build_demo_assets(out, seed=3, **TINY_BUILD) == manifest
    assert weights.stat().st_mtime_ns == modified


def test_the_build_is_deterministic_and_pins_the_instruction_set_whatever_the_caller_runs_on(tiny_assets, tmp_path):
    """The caller here runs torch's widest kernels (AVX-512 on this machine) and two threads; the build runs in a
    process pinned to AVX2 on one thread, so a command line that asks for AVX-512 builds the same weights, data and
    base accuracy as the build before it."""
    from areal_k8s.demo.build import PINNED_ISA

    out, manifest = tiny_assets
    assert manifest["cpu_capability"] == "AVX2" and len(manifest["weights_sha256"]) == 64
    params = [f"--param={key}={value}" for key, value in TINY_BUILD.items()]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": "2"}
    env = {key: value for key, value in env.items() if key not in PINNED_ISA or key == "ATEN_CPU_CAPABILITY"}
    subprocess.run(
        [sys.executable, "-m", "areal_k8s.demo.build", "--out", str(tmp_path), "--seed", "3", *params],
        env=env,
        check=True,
        capture_output=True,
    )
    rebuilt = json.loads((tmp_path / "manifest.json").read_text())
    assert (rebuilt["weights_sha256"], rebuilt["cpu_capability"]) == (manifest["weights_sha256"], "AVX2")
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == (out / "model" / "model.safetensors").read_bytes()
    assert (tmp_path / "train.jsonl").read_text() == (out / "train.jsonl").read_text()
    assert rebuilt["base_greedy_accuracy"] == manifest["base_greedy_accuracy"]


def test_a_build_parameter_on_the_command_line_is_checked(tmp_path, capsys):
    from areal_k8s.demo.build import main

    for param, message in (
        ("--param=sft_steps=3", "unknown build parameter 'sft_steps'"),
        ("--param=sft_max_steps=many", "sft_max_steps must be an integer, got 'many'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--out", str(tmp_path), param])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything was built


def test_warmup_stops_once_the_probe_reaches_the_target(tmp_path):
    from areal_k8s.demo.build import build_demo_assets

    manifest = build_demo_assets(tmp_path, seed=0, **{**TINY_BUILD, "sft_target_accuracy": 0.0})
    assert manifest["sft_steps"] == TINY_BUILD["sft_first_check"]


def test_changed_parameters_rebuild(tiny_assets, tmp_path):
    from areal_k8s.demo.build import build_demo_assets

    out, first = tiny_assets
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)  # a build of seed 3 there
    second = build_demo_assets(tmp_path, seed=1, **TINY_BUILD)
    assert (first["seed"], second["seed"]) == (3, 1) and second["weights_sha256"] != first["weights_sha256"]
    assert json.loads((tmp_path / "manifest.json").read_text())["params"]["seed"] == 1
