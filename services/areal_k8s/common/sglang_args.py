"""SGLang server arguments a job passes to its engines (`rollout.sglang_args`), checked against the pinned SGLang's
own argument list.

sglang_server_args.json is that list: every long option of `sglang.launch_server` in the pinned version, keyed by its
name with underscores (`mem_fraction_static` for --mem-fraction-static), with the ServerArgs field it sets and how many
values it takes. It is generated from SGLang's own parser in the SGLang env (`make sglang-env`):
`python -m areal_k8s_testing.sglang_arguments --write`; tests/service/test_sglang_contract.py checks it is
current.
"""

from __future__ import annotations

import difflib
import json
from functools import cache
from pathlib import Path
from typing import Any

ARGUMENTS_FILE = Path(__file__).with_name("sglang_server_args.json")

# ServerArgs fields areal sets itself (on the engine in a rollout pod, and on a local SGLangServer), and where a job
# says what it wants instead. Keyed by field, so every spelling of an option (--tp and --tp-size) is caught.
RESERVED = {
    "model_path": "the job's `model` (spec.model)",
    "tokenizer_path": "the job's `tokenizer` (spec.tokenizer)",
    "host": "nothing: the engine listens on loopback, beside its rollout agent",
    "port": "nothing: areal picks the engine's port",
    "random_seed": "the job's `seed`",
    "tp_size": "roles.rollout.gpusPerPod (the engine is tensor-parallel over its pod's GPUs)",
    "dp_size": "roles.rollout.replicas (one engine per rollout pod)",
    "pp_size": "roles.rollout.gpusPerPod (the engine is tensor-parallel over its pod's GPUs)",
    "nnodes": "roles.rollout.replicas (one engine per rollout pod, on one node)",
    "node_rank": "roles.rollout.replicas (one engine per rollout pod, on one node)",
    "dist_init_addr": "roles.rollout.replicas (one engine per rollout pod, on one node)",
    "api_key": "nothing: the rollout agent calls its engine without a key, over loopback",
    "config": "rollout.sglang_args itself (one argument per key)",
}


class SGLangArgumentError(ValueError):
    """An argument the pinned SGLang does not have, one areal sets itself, or a value of the wrong shape."""


@cache
def known_arguments() -> dict[str, dict[str, str]]:
    return json.loads(ARGUMENTS_FILE.read_text())


def check_sglang_args(arguments: dict[str, Any]) -> dict[str, Any]:
    """`arguments` if every name is one of the pinned SGLang's and not areal's to set; SGLangArgumentError otherwise,
    naming each bad argument (with the names it may have meant)."""
    known, problems = known_arguments(), []
    for name, value in arguments.items():
        spec = known.get(name)
        if spec is None:
            problems.append(unknown(name, known))
        elif spec["field"] in RESERVED:
            problems.append(f"{name} is set by areal; use {RESERVED[spec['field']]}")
        elif spec["takes"] == "switch" and value is not True:
            problems.append(f"{name} is a switch: set it to true, or leave it out")
        elif spec["takes"] == "value" and isinstance(value, list):
            problems.append(f"{name} takes one value, got a list")
        elif value is None:
            problems.append(f"{name} has no value")
    if problems:
        raise SGLangArgumentError("; ".join(problems))
    return arguments


def unknown(name: str, known: dict) -> str:
    spelled = name.lstrip("-").replace("-", "_")
    if spelled in known:
        return f"{name} is written {spelled} (the option's name with underscores, no dashes)"
    close = difflib.get_close_matches(spelled, known, n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return f"{name} is not an argument of the pinned SGLang's server{hint}"


def sglang_flags(arguments: dict[str, Any]) -> list[str]:
    """The command-line flags for checked `arguments`, in their order."""
    flags: list[str] = []
    for name, value in arguments.items():
        spec = known_arguments()[name]
        flags.append(spec["flag"])
        if spec["takes"] == "switch":
            continue
        values = value if isinstance(value, list) else [value]
        flags += [json.dumps(v) if isinstance(v, dict | bool) else str(v) for v in values]
    return flags
