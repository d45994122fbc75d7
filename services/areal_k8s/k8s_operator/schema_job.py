"""The job-file sections of the RLJob spec, generated from the pydantic job schema (areal_k8s.common.config) with
the job file's own keys: pydantic's JSON Schema made the structural OpenAPI v3.0 schema a CRD accepts."""

from __future__ import annotations

from pydantic import BaseModel

from areal_k8s.common.config import (
    AgentsConfig,
    AlgorithmConfig,
    DatasetConfig,
    JobConfig,
    RebalanceConfig,
    RewardConfig,
    RolloutConfig,
    SamplingConfig,
    TrackingConfig,
    TrainerConfig,
)

# Job-file fields the operator fills from the Kubernetes parts of the spec instead.
OPERATOR_OWNED = {
    "rollout": {"workers", "engine_urls"},  # roles.rollout.replicas; each worker's engine is beside it in its pod
    "algorithm": {"max_staleness", "staleness_target"},  # staleness.eta, staleness.targetBand
    # roles.rollout.minReplicas/maxReplicas, roles.trainer.minReplicas/maxReplicas; gpuBudget
    "rebalance": {"min_workers", "max_workers", "min_trainer_replicas", "max_trainer_replicas", "cores"},
    "trainer": {"replicas", "parallelism"},  # roles.trainer: replicas × gpusPerPod ranks, split as its parallelism
}
JOB_SECTIONS: dict[str, tuple[type[BaseModel], str]] = {
    "agents": (
        AgentsConfig,
        "The job file's `agents` section: the agent runners, a Deployment <name>-agents beside the rollout pods, "
        "claiming the `agent` workflow's episodes through the Service <name>-gateway (docs/agents.md).",
    ),
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
    "tracking": (
        TrackingConfig,
        "The job file's `tracking` section: the experiment trackers the trainer logs each step to. The API keys "
        "come from the Secrets it names (the trainer gets them as WANDB_API_KEY and MLFLOW_TRACKING_TOKEN).",
    ),
}
JOB_FIELDS = ("model", "tokenizer", "context_length", "seed")


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
        k: nested_section(v, source["$defs"]) if model_ref(v) else structural(v)
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


def model_ref(prop: dict) -> str | None:
    """The model a property holds (`Model` or `Model | None`), else None."""
    return prop.get("$ref") or next((v["$ref"] for v in prop.get("anyOf", []) if "$ref" in v), None)


def nested_section(prop: dict, defs: dict) -> dict:
    """A section's field that is a model of its own: every field defaulted (reward.code, tracking.wandb), or optional
    and absent unless given (tracking.wandb.api_key_secret)."""
    model = defs[model_ref(prop).rsplit("/", 1)[-1]]
    properties = {k: nested_section(v, defs) if model_ref(v) else structural(v) for k, v in model["properties"].items()}
    schema = {"type": "object", "description": prop.get("description", ""), "properties": properties}
    if "anyOf" in prop:
        return {**schema, "nullable": True, **({"required": list(model["required"])} if model.get("required") else {})}
    return {**schema, "default": {}}


def job_field(name: str) -> dict:
    return structural(JobConfig.model_json_schema()["properties"][name])
