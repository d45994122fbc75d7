"""The built-in "code" verifier: run the response's program against the problem's tests in the sandbox.

The program is the response's last ```python (or ```py, or bare ```) fenced block, else the whole response.
The reference is JSON in one of the two common dataset shapes:
- stdin/stdout cases: `[{"input": "1 2\\n", "output": "3\\n"}, ...]` or `{"inputs": [...], "outputs": [...]}`.
  Each case is one sandbox run with the input on stdin; it passes when the program exits 0 and its stdout equals
  the expected output line by line, whitespace-normalised (runs of blanks collapse, leading and trailing
  whitespace and blank lines at either end are ignored). This process compares the outputs: the program cannot
  forge a pass.
- assert-style tests on a function: `{"asserts": ["assert add(1, 2) == 3", ...]}`. One run: the program, then each
  test in its namespace; passes are read from the harness's result channel (see sandbox_harness.py), never
  from the program's output, and count only if the harness reached its end.
  Limit: the tests share the program's interpreter, so a program written to introspect the harness (its frames)
  could find the run's token, and a test trusts its own comparison (an object whose __eq__ is always True passes
  `==`). Prints, early exits, signals and replaced builtins cannot forge a pass; a deliberate attack on the
  harness stays inside the sandbox.
Score: the fraction of tests passed, or 1/0 for all/not all ("all"): the service's `reward.code.scoring`, which an
item's metadata `scoring` overrides. The reason names the count and the first failure. A run the sandbox had to
kill (wall clock, output cap, signal) ends the item: its remaining stdin cases count as failed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Literal, NamedTuple

from areal_k8s.common.config import CodeRewardConfig
from areal_k8s.common.sandbox import Sandbox, SandboxLimits, SandboxResult, limits_from_config

Scoring = Literal["fraction", "all"]
SCORINGS = ("fraction", "all")
FENCED_BLOCK = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


class Verdict(NamedTuple):
    """A verifier's reward with the reason for it (the ScoreResult message)."""

    reward: float
    reason: str


@dataclass(frozen=True)
class CodeSettings:
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    scoring: Scoring = "fraction"


@dataclass(frozen=True)
class StdioCase:
    input: str
    output: str


_settings = CodeSettings()


def settings_from_config(config: CodeRewardConfig) -> CodeSettings:
    return CodeSettings(limits_from_config(config), config.scoring)


def configure(settings: CodeSettings) -> None:
    """Set this process's sandbox limits and default scoring (the pool calls it in each worker)."""
    global _settings
    _settings = settings


@cache
def sandbox_for(limits: SandboxLimits) -> Sandbox:
    return Sandbox(limits)


def code_reward(prompt: str, response: str, reference: str, metadata: Mapping[str, str]) -> Verdict:
    tests = parse_tests(reference)
    scoring = metadata.get("scoring", _settings.scoring)
    if scoring not in SCORINGS:
        raise ValueError(f"metadata scoring must be one of {SCORINGS}, got {scoring!r}")
    program = extract_program(response)
    if not program.strip():
        return Verdict(0.0, "the response holds no program")
    sandbox = sandbox_for(_settings.limits)
    if isinstance(tests, list):
        passed, failure = run_stdio_cases(sandbox, program, tests, stop_at_first_failure=scoring == "all")
        total = len(tests)
    else:
        total = len(tests["asserts"])
        passed, failure = run_assert_tests(sandbox, program, tests["asserts"])
    reward = passed / total if scoring == "fraction" else float(passed == total)
    reason = f"{passed}/{total} tests passed" + (f"; {failure}" if failure else "")
    return Verdict(reward, reason)


def parse_tests(reference: str) -> list[StdioCase] | dict[str, list[str]]:
    """The reference's tests; ValueError (the item scores as an error, not a 0) if it is not one of the shapes."""
    try:
        data = json.loads(reference)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the code verifier's reference must be JSON tests: {exc}") from None
    if isinstance(data, dict) and "inputs" in data and "outputs" in data:
        if len(data["inputs"]) != len(data["outputs"]):
            raise ValueError("reference inputs and outputs differ in length")
        data = [{"input": i, "output": o} for i, o in zip(data["inputs"], data["outputs"])]
    if isinstance(data, list) and data and all(isinstance(c, dict) and {"input", "output"} <= c.keys() for c in data):
        if not all(isinstance(c["input"], str) and isinstance(c["output"], str) for c in data):
            raise ValueError("reference stdin/stdout cases need string input and output")
        return [StdioCase(c["input"], c["output"]) for c in data]
    if isinstance(data, dict) and isinstance(data.get("asserts"), list) and data["asserts"]:
        if not all(isinstance(test, str) for test in data["asserts"]):
            raise ValueError("reference asserts must be strings of Python code")
        return {"asserts": data["asserts"]}
    raise ValueError(
        'the code verifier\'s reference must be a non-empty list of {"input", "output"} cases, '
        '{"inputs": [...], "outputs": [...]} or {"asserts": [...]}'
    )


def extract_program(response: str) -> str:
    blocks = FENCED_BLOCK.findall(response)
    return blocks[-1] if blocks else response


def normalised_lines(text: str) -> list[str]:
    lines = [" ".join(line.split()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def run_stdio_cases(
    sandbox: Sandbox, program: str, cases: list[StdioCase], *, stop_at_first_failure: bool
) -> tuple[int, str]:
    passed, first_failure = 0, ""
    for index, case in enumerate(cases):
        result = sandbox.run_program(program, case.input.encode())
        failure = result.failure(sandbox.limits)
        if failure is None:
            got = normalised_lines(result.stdout.decode("utf-8", "replace"))
            if got == normalised_lines(case.output):
                passed += 1
                continue
            got = shorten(result.stdout.decode("utf-8", "replace"))
            failure = f"wrong output: expected {shorten(case.output)}, got {got}"
        first_failure = first_failure or f"test {index}: {failure}"
        if stop_at_first_failure or was_killed(result):
            break
    return passed, first_failure


def run_assert_tests(sandbox: Sandbox, program: str, tests: list[str]) -> tuple[int, str]:
    result, token = sandbox.run_asserts(program, tests)
    passed, failures, done, program_error = set(), [], False, ""
    for line in result.report.decode("utf-8", "replace").splitlines():
        mark, _, rest = line.partition(" ")
        if mark != token:
            continue  # not the harness's (the program may write to the channel, but not with the token)
        kind, _, detail = rest.partition(" ")
        if kind == "pass":
            passed.add(detail)
        elif kind == "fail":
            index, _, why = detail.partition(" ")
            failures.append(f"test {index}: {why}")
        elif kind == "program":
            program_error = detail
        elif kind == "done":
            done = True
    if not done:
        why = result.failure(sandbox.limits) or "exit code 0"
        return 0, f"the run ended before the tests finished ({why})"
    if program_error:
        return 0, f"the program raised {program_error}"
    return len(passed), failures[0] if failures else ""


def was_killed(result: SandboxResult) -> bool:
    return result.timed_out or result.output_exceeded or result.returncode > 128


def shorten(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
