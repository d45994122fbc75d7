"""Code datasets: problem + tests JSONL in the common shapes, turned into items the `code` verifier scores.

Fields (`dataset.code`): the problem is the first of `prompt_fields` present, the tests the first of
`tests_fields` present; a tests value may be JSON text (APPS, LiveCodeBench) or JSON itself. The shapes read:
- stdin/stdout cases: `[{"input": ..., "output": ...}, ...]` (DeepCoder, LiveCodeBench's `"testtype": "stdin"`),
  or `{"inputs": [...], "outputs": [...]}` (APPS `input_output`); a case given as a list of lines is joined with
  newlines;
- call-based: APPS's `{"inputs": [[args...]], "outputs": [[result]], "fn_name": "f"}` becomes asserts
  `assert f(*args) == result` (APPS wraps each result in a one-element list: that list is unwrapped);
- assert-style: a list of assert statements (MBPP's `test_list`), or `{"asserts": [...]}`.
The item's reference is the verifier's JSON (`[{"input", "output"}]` or `{"asserts": [...]}`, see
services/areal_k8s/reward/code_verifier.py), its verifier `code`, its prompt the problem followed by `instruction`.
"""

from __future__ import annotations

import json
from typing import Any

from areal_k8s.common.config import CodeDatasetConfig

VERIFIER = "code"


class CodeRecordError(ValueError):
    """What is wrong with one code record (the loader adds the file and line)."""


def is_code_record(record: dict, config: CodeDatasetConfig) -> bool:
    return any(field in record for field in config.tests_fields)


def parse_code_record(record: dict, config: CodeDatasetConfig) -> tuple[str, str]:
    """(prompt, reference) of one record."""
    prompt_field = next((f for f in config.prompt_fields if f in record), None)
    tests_field = next((f for f in config.tests_fields if f in record), None)
    if prompt_field is None or tests_field is None:
        missing = config.prompt_fields if prompt_field is None else config.tests_fields
        raise CodeRecordError(f"a code record needs one of the keys {list(missing)}, got {sorted(record)}")
    problem = record[prompt_field]
    if not isinstance(problem, str) or not problem.strip():
        raise CodeRecordError(f"{prompt_field!r} must be a non-empty string")
    tests = record[tests_field]
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as exc:
            raise CodeRecordError(f"{tests_field!r} is text but not JSON: {exc.msg}") from None
    try:
        reference = verifier_tests(tests)
    except CodeRecordError as exc:
        raise CodeRecordError(f"{tests_field!r}: {exc}") from None
    return problem + config.instruction, json.dumps(reference)


def verifier_tests(tests: Any) -> list[dict[str, str]] | dict[str, list[str]]:
    if isinstance(tests, dict) and "asserts" in tests:
        return {"asserts": _asserts(tests["asserts"])}
    if isinstance(tests, dict) and {"inputs", "outputs"} <= tests.keys():
        inputs, outputs = tests["inputs"], tests["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
            raise CodeRecordError("inputs and outputs must be non-empty lists of one length")
        if tests.get("fn_name"):
            return {"asserts": [_call_assert(tests["fn_name"], args, result) for args, result in zip(inputs, outputs)]}
        return [{"input": _text(i), "output": _text(o)} for i, o in zip(inputs, outputs)]
    if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
        return {"asserts": _asserts(tests)}
    if isinstance(tests, list) and tests and all(isinstance(t, dict) for t in tests):
        if any(t.get("testtype", "stdin") != "stdin" for t in tests):
            raise CodeRecordError(
                "only stdin/stdout cases are read from a list of cases (a functional test needs fn_name)"
            )
        if not all({"input", "output"} <= t.keys() for t in tests):
            raise CodeRecordError('every case needs "input" and "output"')
        return [{"input": _text(t["input"]), "output": _text(t["output"])} for t in tests]
    raise CodeRecordError(
        'expected stdin/stdout cases ([{"input", "output"}] or {"inputs", "outputs"}), '
        '{"inputs", "outputs", "fn_name"}, or assert statements'
    )


def _text(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value) + "\n"
    if not isinstance(value, str):
        raise CodeRecordError(f"a stdin/stdout case must be text, got {type(value).__name__}")
    return value


def _asserts(tests: Any) -> list[str]:
    if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t.strip() for t in tests):
        raise CodeRecordError("asserts must be a non-empty list of statements")
    return tests


def _call_assert(function: str, args: Any, result: Any) -> str:
    if not function.isidentifier():
        raise CodeRecordError(f"fn_name must be a Python name, got {function!r}")
    if not isinstance(args, list):
        raise CodeRecordError(f"call-based inputs must be argument lists, got {type(args).__name__}")
    expected = result[0] if isinstance(result, list) and len(result) == 1 else result
    return f"assert {function}(*{args!r}) == {expected!r}"
