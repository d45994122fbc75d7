"""A role's pod settings (spec.roles.<role>.env, affinity, volumes, ...) reach its pods, the pods stay valid
Kubernetes objects, and a setting that would replace the operator's own is refused naming the field."""

import kubernetes_validate
import pytest
import yaml
from support.operator_fixtures import rljob

from areal_k8s.cli.main import EXIT_INVALID, main
from areal_k8s.k8s_operator import lifecycle
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.handlers import reconcile
from areal_k8s.k8s_operator.validation import InvalidSpec, validate

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")  # kmock's
AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]
        }
    }
}
SETTINGS = {
    "env": [
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "site-env"}, "prefix": "SITE_"}],
    "affinity": AFFINITY,
    "priorityClassName": "research-low",
    "serviceAccountName": "rl-runner",
    "imagePullSecrets": [{"name": "registry"}],
    "labels": {"team": "reasoning"},
    "annotations": {"cost-center": "42"},
    "volumes": [{"name": "datasets", "nfs": {"server": "nfs.lab", "path": "/datasets", "readOnly": True}}],
    "volumeMounts": [{"name": "datasets", "mountPath": "/datasets", "readOnly": True}],
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}
ROLES = ("controller", "reward", "rollout", "trainer")


def with_settings(settings_by_role: dict, **spec) -> dict:
    body = rljob(**spec)
    for role, settings in settings_by_role.items():
        body["spec"].setdefault("roles", {}).setdefault(role, {}).update(settings)
    return body


def workloads(body: dict) -> dict[str, dict]:
    children = desired_children(validate(body), running=True)
    return {
        c["metadata"]["labels"]["app.kubernetes.io/component"]: c for c in children if "template" in c.get("spec", {})
    }


def test_every_roles_settings_reach_each_of_its_pods_containers_and_the_pods_stay_valid():
    body = with_settings(dict.fromkeys(ROLES, SETTINGS))
    found = workloads(body)
    assert set(found) == set(ROLES)
    for role, workload in found.items():
        kubernetes_validate.validate(workload, "1.30", strict=True)
        template = workload["spec"]["template"]
        pod = template["spec"]
        assert template["metadata"]["labels"]["team"] == "reasoning", role
        assert template["metadata"]["annotations"]["cost-center"] == "42", role
        assert pod["affinity"] == AFFINITY and pod["tolerations"] == SETTINGS["tolerations"], role
        assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("research-low", "rl-runner"), role
        assert pod["imagePullSecrets"] == [{"name": "registry"}], role
        assert pod["automountServiceAccountToken"] is False  # a service account for identity, still no API token
        assert SETTINGS["volumes"][0] in pod["volumes"], role
        for container in pod["containers"]:  # the rollout pods' engine too
            names = [e["name"] for e in container["env"]]
            assert names[-2:] == ["NCCL_DEBUG", "HF_TOKEN"], (role, container["name"])  # after the operator's
            assert container["envFrom"] == SETTINGS["envFrom"]
            assert container["volumeMounts"][-1] == SETTINGS["volumeMounts"][0]
    assert [c["name"] for c in found["rollout"]["spec"]["template"]["spec"]["containers"]] == ["rollout", "engine"]


def test_settings_of_one_role_stay_in_that_roles_pods():
    found = workloads(with_settings({"trainer": {"priorityClassName": "train-high", "env": SETTINGS["env"]}}))
    assert found["trainer"]["spec"]["template"]["spec"]["priorityClassName"] == "train-high"
    for role in ("controller", "reward", "rollout"):
        pod = found[role]["spec"]["template"]["spec"]
        assert "priorityClassName" not in pod
        assert all(e["name"] != "NCCL_DEBUG" for c in pod["containers"] for e in c["env"])


@pytest.mark.parametrize(
    ("role", "settings", "problem"),
    [
        (
            "trainer",
            {"env": [{"name": "A", "value": "1"}, {"name": "WORLD_SIZE", "value": "8"}]},
            "spec.roles.trainer.env[1].name: WORLD_SIZE is set by the operator in the trainer container(s)",
        ),
        (
            "rollout",
            {"env": [{"name": "HOME", "value": "/root"}]},
            "spec.roles.rollout.env[0].name: HOME is set by the operator in the rollout and engine container(s)",
        ),
        (
            "reward",
            {"labels": {"app.kubernetes.io/instance": "other"}},
            "spec.roles.reward.labels: app.kubernetes.io/instance is the operator's",
        ),
        (
            "controller",
            {"volumes": [{"name": "assets", "emptyDir": {}}]},
            "spec.roles.controller.volumes[0].name: assets is a volume of the operator's",
        ),
        (
            "trainer",
            {
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
            },
            "spec.roles.trainer.volumeMounts[0].mountPath: the operator mounts areal-tmp at /tmp",
        ),
        (
            "rollout",
            {"volumeMounts": [{"name": "assets", "mountPath": "/elsewhere"}]},
            "spec.roles.rollout.volumeMounts[0].name: assets is not a volume of spec.roles.rollout.volumes",
        ),
    ],
)
def test_a_setting_that_would_replace_the_operators_own_is_refused_naming_the_field(role, settings, problem):
    with pytest.raises(InvalidSpec) as refused:
        validate(with_settings({role: settings}))
    assert any(p.startswith(problem) for p in refused.value.problems), refused.value.problems


def test_the_schema_refuses_a_malformed_setting():
    with pytest.raises(InvalidSpec, match=r"spec.roles.trainer.env.0: 'name' is a required property"):
        validate(with_settings({"trainer": {"env": [{"value": "x"}]}}))


def test_a_refused_setting_is_the_rljobs_invalid_spec_condition_and_arealctls_one_line(
    operator_context, tmp_path, capsys
):
    body = with_settings({"trainer": {"env": [{"name": "WORLD_SIZE", "value": "8"}]}})
    degraded = lifecycle.condition_of(reconcile(operator_context, body), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert degraded["message"].startswith("spec.roles.trainer.env[0].name: WORLD_SIZE is set by the operator")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    assert main(["manifests", str(path)]) == EXIT_INVALID
    (line,) = capsys.readouterr().err.splitlines()
    assert "spec.roles.trainer.env[0].name: WORLD_SIZE is set by the operator" in line
