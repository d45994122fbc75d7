"""The RLJob CustomResourceDefinition, built in one place: `python -m areal_k8s.k8s_operator.schema --write`.

The job-file sections of the spec (dataset, reward, sampling, algorithm, rollout, trainer, and model/tokenizer/
seed) are generated from the pydantic models in areal_k8s.common.config, keeping the job file's own keys, so
the job file and the RLJob share one typed schema (schema_job.py). The Kubernetes parts (roles and mounts in
schema_roles.py, checkpoint, redis, lifecycle here) are written in camelCase; the status is schema_status.py's.
Cross-field rules come from rules.RULES. operator/crd/rljobs.yaml is this module's output (a test checks it is
current); the Helm chart ships that file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from areal_k8s.common.config import AlgorithmConfig
from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.rules import RULES
from areal_k8s.k8s_operator.schema_job import (
    JOB_FIELDS,
    JOB_SECTIONS,
    OPERATOR_OWNED,
    job_field,
    section_schema,
    structural,
)
from areal_k8s.k8s_operator.schema_openapi import QUANTITY, integer, obj, string
from areal_k8s.k8s_operator.schema_roles import mounts_schema, roles_schema
from areal_k8s.k8s_operator.schema_status import printer_columns, status_schema

# The committed CRD lives in the repository's operator/ folder, and the Helm chart carries an identical copy in its
# crds/ folder (Helm installs it on first install; upgrades apply it with kubectl, see charts/areal/README.md).
# --write writes both, --check verifies both; they work in a checkout.
REPO_ROOT = Path(__file__).resolve().parents[3]
CRD_PATH = REPO_ROOT / "operator" / "crd" / "rljobs.yaml"
CHART_CRD_PATH = REPO_ROOT / "charts" / "areal" / "crds" / "rljobs.yaml"
CRD_PATHS = (CRD_PATH, CHART_CRD_PATH)


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
                    "A claim per trainer pod, made by the StatefulSet (`areal-checkpoint-<name>-trainer-<i>`); "
                    "`retention` says whether deleting the job deletes it.",
                    {
                        "size": {**QUANTITY, "description": "Requested storage."},
                        "storageClassName": string("Storage class; default: the cluster's."),
                    },
                    required=["size"],
                ),
                "retention": string(
                    "What deleting the RLJob does to the volumeClaimTemplate's claims, which hold the checkpoints "
                    "and the final model (final/ in the run directory): `Retain` keeps them to copy out and "
                    "delete by hand, `Delete` deletes them with the job. A claimName claim is never deleted.",
                    enum=["Retain", "Delete"],
                    default="Retain",
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
        "queueName": string(
            "A Kueue LocalQueue in the job's namespace (the `kueue.x-k8s.io/queue-name` label does the same): the "
            "operator writes a Kueue Workload with a pod set per role and starts no pod until Kueue admits it, "
            "so every role starts together; an eviction suspends the job until Kueue admits it again.",
            pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
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


def place_rules(root: dict) -> None:
    """Attach each rule of rules.RULES to the schema node at its path."""
    for rule in RULES:
        node = root
        for step in rule.path:
            node = node["items"] if step == "*" else node["properties"][step]
        node.setdefault("x-kubernetes-validations", []).append({"rule": rule.cel, "message": rule.message})


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
