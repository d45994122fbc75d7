"""arealctl: run a job on this machine, validate a job file, read a job's status, render an RLJob's objects."""

from __future__ import annotations

import argparse
import json
import sys

from google.protobuf.json_format import MessageToDict

from areal_k8s.common.config import JobFileError, load_job_file

EXIT_INVALID, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def fail(message: str, code: int) -> int:
    print(f"arealctl: error: {message}", file=sys.stderr)
    return code


def cmd_validate(args) -> int:
    job = load_job_file(args.job)
    print(f"{args.job}: ok (job {job.name}, {job.algorithm.total_steps} steps, η = {job.algorithm.max_staleness})")
    return 0


def cmd_run(args) -> int:
    from areal_k8s.cli.launcher import LaunchError, LocalRun
    from areal_k8s.cli.progress import ProgressView

    job = load_job_file(args.job)
    run = LocalRun(job)
    mode = "fresh" if args.fresh else "resume" if args.resume else "new"
    view = ProgressView(job.name, job.algorithm.total_steps)
    status = None
    try:
        endpoints = run.start(mode)
        with view:
            status = run.wait(endpoints.controller, view.update)
    except KeyboardInterrupt:
        run.stop()
        if status is not None:
            run.write_summary(status, interrupted=True)
        return fail("interrupted; services stopped (continue with --resume)", EXIT_INTERRUPTED)
    except LaunchError as exc:
        run.stop()
        return fail(str(exc), EXIT_FAILED)
    run.stop()
    summary = run.write_summary(status, interrupted=False)
    print(json.dumps(summary, indent=2))
    print(f"summary: {run.run_dir / 'summary.json'}", file=sys.stderr)
    return 0


REFERENCE_START, REFERENCE_END = "<!-- job-reference:start -->\n", "<!-- job-reference:end -->"


def cmd_reference(args) -> int:
    from pathlib import Path

    from areal_k8s.common.config import reference_markdown

    table = reference_markdown()
    if not args.write:
        print(table, end="")
        return 0
    path = Path(args.write)
    text = path.read_text()
    if REFERENCE_START not in text or REFERENCE_END not in text:
        return fail(f"{path}: no {REFERENCE_START.strip()} ... {REFERENCE_END} markers", EXIT_FAILED)
    head, rest = text.split(REFERENCE_START, 1)
    path.write_text(head + REFERENCE_START + table + REFERENCE_END + rest.split(REFERENCE_END, 1)[1])
    print(f"updated the job-file reference in {path}", file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    import grpc

    from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc

    with grpc.insecure_channel(args.controller) as ch:
        try:
            status = controller_pb2_grpc.ControllerStub(ch).GetJobStatus(controller_pb2.GetJobStatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            return fail(f"controller {args.controller}: {exc.code().name}: {exc.details()}", EXIT_FAILED)
    print(json.dumps(MessageToDict(status, always_print_fields_with_no_presence=True), indent=2))
    return 0


def cmd_manifests(args) -> int:
    from pathlib import Path

    import yaml

    from areal_k8s.k8s_operator.children import desired_children, to_yaml
    from areal_k8s.k8s_operator.validation import InvalidSpec, validate

    try:
        rljob = yaml.safe_load(Path(args.rljob).read_text())
    except OSError as exc:
        return fail(f"{args.rljob}: cannot read ({exc.strerror})", EXIT_INVALID)
    except yaml.YAMLError as exc:
        return fail(f"{args.rljob}: not valid YAML: {exc}", EXIT_INVALID)
    if not isinstance(rljob, dict) or rljob.get("kind") != "RLJob":
        return fail(f"{args.rljob}: expected an RLJob manifest (kind: RLJob)", EXIT_INVALID)
    if args.namespace:
        rljob.setdefault("metadata", {})["namespace"] = args.namespace
    try:
        job = validate(rljob)
    except InvalidSpec as exc:
        return fail(f"{args.rljob}: " + "; ".join(exc.problems), EXIT_INVALID)
    # What the operator creates for this RLJob as it stands (without owner references until it has a uid).
    print(to_yaml(desired_children(job, running=not job.spec["suspend"])), end="")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arealctl", description="areal-k8s: asynchronous RL for reasoning LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job on this machine: every service as a local process")
    run.add_argument("job", help="job file (YAML)")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--fresh", action="store_true", help="delete the job's run directory first")
    again.add_argument("--resume", action="store_true", help="continue the run in the job's run directory")
    run.set_defaults(func=cmd_run)

    validate = sub.add_parser("validate", help="check a job file and exit")
    validate.add_argument("job")
    validate.set_defaults(func=cmd_validate)

    reference = sub.add_parser("reference", help="print the job-file reference (Markdown)")
    reference.add_argument("--write", metavar="README", help="replace the reference between the markers in this file")
    reference.set_defaults(func=cmd_reference)

    status = sub.add_parser("status", help="print a running job's status")
    status.add_argument("--controller", default="127.0.0.1:50051", help="controller address host:port")
    status.set_defaults(func=cmd_status)

    manifests = sub.add_parser("manifests", help="print the Kubernetes objects the operator creates for an RLJob")
    manifests.add_argument("rljob", help="RLJob manifest (YAML)")
    manifests.add_argument("--namespace", help="namespace to render for (default: the manifest's, else default)")
    manifests.set_defaults(func=cmd_manifests)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except JobFileError as exc:
        return fail(str(exc), EXIT_INVALID)


if __name__ == "__main__":
    sys.exit(main())
