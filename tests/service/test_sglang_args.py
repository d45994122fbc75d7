"""rollout.sglang_args: SGLang's own server arguments, checked against the pinned version's list
(common/sglang_server_args.json, which tests/service/test_sglang_contract.py compares with SGLang's parser) and passed
to the engines: the rollout pods' engine command and SGLangServer's."""

import pytest
import yaml
from areal_k8s_testing.sglang_server import SGLangServer
from support.operator_fixtures import EXAMPLES

from areal_k8s.cli.launcher import LaunchError, LocalRun
from areal_k8s.common.config import JobFileError, parse_job
from areal_k8s.common.sglang_args import RESERVED, SGLangArgumentError, check_sglang_args, known_arguments, sglang_flags
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import InvalidSpec, validate

GSM8K = next(p for p in EXAMPLES if p.name == "rljob-gsm8k.yaml")


def sglang_job(sglang_args: dict) -> dict:
    return {
        "name": "j",
        "model": "/m",
        "dataset": {"train": "/t.jsonl"},
        "rollout": {"engine": "sglang", "engine_urls": ["http://127.0.0.1:30000"], "sglang_args": sglang_args},
    }


def test_arguments_become_sglangs_flags_in_their_order():
    arguments = {"mem_fraction_static": 0.8, "enable_torch_compile": True, "cuda_graph_bs_decode": [1, 2, 4]}
    assert parse_job(sglang_job(arguments)).rollout.sglang_args == arguments
    assert sglang_flags(arguments) == [
        "--mem-fraction-static", "0.8", "--enable-torch-compile", "--cuda-graph-bs-decode", "1", "2", "4",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"mem_fraction": 0.8}, "mem_fraction is not an argument of the pinned SGLang's server; did you mean "),
        ({"mem-fraction-static": 0.8}, "mem-fraction-static is written mem_fraction_static"),
        ({"tp_size": 2}, "tp_size is set by areal; use roles.rollout.gpusPerPod"),
        ({"model": "/other"}, "model is set by areal; use the job's `model`"),  # an alias of model_path
        ({"port": 1}, "port is set by areal"),
        ({"enable_torch_compile": False}, "enable_torch_compile is a switch: set it to true, or leave it out"),
        ({"mem_fraction_static": [0.8]}, "mem_fraction_static takes one value, got a list"),
    ],
)
def test_a_bad_argument_is_refused_naming_it(arguments, message):
    with pytest.raises(SGLangArgumentError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        check_sglang_args(arguments)
    with pytest.raises(JobFileError, match=r"rollout\.sglang_args: "):
        parse_job(sglang_job(arguments))


def test_the_suggestion_names_the_argument_meant():
    with pytest.raises(SGLangArgumentError, match="did you mean mem_fraction_static"):
        check_sglang_args({"mem_fraction_statik": 0.8})


def test_sglang_args_need_the_sglang_engine():
    job = {
        "name": "j",
        "model": "/m",
        "dataset": {"train": "/t.jsonl"},
        "rollout": {"sglang_args": {"log_level": "debug"}},
    }
    with pytest.raises(JobFileError, match="sglang_args is only used with engine: sglang"):
        parse_job(job)


def test_the_rljobs_sglang_args_reach_every_engines_command():
    body = yaml.safe_load(GSM8K.read_text())
    wanted = body["spec"]["rollout"]["sglang_args"]
    assert wanted  # the example sets some
    (rollout,) = [
        c for c in desired_children(validate(body), running=True) if c["metadata"]["name"].endswith("-rollout")
    ]
    engine = next(c for c in rollout["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")
    flags = sglang_flags(wanted)
    assert engine["args"][-len(flags) :] == flags
    body["spec"]["rollout"]["sglang_args"] = {"host": "0.0.0.0"}
    with pytest.raises(InvalidSpec, match=r"rollout\.sglang_args: .*host is set by areal"):
        validate(body)


def test_every_reserved_field_is_one_of_the_pinned_sglangs():
    # a field SGLang renamed would otherwise stop being refused without a word
    assert set(RESERVED) <= {argument["field"] for argument in known_arguments().values()}


def test_a_local_sglang_server_takes_the_same_arguments(tmp_path):
    server = SGLangServer(tmp_path / "model", tmp_path / "server.log", sglang_args={"log_level": "debug"})
    assert server.command()[-2:] == ["--log-level", "debug"]
    with pytest.raises(SGLangArgumentError, match="random_seed is set by areal"):
        SGLangServer(tmp_path / "model", tmp_path / "server.log", sglang_args={"random_seed": 3})


def test_a_local_run_refuses_them_and_says_how_to_start_its_external_engines(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    job = parse_job(
        {**sglang_job({"mem_fraction_static": 0.7}), "model": str(tmp_path / "model"), "run_dir": str(tmp_path / "run")}
    )
    with pytest.raises(LaunchError, match=r"start them with --mem-fraction-static 0\.7 and leave sglang_args out"):
        LocalRun(job).start()
    assert not (tmp_path / "run").exists()  # refused before anything started
