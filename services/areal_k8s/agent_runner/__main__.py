"""`python -m areal_k8s.agent_runner --job JOB --gateway URL ...`: an agent runner (`arealctl run` starts
`agents.replicas` of them beside the rollout workers; on Kubernetes they are pods). It claims episodes from every
rollout worker's gateway with the job's claim token (env AREAL_CLAIM_TOKEN) and plays each with `agents.command`, run
once per episode or, `agents.mode: serve`, once per slot (served.py)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import shutil

import httpx

from areal_k8s.agent_runner.gateway_client import GatewayClient
from areal_k8s.agent_runner.program import run_program
from areal_k8s.agent_runner.runner import Runner
from areal_k8s.agent_runner.served import ServedProgram
from areal_k8s.common.service import exit_invalid, load_job, run_service, setup_logging

log = logging.getLogger("areal.agent_runner")


def main() -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m areal_k8s.agent_runner", description="areal-k8s agent runner")
    parser.add_argument("--job", required=True, help="job file (YAML), as validated by `arealctl validate`")
    parser.add_argument(
        "--gateway",
        action="append",
        default=[url for url in env("AREAL_GATEWAY_URLS", "").split(",") if url],
        help="a rollout worker's gateway, http://HOST:PORT (repeated; env AREAL_GATEWAY_URLS, comma-separated)",
    )
    parser.add_argument("--name", default=env("AREAL_RUNNER_NAME", "agent-runner"))
    parser.add_argument("--log-level", default=env("AREAL_LOG_LEVEL", "INFO"))
    args = parser.parse_args()
    setup_logging(args.name, args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per claim and end is noise
    job = load_job(args.job)
    if job.agents is None:
        exit_invalid(f"{args.job}: the job has no agents section: nothing for a runner to play")
    if not args.gateway:
        exit_invalid("no gateway to claim episodes from: pass --gateway http://HOST:PORT (or AREAL_GATEWAY_URLS)")
    agents = job.agents
    if shutil.which(agents.command[0], path=env("PATH")) is None and not os.path.isfile(
        os.path.join(agents.working_dir or "", agents.command[0])
    ):
        exit_invalid(f"agents.command: {agents.command[0]!r} is not a program found on PATH or in the working dir")

    async def run(stop) -> None:
        limits = httpx.Limits(max_connections=2 * agents.episodes_per_replica + len(args.gateway))
        async with httpx.AsyncClient(limits=limits) as http:
            sources = [GatewayClient(url, http, env("AREAL_CLAIM_TOKEN")) for url in args.gateway]
            slots = range(agents.episodes_per_replica)
            if agents.mode == "serve":
                served = [ServedProgram(agents.command, f"{args.name}/{i}", agents.working_dir) for i in slots]
                players = [program.play for program in served]
            else:
                served, players = (
                    [],
                    [functools.partial(run_program, agents.command, cwd=agents.working_dir)] * len(slots),
                )
            log.info(
                "%s: %d episodes at once from %s, played by %s (%s)", args.name, len(slots), ", ".join(args.gateway),
                " ".join(agents.command), "a run per slot" if served else "a run per episode",
            )  # fmt: skip
            try:
                await Runner(sources, players).run(stop)
            finally:
                await asyncio.gather(*(program.close() for program in served))

    run_service("agent_runner", run)


if __name__ == "__main__":
    main()
