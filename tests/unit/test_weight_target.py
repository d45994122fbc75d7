"""One definition of the five weight operations (common/weight_target.py), and every implementation written against
it: each defines every operation itself (none falls back on the protocol's empty body), with the protocol's
parameters, in its order, of its kinds and with its defaults; what an implementation adds must have a default."""

import inspect

import pytest

from areal_k8s.common.sglang import CpuEngineClient, SGLangClient
from areal_k8s.common.weight_target import WeightTarget
from areal_k8s.cpu_engine.engine import CpuEngine
from areal_k8s.trainer.weights.targets import RolloutTarget

OPERATIONS = [
    name for name, member in vars(WeightTarget).items() if inspect.iscoroutinefunction(member) and name[0] != "_"
]
IMPLEMENTATIONS = [SGLangClient, CpuEngineClient, RolloutTarget, CpuEngine]


def test_the_protocol_names_the_five_weight_operations():
    assert sorted(OPERATIONS) == [
        "continue_generation",
        "destroy_weights_update_group",
        "init_weights_update_group",
        "pause_generation",
        "update_weights_from_distributed",
    ]


def defining_class(implementation: type, name: str) -> type:
    return next(klass for klass in implementation.__mro__ if name in vars(klass))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_an_implementation_takes_the_protocols_parameters(implementation, operation):
    assert issubclass(implementation, WeightTarget)
    assert defining_class(implementation, operation) is not WeightTarget, f"{implementation.__name__} lacks {operation}"
    wanted = inspect.signature(getattr(WeightTarget, operation)).parameters
    has = inspect.signature(getattr(implementation, operation)).parameters
    for name, parameter in wanted.items():
        assert name in has, f"{implementation.__name__}.{operation} has no parameter {name!r}"
        assert has[name].kind == parameter.kind, f"{implementation.__name__}.{operation}({name}): {has[name].kind}"
        assert has[name].default == parameter.default, f"{implementation.__name__}.{operation}({name}) default"
    wanted_positional = [n for n, p in wanted.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    has_positional = [n for n, p in has.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert has_positional[: len(wanted_positional)] == wanted_positional, f"{operation}: {has_positional}"
    extra = {n: p for n, p in has.items() if n not in wanted and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert all(p.default is not p.empty for p in extra.values()), f"{operation}: {sorted(extra)} need defaults"
