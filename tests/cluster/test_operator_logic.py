"""The operator's pure parts: desired children from a spec, phase and status from observations, the patch math,
and create-or-patch against kmock (real HTTP) without kopf."""

import asyncio
import copy
import re
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

import pytest
import yaml
from support.operator_fixtures import EXAMPLES, NAMESPACE, Cluster, rljob, with_changes

from areal_k8s.api.v1 import controller_pb2
from areal_k8s.common.config import parse_job
from areal_k8s.cpu_engine.__main__ import parse_args as engine_args
from areal_k8s.k8s_operator import kueue, lifecycle, names
from areal_k8s.k8s_operator.apply import apply, is_subset, merge_patch
from areal_k8s.k8s_operator.children import desired_children, to_yaml
from areal_k8s.k8s_operator.kube import KubeApi
from areal_k8s.k8s_operator.pod_templates import config_hash
from areal_k8s.k8s_operator.validation import InvalidSpec, validate
from areal_k8s.reward.__main__ import parse_args as reward_args

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def children(body: dict, running: bool = True) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in desired_children(validate(body), running=running)}


def container(workload: dict, name: str) -> dict:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


# -- desired children --------------------------------------------------------------------------------------


def test_owner_references_only_for_an_rljob_that_exists():
    with_uid, without = children(rljob(uid="u-9")), children(rljob(uid=None))
    assert all(c["metadata"]["ownerReferences"][0]["uid"] == "u-9" for c in with_uid.values())
    assert all("ownerReferences" not in c["metadata"] for c in without.values())


def test_stopped_jobs_keep_every_child_but_run_no_pods():
    running, stopped = children(rljob(), running=True), children(rljob(), running=False)
    assert running.keys() == stopped.keys()
    for key, child in running.items():
        if child["kind"] in ("Deployment", "StatefulSet"):
            assert stopped[key]["spec"]["replicas"] == 0
            child = copy.deepcopy(child)
            child["spec"]["replicas"] = 0
        assert stopped[key] == child


def test_the_config_map_holds_the_job_the_services_read():
    body = rljob()
    config = children(body)[("ConfigMap", "demo-config")]["data"][names.CONFIG_KEY]
    assert parse_job(yaml.safe_load(config)) == validate(body).config


def test_pods_roll_for_training_settings_but_not_for_the_rollout_pool_size():
    base = validate(rljob())
    resized = validate(with_changes(rljob(), {"spec": {"roles": {"rollout": {"replicas": 3}}}}))
    retuned = validate(with_changes(rljob(), {"spec": {"algorithm": {"lr": 1e-4}}}))
    assert config_hash(resized) == config_hash(base) != config_hash(retuned)


def test_the_service_arguments_are_ones_the_services_accept(monkeypatch):
    made = children(rljob())
    engine = container(made[("Deployment", "demo-rollout")], "engine")
    assert engine["command"] == ["python", "-m", "areal_k8s.cpu_engine"]
    parsed = engine_args(engine["args"])
    assert (parsed.model_path, parsed.port, parsed.host) == ("/assets/model", names.ENGINE_PORT, "127.0.0.1")
    reward = container(made[("Deployment", "demo-reward")], "reward")
    monkeypatch.setattr("sys.argv", ["reward", *reward["args"]])
    assert (reward_args().workers, reward_args().port) == (1, names.REWARD_PORT)
    assert reward_args().job_name == validate(rljob()).config.name  # the `rljob` label of its metrics


def test_the_reward_service_gets_the_jobs_custom_verifiers_and_code_settings(monkeypatch):
    body = rljob(
        reward={
            "verifier": "team.checks:score",
            "allowed_verifiers": ["team.checks:other"],
            "code": {"scoring": "all", "wall_seconds": 2},
        }
    )
    reward = container(children(body)[("Deployment", "demo-reward")], "reward")
    monkeypatch.setattr("sys.argv", ["reward", *reward["args"]])
    parsed = reward_args()
    assert parsed.allow_verifier == ["team.checks:other", "team.checks:score"]
    assert (parsed.code_config.scoring, parsed.code_config.wall_seconds) == ("all", 2)


def test_reward_pods_take_a_runtime_class_and_the_profiles_their_sandbox_needs():
    sandboxed = {
        "runtimeClassName": "gvisor",
        "seccompProfile": {"type": "Unconfined"},
        "appArmorProfile": {"type": "Localhost", "localhostProfile": "areal-bwrap"},
    }
    pods = pod_specs(children(rljob(roles={"reward": sandboxed})))
    reward = pods["demo-reward"]
    assert reward["runtimeClassName"] == "gvisor"
    assert reward["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert reward["securityContext"]["appArmorProfile"] == {"type": "Localhost", "localhostProfile": "areal-bwrap"}
    for name, pod in pods.items():  # nothing changes for the other roles
        if name != "demo-reward":
            assert "runtimeClassName" not in pod and pod["securityContext"]["seccompProfile"] == {
                "type": "RuntimeDefault"
            }, name
    default = pod_specs(children(rljob()))["demo-reward"]
    assert "runtimeClassName" not in default and default["securityContext"]["seccompProfile"] == {
        "type": "RuntimeDefault"
    }


def test_rollout_pods_take_the_profiles_the_tool_agents_sandbox_needs():
    pods = pod_specs(children(rljob(roles={"rollout": {"seccompProfile": {"type": "Unconfined"}}})))
    rollout = [pod for name, pod in pods.items() if "rollout" in name]
    assert rollout and all(pod["securityContext"]["seccompProfile"] == {"type": "Unconfined"} for pod in rollout)
    assert pods["demo-reward"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("example", [p.name for p in EXAMPLES])
def test_engine_probes_run_beside_the_engine_which_listens_on_loopback_only(example):
    # The engine's API (weight updates, pausing generation) is for the agent in its pod: it listens on 127.0.0.1,
    # where an httpGet probe (which the kubelet sends to the pod IP) cannot reach it. SGLang's /health runs a
    # generation and gives up after 20 s itself; loading a large model takes minutes.
    made = children(yaml.safe_load(next(p for p in EXAMPLES if p.name == example).read_text()))
    engine = next(
        container(c, "engine")
        for (kind, _), c in made.items()
        if kind == "Deployment" and c["metadata"]["name"].endswith("-rollout")
    )
    host = engine["args"][engine["args"].index("--host") + 1]
    for kind in ("startupProbe", "readinessProbe"):
        probe = engine[kind]
        command = probe["exec"]["command"]
        assert command[:2] == ["python", "-c"] and "httpGet" not in probe, kind
        url = urlsplit(command[3])
        assert (url.hostname, url.port, url.path) == (host, names.ENGINE_PORT, "/health") and host == "127.0.0.1", kind
        assert probe["timeoutSeconds"] > float(command[4]) > 20, kind
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60


def test_the_controller_checks_the_verifiers_with_the_reward_service():
    controller = container(children(rljob())[("Deployment", "demo-controller")], "controller")
    args = dict(zip(controller["args"][::2], controller["args"][1::2]))
    assert args["--reward"] == "demo-reward:50053"


def test_the_staleness_target_band_reaches_the_job_file_the_controller_exports_it_from():
    body = with_changes(rljob(), {"spec": {"staleness": {"eta": 2, "targetBand": {"min": 0.5, "max": 1.5}}}})
    band = validate(body).config.algorithm.staleness_target
    assert (band.min, band.max) == (0.5, 1.5)
    assert validate(rljob()).config.algorithm.staleness_target is None


def test_rollout_agents_find_their_engine_controller_and_reward():
    agent = container(children(rljob())[("Deployment", "demo-rollout")], "rollout")
    args = dict(zip(agent["args"][::2], agent["args"][1::2]))
    assert args["--engine-url"] == f"http://127.0.0.1:{names.ENGINE_PORT}"
    assert args["--controller"] == "demo-controller:50051" and args["--reward"] == "demo-reward:50053"
    assert args["--job"] == names.JOB_FILE


def test_redis_url_from_a_secret_never_lands_in_the_config_map():
    body = rljob(redis={"urlSecretRef": {"name": "redis-auth", "key": "url"}})
    made = children(body)
    trainer = container(made[("StatefulSet", "demo-trainer")], "trainer")
    assert env_of(trainer)["AREAL_REDIS_URL"] == {"secretKeyRef": {"name": "redis-auth", "key": "url"}}
    assert "redis-auth" not in made[("ConfigMap", "demo-config")]["data"][names.CONFIG_KEY]
    assert validate(body).config.redis.url is None


def test_checkpoints_on_an_existing_claim_or_a_claim_per_trainer_pod():
    claimed = children(rljob(checkpoint={"claimName": "ckpt", "mountPath": "/ckpt"}))[("StatefulSet", "demo-trainer")]
    volumes = {v["name"]: v for v in claimed["spec"]["template"]["spec"]["volumes"]}
    assert volumes[names.CHECKPOINT_VOLUME]["persistentVolumeClaim"]["claimName"] == "ckpt"
    assert "volumeClaimTemplates" not in claimed["spec"]
    templated = children(rljob(checkpoint={"volumeClaimTemplate": {"size": "5Gi", "storageClassName": "ssd"}}))
    spec = templated[("StatefulSet", "demo-trainer")]["spec"]
    assert spec["volumeClaimTemplates"][0]["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "ssd",
        "resources": {"requests": {"storage": "5Gi"}},
    }
    # the checkpoints and the final model outlive the job unless it says otherwise
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    deleted = children(rljob(checkpoint={"volumeClaimTemplate": {"size": "5Gi"}, "retention": "Delete"}))
    retention = deleted[("StatefulSet", "demo-trainer")]["spec"]["persistentVolumeClaimRetentionPolicy"]
    assert retention == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    assert validate(rljob(checkpoint={"claimName": "ckpt", "mountPath": "/ckpt"})).config.run_dir.startswith(
        "/ckpt/demo-"
    )


def test_gpu_jobs_get_gpus_sglang_and_torch_rendezvous():
    gsm8k = next(p for p in EXAMPLES if p.name == "rljob-gsm8k.yaml")
    body = yaml.safe_load(gsm8k.read_text())
    roles = body["spec"]["roles"]
    made = children(body)
    engine = container(made[("Deployment", "gsm8k-qwen-rollout")], "engine")
    assert engine["command"][-1] == "sglang.launch_server"
    assert engine["args"][engine["args"].index("--tp-size") + 1] == str(roles["rollout"]["gpusPerPod"])
    assert engine["resources"]["limits"][names.GPU_RESOURCE] == roles["rollout"]["gpusPerPod"]
    trainer = made[("StatefulSet", "gsm8k-qwen-trainer")]
    env = env_of(container(trainer, "trainer"))
    assert env["MASTER_ADDR"] == "gsm8k-qwen-trainer-0.gsm8k-qwen-trainer"
    ranks = roles["trainer"]["replicas"] * roles["trainer"]["gpusPerPod"]
    assert ranks == 16 and body["spec"]["gpuBudget"] == 64  # the example's 64-GPU split: 48 engines + 16 ranks
    assert (env["WORLD_SIZE"], env["NPROC_PER_NODE"], env["AREAL_TENSOR_PARALLEL_SIZE"]) == (
        str(ranks),
        str(roles["trainer"]["gpusPerPod"]),
        str(roles["trainer"]["parallelism"]["tensor"]),
    )
    assert validate(body).config.trainer.replicas == ranks  # the job file the ranks read names the same world
    assert env["NODE_RANK"] == {"fieldRef": {"fieldPath": f"metadata.labels['{names.POD_INDEX_LABEL}']"}}
    # eight ranks per pod: torchrun starts one process per GPU from the variables above (Kubernetes expands them)
    assert container(trainer, "trainer")["command"] == [
        "torchrun",
        "--nnodes=$(NNODES)",
        "--nproc-per-node=$(NPROC_PER_NODE)",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "areal_k8s.trainer",
    ]
    demo = children(yaml.safe_load(next(p for p in EXAMPLES if p.name == "rljob-demo-cpu.yaml").read_text()))
    demo_trainer = next(w for (kind, name), w in demo.items() if kind == "StatefulSet" and name.endswith("-trainer"))
    assert container(demo_trainer, "trainer")["command"] == ["python", "-m", "areal_k8s.trainer"]  # a rank per pod
    pod = trainer["spec"]["template"]["spec"]
    assert pod["tolerations"][0]["key"] == names.GPU_RESOURCE
    assert {v["name"]: v["image"]["reference"] for v in pod["volumes"] if "image" in v}["model"].endswith(
        "qwen2.5-1.5b-instruct:1"
    )


def pod_specs(made: dict) -> dict[str, dict]:
    return {
        name: c["spec"]["template"]["spec"] for (kind, name), c in made.items() if kind in ("Deployment", "StatefulSet")
    }


SERVICE_CONTAINERS = {"controller", "reward", "rollout", "trainer"}  # the engine is SGLang's (or ours) and has none


@pytest.mark.parametrize("example", [p.name for p in EXAMPLES])
def test_every_service_container_serves_metrics_on_the_named_port(example):
    made = children(yaml.safe_load(next(p for p in EXAMPLES if p.name == example).read_text()))
    seen = set()
    for pod in pod_specs(made).values():
        for c in pod["containers"]:
            ports = {port["name"]: port["containerPort"] for port in c["ports"]}
            if c["name"] in SERVICE_CONTAINERS:
                seen.add(c["name"])
                assert ports[names.METRICS_PORT_NAME] == names.METRICS_PORT == 9400, c["name"]
                assert env_of(c)[names.METRICS_PORT_ENV] == str(names.METRICS_PORT), c["name"]
            else:
                assert names.METRICS_PORT_NAME not in ports and names.METRICS_PORT_ENV not in env_of(c), c["name"]
            assert len(set(ports.values())) == len(ports), f"{c['name']}: two ports share a number"
    assert seen == SERVICE_CONTAINERS
    # the pods carry the labels the chart's PodMonitor and NetworkPolicies select job pods by
    for name, pod_template in (
        (n, c["spec"]["template"]) for (k, n), c in made.items() if k in ("Deployment", "StatefulSet")
    ):
        assert {names.LABEL_NAME: names.APP_NAME, names.LABEL_MANAGED_BY: names.MANAGER}.items() <= pod_template[
            "metadata"
        ]["labels"].items(), name


@pytest.mark.parametrize("example", [p.name for p in EXAMPLES])
def test_every_job_pod_runs_unprivileged_on_a_read_only_root_filesystem(example):
    made = children(yaml.safe_load(next(p for p in EXAMPLES if p.name == example).read_text()))
    for name, pod in pod_specs(made).items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == names.RUN_AS_USER != 0, name
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert context["fsGroup"] == names.RUN_AS_GROUP, name  # the checkpoint claim is writable by that user
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes[names.TMP_VOLUME] == {"name": names.TMP_VOLUME, "emptyDir": {}}
        for c in pod["containers"]:
            assert c["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, (name, c["name"])
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts[names.TMP_DIR] == names.TMP_VOLUME, (name, c["name"])
            assert env_of(c)["HOME"].startswith(names.TMP_DIR + "/"), "caches must land on the writable volume"
            gpus = c.get("resources", {}).get("limits", {}).get(names.GPU_RESOURCE, 0)
            assert (mounts.get("/dev/shm") == names.SHM_VOLUME) == (gpus > 0), (name, c["name"])
        if any(m["mountPath"] == "/dev/shm" for c in pod["containers"] for m in c["volumeMounts"]):
            assert volumes[names.SHM_VOLUME]["emptyDir"] == {"medium": "Memory"}
    printed = to_yaml(
        desired_children(
            validate(yaml.safe_load(next(p for p in EXAMPLES if p.name == example).read_text())), running=True
        )
    )
    assert "&id" not in printed and "*id" not in printed, "shared mounts must not print as YAML aliases"


def test_default_images_follow_the_operator_version_unless_the_chart_overrides_them(monkeypatch):
    monkeypatch.delenv(names.IMAGE_REPOSITORY_ENV, raising=False)
    monkeypatch.delenv(names.IMAGE_TAG_ENV, raising=False)
    assert names.default_image("trainer") == f"{names.IMAGE_REPOSITORY}/trainer:{names.operator_version()}"
    monkeypatch.setenv(names.IMAGE_REPOSITORY_ENV, "registry.example.com/mirror/")
    monkeypatch.setenv(names.IMAGE_TAG_ENV, "0.1.0-rc1")
    assert names.default_image("trainer") == "registry.example.com/mirror/trainer:0.1.0-rc1"
    made = children(rljob())
    assert (
        container(made[("StatefulSet", "demo-trainer")], "trainer")["image"]
        == "registry.example.com/mirror/trainer:0.1.0-rc1"
    )
    assert (
        container(made[("Deployment", "demo-rollout")], "engine")["image"]
        == "registry.example.com/mirror/rollout:0.1.0-rc1"
    )


def test_equal_names_in_other_namespaces_get_other_redis_keys():
    here, there = rljob(), with_changes(rljob(), {"metadata": {"namespace": "elsewhere"}})
    assert validate(here).config.name != validate(there).config.name
    assert validate(here).config.name.startswith("demo-")


# -- phase and status --------------------------------------------------------------------------------------


def spec_of(**changes) -> dict:
    return validate(with_changes(rljob(), {"spec": changes})).spec


def report(phase=controller_pb2.JobStatus.RUNNING, **fields) -> controller_pb2.JobStatus:
    return controller_pb2.JobStatus(phase=phase, **fields)


def test_phase_decisions():
    decide = lifecycle.decide_phase
    running = decide(spec_of(), {}, lifecycle.Observed(controller=report()), NOW)
    assert running.name == lifecycle.RUNNING
    done = decide(
        spec_of(),
        {},
        lifecycle.Observed(controller=report(controller_pb2.JobStatus.COMPLETED, version=3, total_steps=3)),
        NOW,
    )
    assert (done.name, done.reason, done.message) == ("Complete", "TrainingFinished", "trained 3 of 3 steps")
    crashed = decide(spec_of(failurePolicy={"maxRestarts": 1}), {}, lifecycle.Observed(restarts={"rollout": 2}), NOW)
    assert (crashed.name, crashed.reason) == ("Failed", "RestartLimitExceeded")
    assert decide(spec_of(suspend=True), {}, lifecycle.Observed(), NOW).name == "Suspended"
    started = {"startTime": lifecycle.rfc3339(NOW - timedelta(seconds=61))}
    late = decide(spec_of(activeDeadlineSeconds=60), started, lifecycle.Observed(), NOW)
    assert (late.name, late.reason) == ("Failed", "DeadlineExceeded")
    assert (
        decide(spec_of(activeDeadlineSeconds=60, suspend=True), started, lifecycle.Observed(), NOW).name == "Suspended"
    )


def test_kueue_holds_the_job_until_admitted_and_its_eviction_suspends_it():
    decide, queued = lifecycle.decide_phase, kueue.Admission(kueue.PENDING, "queued in team-a: waiting for quota")
    evicted = kueue.Admission(kueue.EVICTED, "Kueue evicted the Workload (Preempted: for a higher priority job)")
    admitted = kueue.Admission(kueue.ADMITTED, "admitted by ClusterQueue team", True)
    started = {"startTime": lifecycle.rfc3339(NOW - timedelta(seconds=61))}
    assert decide(spec_of(), {}, lifecycle.Observed(admission=queued), NOW).reason == "QueuedByKueue"
    assert decide(spec_of(), started, lifecycle.Observed(admission=evicted), NOW).reason == "EvictedByKueue"
    assert decide(spec_of(), started, lifecycle.Observed(admission=admitted), NOW).name == "Running"
    assert decide(spec_of(suspend=True), {}, lifecycle.Observed(admission=admitted), NOW).reason == "SuspendedByUser"
    # a queued job's deadline clock is stopped, as a suspended one's
    assert (
        decide(spec_of(activeDeadlineSeconds=60), started, lifecycle.Observed(admission=queued), NOW).name == "Queued"
    )
    for admission, phase, reason in [(queued, "Queued", "QueuedByKueue"), (evicted, "Suspended", "EvictedByKueue")]:
        observed = lifecycle.Observed(admission=admission)
        status = lifecycle.job_status(
            job_name="demo",
            job_key="demo-1",
            generation=1,
            previous=started,
            phase=decide(spec_of(), started, observed, NOW),
            observed=observed,
            now=NOW,
        )
        conditions = {c["type"]: c for c in status["conditions"]}
        assert status["phase"] == phase and status["startTime"] is None
        assert (conditions["Admitted"]["status"], conditions["Admitted"]["reason"]) == ("False", reason)
        assert (conditions["Suspended"]["status"], conditions["Suspended"]["reason"]) == ("True", reason)


def test_the_printer_columns_fields_a_finished_job_reads_succeeded_with_its_steps_and_accuracy():
    observed = lifecycle.Observed(
        controller=report(controller_pb2.JobStatus.COMPLETED, version=200, total_steps=200, eval_accuracy=0.81234)
    )
    status = lifecycle.job_status(
        job_name="demo",
        job_key="demo-1",
        generation=1,
        previous={},
        phase=lifecycle.decide_phase(spec_of(), {}, observed, NOW),
        observed=observed,
        now=NOW,
    )
    assert (status["phase"], status["progress"], status["accuracy"]) == ("Succeeded", "200/200", 0.8123)
    early = lifecycle.Observed(controller=report(version=37, total_steps=200, eval_accuracy=-1))
    status = lifecycle.job_status(
        job_name="demo",
        job_key="demo-1",
        generation=1,
        previous={},
        phase=lifecycle.decide_phase(spec_of(), {}, early, NOW),
        observed=early,
        now=NOW,
    )
    assert (status["phase"], status["progress"]) == ("Running", "37/200") and "accuracy" not in status


def test_terminal_phases_stick():
    finished = lifecycle.job_status(
        job_name="demo",
        job_key="demo-1",
        generation=1,
        previous={},
        phase=lifecycle.Phase("Complete", "TrainingFinished", "done"),
        observed=lifecycle.Observed(),
        now=NOW,
    )
    later = lifecycle.decide_phase(
        spec_of(), finished, lifecycle.Observed(controller=report()), NOW + timedelta(hours=1)
    )
    assert (later.name, later.reason) == ("Complete", "TrainingFinished")


def ready_replicas(ready: int) -> dict[str, lifecycle.RoleReplicas]:
    return {role: lifecycle.RoleReplicas(1, 1, ready) for role in names.ROLES}


def test_conditions_and_their_transition_times():
    running = lifecycle.Phase("Running", "Running", "up")
    first = lifecycle.job_status(
        job_name="demo",
        job_key="demo-1",
        generation=1,
        previous={},
        phase=running,
        observed=lifecycle.Observed(replicas=ready_replicas(0)),
        now=NOW,
    )
    assert [c["type"] for c in first["conditions"]] == [
        t for t in lifecycle.CONDITION_TYPES if t not in ("Rebalancing", "Admitted")
    ]  # only with the rebalancer, only with a Kueue queue
    ready = {c["type"]: c for c in first["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"], ready["lastTransitionTime"]) == (
        "False",
        "ReplicasNotReady",
        "2026-01-02T03:04:05Z",
    )
    later = NOW + timedelta(minutes=5)
    second = lifecycle.job_status(
        job_name="demo",
        job_key="demo-1",
        generation=2,
        previous=first,
        phase=running,
        observed=lifecycle.Observed(replicas=ready_replicas(1), controller=report()),
        now=later,
    )
    by_type = {c["type"]: c for c in second["conditions"]}
    assert by_type["Ready"]["status"] == "True" and by_type["Ready"]["lastTransitionTime"] == "2026-01-02T03:09:05Z"
    assert by_type["Suspended"]["lastTransitionTime"] == "2026-01-02T03:04:05Z", "unchanged status keeps its time"
    assert by_type["Progressing"]["reason"] == "Training" and by_type["Ready"]["observedGeneration"] == 2
    assert second["startTime"] == first["startTime"] == "2026-01-02T03:04:05Z"


def test_an_unreachable_controller_is_degraded_only_once_its_pod_is_ready():
    running = lifecycle.Phase("Running", "Running", "up")
    for ready, degraded in ((0, "False"), (1, "True")):
        observed = lifecycle.Observed(
            replicas=ready_replicas(ready), controller_error="controller x: UNAVAILABLE: down"
        )
        status = lifecycle.job_status(
            job_name="d", job_key="d-1", generation=1, previous={}, phase=running, observed=observed, now=NOW
        )
        assert {c["type"]: c["status"] for c in status["conditions"]}["Degraded"] == degraded


def test_status_carries_the_controller_metrics():
    status = lifecycle.job_status(
        job_name="demo",
        job_key="demo-1",
        generation=1,
        previous={},
        phase=lifecycle.Phase("Running", "Running", "up"),
        observed=lifecycle.Observed(
            controller=report(
                version=7,
                total_steps=9,
                mean_staleness=1.23456,
                max_staleness_seen=2,
                last_max_staleness=1,
                samples_per_second=3.5,
                tokens_per_second=99.5,
            )
        ),
        now=NOW,
    )
    assert (status["policyVersion"], status["totalSteps"]) == (7, 9)
    assert status["staleness"] == {"mean": 1.2346, "max": 2, "last": 1}
    assert status["throughput"] == {"samplesPerSecond": 3.5, "tokensPerSecond": 99.5}
    assert status["rolloutSelector"] == names.role_selector("demo", "rollout")


def test_status_counts_restarts_per_role_and_groups_by_outcome_and_dead_letters_degrade_past_the_threshold():
    running = lifecycle.Phase("Running", "Running", "up")
    groups = {
        "admitted": 40,
        "running": 3,
        "accepted": 30,
        "filtered": 2,
        "failed": 1,
        "requeued": 4,
        "dropped": 1,
        "lost": 1,
    }
    for dead, threshold, degraded in ((0, 0, "False"), (2, 2, "False"), (3, 2, "True")):
        observed = lifecycle.Observed(
            replicas=ready_replicas(1),
            restarts={"rollout": 2, "trainer": 1},
            controller=report(dead_lettered=dead, **groups),
        )
        status = lifecycle.job_status(
            job_name="d",
            job_key="d-1",
            generation=1,
            previous={},
            phase=running,
            observed=observed,
            now=NOW,
            max_dead_lettered=threshold,
        )
        assert status["groups"] == groups and status["restarts"] == 3
        assert status["replicas"]["rollout"]["restarts"] == 2 and status["replicas"]["controller"]["restarts"] == 0
        condition = lifecycle.condition_of(status, "Degraded")
        assert condition["status"] == degraded
        if degraded == "True":
            assert condition["reason"] == "ItemsDeadLettered" and "3 dataset items" in condition["message"]
    crashed = lifecycle.decide_phase(
        spec_of(failurePolicy={"maxRestarts": 2}), {}, lifecycle.Observed(restarts={"rollout": 2, "trainer": 1}), NOW
    )
    assert crashed.reason == "RestartLimitExceeded" and "(rollout 2, trainer 1)" in crashed.message


def test_suspension_clears_the_start_time_and_finishing_sets_the_completion_time():
    previous = {"startTime": "2026-01-01T00:00:00Z"}
    suspended = lifecycle.job_status(
        job_name="d",
        job_key="d-1",
        generation=1,
        previous=previous,
        phase=lifecycle.Phase("Suspended", "SuspendedByUser", "zero"),
        observed=lifecycle.Observed(),
        now=NOW,
    )
    assert suspended["startTime"] is None and "completionTime" not in suspended
    failed = lifecycle.job_status(
        job_name="d",
        job_key="d-1",
        generation=1,
        previous=previous,
        phase=lifecycle.Phase("Failed", "DeadlineExceeded", "late"),
        observed=lifecycle.Observed(),
        now=NOW,
    )
    assert failed["completionTime"] == "2026-01-02T03:04:05Z"
    assert lifecycle.ttl_expired({"ttlSecondsAfterFinished": 60}, failed, NOW + timedelta(seconds=60))
    assert not lifecycle.ttl_expired({"ttlSecondsAfterFinished": 60}, failed, NOW + timedelta(seconds=59))
    assert not lifecycle.ttl_expired({}, failed, NOW + timedelta(days=9))


def test_invalid_spec_status_and_the_events_of_transitions():
    status = lifecycle.invalid_status(generation=3, previous={}, problems=["spec.x: bad", "spec.y: worse"], now=NOW)
    degraded = lifecycle.condition_of(status, "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == (
        "True",
        "InvalidSpec",
        "spec.x: bad; spec.y: worse",
    )
    assert status["observedGeneration"] == 3 and lifecycle.condition_of(status, "Complete") is None
    assert lifecycle.transitions({}, status) == [("Warning", "InvalidSpec", "spec.x: bad; spec.y: worse")]
    assert lifecycle.transitions(status, status) == []


def test_restarts_count_only_the_jobs_pods():
    def pod(job, *counts):
        return {
            "metadata": {"labels": names.labels(job, "rollout")},
            "status": {"containerStatuses": [{"restartCount": c} for c in counts]},
        }

    assert lifecycle.count_restarts([pod("demo", 2, 1), pod("other", 5), {"metadata": {}}], "demo") == {"rollout": 3}


# -- patch math --------------------------------------------------------------------------------------------


def test_merge_patch_removes_what_was_applied_before_and_is_gone_now():
    last = {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "replicas": 2}, "metadata": {"labels": {"x": "y"}}}
    desired = {"spec": {"nodeSelector": {"a": "1"}, "replicas": 3}, "metadata": {}}
    assert merge_patch(last, desired) == {
        "spec": {"nodeSelector": {"a": "1", "b": None}, "replicas": 3},
        "metadata": {"labels": None},
    }


def test_subset_tolerates_server_defaults_and_quantity_spellings():
    desired = {"spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "0.5", names.GPU_RESOURCE: 1}}}]}}
    live = {
        "spec": {
            "containers": [
                {
                    "name": "a",
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {"limits": {"cpu": "500m", names.GPU_RESOURCE: "1"}},
                }
            ],
            "dnsPolicy": "x",
        }
    }
    assert is_subset(desired, live)
    assert not is_subset(desired, {"spec": {"containers": [{"name": "a", "resources": {"limits": {"cpu": "1"}}}]}})
    assert not is_subset({"args": ["a", "b"]}, {"args": ["a", "b", "c"]})
    assert not is_subset({"name": "0.5"}, {"name": "500m"}), "only resource quantities are compared as quantities"


class ConcurrentlyCreated(KubeApi):
    """A first read that misses an object someone else is creating at that moment (kopf may run a create
    handler twice), so the create that follows meets 409."""

    missed = False

    def get(self, path):
        if not self.missed:
            self.missed = True
            return None
        return super().get(path)


async def test_create_or_patch_against_an_apiserver(cluster: Cluster):
    url = str(cluster.server.url)
    kube = KubeApi.for_url(url)
    service = children(rljob())[("Service", "demo-reward")]
    live = await call(apply, kube, service)
    assert live["spec"]["selector"] == service["spec"]["selector"]
    assert names.LAST_APPLIED_ANNOTATION in live["metadata"]["annotations"]

    writes = len(list(cluster.server))
    await call(apply, kube, service)
    assert [r.method.name for r in list(cluster.server)[writes:]] == ["GET"], "an up-to-date child is only read"

    changed = with_changes(
        service,
        {
            "spec": {"ports": [{"name": "grpc", "port": 1, "targetPort": 1, "protocol": "TCP"}]},
            "metadata": {"labels": {names.LABEL_MANAGED_BY: None}},
        },
    )
    changed["metadata"]["labels"] = {k: v for k, v in changed["metadata"]["labels"].items() if v is not None}
    live = await call(apply, kube, changed)
    assert live["spec"]["ports"][0]["port"] == 1
    assert names.LABEL_MANAGED_BY not in live["metadata"]["labels"], "a label the operator dropped is removed"

    config_map = children(rljob())[("ConfigMap", "demo-config")]
    await call(apply, kube, config_map)
    edited = with_changes(config_map, {"data": {names.CONFIG_KEY: "name: x\n"}})
    live = await call(apply, ConcurrentlyCreated(kube.api_client), edited)
    assert live["data"][names.CONFIG_KEY] == "name: x\n"
    assert cluster.get("v1/configmaps", "demo-config", NAMESPACE)["data"][names.CONFIG_KEY] == "name: x\n"


async def call(fn, *args):
    """Run the operator's blocking client off the event loop that serves kmock."""
    return await asyncio.to_thread(fn, *args)


def test_the_trainers_parallel_layout_reaches_the_job_file_the_ranks_read():
    """roles.trainer.parallelism is the one place a layout is set: the ranks' job file gets its tensor and pipeline
    sizes, and a split model on the torch backend (which only replicates) is refused with the reason."""
    split = {"replicas": 2, "parallelism": {"tensor": 2, "pipeline": 1, "data": 1}}
    valid = validate(rljob(trainer={"backend": "megatron"}, roles={**rljob()["spec"]["roles"], "trainer": split}))
    assert (valid.config.trainer.backend, valid.config.trainer.replicas) == ("megatron", 2)
    assert (valid.config.trainer.parallelism.tensor, valid.config.trainer.parallelism.pipeline) == (2, 1)
    with pytest.raises(InvalidSpec, match=re.escape("parallelism.tensor/pipeline > 1 needs backend: megatron")):
        validate(rljob(roles={**rljob()["spec"]["roles"], "trainer": split}))


def test_a_response_budget_past_the_context_the_spec_names_is_an_invalid_spec_condition():
    assert validate(rljob(context_length=256, sampling={"max_new_tokens": 255})).config.context_length == 256
    with pytest.raises(InvalidSpec) as refused:
        validate(rljob(context_length=256, sampling={"max_new_tokens": 4000}))
    (problem,) = refused.value.problems
    assert problem == (
        "spec.sampling.max_new_tokens: 4000 new tokens after a one-token prompt do not fit the model's context of 256 "
        "positions (context_length): at most 255 do"
    )
    status = lifecycle.invalid_status(generation=1, previous={}, problems=refused.value.problems, now=NOW)
    degraded = lifecycle.condition_of(status, "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "InvalidSpec", problem)


AGENT_ROLLOUT = {"workflow": "agent", "prompt_template": "chat"}


def test_agent_runners_run_as_a_deployment_claiming_through_the_rollout_pods_gateway_service():
    agents = {
        "command": ["python", "/agents/agent.py"], "replicas": 3, "episodes_per_replica": 2,
        "image": "example.com/my-agent:1", "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
    }  # fmt: skip
    made = children(rljob(rollout=AGENT_ROLLOUT, agents=agents))
    runner = made[("Deployment", "demo-agents")]
    assert runner["spec"]["replicas"] == 3
    (main,) = runner["spec"]["template"]["spec"]["containers"]
    assert (main["image"], main["command"]) == ("example.com/my-agent:1", ["python", "-m", "areal_k8s.agent_runner"])
    assert main["args"] == ["--job", names.JOB_FILE, "--gateway", f"http://demo-gateway:{names.GATEWAY_PORT}"]
    assert main["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"}} and "ports" not in main
    assert main["securityContext"]["readOnlyRootFilesystem"] and main["securityContext"]["capabilities"]["drop"] == [
        "ALL"
    ]
    # the job pods' labels: the chart's per-namespace policy admits them to the rollout pods (every port)
    labels = runner["spec"]["template"]["metadata"]["labels"]
    assert labels[names.LABEL_INSTANCE] == "demo" and labels[names.LABEL_COMPONENT] == names.AGENTS
    gateway = made[("Service", "demo-gateway")]
    assert gateway["spec"]["selector"] == names.selector_labels("demo", "rollout")
    assert [(p["name"], p["port"]) for p in gateway["spec"]["ports"]] == [("gateway", names.GATEWAY_PORT)]
    rollout = container(made[("Deployment", "demo-rollout")], "rollout")
    assert rollout["args"][-2:] == ["--gateway-port", str(names.GATEWAY_PORT)]
    assert {"name": "gateway", "containerPort": names.GATEWAY_PORT, "protocol": "TCP"} in rollout["ports"]
    # claimed through the Service, a session lives in one pod: its base URL is that pod's
    assert env_of(rollout)["AREAL_GATEWAY_ADVERTISE"] == f"$(POD_IP):{names.GATEWAY_PORT}"
    config = yaml.safe_load(made[("ConfigMap", "demo-config")]["data"][names.CONFIG_KEY])
    assert config["agents"]["command"] == agents["command"] and config["agents"]["episodes_per_replica"] == 2
    assert (
        children(rljob(rollout=AGENT_ROLLOUT, agents=agents), running=False)[("Deployment", "demo-agents")]["spec"][
            "replicas"
        ]
        == 0
    )
    # the user's own agents, no runners: the Service only; another workflow: neither
    assert {key for key in children(rljob(rollout=AGENT_ROLLOUT)) if "agents" in key[1] or "gateway" in key[1]} == {
        ("Service", "demo-gateway")
    }
    plain = children(rljob())
    assert not {key for key in plain if "agents" in key[1] or "gateway" in key[1]}
    assert "--gateway-port" not in container(plain[("Deployment", "demo-rollout")], "rollout")["args"]


def test_agents_need_the_agent_workflow_and_a_working_dir_inside_the_pods():
    with pytest.raises(
        InvalidSpec, match=re.escape("agents play the agent workflow's episodes: set rollout.workflow: agent")
    ):
        validate(rljob(agents={"command": ["agent"]}))
    with pytest.raises(InvalidSpec) as refused:
        validate(rljob(rollout=AGENT_ROLLOUT, agents={"command": ["agent"], "working_dir": "agents"}))
    assert refused.value.problems == [
        "spec.agents.working_dir: must be an absolute path inside the pods (got 'agents')"
    ]
    with pytest.raises(InvalidSpec, match=r"spec.agents: 'command' is a required property"):
        validate(rljob(rollout=AGENT_ROLLOUT, agents={"replicas": 2}))
