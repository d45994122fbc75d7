"""The program inside the sandbox: `python -I -B -c <this file's text> JOB_FD RESULT_FD` (see sandbox.py).

It reads its job (the untrusted program, the rlimits, and for assert-style tests the tests and the run's token)
from JOB_FD and closes it before any untrusted code runs, so neither the tests nor the token exist as a file or an
open descriptor the program could read. It then sets the rlimits (inside the sandbox's user namespace, so the
process limit counts this sandbox's processes only) and runs the program as __main__.

Assert-style tests run one after another in the program's namespace, each in its own try block; after each, and
after the last, a line `<token> pass|fail|done ...` goes to RESULT_FD. The scorer counts only lines bearing the
token and requires the final `done`, so a program that prints "all tests passed", exits early (sys.exit,
os._exit, a signal) or writes to RESULT_FD without the token earns nothing.
This file runs only the standard library: the sandbox holds the interpreter and nothing else.
"""

import json
import os
import resource
import sys


def set_limits(limits: dict) -> None:
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def run_program(source: str, namespace: dict) -> None:
    exec(compile(source, "program.py", "exec"), namespace)


def run_asserts(source: str, tests: list, token: str, result_fd: int) -> None:
    # Everything the test loop needs is bound (and the tests compiled) before the program runs: it could replace
    # builtins (exec, compile, enumerate) or os.write to turn the tests into no-ops. A loop over a list of locals
    # looks nothing up.
    write, run = os.write, exec
    compiled = [(index, compile(test, f"test_{index}.py", "exec")) for index, test in enumerate(tests)]
    program = compile(source, "program.py", "exec")

    def report(line: str) -> None:
        write(result_fd, f"{token} {line}\n".encode("utf-8", "replace"))

    namespace = {"__name__": "__main__"}
    try:
        run(program, namespace)
    except BaseException as exc:  # SystemExit too: the tests did not run, so nothing passed
        report("program " + describe(exc))
        report("done")
        return
    for index, code in compiled:
        try:
            run(code, namespace)
        except BaseException as exc:
            report(f"fail {index} " + describe(exc))
        else:
            report(f"pass {index}")
    report("done")


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text.replace("\n", " ")[:200]


def main() -> None:
    job_fd, result_fd = int(sys.argv[1]), int(sys.argv[2])
    with os.fdopen(job_fd, "rb") as job_file:
        job = json.loads(job_file.read())
    set_limits(job["rlimits"])
    sys.argv = ["program.py"]
    if job.get("tests") is None:
        os.close(result_fd)
        run_program(job["program"], {"__name__": "__main__"})
    else:
        run_asserts(job["program"], job["tests"], job["token"], result_fd)


if __name__ == "__main__":
    main()
