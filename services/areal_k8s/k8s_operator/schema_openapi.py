"""Builders of the OpenAPI v3.0 nodes the CRD's hand-written (Kubernetes) parts are made of."""

from __future__ import annotations


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
