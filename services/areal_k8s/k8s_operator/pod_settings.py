"""A role's pod settings (spec.roles.<role>: env, envFrom, affinity, priorityClassName, serviceAccountName,
imagePullSecrets, labels, annotations, volumes, volumeMounts) merged into the pod template the operator builds.

The operator's own parts win, and a setting that would replace one is refused (InvalidSpec, so the RLJob reports
InvalidSpec naming the field) rather than dropped: an environment variable it sets in a container (the Redis URL,
the trainer's rendezvous and world size, HOME on the scratch volume...), a label its Services and selectors find
the pods by, its config-hash annotation, a volume name or a mount path it uses. `envFrom` cannot clash: Kubernetes
gives `env` precedence over it.
"""

from __future__ import annotations

from areal_k8s.k8s_operator.valid_job import InvalidSpec

POD_SPEC_FIELDS = ("affinity", "priorityClassName", "serviceAccountName", "imagePullSecrets")


def conflicts(role: str, block: dict, template: dict) -> list[str]:
    """What in the role's settings would replace a part of the operator's `template`."""
    where, spec, problems = f"spec.roles.{role}", template["spec"], []
    for i, variable in enumerate(block.get("env", [])):
        setters = [c["name"] for c in spec["containers"] if any(e["name"] == variable["name"] for e in c["env"])]
        if setters:
            problems.append(
                f"{where}.env[{i}].name: {variable['name']} is set by the operator in the {' and '.join(setters)} "
                "container(s) and cannot be overridden"
            )
    for field, reason in (
        ("labels", "the operator's Services and selectors find the pods by it"),
        ("annotations", "the operator rolls the pods with it"),
    ):
        for key in sorted(set(block.get(field, {})) & set(template["metadata"][field])):
            problems.append(f"{where}.{field}: {key} is the operator's ({reason})")
    # the trainer's checkpoint volume comes from its StatefulSet's claim template: its mounts name it
    mounted = [m for c in spec["containers"] for m in c["volumeMounts"]]
    own_volumes = {v["name"] for v in spec["volumes"]} | {m["name"] for m in mounted}
    extra_volumes = {v["name"] for v in block.get("volumes", [])}
    for i, volume in enumerate(block.get("volumes", [])):
        if volume["name"] in own_volumes:
            problems.append(f"{where}.volumes[{i}].name: {volume['name']} is a volume of the operator's; use another")
    own_paths = {m["mountPath"]: m["name"] for m in mounted}
    for i, mount in enumerate(block.get("volumeMounts", [])):
        if mount["name"] not in extra_volumes:
            problems.append(f"{where}.volumeMounts[{i}].name: {mount['name']} is not a volume of {where}.volumes")
        if mount["mountPath"] in own_paths:
            problems.append(
                f"{where}.volumeMounts[{i}].mountPath: the operator mounts {own_paths[mount['mountPath']]} at "
                f"{mount['mountPath']}"
            )
    return problems


def add_pod_settings(role: str, block: dict, template: dict) -> dict:
    """`template` with the role's settings added; InvalidSpec if one would replace a part of the operator's."""
    problems = conflicts(role, block, template)
    if problems:
        raise InvalidSpec(problems)
    spec = template["spec"]
    for container in spec["containers"]:
        container["env"] = [*container["env"], *block.get("env", [])]
        if block.get("envFrom"):
            container["envFrom"] = block["envFrom"]
        container["volumeMounts"] = [*container["volumeMounts"], *block.get("volumeMounts", [])]
    spec["volumes"] = [*spec["volumes"], *block.get("volumes", [])]
    spec.update({field: block[field] for field in POD_SPEC_FIELDS if block.get(field)})
    template["metadata"]["labels"] = {**block.get("labels", {}), **template["metadata"]["labels"]}
    template["metadata"]["annotations"] = {**block.get("annotations", {}), **template["metadata"]["annotations"]}
    return template
