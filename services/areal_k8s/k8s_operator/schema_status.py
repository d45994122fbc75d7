"""The RLJob's status, as the operator writes it, and the columns `kubectl get rljobs` shows from it."""

from __future__ import annotations

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.schema_openapi import integer, obj, string


def condition_schema() -> dict:
    return obj(
        "A metav1.Condition.",
        {
            "type": string("Ready, Progressing, Degraded, Suspended, Complete, Failed, Rebalancing or Admitted."),
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
            "phase": string(
                "Queued (waiting for Kueue), Running, Suspended, Succeeded or Failed.",
                enum=["Queued", "Running", "Suspended", "Succeeded", "Failed"],
            ),
            "progress": string("Training steps done of the total, as `37/200`."),
            "accuracy": {"type": "number", "description": "The latest held-out accuracy (dataset.eval)."},
            "conditions": {
                "type": "array",
                "description": "Ready, Progressing, Degraded, Suspended, Complete, Failed, Rebalancing, and Admitted "
                "(Kueue's admission, for a job with a queue).",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
                "items": condition_schema(),
            },
            "replicas": obj(
                "Per role (and the agent runners).", dict.fromkeys((*names.ROLES, names.AGENTS), role_replicas)
            ),
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
            "backups": obj(
                "Backups of the stragglers the trainer waited on (rollout.backup_stragglers): the same prompt "
                "generated again on another worker; each group is counted once under groups, whichever copy won.",
                {
                    "started": integer("Backups started."),
                    "won": integer("Backups written before their original, which was revoked."),
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
                    "lost": integer(
                        "Accepted groups whose stream entries Redis lost (it came back without its last writes); "
                        "their prompts were admitted again."
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


def printer_columns() -> list[dict]:
    def condition(kind: str, field: str = "status") -> str:
        return f'.status.conditions[?(@.type=="{kind}")].{field}'

    return [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "string", "jsonPath": ".status.progress", "description": "Steps trained of the total"},
        {"name": "Accuracy", "type": "number", "jsonPath": ".status.accuracy", "description": "Held-out accuracy"},
        {"name": "Staleness", "type": "number", "jsonPath": ".status.staleness.mean", "description": "Mean staleness"},
        {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "description": "Container restarts"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        # -o wide
        {"name": "Samples/s", "type": "number", "jsonPath": ".status.throughput.samplesPerSecond", "priority": 1},
        {"name": "Tokens/s", "type": "number", "jsonPath": ".status.throughput.tokensPerSecond", "priority": 1},
        {
            "name": "Rollout",
            "type": "integer",
            "jsonPath": ".status.replicas.rollout.ready",
            "description": "Ready rollout pods",
            "priority": 1,
        },
        {
            "name": "Trainer",
            "type": "integer",
            "jsonPath": ".status.replicas.trainer.ready",
            "description": "Ready trainer pods",
            "priority": 1,
        },
        {"name": "Ready", "type": "string", "jsonPath": condition("Ready"), "priority": 1},
        {"name": "Reason", "type": "string", "jsonPath": condition("Ready", "reason"), "priority": 1},
    ]
