"""The pinned SGLang's server arguments, read from its own parser in the SGLang env (`make sglang-env`), written as
services/areal_k8s/common/sglang_server_args.json (what `rollout.sglang_args` is checked against):
`python -m areal_k8s_testing.sglang_arguments --write`; tests/service/test_sglang_contract.py checks it is current."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from areal_k8s.common.sglang_args import ARGUMENTS_FILE
from areal_k8s_testing.sglang_server import SGLANG_PYTHON, missing_env_reason

# Run by the SGLang env's python: SGLang's own parser, as `sglang.launch_server` builds it.
READ_ARGUMENTS = """
import argparse, json
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
arguments = {}
for action in parser._actions:
    for option in action.option_strings:
        if option.startswith("--") and action.dest != "help":
            takes = "switch" if action.nargs == 0 else "values" if action.nargs in ("+", "*") else "value"
            arguments[option[2:].replace("-", "_")] = {"flag": option, "field": action.dest, "takes": takes}
print(json.dumps(dict(sorted(arguments.items()))))
"""


def read_sglang_arguments(python: Path) -> dict[str, dict[str, str]]:
    """The argument list of the SGLang installed for `python`, read from its own parser."""
    done = subprocess.run([str(python), "-c", READ_ARGUMENTS], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{python} could not read SGLang's arguments:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(arguments: dict) -> str:
    """One argument a line, so a version bump's diff reads as the arguments it adds and removes."""
    return "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in arguments.items()) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal_k8s_testing.sglang_arguments", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--write", action="store_true", help=f"write {ARGUMENTS_FILE.name}")
    args = parser.parse_args(argv)
    reason = missing_env_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    text = render(read_sglang_arguments(SGLANG_PYTHON))
    if args.write:
        ARGUMENTS_FILE.write_text(text)
        print(f"wrote {ARGUMENTS_FILE}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
