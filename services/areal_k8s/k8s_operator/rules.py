"""Cross-field rules of the RLJob spec: each is a CEL rule in the CRD and the same check in Python.

The apiserver enforces the CEL form (`x-kubernetes-validations`); the operator runs the Python form on every
reconcile, because an object can reach it without the apiserver's checks (an older CRD, a test apiserver) and a
bad spec must end as a condition, never as a crash loop. Both read the object after the CRD's defaults are applied.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from areal_k8s.k8s_operator.names import MAX_NAME_LENGTH, RESERVED_VOLUME_PREFIX

DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


@dataclass(frozen=True)
class Rule:
    path: tuple[str, ...]  # where the rule sits: property names from the object root, "*" for every list item
    cel: str
    message: str
    holds: Callable[[dict], bool]  # the Python form, given the same node `self` is bound to in CEL

    @property
    def where(self) -> str:
        return ".".join(self.path) or "(object)"


def _role_gpus(spec: dict, role: str) -> int:
    block = spec["roles"][role]
    return block["replicas"] * block["gpusPerPod"]


def _replica_bounds(role: str) -> list[Rule]:
    path = ("spec", "roles", role)
    return [
        Rule(
            path,
            "!has(self.minReplicas) || self.minReplicas <= self.replicas",
            f"roles.{role}: replicas must be at least minReplicas",
            lambda r: "minReplicas" not in r or r["minReplicas"] <= r["replicas"],
        ),
        Rule(
            path,
            "!has(self.maxReplicas) || self.replicas <= self.maxReplicas",
            f"roles.{role}: replicas must be at most maxReplicas",
            lambda r: "maxReplicas" not in r or r["replicas"] <= r["maxReplicas"],
        ),
        Rule(
            path,
            "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
            f"roles.{role}: minReplicas must not exceed maxReplicas",
            lambda r: "minReplicas" not in r or "maxReplicas" not in r or r["minReplicas"] <= r["maxReplicas"],
        ),
    ]


RULES: list[Rule] = [
    Rule(
        (),
        f"self.metadata.name.matches('{DNS_1035_LABEL}') && size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be a DNS-1035 label (lower-case letter first) of at most {MAX_NAME_LENGTH} characters: "
        "it names the job's Services and StatefulSet",
        lambda o: (
            bool(re.match(DNS_1035_LABEL, o["metadata"]["name"])) and len(o["metadata"]["name"]) <= MAX_NAME_LENGTH
        ),
    ),
    Rule(
        ("spec",),
        "self.model.startsWith('/')",
        "model must be an absolute path inside the pods (mount it with spec.mounts or bake it into the images)",
        lambda s: s["model"].startswith("/"),
    ),
    Rule(
        ("spec", "dataset"),
        "self.train.startsWith('/')",
        "dataset.train must be an absolute path inside the pods",
        lambda d: d["train"].startswith("/"),
    ),
    Rule(
        ("spec", "staleness", "targetBand"),
        "double(self.min) <= double(self.max)",
        "staleness.targetBand: min must not exceed max",
        lambda b: b["min"] <= b["max"],
    ),
    Rule(
        ("spec", "staleness"),
        "!has(self.targetBand) || double(self.targetBand.max) <= double(self.eta)",
        "staleness.targetBand.max must not exceed eta: measured staleness never goes above eta",
        lambda s: "targetBand" not in s or s["targetBand"]["max"] <= s["eta"],
    ),
    Rule(
        ("spec",),
        "!has(self.queueName) || !self.rebalance.enabled",
        "queueName and rebalance.enabled exclude each other: Kueue admits fixed pod counts per role, which the "
        "rebalancer would change",
        lambda s: "queueName" not in s or not s["rebalance"]["enabled"],
    ),
    *_replica_bounds("rollout"),
    *_replica_bounds("reward"),
    *_replica_bounds("trainer"),
    Rule(
        ("spec", "roles", "trainer"),
        "(!has(self.minReplicas) && !has(self.maxReplicas)) || "
        "(self.parallelism.tensor * self.parallelism.pipeline) % (self.gpusPerPod > 0 ? self.gpusPerPod : 1) == 0",
        "roles.trainer: a trainer the rebalancer resizes (minReplicas or maxReplicas) moves by data-parallel replicas, "
        "so tensor × pipeline must fill whole pods (a multiple of gpusPerPod)",
        lambda t: (
            ("minReplicas" not in t and "maxReplicas" not in t)
            or (t["parallelism"]["tensor"] * t["parallelism"]["pipeline"]) % max(t["gpusPerPod"], 1) == 0
        ),
    ),
    Rule(
        ("spec", "roles", "trainer"),
        "self.replicas * (self.gpusPerPod > 0 ? self.gpusPerPod : 1) == "
        "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data",
        "roles.trainer: ranks (replicas × gpusPerPod, one rank per pod without GPUs) must equal "
        "parallelism.tensor × pipeline × data",
        lambda t: (
            t["replicas"] * max(t["gpusPerPod"], 1)
            == t["parallelism"]["tensor"] * t["parallelism"]["pipeline"] * t["parallelism"]["data"]
        ),
    ),
    Rule(
        ("spec",),
        "(self.rollout.engine == 'sglang') == (self.roles.rollout.gpusPerPod > 0)",
        "rollout.engine sglang needs roles.rollout.gpusPerPod > 0, and the cpu engine uses no GPUs",
        lambda s: (s["rollout"]["engine"] == "sglang") == (s["roles"]["rollout"]["gpusPerPod"] > 0),
    ),
    Rule(
        ("spec",),
        "(self.trainer.device == 'cuda') == (self.roles.trainer.gpusPerPod > 0)",
        "trainer.device cuda needs roles.trainer.gpusPerPod > 0, and device cpu uses no GPUs",
        lambda s: (s["trainer"]["device"] == "cuda") == (s["roles"]["trainer"]["gpusPerPod"] > 0),
    ),
    Rule(
        ("spec",),
        "!has(self.gpuBudget) || self.roles.rollout.replicas * self.roles.rollout.gpusPerPod"
        " + self.roles.reward.replicas * self.roles.reward.gpusPerPod"
        " + self.roles.trainer.replicas * self.roles.trainer.gpusPerPod <= self.gpuBudget",
        "the GPUs the roles request (replicas × gpusPerPod, summed) exceed gpuBudget",
        lambda s: (
            "gpuBudget" not in s or sum(_role_gpus(s, r) for r in ("rollout", "reward", "trainer")) <= s["gpuBudget"]
        ),
    ),
    Rule(
        ("spec",),
        "!self.rebalance.enabled || has(self.staleness.targetBand)",
        "rebalance.enabled needs staleness.targetBand: the band is what the rebalancer holds",
        lambda s: not s["rebalance"]["enabled"] or "targetBand" in s["staleness"],
    ),
    Rule(
        ("spec",),
        "!self.rebalance.enabled || has(self.roles.rollout.maxReplicas) || "
        "(has(self.gpuBudget) && self.roles.rollout.gpusPerPod > 0)",
        "rebalance.enabled needs a ceiling for the rollout pool: roles.rollout.maxReplicas, or gpuBudget with "
        "GPU rollout pods",
        lambda s: (
            not s["rebalance"]["enabled"]
            or "maxReplicas" in s["roles"]["rollout"]
            or ("gpuBudget" in s and s["roles"]["rollout"]["gpusPerPod"] > 0)
        ),
    ),
    Rule(
        ("spec", "redis"),
        "has(self.url) != has(self.urlSecretRef)",
        "redis: set exactly one of url and urlSecretRef",
        lambda r: ("url" in r) != ("urlSecretRef" in r),
    ),
    Rule(
        ("spec", "checkpoint"),
        "has(self.claimName) != has(self.volumeClaimTemplate)",
        "checkpoint: set exactly one of claimName and volumeClaimTemplate",
        lambda c: ("claimName" in c) != ("volumeClaimTemplate" in c),
    ),
    Rule(
        ("spec", "mounts", "*"),
        "has(self.persistentVolumeClaim) != has(self.image)",
        "mounts: each mount needs exactly one source, persistentVolumeClaim or image",
        lambda m: ("persistentVolumeClaim" in m) != ("image" in m),
    ),
    Rule(
        ("spec", "mounts", "*"),
        f"!self.name.startsWith('{RESERVED_VOLUME_PREFIX}')",
        f"mounts: names starting with {RESERVED_VOLUME_PREFIX!r} are reserved for the operator's own volumes",
        lambda m: not m["name"].startswith(RESERVED_VOLUME_PREFIX),
    ),
]


def nodes_at(obj: object, path: tuple[str, ...]) -> list[object]:
    """Every node of `obj` at `path` (several below a "*"); none where a step is absent."""
    if not path:
        return [obj]
    step, rest = path[0], path[1:]
    if step == "*":
        return [found for item in obj for found in nodes_at(item, rest)] if isinstance(obj, list) else []
    if isinstance(obj, dict) and step in obj:
        return nodes_at(obj[step], rest)
    return []


def broken_rules(obj: dict) -> list[Rule]:
    """The rules `obj` (an RLJob with the CRD's defaults applied) breaks, in RULES order."""
    return [rule for rule in RULES if any(not rule.holds(node) for node in nodes_at(obj, rule.path))]
