"""The spec's `roles` (each service's pods) and `mounts` (the volumes every service pod mounts)."""

from __future__ import annotations

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.schema_openapi import integer, obj, resources, string


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
    properties.update(pod_settings())
    properties.update(extra or {})
    return obj(description, properties, default={})


def kubernetes_object(description: str, properties: dict | None = None, required: list[str] | None = None) -> dict:
    """A core/v1 object kept whole (its full schema is hundreds of lines; the apiserver checks the pods made of it)."""
    return {**obj(description, properties or {}, required=required), "x-kubernetes-preserve-unknown-fields": True}


def string_map(description: str) -> dict:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def named_list(description: str, item: dict) -> dict:
    return {
        "type": "array",
        "description": description,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
        "items": item,
    }


def pod_settings() -> dict:
    """What a shared cluster asks of a role's pods, in core/v1's own shapes (KubeRay and JobSet take a whole pod
    template; these are the parts of one the operator does not build itself). Names the operator sets (its env,
    labels, volumes and mount paths) are refused, not overridden: pod_settings.py."""
    return {
        "env": named_list(
            "Environment variables of every container of the role's pods (core/v1 EnvVar), after the operator's: "
            "they may refer to its variables, $(POD_IP) and the like, but not set them again.",
            obj(
                "One variable.",
                {
                    "name": string("Variable name."),
                    "value": string("Its value."),
                    "valueFrom": kubernetes_object(
                        "core/v1 EnvVarSource: secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef."
                    ),
                },
                required=["name"],
            ),
        ),
        "envFrom": {
            "type": "array",
            "description": "Secrets and ConfigMaps whose keys become variables of every container (core/v1 "
            "EnvFromSource); `env` (the operator's included) wins over them.",
            "items": obj(
                "One source.",
                {
                    "prefix": string("Prefix of the variable names."),
                    "secretRef": obj(
                        "A Secret.",
                        {"name": string("Secret name."), "optional": {"type": "boolean"}},
                        required=["name"],
                    ),
                    "configMapRef": obj(
                        "A ConfigMap.",
                        {"name": string("ConfigMap name."), "optional": {"type": "boolean"}},
                        required=["name"],
                    ),
                },
            ),
        },
        "affinity": kubernetes_object("core/v1 Affinity of the pods: nodeAffinity, podAffinity, podAntiAffinity."),
        "priorityClassName": string("PriorityClass of the pods (preemption order on a shared cluster)."),
        "serviceAccountName": string(
            "ServiceAccount the pods run as (e.g. for workload identity); no token is mounted, the services do not "
            "call the Kubernetes API."
        ),
        "imagePullSecrets": {
            "type": "array",
            "description": "Secrets for pulling the role's images from a private registry.",
            "items": obj("core/v1 LocalObjectReference.", {"name": string("Secret name.")}, required=["name"]),
        },
        "labels": string_map("Labels of the pods, beside the operator's own (which may not be set here)."),
        "annotations": string_map("Annotations of the pods, beside the operator's config hash."),
        "volumes": named_list(
            "Extra volumes of the pods (core/v1 Volume: any source), mounted with `volumeMounts`.",
            kubernetes_object("One volume.", {"name": string("Volume name.", maxLength=63)}, required=["name"]),
        ),
        "volumeMounts": {
            "type": "array",
            "description": "Where every container of the pods mounts the role's `volumes` (core/v1 VolumeMount).",
            "items": obj(
                "One mount.",
                {
                    "name": string("A volume of `volumes`."),
                    "mountPath": string("Where it appears.", pattern="^/"),
                    "subPath": string("Mount only this path of the volume."),
                    "readOnly": {"type": "boolean", "description": "Mount read-only."},
                },
                required=["name", "mountPath"],
            ),
        },
    }


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
