"""The RLJob CustomResourceDefinition, built in one place: `python -m areal_k8s.k8s_operator.schema --write`.

The job-file sections of the spec (dataset, reward, sampling, algorithm, rollout, trainer, and model/tokenizer/
seed) are generated from the pydantic models in areal_k8s.common.config, keeping the job file's own keys, so
the job file and the RLJob share one typed schema. The Kubernetes parts (roles, mounts, checkpoint, redis,
lifecycle) are written here in camelCase. Cross-field rules come from rules.RULES. operator/crd/rljobs.yaml is
this module's output (a test checks it is current); the Helm chart ships that file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel

from areal_k8s.common.config import (
    AlgorithmConfig,
    DatasetConfig,
    JobConfig,
    RebalanceConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    TrainerConfig,
)
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.rules import RULES

# The committed CRD lives in the repository's operator/ folder, and the Helm chart carries an identical copy in its
# crds/ folder (Helm installs it on first install; upgrades apply it with kubectl, see charts/areal/README.md).
# --write writes both, --check verifies both; they work in a checkout.
REPO_ROOT = Path(__file__).resolve().parents[3]
CRD_PATH = REPO_ROOT / "operator" / "crd" / "rljobs.yaml"
CHART_CRD_PATH = REPO_ROOT / "charts" / "areal" / "crds" / "rljobs.yaml"
CRD_PATHS = (CRD_PATH, CHART_CRD_PATH)

# Job-file fields the operator fills from the Kubernetes parts of the spec instead.
OPERATOR_OWNED = {
    "rollout": {"workers", "engine_urls"},  # roles.rollout.replicas; each worker's engine is beside it in its pod
    "algorithm": {"max_staleness", "staleness_target"},  # staleness.eta, staleness.targetBand
    # roles.rollout.minReplicas/maxReplicas, roles.trainer.minReplicas/maxReplicas; gpuBudget
    "rebalance": {"min_workers", "max_workers", "min_trainer_replicas", "max_trainer_replicas", "cores"},
    "trainer": {"replicas", "parallelism"},  # roles.trainer: replicas × gpusPerPod ranks, split as its parallelism
}
JOB_SECTIONS: dict[str, tuple[type[BaseModel], str]] = {
    "dataset": (DatasetConfig, "The job file's `dataset` section."),
    "reward": (RewardConfig, "The job file's `reward` section: the verifier and its options."),
    "sampling": (SamplingConfig, "The job file's `sampling` section."),
    "algorithm": (AlgorithmConfig, "The job file's `algorithm` section (η is staleness.eta)."),
    "rollout": (RolloutConfig, "The job file's `rollout` section (the worker count is roles.rollout.replicas)."),
    "trainer": (TrainerConfig, "The job file's `trainer` section (the rank count is roles.trainer's)."),
    "rebalance": (
        RebalanceConfig,
        "The job file's `rebalance` section: the staleness rebalancer. It sizes the rollout "
        "pool to hold the mean staleness in staleness.targetBand, within roles.rollout.minReplicas/maxReplicas "
        "and gpuBudget. While enabled it owns the rollout replicas: roles.rollout.replicas is only its "
        "starting point, and no HorizontalPodAutoscaler (or KEDA ScaledObject) may target the RLJob (the "
        "operator reports one as Degraded, reason AutoscalerConflict, and changes nothing while it exists). "
        "The trainer's size stays as set unless roles.trainer.minReplicas/maxReplicas allow it to move: a move "
        "restarts the trainer world at the new size from a checkpoint it hands off at a step boundary.",
    ),
}
JOB_FIELDS = ("model", "tokenizer", "seed")

# -- pydantic JSON Schema -> structural OpenAPI v3.0 ------------------------------------------------------


def structural(prop: dict) -> dict:
    """One pydantic JSON-Schema property as the structural OpenAPI v3.0 schema a CRD accepts."""
    prop = {k: v for k, v in prop.items() if k != "title"}
    if "anyOf" in prop:  # `X | None`
        variants = [v for v in prop.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"cannot express a union of {variants} in a structural schema")
        prop = {**structural(variants[0]), **prop, "nullable": True}
    if "const" in prop:
        prop["enum"] = [prop.pop("const")]
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if exclusive in prop and not isinstance(prop[exclusive], bool):  # draft 2020 number -> v3.0 boolean flag
            prop[bound] = prop.pop(exclusive)
            prop[exclusive] = True
    if "prefixItems" in prop:  # fixed-length tuples of one type
        items = prop.pop("prefixItems")
        if any(item != items[0] for item in items):
            raise ValueError(f"cannot express a mixed tuple {items} in a structural schema")
        prop["items"] = items[0]
    if "items" in prop:
        prop["items"] = structural(prop["items"])
    if prop.get("additionalProperties") is True:  # a free-form mapping (rollout.workflow_args)
        del prop["additionalProperties"]
        prop["x-kubernetes-preserve-unknown-fields"] = True
    if "$ref" in prop or "properties" in prop:
        raise ValueError(f"nested models are not expected in a job-file section: {prop}")
    if "default" in prop and prop["default"] is None:
        del prop["default"]
    return {key: prop[key] for key in sorted(prop, key=lambda k: (k != "type", k != "description", k))}


def section_schema(model: type[BaseModel], description: str, exclude: set[str] = frozenset()) -> dict:
    source = model.model_json_schema()
    properties = {
        k: nested_section(v, source["$defs"]) if "$ref" in v else structural(v)
        for k, v in source["properties"].items()
        if k not in exclude
    }
    schema = {"type": "object", "description": description, "properties": properties}
    required = [k for k in source.get("required", []) if k not in exclude]
    if required:
        schema["required"] = required
    else:
        schema["default"] = {}  # so the apiserver fills in the section's field defaults
    return schema


def nested_section(prop: dict, defs: dict) -> dict:
    """A section's field that is a model of its own (reward.code), every field defaulted."""
    model = defs[prop["$ref"].rsplit("/", 1)[-1]]
    properties = {k: structural(v) for k, v in model["properties"].items()}
    return {"type": "object", "description": prop.get("description", ""), "properties": properties, "default": {}}


def job_field(name: str) -> dict:
    return structural(JobConfig.model_json_schema()["properties"][name])


# -- Kubernetes parts --------------------------------------------------------------------------------------


def obj(description: str, properties: dict, *, required: list[str] | None = None, default: dict | None = None) -> dict:
    schema = {"type": "object", "description": description, "properties": properties}
    if required:
        schema["required"] = required
    if default is not None:
        schema["default"] = default
    return schema


def integer(description: str, *, minimum: int | None = None, default: int | None = None) -> dict:
    schema: dict = {"type": "integer", "description": description}
    if minimum is not None:
        schema["minimum"] = minimum
    if default is not None:
        schema["default"] = default
    return schema


def string(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "x-kubernetes-int-or-string": True,
    # Kubernetes' resource.Quantity pattern
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
}


def resources(description: str) -> dict:
    quantities = {"type": "object", "additionalProperties": QUANTITY}
    return obj(
        description + " (core/v1 ResourceRequirements: requests and limits).",
        {"requests": quantities, "limits": quantities},
    )


def role(
    component: str,
    description: str,
    *,
    replicas: str | None,
    autoscaled: bool,
    gpus: str | None,
    extra: dict | None = None,
) -> dict:
    properties: dict = {
        "image": string(f"Container image; default {names.IMAGE_REPOSITORY}/{component}:<operator version>."),
        "imagePullPolicy": string(
            "Image pull policy of the role's containers.", enum=["Always", "IfNotPresent", "Never"]
        ),
    }
    if replicas:
        properties["replicas"] = integer(replicas, minimum=1, default=1)
    if autoscaled:
        properties["minReplicas"] = integer(
            "Lowest replica count an autoscaler (HPA/KEDA through /scale) may set.", minimum=1
        )
        properties["maxReplicas"] = integer("Highest replica count an autoscaler may set.", minimum=1)
    properties["resources"] = resources("CPU and memory of the role's main container")
    if gpus:
        properties["gpusPerPod"] = integer(gpus, minimum=0, default=0)
    properties["nodeSelector"] = {
        "type": "object",
        "description": "Node labels the pods must match.",
        "additionalProperties": {"type": "string"},
    }
    properties["tolerations"] = {
        "type": "array",
        "description": "Taints the pods tolerate (core/v1 Toleration).",
        "items": {
            "type": "object",
            "properties": {
                "key": {"type": "string"},
                "operator": {"type": "string", "enum": ["Exists", "Equal"]},
                "value": {"type": "string"},
                "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
                "tolerationSeconds": {"type": "integer"},
            },
        },
    }
    properties.update(extra or {})
    return obj(description, properties, default={})


def security_profile(kind: str, pods: str, default: str) -> dict:
    return obj(
        f"core/v1 {kind} of the {pods} pods; default {default}.",
        {
            "type": string("Profile type.", enum=["RuntimeDefault", "Unconfined", "Localhost"]),
            "localhostProfile": string("The node's profile to load, with type Localhost."),
        },
        required=["type"],
    )


def sandbox_properties(pods: str, sandbox: str, runtime_class_default: str) -> dict:
    """Pods that run untrusted programs in bubblewrap (reward: the `code` verifier; rollout: the tool_agent's python
    tool), which needs user namespaces."""
    return {
        "runtimeClassName": string(
            f"RuntimeClass of the {pods} pods (e.g. gvisor or kata): a further isolation layer "
            f"around {sandbox}. Default: {runtime_class_default}."
        ),
        "seccompProfile": security_profile(
            "SeccompProfile",
            pods,
            f"RuntimeDefault, which on containerd and CRI-O refuses the user namespaces "
            f"{sandbox} (bubblewrap) creates: jobs using it set Unconfined, or Localhost with a profile "
            "that also allows clone/unshare with CLONE_NEWUSER",
        ),
        "appArmorProfile": security_profile(
            "AppArmorProfile",
            pods,
            "the node's (where AppArmor runs, its runtime/default profile denies the mounts "
            "bubblewrap makes: jobs using it on such nodes set Unconfined or a Localhost profile)",
        ),
    }


def roles_schema() -> dict:
    engine = obj(
        "The inference engine container beside each rollout agent (it gets the role's GPUs).",
        {
            "image": string(
                "Engine image; default: the rollout image for the cpu engine, "
                f"{names.IMAGE_REPOSITORY}/sglang:<operator version> for sglang."
            ),
            "resources": resources("CPU and memory of the engine container"),
        },
        default={},
    )
    trainer_bounds = {
        "minReplicas": integer(
            "Fewest trainer pods the staleness rebalancer may shrink the trainer to (default: "
            "replicas, a fixed size). A move restarts the trainer world at the new size from a "
            "checkpoint it hands off at a step boundary.",
            minimum=1,
        ),
        "maxReplicas": integer(
            "Most trainer pods the staleness rebalancer may grow the trainer to (default: replicas).", minimum=1
        ),
    }
    parallelism = obj(
        "Megatron-style parallel sizes; tensor × pipeline × data is the trainer's rank count. Tensor or pipeline "
        "above 1 needs trainer.backend: megatron.",
        {
            "tensor": integer("Tensor-parallel size.", minimum=1, default=1),
            "pipeline": integer("Pipeline-parallel size.", minimum=1, default=1),
            "data": integer("Data-parallel size.", minimum=1, default=1),
        },
        default={},
    )
    return obj(
        "Pod settings of each service.",
        {
            "controller": role(
                "controller",
                "The controller: one pod (admission state lives in it and in Redis).",
                replicas=None,
                autoscaled=False,
                gpus=None,
            ),
            "reward": role(
                "reward",
                "The reward service (verifiers).",
                replicas="Reward service pods.",
                autoscaled=True,
                gpus="GPUs per reward pod (model-based rewards).",
                extra=sandbox_properties(
                    "reward",
                    "the `code` verifier's sandbox",
                    "the chart's jobs.rewardRuntimeClassName, else the cluster's",
                ),
            ),
            "rollout": role(
                "rollout",
                "Rollout pods: a rollout agent and its inference engine each. "
                "The /scale subresource sets roles.rollout.replicas.",
                replicas="Rollout workers.",
                autoscaled=True,
                gpus="GPUs of each pod's engine.",
                extra={
                    "engine": engine,
                    **sandbox_properties("rollout", "the tool_agent workflow's python tool sandbox", "the cluster's"),
                },
            ),
            "trainer": role(
                "trainer",
                "The trainer StatefulSet (one pod per node; torch rendezvous via a headless Service).",
                replicas="Trainer pods (nodes).",
                autoscaled=False,
                gpus="GPUs (ranks) per trainer pod.",
                extra={"parallelism": parallelism, **trainer_bounds},
            ),
        },
        default={},
    )


def mounts_schema() -> dict:
    return {
        "type": "array",
        "description": "Volumes mounted into every service pod, so model, tokenizer and dataset paths resolve.",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
        "items": obj(
            "One mount: a PersistentVolumeClaim or an OCI image (image volumes need Kubernetes >= 1.31).",
            {
                "name": string("Volume name, unique in the list.", maxLength=63),
                "mountPath": string("Where the volume appears in the containers.", pattern="^/"),
                "subPath": string("Mount only this path of the volume."),
                "readOnly": {"type": "boolean", "description": "Mount read-only.", "default": True},
                "persistentVolumeClaim": obj(
                    "An existing PersistentVolumeClaim.", {"claimName": string("Claim name.")}, required=["claimName"]
                ),
                "image": obj(
                    "An OCI image (or artifact) holding model weights or data.",
                    {
                        "reference": string("Image reference."),
                        "pullPolicy": string("Pull policy.", enum=["Always", "IfNotPresent", "Never"]),
                    },
                    required=["reference"],
                ),
            },
            required=["name", "mountPath"],
        ),
    }


def spec_schema() -> dict:
    job_parts = {field: job_field(field) for field in JOB_FIELDS}
    sections = {
        key: section_schema(model, description, OPERATOR_OWNED.get(key, set()))
        for key, (model, description) in JOB_SECTIONS.items()
    }
    eta = structural(AlgorithmConfig.model_json_schema()["properties"]["max_staleness"])
    properties = {
        **job_parts,
        **sections,
        "staleness": obj(
            "The staleness target: the bound η, and the band measured staleness should stay in.",
            {
                "eta": eta,
                "targetBand": obj(
                    "Band for the measured mean staleness (status.staleness.mean), within [0, eta].",
                    {
                        "min": {"type": "number", "minimum": 0, "description": "Lower edge.", "default": 0},
                        "max": {"type": "number", "minimum": 0, "description": "Upper edge."},
                    },
                    required=["max"],
                ),
            },
            default={},
        ),
        "gpuBudget": integer("GPUs the job may hold at once, over all roles.", minimum=0),
        "roles": roles_schema(),
        "mounts": mounts_schema(),
        "checkpoint": obj(
            "Where the trainer keeps checkpoints (the run directory); it survives suspend, so a resumed job "
            "continues from its last checkpoint.",
            {
                "mountPath": string(
                    "Where the checkpoint volume is mounted in the trainer.", pattern="^/", default="/var/lib/areal"
                ),
                "claimName": string(
                    "An existing PersistentVolumeClaim (ReadWriteOnce is enough: only the trainer writes)."
                ),
                "volumeClaimTemplate": obj(
                    "A claim per trainer pod, made by the StatefulSet and deleted with the job.",
                    {
                        "size": {**QUANTITY, "description": "Requested storage."},
                        "storageClassName": string("Storage class; default: the cluster's."),
                    },
                    required=["size"],
                ),
            },
            default={"volumeClaimTemplate": {"size": "10Gi"}},
        ),
        "redis": obj(
            "The Redis holding the trajectory stream: the chart's in-cluster Redis "
            "(redis://<release>-redis.<namespace>.svc:6379/0) or an external one.",
            {
                "url": string("redis://[:password@]host:port/db, for a Redis without credentials."),
                "urlSecretRef": obj(
                    "A Secret key holding the whole URL, when it carries a password.",
                    {"name": string("Secret name."), "key": string("Key in the Secret.")},
                    required=["name", "key"],
                ),
            },
        ),
        "suspend": {
            "type": "boolean",
            "default": False,
            "description": "Scale every service to zero; clearing it resumes from the last checkpoint.",
        },
        "activeDeadlineSeconds": integer(
            "Fail the job once it has run this long (suspended time not counted).", minimum=1
        ),
        "ttlSecondsAfterFinished": integer("Delete the RLJob this long after it completed or failed.", minimum=0),
        "failurePolicy": obj(
            "When to give up.",
            {
                "maxRestarts": integer(
                    "Fail the job once the containers of its current pods restarted more often than this, in total.",
                    minimum=0,
                    default=10,
                ),
                "maxDeadLetteredItems": integer(
                    "Report Degraded (reason ItemsDeadLettered) once more dataset items than "
                    "this were dead-lettered; the job goes on without them.",
                    minimum=0,
                    default=0,
                ),
            },
            default={},
        ),
    }
    return obj(
        "What to train and how to run it. Job-file sections keep the job file's keys (snake_case); "
        "the Kubernetes parts use camelCase.",
        properties,
        required=["model", "dataset", "redis"],
    )


def condition_schema() -> dict:
    return obj(
        "A metav1.Condition.",
        {
            "type": string("Ready, Progressing, Degraded, Suspended, Complete or Failed."),
            "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "observedGeneration": integer("The spec generation the condition describes."),
            "lastTransitionTime": string("When status last changed.", format="date-time"),
            "reason": string("CamelCase reason."),
            "message": string("Human-readable detail."),
        },
        required=["type", "status", "lastTransitionTime", "reason", "message"],
    )


def rebalance_status_schema() -> dict:
    number = {"type": "number"}
    return obj(
        "The rebalancer's state (spec.rebalance.enabled): the split it holds and what it measures.",
        {
            "rollout": integer("Rollout pods the rebalancer holds (the rollout Deployment's replicas)."),
            "trainer": integer(
                "Trainer data-parallel replicas the rebalancer holds (the trainer StatefulSet's pods are "
                "these × tensor × pipeline ÷ ranks per pod)."
            ),
            "decision": obj(
                "The last decision.",
                {
                    "code": string(
                        "WithinBand, MovedToRollout, MovedToTraining, SignalsDisagree, LatencyBound, AtLimit, "
                        "BandBetweenSplits, CollectingData or BoundsChanged."
                    ),
                    "message": string("What it measured and why it decided so."),
                    "time": string("When.", format="date-time"),
                },
            ),
            "window": obj(
                "The last complete window.",
                {
                    "seconds": number,
                    "samples": integer("Samples trained in it."),
                    "meanStaleness": number,
                    "withinBand": {**number, "description": "Share of its samples inside the band."},
                    "trainerIdle": {**number, "description": "Share of it the trainer waited for data."},
                    "rolloutHeld": {
                        **number,
                        "description": "Share of the workers' time the staleness bound held them.",
                    },
                },
            ),
            "windowStart": obj(
                "The controller's running totals where the current window began.",
                {
                    "at": number,
                    "trainedSamples": integer("Samples."),
                    "trainedTokens": integer("Tokens."),
                    "stalenessSum": number,
                    "stalenessCounts": {"type": "array", "items": {"type": "integer"}},
                    "trainerWaitSeconds": number,
                    "heldByStalenessSeconds": number,
                    "acceptedGroups": integer("Groups."),
                    "workers": integer("Workers."),
                },
            ),
            "lastChangeAt": {
                **number,
                "description": "The controller's clock at the last change (starts the cooldown).",
            },
            "memory": {
                "type": "array",
                "description": "How each split measured first, to recognise a band between two "
                "splits; cleared when the workload drifts.",
                "items": obj(
                    "A split's verdict.",
                    {
                        "rollout": integer("Rollout pods."),
                        "trainer": integer("Trainer replicas."),
                        "side": string("above, inside or below the band."),
                        "meanStaleness": number,
                        "tokensPerSample": {**number, "description": "The responses' length it was measured under."},
                        "latencyBound": {"type": "boolean", "description": "Above the band while the trainer waited."},
                        "trainedPerSecond": {**number, "description": "Samples trained per second."},
                    },
                ),
            },
        },
    )


def status_schema() -> dict:
    role_replicas = obj(
        "Replica counts of one role.",
        {
            "desired": integer("Replicas the operator asks for (0 while suspended or finished)."),
            "current": integer("Pods the workload has."),
            "ready": integer("Pods ready."),
            "restarts": integer("Container restarts in the role's current pods."),
        },
    )
    return obj(
        "Observed state, written by the operator.",
        {
            "observedGeneration": integer("The spec generation last reconciled."),
            "jobName": string("The job's name in its services and Redis keys (areal:{jobName}:...)."),
            "conditions": {
                "type": "array",
                "description": "Ready, Progressing, Degraded, Suspended, Complete, Failed.",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": condition_schema(),
            },
            "replicas": obj("Per role.", dict.fromkeys(names.ROLES, role_replicas)),
            "rolloutSelector": string("Label selector of the rollout pods (for the /scale subresource)."),
            "policyVersion": integer("Policy version the rollout engines serve."),
            "totalSteps": integer("Training steps the job runs."),
            "staleness": obj(
                "Staleness of trained samples, in policy versions.",
                {
                    "mean": {"type": "number", "description": "Mean over the run."},
                    "max": integer("Largest seen."),
                    "last": integer("Largest in the last step."),
                },
            ),
            "throughput": obj(
                "Training throughput over the run.",
                {
                    "samplesPerSecond": {"type": "number", "description": "Trained samples per second."},
                    "tokensPerSecond": {"type": "number", "description": "Trained tokens per second."},
                },
            ),
            "deadLetteredItems": integer(
                "Dataset items given up on after rollout.max_group_failures failed groups in a row "
                "(each has an entry with its last reason in the job's dead-letter stream in Redis)."
            ),
            "restarts": integer(
                "Container restarts in the job's current pods, counted against failurePolicy.maxRestarts "
                "(per role under replicas)."
            ),
            "groups": obj(
                "Prompt groups admitted since the job started, by how each was settled: each counted once.",
                {
                    "admitted": integer("Admitted: the sum of the others."),
                    "running": integer("Being generated and scored."),
                    "accepted": integer("Written to the trajectory stream."),
                    "filtered": integer(
                        "Dropped for carrying no reward signal; another group is admitted in its place."
                    ),
                    "failed": integer("Failed; re-queued, or dead-lettered after rollout.max_group_failures in a row."),
                    "requeued": integer(
                        "Handed back unproduced (their worker or engine died or stopped); re-queued, not "
                        "counted against their prompt."
                    ),
                    "dropped": integer(
                        "Accepted groups the trainer dropped as past the staleness bound after it rolled "
                        "back to a checkpoint; their prompts were admitted again."
                    ),
                },
            ),
            "lastRebalanceTime": string(
                "When the staleness rebalancer last changed the rollout/trainer split.", format="date-time"
            ),
            "lastRebalanceReason": string("Why it changed: the window it measured and the move."),
            "rebalance": rebalance_status_schema(),
            "startTime": string("When the job last started running (reset by resume).", format="date-time"),
            "completionTime": string("When the job completed or failed.", format="date-time"),
        },
    )


def place_rules(root: dict) -> None:
    """Attach each rule of rules.RULES to the schema node at its path."""
    for rule in RULES:
        node = root
        for step in rule.path:
            node = node["items"] if step == "*" else node["properties"][step]
        node.setdefault("x-kubernetes-validations", []).append({"rule": rule.cel, "message": rule.message})


def printer_columns() -> list[dict]:
    def condition(kind: str) -> str:
        return f'.status.conditions[?(@.type=="{kind}")].status'

    return [
        {"name": "Version", "type": "integer", "jsonPath": ".status.policyVersion", "description": "Policy version"},
        {"name": "Staleness", "type": "number", "jsonPath": ".status.staleness.mean", "description": "Mean staleness"},
        {"name": "Samples/s", "type": "number", "jsonPath": ".status.throughput.samplesPerSecond"},
        {"name": "Tokens/s", "type": "number", "jsonPath": ".status.throughput.tokensPerSecond", "priority": 1},
        {
            "name": "Rollout",
            "type": "integer",
            "jsonPath": ".status.replicas.rollout.ready",
            "description": "Ready rollout pods",
        },
        {
            "name": "Trainer",
            "type": "integer",
            "jsonPath": ".status.replicas.trainer.ready",
            "description": "Ready trainer pods",
        },
        {"name": "Ready", "type": "string", "jsonPath": condition("Ready")},
        {
            "name": "Reason",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def openapi_schema() -> dict:
    root = obj(
        "RLJob: an asynchronous RL run (controller, rollout, reward and trainer services) on Kubernetes.",
        {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
        required=["spec"],
    )
    place_rules(root)
    return root


def build_crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": names.CRD_NAME, "labels": {names.LABEL_NAME: names.APP_NAME}},
        "spec": {
            "group": names.GROUP,
            "names": {
                "kind": names.KIND,
                "listKind": f"{names.KIND}List",
                "plural": names.PLURAL,
                "singular": names.SINGULAR,
                "shortNames": names.SHORT_NAMES,
                "categories": ["areal"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": names.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.roles.rollout.replicas",
                            "statusReplicasPath": ".status.replicas.rollout.current",
                            "labelSelectorPath": ".status.rolloutSelector",
                        },
                    },
                    "additionalPrinterColumns": printer_columns(),
                }
            ],
        },
    }


HEADER = "# Generated by `python -m areal_k8s.k8s_operator.schema --write` from operator/schema.py; do not edit.\n"


def render() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, allow_unicode=True, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal_k8s.k8s_operator.schema", description=__doc__.splitlines()[0]
    )
    action = parser.add_mutually_exclusive_group()
    targets = " and ".join(map(str, CRD_PATHS))
    action.add_argument("--write", action="store_true", help=f"write {targets}")
    action.add_argument("--check", action="store_true", help=f"exit 1 unless {targets} are the generated CRD")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        for path in CRD_PATHS:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}", file=sys.stderr)
    elif args.check:
        stale = [path for path in CRD_PATHS if (path.read_text() if path.exists() else "") != text]
        for path in stale:
            print(f"{path} is stale: run python -m areal_k8s.k8s_operator.schema --write", file=sys.stderr)
        if stale:
            return 1
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
