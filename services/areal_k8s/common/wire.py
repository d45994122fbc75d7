"""Plain records (common/trajectory.py) to and from their protobuf messages: the one place where the two meet.

A record's fields carry the names of its message's fields; nested records are nested messages, lists are repeated
fields and dicts are maps. The gRPC shells and the trajectory stream call these; the cores never see a message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from functools import cache
from typing import Any, TypeVar, get_type_hints

from google.protobuf.message import Message

from areal_k8s.api.v1 import common_pb2
from areal_k8s.common.trajectory import PromptGroup, Trajectory

Record = TypeVar("Record")


def to_message(record: Any, message_type: type[Message]) -> Message:
    """`record` as a `message_type`: every field of the record set on the message field of its name."""
    message = message_type()
    for name, _ in _record_fields(type(record)):
        value = getattr(record, name)
        target = getattr(message, name)
        if is_dataclass(value):
            target.CopyFrom(to_message(value, type(target)))
        elif isinstance(value, Mapping):
            target.update(value)
        elif isinstance(value, (list, tuple)):
            target.extend(value)
        elif value is None:  # an optional field left unset
            continue
        else:
            setattr(message, name, value)
    return message


def from_message(message: Message, record_type: type[Record]) -> Record:
    """`message` as a `record_type`: the record's fields read from the message fields of their names."""
    values = {}
    for name, nested in _record_fields(record_type):
        value = getattr(message, name)
        if nested is not None:
            value = from_message(value, nested)
        elif isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
            value = list(value)
        values[name] = value
    return record_type(**values)


@cache
def _record_fields(record_type: type) -> tuple[tuple[str, type | None], ...]:
    """(name, the record type of a nested record field or None) for each field of a record type."""
    hints = get_type_hints(record_type)
    return tuple((f.name, hints[f.name] if is_dataclass(hints[f.name]) else None) for f in fields(record_type))


def group_message(group: PromptGroup) -> common_pb2.PromptGroup:
    return to_message(group, common_pb2.PromptGroup)


def group_record(message: common_pb2.PromptGroup) -> PromptGroup:
    return from_message(message, PromptGroup)


def trajectory_message(trajectory: Trajectory) -> common_pb2.Trajectory:
    return to_message(trajectory, common_pb2.Trajectory)


def trajectory_record(message: common_pb2.Trajectory) -> Trajectory:
    return from_message(message, Trajectory)
