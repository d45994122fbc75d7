"""The job schema: valid files load, malformed ones fail with one readable line naming the field."""

import subprocess
import sys
from pathlib import Path

import pytest

from areal_k8s.common.config import JobFileError, load_job_file, parse_job

MINIMAL = "name: demo\nmodel: models/tiny\ndataset:\n  train: data/train.jsonl\n"
MINIMAL_FIELDS = {"name": "demo", "model": "models/tiny", "dataset": {"train": "data/train.jsonl"}}
# Job files; the RLJob custom resources beside them (rljob-*.yaml) are checked against the CRD by the operator tests.
EXAMPLES = sorted(
    p
    for p in (Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")
    if not p.name.startswith(("rljob", "scenario"))
)  # RLJobs: test_crd.py; scenarios: test_simulator.py


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def with_its_files(tmp_path):
    """The model directory and training set MINIMAL names, under `tmp_path` (`validate` looks for them)."""
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    return tmp_path


def test_minimal_job_gets_defaults_and_absolute_paths(tmp_path):
    job = load_job_file(write(tmp_path, MINIMAL), project_root=tmp_path)
    assert job.algorithm.max_staleness == 2 and job.algorithm.concurrency == 16 * 3
    assert job.model == str(tmp_path / "models/tiny")
    assert job.run_dir == str(tmp_path / "runs/demo")
    assert job.tokenizer_path == job.model


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            "algorithm:\n  max_staleness: -1\n",
            "algorithm.max_staleness: Input should be greater than or equal to 0 (got -1)",
        ),
        ("algorithm:\n  batch_sise: 4\n", "algorithm.batch_sise: unknown field"),
        ("sampling:\n  temperature: hot\n", "sampling.temperature: Input should be a valid number"),
        ("rollout:\n  engine: vllm\n", "rollout.engine: Input should be 'cpu' or 'sglang'"),
        (
            "trainer:\n  backend: deepspeed\n",
            "trainer.backend: Input should be 'torch' or 'megatron' (got 'deepspeed')",
        ),
        ("trainer:\n  precision: fp16\n", "trainer.precision: Input should be 'fp32' or 'bf16' (got 'fp16')"),
        (
            "trainer:\n  logprob_chunk_tokens: 0\n",
            "trainer.logprob_chunk_tokens: Input should be greater than or equal to 1",
        ),
        (
            "rollout:\n  engine: sglang\n  workers: 2\n  engine_urls: [http://a:30000]\n",
            "needs one entry in engine_urls per worker",
        ),
        (
            "rollout:\n  engine: sglang\n  engine_urls: [http://a:30000]\ntrainer:\n  verify_weight_sync: true\n",
            "trainer.verify_weight_sync needs rollout.engine: cpu",
        ),
        ("algorithm:\n  staleness_cap: 4\n", "staleness_cap applies to staleness_policy `capped` only"),
        (
            "algorithm:\n  staleness_policy: capped\n  max_staleness: 3\n  staleness_cap: 2\n",
            "staleness_cap must be at least max_staleness (η = 3), got 2",
        ),
        ("algorithm:\n  staleness_policy: eager\n", "Input should be 'strict', 'admission' or 'capped'"),
    ],
)
def test_bad_field_is_named_in_one_line(tmp_path, extra, expected):
    with pytest.raises(JobFileError) as info:
        load_job_file(write(tmp_path, MINIMAL + extra))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / "job.yaml"))
    assert expected in message


def test_weights_are_pushed_in_the_engines_dtype_unless_told(tmp_path):
    assert load_job_file(write(tmp_path, MINIMAL)).push_dtype == "float32"  # the CPU engine serves float32
    sglang = "rollout:\n  engine: sglang\n  engine_urls: [http://a:30000]\n"
    assert load_job_file(write(tmp_path, MINIMAL + sglang)).push_dtype == "bfloat16"
    assert (
        load_job_file(write(tmp_path, MINIMAL + sglang + "trainer:\n  push_dtype: float32\n")).push_dtype == "float32"
    )


def test_sglang_engines_may_retract(tmp_path):
    """SGLang 0.5.20 names each token's weight version (`weight_versions` spans), so a retract pause is fine."""
    job = load_job_file(
        write(tmp_path, MINIMAL + "rollout:\n  engine: sglang\n  engine_urls: [http://a:30000]\n  interrupt: retract\n")
    )
    assert job.rollout.interrupt == "retract"


def test_missing_required_field_and_bad_name(tmp_path):
    with pytest.raises(JobFileError, match=r"dataset: required field is missing"):
        load_job_file(write(tmp_path, "name: demo\nmodel: m\n"))
    with pytest.raises(JobFileError, match=r"name: String should match pattern"):
        parse_job({"name": "Demo_Job", "model": "m", "dataset": {"train": "t"}})


def test_yaml_syntax_error_names_the_line(tmp_path):
    with pytest.raises(JobFileError, match=r"not valid YAML at line 2"):
        load_job_file(write(tmp_path, "name: demo\nmodel: a: b\n"))
    with pytest.raises(JobFileError, match="expected a mapping"):
        load_job_file(write(tmp_path, "- just\n- a list\n"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(example):
    load_job_file(example)


def test_cli_exits_non_zero_with_one_readable_line(tmp_path):
    bad = write(tmp_path, MINIMAL + "algorithm:\n  group_size: 0\n")
    result = subprocess.run(
        [sys.executable, "-m", "areal_k8s.cli.main", "validate", str(bad)], capture_output=True, text=True
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"arealctl: error: {bad}: algorithm.group_size: Input should be greater than or equal to 1 (got 0)"
    ]
    good = write(tmp_path, MINIMAL)
    result = subprocess.run(
        [sys.executable, "-m", "areal_k8s.cli.main", "validate", str(good)],
        capture_output=True,
        text=True,
        cwd=with_its_files(tmp_path),  # MINIMAL's relative paths are read against it
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_settings_on_the_command_line_go_over_the_file_and_are_validated_as_its_own(tmp_path):
    """`--set section.field=value` (values read as YAML), as `helm --set`: the demo on the megatron backend is one
    command, and a misspelt or mistyped setting fails with one line naming it."""
    good = write(tmp_path, MINIMAL)
    job = load_job_file(
        good,
        overrides=[
            "trainer.backend=megatron",
            "trainer.replicas=2",
            "trainer.parallelism.tensor=2",
            "algorithm.lr=1e-5",
            "name=other",
        ],
    )
    assert (job.trainer.backend, job.trainer.replicas, job.trainer.parallelism.tensor, job.name) == (
        "megatron",
        2,
        2,
        "other",
    )
    assert job.algorithm.lr == 1e-5
    cases = [
        ("trainer.replicaz=2", f"{good} with --set: trainer.replicaz: unknown field (did you mean 'replicas'?)"),
        (
            "trainer.replicas=two",
            f"{good} with --set: trainer.replicas: Input should be a valid integer, unable to parse string as an "
            "integer (got 'two')",
        ),
        ("trainer.replicas", "--set 'trainer.replicas': expected KEY=VALUE, e.g. trainer.replicas=2"),
        ("name.first=x", "--set name.first: name is a value, not a section"),
    ]
    for setting, line in cases:
        result = subprocess.run(
            [sys.executable, "-m", "areal_k8s.cli.main", "validate", str(good), "--set", setting],
            capture_output=True,
            text=True,
        )
        assert (result.returncode, result.stderr.strip()) == (2, f"arealctl: error: {line}")


def test_docs_job_reference_is_generated_from_the_schema():
    from areal_k8s.cli.main import REFERENCE_END, REFERENCE_START
    from areal_k8s.common.config import reference_markdown

    readme = (Path(__file__).resolve().parents[2] / "docs" / "job-file.md").read_text()
    documented = readme.split(REFERENCE_START, 1)[1].split(REFERENCE_END, 1)[0]
    assert documented == reference_markdown(), "run `arealctl reference --write docs/job-file.md`"


def test_nothing_at_the_repository_root_shadows_the_standard_library():
    # `python -m ...` run from the checkout puts the root first on sys.path: an `operator/__init__.py` there once
    # broke pip itself (the stdlib `operator` module was shadowed).
    root = Path(__file__).resolve().parents[2]
    importable = {p.stem for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert importable & set(sys.stdlib_module_names) == set()


def test_a_job_file_may_build_on_another_and_names_a_loop(tmp_path):
    """`base: other.yaml` (relative to the file): sections merge field by field, the file's own values win, `--set`
    goes over both; a file based on itself, however indirectly, is refused with one line."""
    write(tmp_path, MINIMAL + "trainer:\n  micro_batch_tokens: 2048\n")
    (tmp_path / "split.yaml").write_text(
        "base: job.yaml\nname: split\ntrainer:\n  backend: megatron\n  replicas: 2\n  parallelism: {tensor: 2}\n"
    )
    job = load_job_file(tmp_path / "split.yaml", overrides=["trainer.replicas=4"])
    minimal = load_job_file(tmp_path / "job.yaml")
    assert (job.name, job.trainer.backend, job.trainer.replicas, job.trainer.parallelism.tensor) == (
        "split",
        "megatron",
        4,
        2,
    )
    assert job.model_dump(exclude={"name", "trainer", "run_dir"}) == minimal.model_dump(
        exclude={"name", "trainer", "run_dir"}
    )
    assert job.trainer.micro_batch_tokens == 2048  # the section merged, not replaced
    (tmp_path / "a.yaml").write_text("base: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nname: b\n")
    with pytest.raises(JobFileError, match=r"b.yaml: its base .*a.yaml leads back to this file"):
        load_job_file(tmp_path / "a.yaml")


def test_the_megatron_demo_is_the_demo_on_two_tensor_parallel_ranks():
    examples = Path(__file__).resolve().parents[2] / "examples"
    demo, megatron = load_job_file(examples / "demo.yaml"), load_job_file(examples / "demo-megatron.yaml")
    assert (megatron.trainer.backend, megatron.trainer.replicas, megatron.trainer.parallelism.tensor) == (
        "megatron",
        2,
        2,
    )
    assert (
        megatron.algorithm == demo.algorithm and megatron.rollout == demo.rollout and megatron.dataset == demo.dataset
    )


@pytest.mark.parametrize(
    ("algorithm", "bound"),
    [
        ("max_staleness: 3\n", 3),
        ("max_staleness: 3\n  staleness_policy: admission\n", None),
        ("max_staleness: 3\n  staleness_policy: capped\n", 6),
        ("max_staleness: 3\n  staleness_policy: capped\n  staleness_cap: 4\n", 4),
    ],
)
def test_each_staleness_policy_bounds_what_it_says(tmp_path, algorithm, bound):
    job = load_job_file(write(tmp_path, MINIMAL + "algorithm:\n  " + algorithm))
    assert job.algorithm.staleness.wait_bound == bound


def test_a_response_budget_past_the_models_context_is_named_with_what_fits(tmp_path):
    job = parse_job({"name": "demo", "model": "m", "dataset": {"train": "t"}, "sampling": {"max_new_tokens": 200}})
    assert job.context_problems(model_context=256, longest_prompt=(56, "dataset.train item 7")) == []
    assert job.context_problems(model_context=256, longest_prompt=(57, "dataset.train item 7")) == [
        "sampling.max_new_tokens: 200 new tokens after the longest prompt (57 tokens, dataset.train item 7) do not "
        "fit the model's context of 256 positions (max_position_embeddings): at most 199 do"
    ]
    # no context known: nothing to check; a context the job names is checked against a prompt of one token at least
    assert job.context_problems() == []
    named = job.model_copy(update={"context_length": 200})
    assert named.context_problems() == [
        "sampling.max_new_tokens: 200 new tokens after a one-token prompt do not fit the model's context of 200 "
        "positions (context_length): at most 199 do"
    ]
    # a named context past the model's own is itself wrong; the smaller one decides
    (past, budget) = named.model_copy(update={"context_length": 4096}).context_problems(model_context=128)
    assert past.startswith("context_length: 4096 is past the model's own 128 positions")
    assert "context of 128 positions (max_position_embeddings): at most 127 do" in budget


def test_agents_are_the_agent_workflows_players_and_a_rule_across_sections_is_one_short_line(tmp_path):
    agents = {"command": ["python", "agent.py"], "working_dir": "agents"}
    job = parse_job({**MINIMAL_FIELDS, "rollout": {"workflow": "agent", "prompt_template": "chat"}, "agents": agents})
    assert (job.agents.replicas, job.agents.episodes_per_replica) == (1, 4)
    assert job.resolve_paths(tmp_path).agents.working_dir == str(tmp_path / "agents")
    with pytest.raises(JobFileError) as refused:
        parse_job({**MINIMAL_FIELDS, "agents": agents})
    assert str(refused.value) == (
        "job: (top level): Value error, agents play the agent workflow's episodes: set rollout.workflow: agent "
        "(got single_turn)"
    )
    with pytest.raises(JobFileError, match=r"agents.command: List should have at least 1 item"):
        parse_job(
            {**MINIMAL_FIELDS, "rollout": {"workflow": "agent", "prompt_template": "chat"}, "agents": {"command": []}}
        )
