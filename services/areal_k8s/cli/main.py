"""arealctl: run a job on this machine, validate a job file, read a job's status, render an RLJob's objects."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from google.protobuf.json_format import MessageToDict

from areal_k8s.common.config import JobFileError, load_job_file

EXIT_INVALID, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def fail(message: str, code: int) -> int:
    print(f"arealctl: error: {message}", file=sys.stderr)
    return code


def cmd_validate(args) -> int:
    job = load_job_file(args.job, overrides=args.set)
    print(f"{args.job}: ok (job {job.name}, {job.algorithm.total_steps} steps, η = {job.algorithm.max_staleness})")
    return 0


def cmd_run(args) -> int:
    from areal_k8s.cli.launcher import LaunchError, LocalRun
    from areal_k8s.cli.monitor import PrometheusError
    from areal_k8s.cli.progress import ProgressView
    from areal_k8s.cli.supervisor import RestartPolicy
    from areal_k8s.common.prompts import ModelDirectoryError

    job = load_job_file(args.job, overrides=args.set)
    run = LocalRun(job, restarts=RestartPolicy(budget=args.max_restarts))
    # SIGTERM (`timeout`, a process manager) stops the services like Ctrl-C: they run in sessions of their own and
    # would otherwise outlive arealctl. SIGINT is set too: a shell starts a background command with SIGINT ignored,
    # and `kill -INT` must still stop such a run gracefully.
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.default_int_handler)
    mode = "fresh" if args.fresh else "resume" if args.resume else "new"
    view = ProgressView(job.name, job.algorithm.total_steps)
    try:
        endpoints = run.start(mode, prometheus=args.scrape_interval if args.prometheus else None)
        view.recorder = run.recorder
        if run.prometheus:
            print(
                f"prometheus: {run.prometheus.url} (data in {run.prometheus.directory}); point Grafana at it and "
                "import charts/areal/dashboards/*.json",
                file=sys.stderr,
            )
        with view:
            status = run.wait(endpoints.controller, view.update)
    except KeyboardInterrupt:
        status = run.current_status()
        run.stop()
        if run.run_dir.is_dir():  # absent only when interrupted before the run directory was made
            run.write_summary(status, interrupted=True)
            report_quietly(run.run_dir)
        return fail("interrupted; services stopped, summary written (continue with --resume)", EXIT_INTERRUPTED)
    except ModelDirectoryError as exc:  # found before anything started
        return fail(str(exc), EXIT_INVALID)
    except (LaunchError, PrometheusError) as exc:
        run.stop()
        return fail(str(exc), EXIT_FAILED)
    run.stop()
    summary = run.write_summary(status, interrupted=False)
    print(json.dumps(summary, indent=2))
    print(f"summary: {run.run_dir / 'summary.json'}", file=sys.stderr)
    report_quietly(run.run_dir)
    return 0


def report_quietly(run_dir) -> None:
    """The report is a by-product of a run: failing to draw it must not fail the run."""
    from areal_k8s.cli.report import ReportError, write_report

    try:
        png, md = write_report(run_dir)
        print(f"report: {md} ({png.name})", file=sys.stderr)
    except ReportError as exc:
        print(f"arealctl: no report: {exc}", file=sys.stderr)


def cmd_report(args) -> int:
    from pathlib import Path

    from areal_k8s.cli.report import ReportError, write_report

    try:
        png, md = write_report(Path(args.run_dir))
    except ReportError as exc:
        return fail(str(exc), EXIT_INVALID)
    print(f"{md}\n{png}")
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
            status = controller_pb2_grpc.ControllerStub(ch).GetJobStatus(
                controller_pb2.GetJobStatusRequest(), timeout=10
            )
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


def cmd_simulate(args) -> int:
    from pathlib import Path

    from areal_k8s.simulator.model import simulate
    from areal_k8s.simulator.scenario import load_scenario

    result = simulate(load_scenario(Path(args.scenario)))
    print(
        json.dumps(
            {
                **result.figures(),
                "splits": result.splits,
                "decisions": [{"at": round(t, 1), "code": d.code, "message": d.message} for t, d in result.decisions],
            },
            indent=2,
        )
    )
    return 0


def cmd_plan(args) -> int:
    from pathlib import Path

    from areal_k8s.simulator.plan import plan, recommend
    from areal_k8s.simulator.scenario import load_scenario

    scenario = load_scenario(Path(args.scenario))
    runs = plan(scenario, args.steps)
    print(
        f"simulated: each static split of the scenario's budget ({min(args.steps, scenario.job.total_steps)} steps), "
        "fastest first"
    )
    print(
        f"{'rollout':>8} {'trainer':>8} {'samples/s':>10} {'trainer busy':>13} {'engines busy':>13} "
        f"{'held by η':>10} {'staleness':>10}"
    )
    for split, result in runs:
        f = result.figures()
        print(
            f"{split.rollout:>8} {split.trainer:>8} {f['steady_samples_per_second']:>10.2f} "
            f"{f['trainer_busy']:>13.1%} {f['engine_busy']:>13.1%} {f['engines_held_by_staleness']:>10.1%} "
            f"{f['mean_staleness']:>10.2f}"
        )
    print()
    print("\n".join(recommend(scenario, runs, args.steps).lines))
    return 0


def add_overrides(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a job-file field over the file's, e.g. --set trainer.backend=megatron (repeatable; "
        "the value is read as YAML)",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arealctl", description="areal-k8s: asynchronous RL for reasoning LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a job on this machine: every service as a local process")
    run.add_argument("job", help="job file (YAML)")
    add_overrides(run)
    again = run.add_mutually_exclusive_group()
    again.add_argument("--fresh", action="store_true", help="delete the job's run directory first")
    again.add_argument("--resume", action="store_true", help="continue the run in the job's run directory")
    run.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a Prometheus server (Debian's prometheus package) scraping every service",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=10,
        metavar="N",
        help="restart processes that die (with back-off, as a kubelet does) up to N times in all, then "
        "fail the run (default 10; an RLJob's failurePolicy.maxRestarts)",
    )
    run.add_argument(
        "--scrape-interval", default="5s", help="Prometheus scrape interval with --prometheus (default 5s)"
    )
    run.set_defaults(func=cmd_run)

    report = sub.add_parser("report", help="write report.png and report.md for a run directory")
    report.add_argument("run_dir", help="the job's run directory (runs/NAME)")
    report.set_defaults(func=cmd_report)

    validate = sub.add_parser("validate", help="check a job file and exit")
    validate.add_argument("job")
    add_overrides(validate)
    validate.set_defaults(func=cmd_validate)

    reference = sub.add_parser("reference", help="print the job-file reference (Markdown)")
    reference.add_argument("--write", metavar="README", help="replace the reference between the markers in this file")
    reference.set_defaults(func=cmd_reference)

    status = sub.add_parser("status", help="print a running job's status")
    status.add_argument("--controller", default="127.0.0.1:50051", help="controller address host:port")
    status.set_defaults(func=cmd_status)

    simulate = sub.add_parser(
        "simulate", help="simulate a job on a modelled cluster (a scenario file); figures are simulated"
    )
    simulate.add_argument(
        "scenario", help="scenario file (YAML): the job's shape, the split, costs, lengths, rebalancer"
    )
    simulate.set_defaults(func=cmd_simulate)

    plan = sub.add_parser(
        "plan",
        help="simulate every static rollout/trainer split of a scenario's budget, then recommend a split, B and η and "
        "say whether the staleness bound or the split limits throughput",
    )
    plan.add_argument("scenario", help="scenario file (YAML)")
    plan.add_argument(
        "--steps", type=int, default=40, help="steps to simulate each candidate for (default 40, at most the job's)"
    )
    plan.set_defaults(func=cmd_plan)

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
