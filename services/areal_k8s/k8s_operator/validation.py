"""From an RLJob object to a checked job: the CRD's defaults, its schema, its CEL rules, then the JobConfig.

The apiserver already defaults, prunes and validates what it stores; the operator does it again, with the same
schema, because it must never act on a spec it cannot run (and a test apiserver does none of it). Every problem
comes back as one readable line naming the field.
"""

from __future__ import annotations

import copy
from functools import cache

import jsonschema

from areal_k8s.common.config import JobConfig, JobFileError, parse_job
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.children import desired_children
from areal_k8s.k8s_operator.rules import broken_rules
from areal_k8s.k8s_operator.schema import build_crd
from areal_k8s.k8s_operator.schema_job import JOB_FIELDS
from areal_k8s.k8s_operator.valid_job import ENGINE_URL, InvalidSpec, ValidJob


@cache
def openapi_schema() -> dict:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict, value: object) -> object:
    """Fill in `default`s the way the apiserver does: absent properties get theirs, then each is descended into."""
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(schema["items"], item)
    return value


def strict_json_schema(schema: dict) -> dict:
    """The OpenAPI v3.0 schema as JSON Schema draft 4, rejecting unknown fields (what `kubectl --validate=strict`
    does; the apiserver itself would prune them)."""
    out = {
        k: strict_json_schema(v) if isinstance(v, dict) else v
        for k, v in schema.items()
        if not k.startswith("x-kubernetes-")
    }
    if "properties" in schema:
        out["properties"] = {k: strict_json_schema(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):  # a core/v1 object kept whole
            out.setdefault("additionalProperties", False)
    if out.pop("nullable", False):
        out["type"] = [out["type"], "null"]
    if "anyOf" in schema:
        out["anyOf"] = [strict_json_schema(v) for v in schema["anyOf"]]
    return out


@cache
def _validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(strict_json_schema(openapi_schema()))


def schema_problems(rljob: dict) -> list[str]:
    """What the CRD's structural schema rejects in `rljob` (its status is the operator's and not checked)."""
    checked = {k: v for k, v in rljob.items() if k != "status"}
    problems = []
    for error in sorted(_validator().iter_errors(checked), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(part) for part in error.absolute_path) or "(object)"
        problems.append(f"{where}: {error.message}")
    return problems


def path_problems(spec: dict) -> list[str]:
    """Paths the services resolve against their working directory would point nowhere useful in a pod."""
    optional_paths = {
        "tokenizer": spec.get("tokenizer"),
        "dataset.eval": spec["dataset"].get("eval"),
        "agents.working_dir": spec.get("agents", {}).get("working_dir"),
    }
    return [
        f"spec.{field}: must be an absolute path inside the pods (got {path!r})"
        for field, path in optional_paths.items()
        if path is not None and not path.startswith("/")
    ]


def compose_job_config(rljob: dict) -> JobConfig:
    """The JobConfig the services read: the spec's job-file sections plus what the Kubernetes parts decide."""
    meta, spec = rljob["metadata"], rljob["spec"]
    key = names.job_key(meta["namespace"], meta["name"])
    workers, trainer = spec["roles"]["rollout"]["replicas"], spec["roles"]["trainer"]
    data = {
        "name": key,
        **{field: spec[field] for field in JOB_FIELDS if field in spec},
        "run_dir": f"{spec['checkpoint']['mountPath'].rstrip('/')}/{key}",
        **{
            section: spec[section]
            for section in ("dataset", "reward", "sampling", "tracking", "agents")
            if section in spec
        },
        # one rank per pod without GPUs, one per GPU otherwise (the world the StatefulSet's WORLD_SIZE names)
        "trainer": {
            **spec["trainer"],
            "replicas": trainer["replicas"] * max(trainer["gpusPerPod"], 1),
            "parallelism": {size: trainer["parallelism"][size] for size in ("tensor", "pipeline")},
        },
        "rebalance": {
            **spec["rebalance"],
            "min_workers": spec["roles"]["rollout"].get("minReplicas", 1),
            **(
                {"max_workers": spec["roles"]["rollout"]["maxReplicas"]}
                if "maxReplicas" in spec["roles"]["rollout"]
                else {}
            ),
            # the trainer's bounds in ranks, as its replicas
            **{
                f"{side}_trainer_replicas": trainer[f"{side}Replicas"] * max(trainer["gpusPerPod"], 1)
                for side in ("min", "max")
                if f"{side}Replicas" in trainer
            },
        },
        "algorithm": {
            **spec["algorithm"],
            "max_staleness": spec["staleness"]["eta"],
            **({"staleness_target": spec["staleness"]["targetBand"]} if "targetBand" in spec["staleness"] else {}),
        },
        "rollout": {
            **spec["rollout"],
            "workers": workers,
            "engine_urls": [ENGINE_URL] * workers if spec["rollout"]["engine"] == "sglang" else [],
        },
        "redis": {"url": spec["redis"].get("url")},  # a URL from a Secret reaches the pods as AREAL_REDIS_URL only
    }
    return parse_job(data, source="spec")


def validate(rljob: dict) -> ValidJob:
    """Check an RLJob and build its job configuration, or raise InvalidSpec listing every problem found."""
    rljob = copy.deepcopy(rljob)
    rljob.setdefault("metadata", {}).setdefault("namespace", "default")
    problems = schema_problems(rljob)
    if problems:  # the rules and the JobConfig assume a well-typed spec
        raise InvalidSpec(problems)
    apply_defaults(openapi_schema(), rljob)
    problems = [f"{rule.where}: {rule.message}" for rule in broken_rules(rljob)] + path_problems(rljob["spec"])
    if problems:
        raise InvalidSpec(problems)
    try:
        config = compose_job_config(rljob)
    except JobFileError as exc:
        raise InvalidSpec([str(exc)]) from None
    # The model and the data are inside the pods: the budget is checked against the context the spec names.
    problems = [f"spec.{problem}" for problem in config.context_problems()]
    if problems:
        raise InvalidSpec(problems)
    meta = rljob["metadata"]
    job = ValidJob(
        name=meta["name"],
        namespace=meta["namespace"],
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        spec=rljob["spec"],
        config=config,
    )
    # A role's pod settings are checked against the pods they join: building the children raises InvalidSpec for
    # one that would replace a part of the operator's (pod_settings.py).
    desired_children(job, running=True)
    return job
