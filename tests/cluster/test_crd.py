"""The RLJob CRD: generated from one source, structurally sound, and checked the same way in CEL and in Python.

CEL cannot be run by an apiserver here; cel-python evaluates the CRD's own rule texts instead, next to the
operator's Python form of each rule, so a rule whose two forms disagree fails.
"""

import copy

import celpy
import jsonschema
import pytest
import yaml
from support.operator_fixtures import CRD_FILE, EXAMPLES, committed_crd, with_changes

from areal_k8s.common.config import AlgorithmConfig, JobConfig, RolloutConfig, SamplingConfig, TrainerConfig
from areal_k8s.k8s_operator import names, schema
from areal_k8s.k8s_operator.rules import RULES, Rule, nodes_at
from areal_k8s.k8s_operator.schema import CHART_CRD_PATH, render
from areal_k8s.k8s_operator.schema_job import JOB_SECTIONS, OPERATOR_OWNED
from areal_k8s.k8s_operator.validation import (
    InvalidSpec,
    apply_defaults,
    openapi_schema,
    schema_problems,
    strict_json_schema,
    validate,
)

CPU_EXAMPLE = next(p for p in EXAMPLES if p.name == "rljob-demo-cpu.yaml")


def example() -> dict:
    return yaml.safe_load(CPU_EXAMPLE.read_text())


def spec_schema() -> dict:
    return committed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_committed_crd_is_the_generated_one():
    assert CRD_FILE.read_text() == render(), (
        "operator/crd/rljobs.yaml is stale: python -m areal_k8s.k8s_operator.schema --write"
    )


def test_the_chart_ships_the_same_crd_and_check_covers_both_copies(tmp_path, monkeypatch, capsys):
    assert schema.CRD_PATHS == (CRD_FILE, CHART_CRD_PATH)
    assert CHART_CRD_PATH.read_bytes() == CRD_FILE.read_bytes(), (
        "charts/areal/crds/rljobs.yaml is stale: python -m areal_k8s.k8s_operator.schema --write"
    )
    assert schema.main(["--check"]) == 0

    copies = (tmp_path / "operator.yaml", tmp_path / "chart" / "rljobs.yaml")
    monkeypatch.setattr(schema, "CRD_PATHS", copies)
    assert schema.main(["--write"]) == 0
    assert [path.read_text() for path in copies] == [render(), render()]
    assert schema.main(["--check"]) == 0
    copies[1].write_text(render().replace("RLJob", "RLJobs", 1))  # a chart copy edited by hand
    assert schema.main(["--check"]) == 1
    assert f"{copies[1]} is stale" in capsys.readouterr().err


def test_job_file_sections_come_from_the_job_config_models():
    properties = spec_schema()["properties"]
    for key, (model, _) in JOB_SECTIONS.items():
        generated = properties[key]["properties"]
        assert set(generated) == set(model.model_fields) - OPERATOR_OWNED.get(key, set()), key
        for name, prop in generated.items():
            field = model.model_fields[name]
            assert prop["description"] == field.description, f"{key}.{name}"
            if field.default is not None and not field.is_required() and field.default_factory is None:
                assert prop["default"] == (
                    list(field.default) if isinstance(field.default, tuple) else field.default
                ), f"{key}.{name}"
    eta = properties["staleness"]["properties"]["eta"]
    assert eta["description"] == AlgorithmConfig.model_fields["max_staleness"].description
    assert (eta["minimum"], eta["default"]) == (0, AlgorithmConfig.model_fields["max_staleness"].default)
    assert properties["model"]["description"] == JobConfig.model_fields["model"].description


def test_crd_defaults_give_the_job_config_defaults():
    minimal = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "tiny", "namespace": "ns"},
        "spec": {"model": "/m", "dataset": {"train": "/d.jsonl"}, "redis": {"url": "redis://r:6379/0"}},
    }
    config = validate(minimal).config
    assert config.sampling == SamplingConfig()
    assert config.trainer == TrainerConfig()
    assert config.algorithm == AlgorithmConfig()
    assert config.rollout == RolloutConfig()
    assert config.run_dir == f"/var/lib/areal/{names.job_key('ns', 'tiny')}"


def walk(schema: dict, where: str = ""):
    yield where, schema
    for key, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{where}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{where}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{where}{{}}")


def test_the_schema_is_structural_and_its_defaults_are_valid():
    root = committed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for where, node in walk(root):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{where}: no type"
        assert not ("properties" in node and "additionalProperties" in node), (
            f"{where}: properties with additionalProperties"
        )
        if "default" in node:
            checked = {k: v for k, v in node.items() if k != "nullable"}
            jsonschema.Draft4Validator(checked).validate(node["default"])
        if node.get("x-kubernetes-list-type") == "map":
            assert set(node["x-kubernetes-list-map-keys"]) <= set(node["items"]["required"]), where


def schema_at(path: str) -> dict:
    node = committed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for step in path.strip(".").split("."):
        node = node["properties"][step.split("[")[0]]
    return node


def test_scale_and_printer_columns_point_at_fields_of_the_schema():
    version = committed_crd()["spec"]["versions"][0]
    scale = version["subresources"]["scale"]
    assert schema_at(scale["specReplicasPath"])["type"] == "integer"
    assert schema_at(scale["statusReplicasPath"])["type"] == "integer"
    assert schema_at(scale["labelSelectorPath"])["type"] == "string"
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status.conditions"):
            assert schema_at(".status.conditions")["x-kubernetes-list-map-keys"] == ["type"]
        elif path != ".metadata.creationTimestamp":
            assert schema_at(path)["type"] == column["type"], column["name"]
    shown = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "Step", "Accuracy", "Staleness", "Restarts", "Age"} <= shown


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_are_valid_rljobs(path):
    doc = yaml.safe_load(path.read_text())
    committed = committed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert list(jsonschema.Draft4Validator(strict_json_schema(committed)).iter_errors(doc)) == []
    defaulted = apply_defaults(openapi_schema(), copy.deepcopy(doc))
    for rule in RULES:
        assert all(cel_holds(rule, node) for node in nodes_at(defaulted, rule.path)), rule.message
    validate(doc)


INVALID = [
    (
        "negative replicas",
        {"spec": {"roles": {"rollout": {"replicas": -1}}}},
        "spec.roles.rollout.replicas: -1 is less than the minimum of 1",
    ),
    (
        "min above max",
        {"spec": {"roles": {"rollout": {"replicas": 3, "minReplicas": 4, "maxReplicas": 2}}}},
        "roles.rollout: minReplicas must not exceed maxReplicas",
    ),
    ("negative eta", {"spec": {"staleness": {"eta": -1}}}, "spec.staleness.eta: -1 is less than the minimum of 0"),
    (
        "unknown algorithm",
        {"spec": {"algorithm": {"name": "not-an-algorithm"}}},
        "spec.algorithm.name: 'not-an-algorithm' is not one of",
    ),
    (
        "unknown field",
        {"spec": {"rollout": {"worker": 3}}},
        "spec.rollout: Additional properties are not allowed ('worker' was unexpected)",
    ),
    ("relative tokenizer", {"spec": {"tokenizer": "tok"}}, "spec.tokenizer: must be an absolute path"),
]


@pytest.mark.parametrize(("changes", "reason"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_rljobs_are_rejected_with_the_reason(changes, reason):
    with pytest.raises(InvalidSpec) as info:
        validate(with_changes(example(), changes))
    assert any(reason in problem for problem in info.value.problems), info.value.problems


# One schema-valid change per rule that breaks exactly that rule: (a unique part of the rule's message, changes).
VIOLATIONS = [
    ("DNS-1035 label", {"metadata": {"name": "9-lives"}}),
    ("model must be an absolute path", {"spec": {"model": "models/qwen"}}),
    ("dataset.train must be an absolute path", {"spec": {"dataset": {"train": "train.jsonl"}}}),
    ("targetBand: min must not exceed max", {"spec": {"staleness": {"targetBand": {"min": 1.5, "max": 1.0}}}}),
    ("targetBand.max must not exceed eta", {"spec": {"staleness": {"eta": 1, "targetBand": {"min": 0.5, "max": 1.5}}}}),
    (
        "roles.rollout: replicas must be at least minReplicas",
        {"spec": {"roles": {"rollout": {"replicas": 1, "minReplicas": 2}}}},
    ),
    ("roles.rollout: replicas must be at most maxReplicas", {"spec": {"roles": {"rollout": {"replicas": 5}}}}),
    ("roles.rollout: minReplicas must not exceed maxReplicas", {"spec": {"roles": {"rollout": {"minReplicas": 5}}}}),
    ("roles.reward: replicas must be at least minReplicas", {"spec": {"roles": {"reward": {"minReplicas": 2}}}}),
    (
        "roles.reward: replicas must be at most maxReplicas",
        {"spec": {"roles": {"reward": {"replicas": 3, "maxReplicas": 2}}}},
    ),
    (
        "roles.reward: minReplicas must not exceed maxReplicas",
        {"spec": {"roles": {"reward": {"replicas": 2, "minReplicas": 3, "maxReplicas": 2}}}},
    ),
    ("roles.trainer: ranks", {"spec": {"roles": {"trainer": {"replicas": 2}}}}),
    ("roles.trainer: replicas must be at least minReplicas", {"spec": {"roles": {"trainer": {"minReplicas": 2}}}}),
    (
        "roles.trainer: replicas must be at most maxReplicas",
        {"spec": {"roles": {"trainer": {"replicas": 2, "maxReplicas": 1, "parallelism": {"data": 2}}}}},
    ),
    (
        "roles.trainer: minReplicas must not exceed maxReplicas",
        {
            "spec": {
                "roles": {"trainer": {"replicas": 2, "minReplicas": 3, "maxReplicas": 2, "parallelism": {"data": 2}}}
            }
        },
    ),
    (
        "roles.trainer: a trainer the rebalancer resizes",
        {
            "spec": {
                "trainer": {"device": "cuda"},
                "roles": {"trainer": {"gpusPerPod": 4, "maxReplicas": 2, "parallelism": {"tensor": 2, "data": 2}}},
            }
        },
    ),
    ("rollout.engine sglang needs", {"spec": {"rollout": {"engine": "sglang"}}}),
    ("trainer.device cuda needs", {"spec": {"trainer": {"device": "cuda"}}}),
    (
        "exceed gpuBudget",
        {"spec": {"gpuBudget": 0, "trainer": {"device": "cuda"}, "roles": {"trainer": {"gpusPerPod": 1}}}},
    ),
    (
        "rebalance.enabled needs staleness.targetBand",
        {"spec": {"rebalance": {"enabled": True}, "staleness": {"targetBand": None}}},
    ),
    (
        "rebalance.enabled needs a ceiling",
        {"spec": {"rebalance": {"enabled": True}, "roles": {"rollout": {"maxReplicas": None}}}},
    ),
    (
        "redis: set exactly one",
        {"spec": {"redis": {"url": "redis://r:6379/0", "urlSecretRef": {"name": "r", "key": "url"}}}},
    ),
    ("queueName and rebalance.enabled", {"spec": {"queueName": "team-a", "rebalance": {"enabled": True}}}),
    ("checkpoint: set exactly one", {"spec": {"checkpoint": {"claimName": "ckpt"}}}),
    ("each mount needs exactly one source", {"spec": {"mounts": [{"name": "m", "mountPath": "/m"}]}}),
    (
        "reserved for the operator",
        {"spec": {"mounts": [{"name": "areal-data", "mountPath": "/d", "persistentVolumeClaim": {"claimName": "d"}}]}},
    ),
]


def rule_for(fragment: str) -> Rule:
    (rule,) = [r for r in RULES if fragment in r.message]
    return rule


def cel_holds(rule: Rule, node: object) -> bool:
    env = celpy.Environment()
    return bool(env.program(env.compile(rule.cel)).evaluate({"self": celpy.json_to_cel(node)}))


def test_every_cel_rule_in_the_crd_has_a_python_form_and_a_violating_case():
    placed = set()
    for where, node in walk(committed_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]):
        placed |= {(where, v["rule"]) for v in node.get("x-kubernetes-validations", [])}
    expected = {("".join("[]" if step == "*" else f".{step}" for step in rule.path), rule.cel) for rule in RULES}
    assert placed == expected
    assert {id(rule_for(fragment)) for fragment, _ in VIOLATIONS} == {id(rule) for rule in RULES}


@pytest.mark.parametrize(("fragment", "changes"), VIOLATIONS, ids=[v[0] for v in VIOLATIONS])
def test_cel_and_python_agree_on_each_rule(fragment, changes):
    rule = rule_for(fragment)
    broken = with_changes(example(), changes)
    assert schema_problems(broken) == [], "the case must pass the schema and break only the rule"
    defaulted = apply_defaults(openapi_schema(), copy.deepcopy(broken))
    nodes = nodes_at(defaulted, rule.path)
    assert nodes, f"{rule.where} is absent in the case"
    assert [cel_holds(rule, n) for n in nodes] == [rule.holds(n) for n in nodes]
    assert not all(rule.holds(n) for n in nodes), "the case breaks the rule"
    fine = apply_defaults(openapi_schema(), example())
    assert all(cel_holds(rule, n) and rule.holds(n) for n in nodes_at(fine, rule.path))
    with pytest.raises(InvalidSpec) as info:
        validate(broken)
    assert f"{rule.where}: {rule.message}" in info.value.problems


# Rules hold at their edges: equal bounds, a budget used exactly, the longest name.
EDGES = [
    ("band equal to eta", {"spec": {"staleness": {"eta": 1, "targetBand": {"min": 1.0, "max": 1.0}}}}),
    (
        "pinned replicas",
        {
            "spec": {
                "roles": {
                    "rollout": {"replicas": 2, "minReplicas": 2, "maxReplicas": 2},
                    "reward": {"replicas": 2, "minReplicas": 2, "maxReplicas": 2},
                }
            }
        },
    ),
    (
        "budget used up",
        {
            "spec": {
                "gpuBudget": 2,
                "trainer": {"device": "cuda"},
                "roles": {"trainer": {"gpusPerPod": 2, "parallelism": {"data": 2}}},
            }
        },
    ),
    ("longest name", {"metadata": {"name": "a" * names.MAX_NAME_LENGTH}}),
]


@pytest.mark.parametrize("changes", [e[1] for e in EDGES], ids=[e[0] for e in EDGES])
def test_rules_hold_at_their_edges_in_both_forms(changes):
    edge = with_changes(example(), changes)
    defaulted = apply_defaults(openapi_schema(), copy.deepcopy(edge))
    for rule in RULES:
        for node in nodes_at(defaulted, rule.path):
            assert cel_holds(rule, node) and rule.holds(node), rule.message
    validate(edge)
