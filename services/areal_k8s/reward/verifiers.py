"""Verifiers: a name resolves to `verifier(prompt, response, reference, metadata) -> reward`.

Built-in names are "math", "addition" (the demo task's answers: addition_verifier.py), "running_sum" (the long-tail
task's work and answers: running_sum_verifier.py), "exact" and "code" (the response's program against the
reference's tests in the sandbox: code_verifier.py). Any other name of the form
"package.module:function" is a custom verifier: a plain Python function taking the same four positional arguments
(prompt, response, reference: str; metadata: dict[str, str]) and returning a finite real number, or a
`Verdict(reward, reason)` (importable from here), whose reason becomes the result's message.
A custom verifier runs only if the job declares it (`reward.verifier` or `reward.allowed_verifiers`): naming one
in a request or a dataset row is not enough, since importing a module runs its code (`check_allowed`).
Verifiers run in pool worker processes, so a slow or crashing one costs its item, never the service.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Collection, Mapping

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from areal_k8s.reward.addition_verifier import addition_reward
from areal_k8s.reward.code_verifier import Verdict, code_reward
from areal_k8s.reward.running_sum_verifier import running_sum_reward

Verifier = Callable[[str, str, str, Mapping[str, str]], float | Verdict]

# The extraction targets AReaL uses for both the reference and the response (math-verify tries their patterns
# by priority, so the order here hardly matters).
MATH_TARGETS = (LatexExtractionConfig(), ExprExtractionConfig(try_extract_without_anchor=True))
# Digits that must agree when comparing floats (AReaL's `precision`).
MATH_FLOAT_ROUNDING = 6


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once per process that its timeouts are off; that is deliberate here (see parse_math)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _logger_name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger_name).addFilter(_DropTimeoutDisabledWarning())


class UnknownVerifier(LookupError):
    """A verifier name that is neither built in nor an importable custom function."""


def math_reward(prompt: str, response: str, reference: str, metadata: Mapping[str, str]) -> float:
    """1.0 iff math-verify finds the response's answer equivalent to the reference; unparseable scores 0.0."""
    gold = parse_reference(reference)
    answer = parse_math(response)
    if not gold or not answer:
        return 0.0
    # math-verify is not symmetric: the reference goes first.
    return 1.0 if verify(gold, answer, float_rounding=MATH_FLOAT_ROUNDING, timeout_seconds=None) else 0.0


def parse_math(text: str) -> list:
    # math-verify's own timeouts use SIGALRM, which only works on a main thread and would fire as a silent 0.0;
    # the pool's per-item timeout is the one limit, and it reports TIMEOUT.
    return parse(text, extraction_config=MATH_TARGETS, parsing_timeout=None)


def parse_reference(reference: str) -> list:
    """Parse a bare reference ("2x+3", "\\sqrt{2}/2") as one LaTeX expression.

    Without LaTeX anchors only the number search applies, which reads "2x+3" as 2 and would accept a wrong "2".
    """
    if "\\boxed" in reference or "$" in reference:
        return parse_math(reference)
    return parse_math(f"\\boxed{{{reference}}}") or parse_math(reference)


def exact_reward(prompt: str, response: str, reference: str, metadata: Mapping[str, str]) -> float:
    return 1.0 if response.strip() == reference.strip() else 0.0


BUILTIN_VERIFIERS: dict[str, Verifier] = {
    "math": math_reward,
    "addition": addition_reward,
    "exact": exact_reward,
    "code": code_reward,
    "running_sum": running_sum_reward,
}


def check_allowed(name: str, allowed: Collection[str]) -> None:
    """Raise UnknownVerifier if `name` is a custom verifier ("module:function") the job has not declared."""
    if ":" in name and name not in allowed:  # other names are built-ins or unknown (resolve says which)
        declared = ", ".join(sorted(allowed)) or "none"
        raise UnknownVerifier(
            f"verifier {name!r} is not allowed: this job runs the built-in verifiers {sorted(BUILTIN_VERIFIERS)} and "
            f"the custom ones its job file declares (reward.verifier, reward.allowed_verifiers: {declared})"
        )


def resolve(name: str) -> Verifier:
    """The verifier called `name`; raises UnknownVerifier saying why a name does not resolve."""
    if name in BUILTIN_VERIFIERS:
        return BUILTIN_VERIFIERS[name]
    module_name, _, function_name = name.partition(":")
    if not module_name or not function_name:
        raise UnknownVerifier(
            f"unknown verifier {name!r}: expected one of {sorted(BUILTIN_VERIFIERS)} or 'package.module:function'"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raises while it loads
        raise UnknownVerifier(f"cannot import verifier module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, function_name):
        raise UnknownVerifier(f"verifier module {module_name!r} has no {function_name!r}")
    function = getattr(module, function_name)
    check_custom_verifier(name, function)
    return function


def check_custom_verifier(name: str, function: object) -> None:
    # Requiring a plain function that accepts the four arguments turns a misspelt or wrong target into a clear
    # request error instead of a failure per item. It is a sanity check, not a sandbox.
    if not inspect.isfunction(function):
        raise UnknownVerifier(f"verifier {name!r} is not a Python function")
    try:
        inspect.signature(function).bind("prompt", "response", "reference", {})
    except TypeError as exc:
        raise UnknownVerifier(f"verifier {name!r} must accept (prompt, response, reference, metadata): {exc}") from exc
