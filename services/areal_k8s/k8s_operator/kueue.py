"""Kueue gang admission: an RLJob with a queue runs only while Kueue admits its Workload.

An RLJob names its LocalQueue with spec.queueName or the `kueue.x-k8s.io/queue-name` label. The operator then
writes a Workload (kueue.x-k8s.io/v1beta2) owned by the RLJob, one pod set per role with the pod template and
count its workload would run, and keeps every workload at zero pods until Kueue admits the Workload: all roles
start together or none does, so a job never holds its rollout GPUs while its trainer is Pending. Admission's
flavors bring their ResourceFlavors' node labels and tolerations into the pods. When Kueue evicts the Workload
(preemption, a deactivated queue), the job stops as for spec.suspend (a checkpoint, then zero pods) and then
hands its quota back; readmitted, it resumes from that checkpoint. A finished job marks its Workload Finished so
Kueue frees its quota. Kueue's own job integrations do the same for Jobs and JobSets; this is the RLJob's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.apply import apply
from areal_k8s.k8s_operator.kube import KubeApi, object_path
from areal_k8s.k8s_operator.pod_templates import metadata
from areal_k8s.k8s_operator.valid_job import ValidJob

PENDING, ADMITTED, EVICTED = "Pending", "Admitted", "Evicted"


def queue_of(rljob: dict) -> str | None:
    """The LocalQueue the RLJob waits in: spec.queueName, else the Kueue label, else none (no Kueue)."""
    labels = rljob.get("metadata", {}).get("labels") or {}
    return rljob.get("spec", {}).get("queueName") or labels.get(names.KUEUE_QUEUE_LABEL) or None


def workload_name(job_name: str) -> str:
    return f"rljob-{job_name}"


def workload_path(namespace: str, job_name: str, subresource: str | None = None) -> str:
    return object_path(names.KUEUE_API, "workloads", namespace, workload_name(job_name), subresource)


def desired_workload(job: ValidJob, queue: str, children: list[dict]) -> dict:
    """The Workload for `job`: a pod set per role, from the workloads `children` holds while running (their pod
    templates carry the GPU and CPU requests Kueue counts against the queue's quota)."""
    pod_sets = [
        {
            "name": child["metadata"]["labels"][names.LABEL_COMPONENT],
            "count": child["spec"]["replicas"],
            "template": child["spec"]["template"],
        }
        for child in children
        if child["kind"] in ("Deployment", "StatefulSet")
    ]
    meta = metadata(job, workload_name(job.name), "workload")
    meta["labels"][names.KUEUE_QUEUE_LABEL] = queue
    return {
        "apiVersion": names.KUEUE_API,
        "kind": "Workload",
        "metadata": meta,
        "spec": {"queueName": queue, "podSets": pod_sets},
    }


@dataclass(frozen=True)
class Admission:
    """Where Kueue stands on the job's Workload."""

    state: str  # Pending | Admitted | Evicted
    message: str
    reserved: bool = False  # Kueue holds quota for it (its pod sets are then immutable)
    flavors: dict[str, list[str]] = field(default_factory=dict)  # pod set -> the ResourceFlavors it was given
    finished: bool = False

    @property
    def admitted(self) -> bool:
        return self.state == ADMITTED


def condition(workload: dict, kind: str) -> dict:
    return next((c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def admission_of(workload: dict | None) -> Admission:
    if workload is None:
        return Admission(PENDING, "the Workload is being created")
    status = workload.get("status") or {}
    reserved = condition(workload, "QuotaReserved").get("status") == "True"
    finished = condition(workload, "Finished").get("status") == "True"
    evicted = condition(workload, "Evicted")
    if evicted.get("status") == "True":
        why = f"{evicted.get('reason', 'Evicted')}: {evicted.get('message', '')}".rstrip(": ")
        return Admission(EVICTED, f"Kueue evicted the Workload ({why})", reserved=reserved, finished=finished)
    if condition(workload, "Admitted").get("status") == "True":
        assignments = (status.get("admission") or {}).get("podSetAssignments") or []
        flavors = {a["name"]: sorted(set((a.get("flavors") or {}).values())) for a in assignments}
        queue = (status.get("admission") or {}).get("clusterQueue", "?")
        return Admission(ADMITTED, f"admitted by ClusterQueue {queue}", True, flavors, finished)
    waiting = condition(workload, "QuotaReserved").get("message") or "waiting for quota"
    return Admission(PENDING, f"queued in {workload['spec'].get('queueName')}: {waiting}", reserved, finished=finished)


@dataclass
class Placement:
    """Where admission puts a pod set: its flavors' node labels, and the tolerations of their taints."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)


def placements(kube: KubeApi, admission: Admission) -> dict[str, Placement]:
    """Per pod set, what the ResourceFlavors (cluster-scoped objects) admission assigned it ask of its pods."""
    out: dict[str, Placement] = {}
    for pod_set, flavors in admission.flavors.items():
        placement = out.setdefault(pod_set, Placement())
        for flavor in flavors:
            spec = (kube.get(f"/apis/{names.KUEUE_API}/resourceflavors/{flavor}") or {}).get("spec") or {}
            placement.node_selector.update(spec.get("nodeLabels") or {})
            placement.tolerations += [t for t in spec.get("tolerations") or [] if t not in placement.tolerations]
    return out


def placed(children: list[dict], where: dict[str, Placement]) -> list[dict]:
    """`children` with each role's pods on the nodes of its admitted flavors, tolerating their taints."""
    out = []
    for child in children:
        placement = where.get(child["metadata"]["labels"].get(names.LABEL_COMPONENT))
        if child["kind"] in ("Deployment", "StatefulSet") and placement:
            child = copy.deepcopy(child)
            pod = child["spec"]["template"]["spec"]
            if placement.node_selector:
                pod["nodeSelector"] = {**pod.get("nodeSelector", {}), **placement.node_selector}
            extra = [t for t in placement.tolerations if t not in pod.get("tolerations", [])]
            if extra:
                pod["tolerations"] = [*pod.get("tolerations", []), *extra]
        out.append(child)
    return out


def with_condition(workload: dict, kind: str, status: str, reason: str, message: str, now: str) -> list[dict]:
    """The Workload's conditions with `kind` set (its transition time kept while its status holds)."""
    before = condition(workload, kind)
    wanted = {"type": kind, "status": status, "reason": reason, "message": message}
    wanted["lastTransitionTime"] = before["lastTransitionTime"] if before.get("status") == status else now
    others = [c for c in (workload.get("status") or {}).get("conditions") or [] if c.get("type") != kind]
    return [*others, wanted]


def release_quota(kube: KubeApi, workload: dict, now: str) -> None:
    """After an eviction, once the job runs no pods: give the quota back, so Kueue queues the Workload again (what
    Kueue's job integrations do for their jobs)."""
    message = condition(workload, "Evicted").get("message") or "evicted"
    conditions = with_condition(workload, "QuotaReserved", "False", "Pending", message, now)
    conditions = with_condition(
        {"status": {"conditions": conditions}}, "Admitted", "False", "NoReservation", message, now
    )
    kube.patch(
        workload_path(
            workload["metadata"]["namespace"], workload["metadata"]["labels"][names.LABEL_INSTANCE], "status"
        ),
        {"status": {"admission": None, "conditions": conditions}},
    )


def mark_finished(kube: KubeApi, workload: dict, succeeded: bool, message: str, now: str) -> None:
    """A finished job's Workload is Finished: Kueue frees its quota."""
    reason = "Succeeded" if succeeded else "Failed"
    conditions = with_condition(workload, "Finished", "True", reason, message, now)
    kube.patch(
        workload_path(
            workload["metadata"]["namespace"], workload["metadata"]["labels"][names.LABEL_INSTANCE], "status"
        ),
        {"status": {"conditions": conditions}},
    )


def sync_workload(kube: KubeApi, job: ValidJob, queue: str, running_children: list[dict]) -> dict:
    """Create the job's Workload, or bring its pod sets up to date while Kueue holds no quota for it (they are
    immutable then: a change waits for the job's next stop); returns the live Workload."""
    desired = desired_workload(job, queue, running_children)
    live = kube.get(workload_path(job.namespace, job.name))
    if live is not None and admission_of(live).reserved:
        return live
    return apply(kube, desired)


def settle(
    kube: KubeApi,
    workload: dict,
    admission: Admission,
    *,
    stopped: bool,
    outcome: tuple[bool, str] | None,
    now: str,
) -> None:
    """What the job owes Kueue after a reconcile: an evicted job that runs no pods any more gives its quota back;
    a finished one (`outcome`: succeeded, message) marks its Workload Finished."""
    if outcome is not None and not admission.finished:
        mark_finished(kube, workload, *outcome, now)
    elif admission.state == EVICTED and admission.reserved and stopped:
        release_quota(kube, workload, now)
