"""charts/areal, rendered by the real Helm engine (helm-python-sdk, Helm 4 in-process), linted strictly, every
manifest validated strictly against the Kubernetes schemas of two versions (kubernetes-validate), for the default
values and the value sets in charts/areal/ci/ (external Redis, monitoring on, multi-namespace, hardened, kind).

What an apiserver would add (CEL on the CRD, admission, RBAC enforcement, `helm test` itself) is not here: see
charts/areal/README.md ("Testing") and `make e2e-kind`.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil

import helm_python as helm
import jsonschema
import kubernetes_validate as kv
import pytest
import yaml
from support.chart import (
    CHART,
    DUMMY_KUBECONFIG,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    REQUIRED_VALUE_SETS,
    VALUE_SETS,
    chart,
    documents,
    is_hook,
    kube_validate,
    notes,
    of_kind,
    one,
    operator_deployment,
    pod_specs,
    render_files,
    rendered,
    selects,
)
from support.operator_fixtures import CRD_FILE, EXAMPLES, ROOT

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.__main__ import parse_args as operator_args
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.validation import validate


def test_the_required_value_sets_exist():
    assert VALUE_SETS.keys() >= REQUIRED_VALUE_SETS


# -- lint and schemas ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_strict_is_clean(value_set):
    result = helm.lint(
        str(CHART),
        copy.deepcopy(VALUE_SETS[value_set]),
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSIONS[0]}.0",
    )
    assert result["errors"] == []
    # severity 1 is INFO ("icon is recommended"); warnings and errors fail strict lint
    assert [m for m in result["messages"] if m["severity"] > 1] == []


def test_the_validation_is_strict():
    deployment = copy.deepcopy(operator_deployment(rendered("default")))
    deployment["spec"]["template"]["spec"]["containers"][0]["bogusField"] = 1
    with pytest.raises(kv.ValidationError):
        kube_validate(json.dumps(deployment), KUBE_VERSIONS[0])
    monitor = copy.deepcopy(of_kind(rendered("monitoring"), "PodMonitor")[0])
    monitor["spec"]["podMetricsEndpoints"][0]["prot"] = "metrics"
    with pytest.raises(jsonschema.ValidationError):
        kube_validate(json.dumps(monitor), KUBE_VERSIONS[0])


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_manifest_is_valid_kubernetes(value_set, kube_version):
    docs = rendered(value_set)
    assert docs
    for doc in docs:
        try:
            kube_validate(json.dumps(doc, sort_keys=True), kube_version)
        except (kv.ValidationError, jsonschema.ValidationError) as error:
            pytest.fail(f"{value_set}: {doc['kind']} {doc['metadata']['name']} at {list(error.path)}: {error.message}")
        except kv.SchemaNotFoundError:
            pytest.fail(f"{doc['kind']} ({doc['apiVersion']}) is neither built in nor in CUSTOM_SCHEMAS")
        assert doc["metadata"]["name"] and len(doc["metadata"]["name"]) <= 63
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace"), f"{doc['kind']} {doc['metadata']['name']}: no namespace"


def test_the_crd_of_the_chart_is_the_one_the_operator_expects():
    (crd,) = chart().crds
    assert crd["name"] == "crds/rljobs.yaml"
    assert crd["data"] == CRD_FILE.read_text()  # byte for byte: one generator writes both (tests/cluster/test_crd.py)
    document = yaml.safe_load(crd["data"])
    assert document["metadata"]["name"] == names.CRD_NAME
    for version in KUBE_VERSIONS:
        kv.validate(document, version, strict=True)
    # the `helm test` pod compares the served CRD with the chart's copy it carries
    (config_map,) = [d for d in of_kind(rendered("default"), "ConfigMap") if d["metadata"]["name"] == f"{RELEASE}-test"]
    assert config_map["data"]["rljobs.yaml"] == crd["data"].rstrip("\n")


# -- values.schema.json -------------------------------------------------------------------------------------


def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["definitions"][node["$ref"].split("/")[-1]]
    return node


def test_values_yaml_and_every_value_set_satisfy_the_schema():
    schema = values_schema()
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    for name, values in VALUE_SETS.items():
        chart().validate_schema(copy.deepcopy(values))  # Helm's own validator, over the merged values
        assert name


KUBERNETES_TYPES = ("core/v1 ", "networking/v1 ")


def test_the_schema_covers_every_value_and_closes_every_object():
    schema = values_schema()
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value, node: dict, where: str):
        node = resolve(schema, node)
        if node.get("description", "").startswith(KUBERNETES_TYPES):
            return  # passed through to a manifest, where kubernetes-validate checks every field strictly
        if isinstance(value, dict) and "properties" in node:
            assert node.get("additionalProperties") is False, f"{where or '(root)'}: unknown keys must be rejected"
            for key, sub in value.items():
                assert key in node["properties"], f"{where}.{key} is not in values.schema.json"
                walk(sub, node["properties"][key], f"{where}.{key}".lstrip("."))
        else:
            assert node, f"{where}: no schema"

    walk(defaults, schema, "")


REJECTED = [
    ("unknown key", {"operatr": {}}, "additional properties 'operatr' not allowed"),
    ("cluster-wide by a wildcard", {"operator": {"watchNamespaces": ["*"]}}, "at '/operator/watchNamespaces/0'"),
    (
        "no reconcile interval",
        {"operator": {"reconcileInterval": 0}},
        "at '/operator/reconcileInterval': exclusiveMinimum",
    ),
    (
        "root operator",
        {"operator": {"podSecurityContext": {"runAsNonRoot": False}}},
        "at '/operator/podSecurityContext/runAsNonRoot'",
    ),
    (
        "privileged operator",
        {"operator": {"securityContext": {"privileged": True}}},
        "at '/operator/securityContext/privileged'",
    ),
    (
        "privileged Redis",
        {"redis": {"securityContext": {"allowPrivilegeEscalation": True}}},
        "at '/redis/securityContext/allowPrivilegeEscalation'",
    ),
    ("fsync policy", {"redis": {"appendfsync": "sometimes"}}, "at '/redis/appendfsync'"),
    ("password not URL-safe", {"redis": {"auth": {"password": "p@ss word"}}}, "at '/redis/auth/password'"),
    (
        "external URL scheme",
        {"redis": {"enabled": False, "external": {"url": "http://redis:6379"}}},
        "at '/redis/external/url'",
    ),
    ("digest", {"operator": {"image": {"digest": "sha256:abc"}}}, "at '/operator/image/digest'"),
    ("bad quantity", {"redis": {"persistence": {"size": "lots"}}}, "at '/redis/persistence/size'"),
    ("memory size", {"redis": {"maxmemory": "1 GB"}}, "at '/redis/maxmemory'"),
    ("interval", {"monitoring": {"podMonitor": {"interval": "often"}}}, "at '/monitoring/podMonitor/interval'"),
    ("pull secret", {"imagePullSecrets": ["regcred"]}, "at '/imagePullSecrets/0'"),
]


@pytest.mark.parametrize(("values", "message"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED])
def test_values_that_break_the_schema_are_rejected_with_the_place(values, message):
    with pytest.raises(helm.HelmValuesError) as info:
        chart().validate_schema(values)
    assert message in str(info.value)
    with pytest.raises(helm.HelmError) as info:  # render (so install, upgrade, template) enforces it too
        render_files(values)
    assert message in str(info.value)


CROSS_FIELD = [
    (
        "no Redis at all",
        {"redis": {"enabled": False}},
        "redis.enabled is false: set redis.external.url or redis.external.existingSecret",
    ),
    (
        "two external Redis sources",
        {"redis": {"enabled": False, "external": {"url": "redis://r:6379/0", "existingSecret": "s"}}},
        "redis.external: set only one of url and existingSecret",
    ),
    (
        "two passwords",
        {"redis": {"auth": {"password": "abc", "existingSecret": "s"}}},
        "redis.auth: set only one of password and existingSecret",
    ),
]


@pytest.mark.parametrize(("values", "message"), [c[1:] for c in CROSS_FIELD], ids=[c[0] for c in CROSS_FIELD])
def test_cross_field_mistakes_fail_the_render_with_a_reason(values, message):
    with pytest.raises(helm.HelmRenderError) as info:
        render_files(values)
    assert message in str(info.value)


# -- the operator --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_operator_runs_one_replica_with_flags_it_accepts(value_set):
    values, docs = VALUE_SETS[value_set], rendered(value_set)
    deployment = operator_deployment(docs)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "areal_k8s.k8s_operator"]
    args = operator_args(container["args"])
    assert args.namespace == values.get("operator", {}).get("watchNamespaces", [])
    assert args.interval == values.get("operator", {}).get("reconcileInterval", 10)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.liveness == f"http://0.0.0.0:{ports['health']}/healthz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == f"{RELEASE}-operator"


def test_job_images_follow_the_values_through_the_operators_environment():
    env = {
        e["name"]: e["value"]
        for e in operator_deployment(rendered("hardened"))["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env[names.IMAGE_REPOSITORY_ENV] == "registry.example.com/areal-k8s"
    assert env[names.IMAGE_TAG_ENV] == "0.1.0"
    default_env = operator_deployment(rendered("default"))["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not {names.IMAGE_REPOSITORY_ENV, names.IMAGE_TAG_ENV} & {e["name"] for e in default_env}


def test_the_reward_runtime_class_follows_the_values_through_the_operators_environment(monkeypatch):
    env = {
        e["name"]: e["value"]
        for e in operator_deployment(rendered("hardened"))["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env[names.REWARD_RUNTIME_CLASS_ENV] == "gvisor"
    default_env = operator_deployment(rendered("default"))["spec"]["template"]["spec"]["containers"][0]["env"]
    assert names.REWARD_RUNTIME_CLASS_ENV not in {e["name"] for e in default_env}
    # what the operator does with it: the reward pods only, and an RLJob's own choice wins
    monkeypatch.setenv(names.REWARD_RUNTIME_CLASS_ENV, env[names.REWARD_RUNTIME_CLASS_ENV])
    example = yaml.safe_load(EXAMPLES[0].read_text())
    classes = {
        c["metadata"]["name"].rsplit("-", 1)[1]: c["spec"]["template"]["spec"].get("runtimeClassName")
        for c in desired_children(validate(example), running=True)
        if c["kind"] in ("Deployment", "StatefulSet")
    }
    assert classes == {"controller": None, "reward": "gvisor", "rollout": None, "trainer": None}
    example["spec"].setdefault("roles", {}).setdefault("reward", {})["runtimeClassName"] = "kata"
    reward = next(
        c
        for c in desired_children(validate(example), running=True)
        if c["metadata"]["name"].endswith("-reward") and c["kind"] == "Deployment"
    )
    assert reward["spec"]["template"]["spec"]["runtimeClassName"] == "kata"


def test_hardened_values_pin_the_image_by_digest_and_pull_with_the_secret():
    docs, values = rendered("hardened"), VALUE_SETS["hardened"]
    image = values["operator"]["image"]
    assert (
        operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["image"]
        == f"{image['repository']}@{image['digest']}"
    )
    for name, pod in pod_specs(docs):
        assert pod["imagePullSecrets"] == values["imagePullSecrets"], name
    (test_pod,) = [d for d in of_kind(docs, "Pod") if is_hook(d)]
    assert (
        test_pod["spec"]["containers"][0]["image"]
        == f"{values['tests']['image']['repository']}:{values['tests']['image']['tag']}"
    )
    assert operator_deployment(docs)["spec"]["template"]["spec"]["priorityClassName"] == "system-cluster-critical"


# -- Redis ---------------------------------------------------------------------------------------------------


def secrets(docs: list[dict]) -> dict[tuple[str, str], dict[str, str]]:
    return {
        (s["metadata"]["namespace"], s["metadata"]["name"]): {
            k: base64.b64decode(v).decode() for k, v in s["data"].items()
        }
        for s in of_kind(docs, "Secret")
    }


def test_in_chart_redis_is_a_persistent_valkey_with_aof_a_generated_password_and_limits():
    docs = rendered("multi-namespace")
    statefulset = one(docs, "StatefulSet", f"{RELEASE}-redis")
    pod = statefulset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"].startswith("docker.io/valkey/valkey:") and not container["image"].endswith(":latest")
    assert container["resources"]["limits"]["memory"] and container["resources"]["requests"]["cpu"]
    claim = statefulset["spec"]["volumeClaimTemplates"][0]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    config = one(docs, "ConfigMap", f"{RELEASE}-redis")["data"]["valkey.conf"]
    assert re.search(r"^appendonly yes$", config, re.M) and re.search(r"^maxmemory-policy noeviction$", config, re.M)
    assert re.search(r"^dir /data$", config, re.M)
    found = secrets(docs)
    password = found[(NAMESPACE, f"{RELEASE}-redis")]["password"]
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    url = f"redis://:{password}@{RELEASE}-redis.{NAMESPACE}.svc:6379/0"
    assert found[("team-a", f"{RELEASE}-redis")] == found[("team-b", f"{RELEASE}-redis")] == {"url": url}
    env = {e["name"]: e for e in container["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-redis", "key": "password"}
    assert "$(REDIS_PASSWORD)" in container["args"]
    service = one(docs, "Service", f"{RELEASE}-redis")
    assert service["spec"]["selector"] == statefulset["spec"]["selector"]["matchLabels"]


def test_a_given_password_and_a_password_secret():
    given = secrets(documents(render_files({"redis": {"auth": {"password": "s3cret-Pass"}}})))
    assert (
        given[(NAMESPACE, f"{RELEASE}-redis")]["url"] == f"redis://:s3cret-Pass@{RELEASE}-redis.{NAMESPACE}.svc:6379/0"
    )
    docs = rendered("hardened")
    assert secrets(docs) == {}  # the password is the user's: the chart writes no Secret, the notes say what to create
    (container,) = one(docs, "StatefulSet", f"{RELEASE}-redis")["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e for e in container["env"]}["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"][
        "name"
    ] == "my-redis-password"
    assert "redis://:PASSWORD@" in notes("hardened")
    volumes = {
        v["name"]: v for v in one(docs, "StatefulSet", f"{RELEASE}-redis")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["data"] == {"name": "data", "emptyDir": {}}


def test_external_redis_replaces_the_in_chart_one():
    docs = rendered("external-redis")
    assert not of_kind(docs, "StatefulSet")
    assert not [d for d in of_kind(docs, "Service") if d["metadata"]["name"].endswith("-redis")]
    url = VALUE_SETS["external-redis"]["redis"]["external"]["url"]
    assert secrets(docs) == {
        ("areal", f"{RELEASE}-redis"): {"url": url},
        ("research", f"{RELEASE}-redis"): {"url": url},
    }
    own = documents(
        render_files(
            {"redis": {"enabled": False, "external": {"existingSecret": "team-redis", "existingSecretKey": "uri"}}}
        )
    )
    assert secrets(own) == {}
    text = render_files(
        {"redis": {"enabled": False, "external": {"existingSecret": "team-redis", "existingSecretKey": "uri"}}}
    )
    assert "urlSecretRef: {name: team-redis, key: uri}" in text[f"{CHART.name}/templates/NOTES.txt"]


@pytest.mark.parametrize("example", [p.name for p in EXAMPLES])
def test_the_examples_use_the_redis_secret_the_chart_writes(example):
    spec = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    assert spec["redis"] == {"urlSecretRef": {"name": f"{RELEASE}-redis", "key": "url"}}
    assert f"urlSecretRef: {{name: {RELEASE}-redis, key: url}}" in notes("default")


# -- monitoring ----------------------------------------------------------------------------------------------


def test_the_pod_monitor_scrapes_the_metrics_port_of_the_job_pods():
    docs = rendered("monitoring")
    (monitor,) = of_kind(docs, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}  # cluster-wide operator, no jobs.namespaces
    made = desired_children(validate(yaml.safe_load(EXAMPLES[0].read_text())), running=True)
    scraped = set()
    for name, pod in pod_specs(made):
        template = next(
            d for d in made if d["metadata"]["name"] == name and d["kind"] in ("Deployment", "StatefulSet")
        )["spec"]["template"]
        assert selects(monitor["spec"]["selector"], template["metadata"]["labels"]), name
        scraped |= {
            c["name"]
            for c in pod["containers"]
            if any(p["name"] == monitor["spec"]["podMetricsEndpoints"][0]["port"] for p in c["ports"])
        }
    assert scraped == {"controller", "reward", "rollout", "trainer"}
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"
    namespaced = documents(
        render_files({"monitoring": {"podMonitor": {"enabled": True}}, "jobs": {"namespaces": ["a", "b"]}})
    )
    assert of_kind(namespaced, "PodMonitor")[0]["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    assert of_kind(rendered("default"), "PodMonitor") == []


def dashboard_config_maps(docs: list[dict]) -> list[dict]:
    return [d for d in of_kind(docs, "ConfigMap") if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]


def test_one_dashboard_config_map_per_json_file_of_the_chart():
    files = sorted((CHART / "dashboards").glob("*.json"))
    maps = dashboard_config_maps(rendered("monitoring"))
    assert len(maps) == len(files)
    assert sorted(key for m in maps for key in m["data"]) == [f.name for f in files]
    for config_map in maps:
        ((key, text),) = config_map["data"].items()
        assert json.loads(text) == json.loads((CHART / "dashboards" / key).read_text())
        assert config_map["metadata"]["namespace"] == "monitoring"
        assert config_map["metadata"]["labels"]["team"] == "ml-platform"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "AReaL"}
    assert dashboard_config_maps(rendered("default")) == []


def test_dashboards_are_read_from_the_folder_whatever_it_holds(tmp_path):
    copy_of_chart = tmp_path / "areal"
    shutil.copytree(CHART, copy_of_chart, ignore=shutil.ignore_patterns("*.json"))
    boards = {"Job_Overview.json": {"title": "overview", "panels": []}, "staleness.json": {"title": "staleness"}}
    for name, board in boards.items():
        (copy_of_chart / "dashboards" / name).write_text(json.dumps(board))
    (copy_of_chart / "dashboards" / "notes.txt").write_text("not a dashboard")
    values = {
        "monitoring": {
            "dashboards": {"enabled": True, "folder": "", "annotations": {"k8s-sidecar-target-directory": "/x"}}
        }
    }
    maps = dashboard_config_maps(documents(render_files(values, chart_obj=helm.Chart.load(str(copy_of_chart)))))
    assert {m["metadata"]["name"]: json.loads(next(iter(m["data"].values()))) for m in maps} == {
        f"{RELEASE}-dashboard-job-overview": boards["Job_Overview.json"],
        f"{RELEASE}-dashboard-staleness": boards["staleness.json"],
    }
    assert all(m["metadata"]["annotations"] == {"k8s-sidecar-target-directory": "/x"} for m in maps)
    (copy_of_chart / "dashboards" / "Job_Overview.json").unlink()
    (copy_of_chart / "dashboards" / "staleness.json").unlink()
    assert dashboard_config_maps(documents(render_files(values, chart_obj=helm.Chart.load(str(copy_of_chart))))) == []


# -- install, notes, helm test ---------------------------------------------------------------------------------


def test_a_client_side_install_of_the_chart():
    config = helm.Config(storage_driver="memory", namespace=NAMESPACE, kubeconfig_content=DUMMY_KUBECONFIG)
    release = config.install(chart(), RELEASE, {}, namespace=NAMESPACE, dry_run="client")
    assert release["chart_name"] == "areal" and release["app_version"] == chart_yaml()["appVersion"]
    installed = [d for d in yaml.safe_load_all(release["manifest"]) if d]
    assert {d["kind"] for d in installed} >= {"Deployment", "StatefulSet", "ClusterRole", "NetworkPolicy", "Secret"}
    assert not any(is_hook(d) for d in installed)  # hooks are not part of the release manifest
    assert "kubectl get rljobs" in release["notes"]


def chart_yaml() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def test_chart_metadata():
    meta = chart_yaml()
    assert meta["apiVersion"] == "v2" and meta["type"] == "application"
    assert meta["kubeVersion"] == f">={KUBE_VERSIONS[0]}.0-0"
    assert helm.dependency_list(str(CHART)) in ([], None) or all(
        d["status"] in ("ok", "unpacked") for d in helm.dependency_list(str(CHART))
    )


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_notes_tell_how_to_submit_watch_and_open_the_dashboards(value_set):
    text = notes(value_set)
    assert "kubectl apply" in text and "examples/rljob-demo-cpu.yaml" in text
    assert "kubectl get rljobs" in text
    assert "helm test" in text
    assert "kubectl apply --server-side --force-conflicts -f charts/areal/crds/" in text
    assert "urlSecretRef" in text
    if VALUE_SETS[value_set].get("monitoring", {}).get("dashboards", {}).get("enabled"):
        assert "grafana_dashboard" in text and "port-forward" in text
    else:
        assert "monitoring.dashboards.enabled=true" in text
    for namespace in VALUE_SETS[value_set].get("operator", {}).get("watchNamespaces", []):
        assert namespace in text


def test_helm_test_checks_the_crd_and_the_operator():
    docs = rendered("default")
    hooks = [d for d in docs if is_hook(d)]
    assert {d["metadata"]["annotations"]["helm.sh/hook"] for d in hooks} == {"test"}
    (pod,) = of_kind(hooks, "Pod")
    (container,) = pod["spec"]["containers"]
    assert container["image"] == operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["image"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["OPERATOR_HEALTH_URL"] == f"http://{RELEASE}-operator.{NAMESPACE}.svc:8080/healthz"
    service = one(docs, "Service", f"{RELEASE}-operator")
    assert service["spec"]["ports"][0]["port"] == 8080
    script = one(docs, "ConfigMap", f"{RELEASE}-test")["data"]["helm-test.py"]
    compile(script, "helm-test.py", "exec")
    assert script.rstrip() == (CHART / "files" / "helm-test.py").read_text().rstrip()
    (cluster_role,) = list(of_kind(hooks, "ClusterRole"))
    assert cluster_role["rules"] == [
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "resourceNames": [names.CRD_NAME],
            "verbs": ["get"],
        }
    ]
