"""Create-or-patch of one child: idempotent, 409-tolerant, and a no-op when the live object already matches.

Each child carries the manifest last applied to it (an annotation, as `kubectl apply` does), so a field dropped
from the desired manifest is removed from the live object, while fields the apiserver or other controllers add
are left alone.
"""

from __future__ import annotations

import json
from decimal import InvalidOperation

from kubernetes.utils import parse_quantity

from areal_k8s.k8s_operator import names
from areal_k8s.k8s_operator.children import CHILD_KINDS
from areal_k8s.k8s_operator.kube import ApiError, KubeApi, object_path

QUANTITY_MAPS = {"requests", "limits"}  # the apiserver rewrites quantities: "0.5" comes back as "500m"


def merge_patch(last_applied: dict, desired: dict) -> dict:
    """An RFC 7386 merge patch to `desired` that also deletes keys the last applied manifest set and `desired`
    no longer has. Lists are replaced whole, which suits containers, env, volumes and tolerations."""
    patch = dict(desired)
    for key, before in last_applied.items():
        if key not in desired:
            patch[key] = None
        elif isinstance(before, dict) and isinstance(desired[key], dict):
            patch[key] = merge_patch(before, desired[key])
    return patch


def _same_quantity(a: object, b: object) -> bool:
    try:
        return parse_quantity(a) == parse_quantity(b)
    except (ValueError, TypeError, InvalidOperation):
        return False


def is_subset(desired: object, live: object, *, quantities: bool = False) -> bool:
    """Does `live` already hold everything `desired` says (extra live fields are fine)?"""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            key in live and is_subset(value, live[key], quantities=quantities or key in QUANTITY_MAPS)
            for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, v, quantities=quantities) for d, v in zip(desired, live))
        )
    return desired == live or (quantities and _same_quantity(desired, live))


def with_last_applied(desired: dict) -> dict:
    body = json.loads(json.dumps(desired))
    annotations = body["metadata"].setdefault("annotations", {})
    annotations[names.LAST_APPLIED_ANNOTATION] = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    return body


def last_applied_of(live: dict) -> dict:
    text = (live.get("metadata", {}).get("annotations") or {}).get(names.LAST_APPLIED_ANNOTATION)
    try:
        return json.loads(text) if text else {}
    except ValueError:  # someone edited it by hand: fall back to a plain merge
        return {}


def paths_of(child: dict) -> tuple[str, str]:
    """(collection path, object path) of a child manifest."""
    api_version, plural = CHILD_KINDS[child["kind"]]
    meta = child["metadata"]
    return object_path(api_version, plural, meta["namespace"]), object_path(
        api_version, plural, meta["namespace"], meta["name"]
    )


def apply(kube: KubeApi, desired: dict) -> dict:
    """Make the live child match `desired`; returns the live object."""
    collection, path = paths_of(desired)
    body = with_last_applied(desired)
    live = kube.get(path)
    if live is None:
        try:
            return kube.create(collection, body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            live = kube.get(path)  # created meanwhile (kopf may run a create handler twice): patch it instead
            if live is None:
                raise
    if is_subset(body, live):
        return live
    return kube.patch(path, merge_patch(last_applied_of(live), body))


def create_once(kube: KubeApi, desired: dict) -> dict:
    """Create `desired` unless it exists; an existing one is left as it is, never patched (a generated secret
    keeps the value the pods already read)."""
    collection, path = paths_of(desired)
    live = kube.get(path)
    if live is not None:
        return live
    try:
        return kube.create(collection, desired)
    except ApiError as exc:
        if exc.status != 409:
            raise
        live = kube.get(path)  # created meanwhile (kopf may run a create handler twice)
        if live is None:
            raise
        return live
