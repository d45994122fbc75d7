"""python -m areal_k8s.reward [--host 127.0.0.1] [--port 50053] [--workers 2] [--timeout 15] [--job-name NAME]
[--allow-verifier package.module:function ...] [--code-config JSON]"""

import argparse
import asyncio
import logging
import os

from pydantic import ValidationError

from areal_k8s.common.config import CodeRewardConfig
from areal_k8s.common.metrics import RewardMetrics
from areal_k8s.common.service import add_metrics_port, run_service, setup_logging
from areal_k8s.reward.code_verifier import settings_from_config
from areal_k8s.reward.server import serve

log = logging.getLogger("areal.reward")


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m areal_k8s.reward", description="areal-k8s reward service")
    parser.add_argument("--host", default=env("AREAL_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("AREAL_PORT", 50053)), help="0 picks a free port")
    parser.add_argument("--workers", type=int, default=2, help="verifier worker processes")
    parser.add_argument("--timeout", type=float, default=15.0, help="default per-item scoring timeout, seconds")
    parser.add_argument(
        "--job-name", default=env("AREAL_JOB_NAME", ""), help="the job this service scores for (a metrics label)"
    )
    parser.add_argument(
        "--allow-verifier",
        action="append",
        default=[],
        metavar="MODULE:FUNCTION",
        help="a custom verifier the job declares (repeatable); no other custom verifier runs",
    )
    parser.add_argument(
        "--code-config",
        type=code_config,
        default=CodeRewardConfig(),
        metavar="JSON",
        help="the job's reward.code section: the code verifier's scoring and sandbox limits",
    )
    add_metrics_port(parser)
    parser.add_argument("--log-level", default=env("AREAL_LOG_LEVEL", "INFO"))
    return parser.parse_args()


def code_config(text: str) -> CodeRewardConfig:
    try:
        return CodeRewardConfig.model_validate_json(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    args = parse_args()
    setup_logging("reward", args.log_level)

    async def run(stop: asyncio.Event) -> None:
        metrics = RewardMetrics(args.job_name)
        metrics.serve(args.host, args.metrics_port)
        service = await serve(
            f"{args.host}:{args.port}",
            workers=args.workers,
            timeout=args.timeout,
            metrics=metrics,
            allowed_verifiers=args.allow_verifier,
            code_settings=settings_from_config(args.code_config),
        )
        log.info("reward service listening on %s:%d", args.host, service.port)
        await stop.wait()
        log.info("reward service stopping")
        await service.stop(grace=5)

    run_service("reward", run)


if __name__ == "__main__":
    main()
