"""`arealctl manifests`: the operator's own children function, printed for review or GitOps."""

import base64

import yaml
from support.operator_fixtures import EXAMPLES, rljob

from areal_k8s.cli.main import EXIT_INVALID, main
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import validate


def test_prints_exactly_what_the_operator_would_create(capsys):
    for path in EXAMPLES:
        assert main(["manifests", str(path)]) == 0
        printed = list(yaml.safe_load_all(capsys.readouterr().out))
        assert printed == desired_children(validate(yaml.safe_load(path.read_text())), running=True), path.name
        assert all("ownerReferences" not in doc["metadata"] for doc in printed)


def test_namespace_override_and_a_suspended_job(tmp_path, capsys):
    job = rljob(uid=None, suspend=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["manifests", str(path), "--namespace", "team-b"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {doc["metadata"]["namespace"] for doc in printed} == {"team-b"}
    assert [doc["spec"]["replicas"] for doc in printed if doc["kind"] in ("Deployment", "StatefulSet")] == [0, 0, 0, 0]
    config = yaml.safe_load(next(d for d in printed if d["kind"] == "ConfigMap")["data"]["job.yaml"])
    assert config["name"] == validate({**job, "metadata": {**job["metadata"], "namespace": "team-b"}}).config.name


def test_an_invalid_rljob_is_one_readable_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(rljob(staleness={"eta": -1})))
    assert main(["manifests", str(path)]) == EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith("arealctl: error: ") and "spec.staleness.eta: -1 is less than the minimum of 0" in err
    path.write_text("kind: Deployment\n")
    assert main(["manifests", str(path)]) == EXIT_INVALID
    assert "expected an RLJob manifest" in capsys.readouterr().err


def test_an_agent_job_prints_its_claim_token_secret_before_the_pods_that_read_it(tmp_path, capsys):
    path = tmp_path / "agent.yaml"
    agents = {"command": ["python", "/agents/agent.py"], "replicas": 1}
    path.write_text(
        yaml.safe_dump(rljob(uid=None, rollout={"workflow": "agent", "prompt_template": "chat"}, agents=agents))
    )
    assert main(["manifests", str(path)]) == 0
    secret, *children = yaml.safe_load_all(capsys.readouterr().out)
    assert (secret["kind"], secret["metadata"]["name"]) == ("Secret", "demo-claim-token")
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    assert children == desired_children(validate(yaml.safe_load(path.read_text())), running=True)
