"""arealctl: run a job on this machine, validate a job file, read a job's status, render an RLJob's objects."""

from __future__ import annotations

import argparse
import json
import signal
import sys

from google.protobuf.json_format import MessageToDict

from areal_k8s.common.config import JobFileError, load_job_file
from areal_k8s.common.final_model import refresh_model_card

EXIT_INVALID, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def fail(message: str, code: int) -> int:
    print(f"arealctl: error: {message}", file=sys.stderr)
    return code


def cmd_validate(args) -> int:
    from pathlib import Path

    from areal_k8s.cli.validate import validate_file

    print(validate_file(Path(args.job), args.set))
    return 0


def cmd_run(args) -> int:
    from pathlib import Path

    from areal_k8s.cli.launcher import LaunchError, LocalRun
    from areal_k8s.cli.monitor import PrometheusError
    from areal_k8s.cli.progress import ProgressView
    from areal_k8s.cli.supervisor import RestartPolicy
    from areal_k8s.cli.validate import check_budget_at_start
    from areal_k8s.common.prompts import ModelDirectoryError

    job = load_job_file(args.job, overrides=args.set)
    check_budget_at_start(job, Path(args.job))  # the tokenized data against the context, before anything starts
    planned = ""
    if args.calibrate:
        job.rollout.workers, planned = calibrated_start(job, Path(args.calibrate))
        print(planned, file=sys.stderr)
    run = LocalRun(job, restarts=RestartPolicy(budget=args.max_restarts), planned=planned)
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
    if card := refresh_model_card(run.run_dir, job):
        print(f"final model: {card.parent} (Hugging Face format; model card README.md)", file=sys.stderr)
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


def cmd_export(args) -> int:
    from pathlib import Path

    from areal_k8s.cli.export import export
    from areal_k8s.common.final_model import ExportError
    from areal_k8s.common.prompts import ModelDirectoryError

    try:
        out = export(Path(args.checkpoint), Path(args.out), args.job and Path(args.job), args.tokenizer)
    except (ExportError, ModelDirectoryError) as exc:
        return fail(str(exc), EXIT_INVALID)
    except OSError as exc:  # where it writes: not a directory, no room, no permission
        return fail(f"{args.out}: cannot write the model ({exc.strerror or exc})", EXIT_FAILED)
    print(out)
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
    from pathlib import Path

    import grpc

    from areal_k8s.api.v1 import controller_pb2, controller_pb2_grpc
    from areal_k8s.cli.run_files import SUMMARY_FILE, RunDirError, read_endpoints, run_ended

    address = args.controller
    if args.run_dir:
        try:
            address = read_endpoints(Path(args.run_dir))["controller"]
        except RunDirError as exc:
            return fail(str(exc), EXIT_INVALID)
    with grpc.insecure_channel(address) as ch:
        try:
            status = controller_pb2_grpc.ControllerStub(ch).GetJobStatus(
                controller_pb2.GetJobStatusRequest(), timeout=10
            )
        except grpc.RpcError as exc:
            if args.run_dir and run_ended(Path(args.run_dir)):  # its controller is gone with it: the summary
                print((Path(args.run_dir) / SUMMARY_FILE).read_text(), end="")
                print(f"the run has ended: its summary ({Path(args.run_dir) / SUMMARY_FILE})", file=sys.stderr)
                return 0
            return fail(f"controller {address}: {exc.code().name}: {exc.details()}", EXIT_FAILED)
    print(json.dumps(MessageToDict(status, always_print_fields_with_no_presence=True), indent=2))
    return 0


def cmd_logs(args) -> int:
    from pathlib import Path

    from areal_k8s.cli.run_files import RunDirError, show_logs

    try:
        show_logs(Path(args.run_dir), args.service, args.follow)
    except RunDirError as exc:
        return fail(str(exc), EXIT_INVALID)
    except KeyboardInterrupt:  # the way to stop following a run that goes on
        return EXIT_INTERRUPTED
    return 0


def cmd_manifests(args) -> int:
    import secrets
    from pathlib import Path

    import yaml

    from areal_k8s.k8s_operator.children import claim_token_secret, desired_children, to_yaml
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
    # What the operator creates for this RLJob as it stands (without owner references until it has a uid); the
    # agent workflow's claim token is made here as the operator makes it, once: applied again, these rotate it
    children = desired_children(job, running=not job.spec["suspend"])
    secret = claim_token_secret(job, secrets.token_urlsafe(32))
    print(to_yaml([secret, *children] if secret else children), end="")
    return 0


def cmd_calibrate(args) -> int:
    from pathlib import Path

    from areal_k8s.cli.calibrate import calibrate
    from areal_k8s.cli.run_files import ENDPOINTS_FILE
    from areal_k8s.simulator.run_calibration import RunCalibrationError

    if args.prometheus and not args.cores and not (Path(args.run_dir) / ENDPOINTS_FILE).is_file():
        raise JobFileError(
            f"{args.run_dir} is no local run of this machine: --prometheus needs --cores, the CPU cores its services "
            "shared (a node's, for pods on one node)"
        )
    try:
        calibration = calibrate(Path(args.run_dir), args.cores, args.prometheus)
    except RunCalibrationError as exc:
        raise JobFileError(f"cannot calibrate on {args.run_dir}: {exc}") from None
    measured, simulated = calibration["measured"], calibration["self_check"]
    print(json.dumps({k: calibration[k] for k in ("engine", "response", "completion_seconds", "completion_fitted")}))
    print(
        f"the run measured {measured['samples_per_second']:.1f} samples/s, trainer idle "
        f"{measured['trainer_idle']:.1%}; "
        f"simulated under its calibration: {simulated['samples_per_second']:.1f} samples/s, trainer idle "
        f"{simulated['trainer_idle']:.1%}"
    )
    print(f"calibration: {Path(args.run_dir) / 'calibration.json'}", file=sys.stderr)
    return 0


def calibrated_start(job, run_dir):
    """`run --calibrate`'s rollout workers and the line that says why; JobFileError with one line otherwise."""
    from areal_k8s.cli.calibrate import load_calibration, planned_workers
    from areal_k8s.simulator.run_calibration import RunCalibrationError

    try:
        return planned_workers(load_calibration(run_dir), job)
    except RunCalibrationError as exc:
        raise JobFileError(f"cannot calibrate on {run_dir}: {exc}") from None


def chosen_scenario(args):
    """The scenario file given, or the job of the run given with --calibrate under its calibration (and --set);
    JobFileError with one readable line otherwise."""
    from pathlib import Path

    from areal_k8s.simulator.run_calibration import RunCalibrationError
    from areal_k8s.simulator.scenario import load_scenario

    if (args.scenario is None) == (args.calibrate is None):
        raise JobFileError("give a scenario file or --calibrate RUN_DIR (one of them)")
    overrides = getattr(args, "set", [])
    if args.calibrate is None:
        if overrides:
            raise JobFileError("--set changes the job of a calibrated run (--calibrate RUN_DIR); edit a scenario file")
        return load_scenario(Path(args.scenario), args.row)
    from areal_k8s.cli.calibrate import calibrated_scenario, load_calibration, run_job

    try:
        return calibrated_scenario(load_calibration(Path(args.calibrate)), run_job(Path(args.calibrate), overrides))
    except RunCalibrationError as exc:
        raise JobFileError(f"cannot calibrate on {args.calibrate}: {exc}") from None


def cmd_simulate(args) -> int:
    from areal_k8s.simulator.model import simulate

    scenario = chosen_scenario(args)
    result = simulate(scenario)
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
    from areal_k8s.simulator.plan import expected_error, plan, recommend

    scenario = chosen_scenario(args)
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
    print(f"calibration: {scenario.calibration()}")
    print(expected_error(scenario))
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


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("areal-k8s")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "unknown (not installed)"


def with_examples(examples: list[tuple[str, str]]) -> str:
    """An --help epilog: `arealctl ...` command lines, each with what it does."""
    width = max(len(line) for line, _ in examples)
    return "examples:\n" + "\n".join(f"  {line:<{width}}  # {what}" for line, what in examples)


def command(sub, name: str, summary: str, examples: list[tuple[str, str]], description: str | None = None):
    """A subcommand whose --help ends with examples."""
    return sub.add_parser(
        name,
        help=summary,
        description=description or summary[0].upper() + summary[1:] + ".",
        epilog=with_examples(examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="arealctl",
        description="areal-k8s: asynchronous RL for reasoning LLMs. `arealctl COMMAND --help` for each command.",
        epilog=with_examples(
            [
                ("arealctl run examples/demo.yaml --fresh", "the demo, every service a local process"),
                ("arealctl status runs/demo", "its status, from another terminal"),
                ("arealctl logs runs/demo trainer -f", "follow one service's log"),
                ("arealctl export runs/demo my-model", "its newest checkpoint as a Hugging Face model"),
            ]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"arealctl {package_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    run = command(
        sub,
        "run",
        "run a job on this machine: every service as a local process",
        [
            ("arealctl run examples/demo.yaml --fresh", "start over: delete the job's run directory first"),
            ("arealctl run examples/demo.yaml --resume", "continue from its checkpoint and Redis"),
            ("arealctl run examples/demo.yaml --set algorithm.max_staleness=8", "a job-file field set over the file's"),
            ("arealctl run examples/demo.yaml --fresh --prometheus", "with a Prometheus server scraping every service"),
            (
                "arealctl run examples/demo.yaml --fresh --calibrate runs/demo-before",
                "start with the rollout workers the model calibrated on an earlier run finds fastest",
            ),
        ],
        description="Run a job on this machine: Redis (embedded unless the job names one), the controller, the reward "
        "service, the rollout workers and their engines, and the trainer, each its own process on loopback. The run "
        "directory (runs/NAME) gets endpoints.json (where they listen), their logs, checkpoints, summary.json, a "
        "report, and final/: the trained model in Hugging Face format.",
    )
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
        "--calibrate",
        metavar="RUN_DIR",
        help="start with the rollout workers the simulator, calibrated on the run in RUN_DIR (an earlier run of "
        "this job's kind, on this machine), finds fastest for this job; with rebalance.enabled the rebalancer goes "
        "on from there",
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

    report = command(
        sub,
        "report",
        "write report.png and report.md for a run directory",
        [("arealctl report runs/demo", "redraw runs/demo/report.png and report.md")],
    )
    report.add_argument("run_dir", help="the job's run directory (runs/NAME)")
    report.set_defaults(func=cmd_report)

    export = command(
        sub,
        "export",
        "write a checkpoint as a Hugging Face model directory (as a run's final/)",
        [
            ("arealctl export runs/demo my-model", "the run's newest checkpoint"),
            ("arealctl export runs/demo/checkpoints/v000100 my-model", "one checkpoint"),
            ("arealctl export copied/checkpoints/v000150 out --job job.yaml", "one copied out of a cluster"),
        ],
        description="Write a checkpoint as a Hugging Face model directory: safetensors weights, config, tokenizer, "
        "generation config (the job's sampling) and a model card with the run's figures, as a run writes final/.",
    )
    export.add_argument("checkpoint", help="a checkpoint (RUN_DIR/checkpoints/vNNNNNN) or a run directory")
    export.add_argument("out", help="the directory to write (replaced if it exists)")
    export.add_argument("--job", help="the job file that trained it (default: job.yaml in its run directory)")
    export.add_argument("--tokenizer", help="tokenizer directory (default: the job's)")
    export.set_defaults(func=cmd_export)

    validate = command(
        sub,
        "validate",
        "check a job file (fields, model, tokenizer, datasets) or an RLJob manifest",
        [
            ("arealctl validate examples/demo.yaml", "a job file, and the files it names"),
            ("arealctl validate examples/demo.yaml --set algorithm.max_staleness=8", "with a field set over it"),
            ("arealctl validate examples/rljob-demo-cpu.yaml", "an RLJob, as the operator checks it"),
        ],
        description="Check a job file: every field, then the model and tokenizer directories and the dataset files "
        "it names, on this machine. Or check an RLJob manifest (kind: RLJob) as the operator does. Every problem "
        "is reported, in one line; an unknown field with the names it may have meant.",
    )
    validate.add_argument("job", help="job file or RLJob manifest (YAML)")
    add_overrides(validate)
    validate.set_defaults(func=cmd_validate)

    reference = command(
        sub,
        "reference",
        "print the job-file reference (Markdown)",
        [("arealctl reference --write docs/job-file.md", "regenerate the reference in the docs")],
    )
    reference.add_argument(
        "--write", metavar="FILE", help="replace the reference between the markers in FILE (docs/job-file.md)"
    )
    reference.set_defaults(func=cmd_reference)

    status = command(
        sub,
        "status",
        "print a job's status (JSON): a local run's from its run directory, or any controller's",
        [
            ("arealctl status runs/demo", "a local run's"),
            ("kubectl port-forward svc/demo-controller 50051 & arealctl status", "an RLJob's controller"),
        ],
        description="Print a job's status as its controller reports it (JSON). A local run's controller is found "
        "in RUN_DIR/endpoints.json, which `arealctl run` writes at start; once the run has ended, its summary.",
    )
    status.add_argument("run_dir", nargs="?", help="a local run's directory (runs/NAME)")
    status.add_argument("--controller", default="127.0.0.1:50051", help="controller address host:port, without RUN_DIR")
    status.set_defaults(func=cmd_status)

    logs = command(
        sub,
        "logs",
        "print (or follow) the logs of a local run's services",
        [
            ("arealctl logs runs/demo", "every service's, each line after its name"),
            ("arealctl logs runs/demo trainer", "one: controller, reward, trainer, rollout-0, engine-0, ..."),
            ("arealctl logs runs/demo rollout-0 -f", "follow it until the run ends"),
        ],
        description="Print the logs of a local run's services (RUN_DIR/logs), every service's with its name before "
        "each line, or one service's. With -f, keep printing what they write until the run ends.",
    )
    logs.add_argument("run_dir", help="the run's directory (runs/NAME)")
    logs.add_argument("service", nargs="?", help="one service (default: all)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the run ends")
    logs.set_defaults(func=cmd_logs)

    simulate = command(
        sub,
        "simulate",
        "simulate a job on a modelled cluster (a scenario file); figures are simulated",
        [("arealctl simulate examples/scenario-long-tail.yaml", "its figures, splits and decisions as JSON")],
    )
    simulate.add_argument(
        "scenario", nargs="?", help="scenario file (YAML): the job's shape, the split, costs, lengths, rebalancer"
    )
    simulate.add_argument("--row", help="in a file of rows (one parameter set, several setups): the row to simulate")
    simulate.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="instead of a scenario: the job of a local run, on this machine, under costs fitted to what the run "
        "measured (RUN_DIR/calibration.json, fitted first if absent); --set changes the job (η, B, workers)",
    )
    add_overrides(simulate)
    simulate.set_defaults(func=cmd_simulate)

    calibrate = command(
        sub,
        "calibrate",
        "fit the simulator's costs to what a run measured (its engines' counters, steps and CPU), into "
        "RUN_DIR/calibration.json",
        [
            ("arealctl calibrate runs/demo", "fit, write runs/demo/calibration.json, compare the run with itself"),
            (
                "arealctl calibrate runs/demo --prometheus http://127.0.0.1:9090",
                "the engines' counters and the services' CPU from the Prometheus that scraped the run",
            ),
            (
                "arealctl simulate --calibrate runs/demo --set algorithm.max_staleness=0",
                "then: the same job synchronously, simulated",
            ),
        ],
    )
    calibrate.add_argument("run_dir", help="a local run's directory (runs/NAME), with 3 or more steps")
    calibrate.add_argument(
        "--cores", type=float, help="CPU cores the run's services shared (default: this machine's, for a local run)"
    )
    calibrate.add_argument(
        "--prometheus",
        metavar="URL",
        help="read the engines' counters and the services' CPU from the Prometheus that scraped the run (a "
        "cluster's job: RUN_DIR holds its job.yaml and its trainer's steps.jsonl) instead of measurements.jsonl",
    )
    calibrate.set_defaults(func=cmd_calibrate)

    plan = command(
        sub,
        "plan",
        "simulate every static rollout/trainer split of a scenario's budget, then recommend a split, B and η and say "
        "whether the staleness bound or the split limits throughput",
        [
            ("arealctl plan bench/scenarios/areal-1.5b.yaml --steps 12", "AReaL's 1.5B setup, a short simulation"),
            ("arealctl plan examples/scenario-long-tail.yaml", "a table, one split a line, and the recommendation"),
            (
                "arealctl plan bench/scenarios/areal-table1.yaml --row 32b --steps 8",
                "AReaL's 32B row, its expected error",
            ),
        ],
    )
    plan.add_argument("scenario", nargs="?", help="scenario file (YAML)")
    plan.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="instead of a scenario: the job of a local run on this machine, under costs fitted to what the run "
        "measured (arealctl calibrate); the splits tried are 1 to as many rollout workers as cores, one trainer",
    )
    plan.add_argument(
        "--steps", type=int, default=40, help="steps to simulate each candidate for (default 40, at most the job's)"
    )
    plan.add_argument("--row", help="in a file of rows (one parameter set, several setups): the row to plan")
    plan.set_defaults(func=cmd_plan)

    manifests = command(
        sub,
        "manifests",
        "print the Kubernetes objects the operator creates for an RLJob",
        [
            ("arealctl manifests examples/rljob-demo-cpu.yaml", "as YAML"),
            ("arealctl manifests examples/rljob-demo-cpu.yaml --namespace areal", "for another namespace"),
        ],
    )
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
