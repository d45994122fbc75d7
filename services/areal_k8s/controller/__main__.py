"""python -m areal_k8s.controller --job JOB.yaml --redis-url URL [--reward ADDR] [--port 50051]"""

import logging
import os

from areal_k8s.api.v1 import reward_pb2_grpc
from areal_k8s.common.grpcutil import dependency_channel
from areal_k8s.common.metrics import ControllerMetrics
from areal_k8s.common.service import base_parser, load_job, run_service, setup_logging
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.server import job_verifiers, serve
from areal_k8s.data.dataset import load_items

log = logging.getLogger("areal.controller")


def main() -> None:
    parser = base_parser("controller", default_port=50051)
    parser.add_argument(
        "--redis-url", default=os.environ.get("AREAL_REDIS_URL"), required=not os.environ.get("AREAL_REDIS_URL")
    )
    parser.add_argument(
        "--reward",
        default=os.environ.get("AREAL_REWARD_ADDRESS"),
        help="the reward service (host:port): nothing is admitted until it can load every verifier the "
        "job uses, and the job fails if it cannot; unset: no such check",
    )
    args = parser.parse_args()
    setup_logging("controller", args.log_level)
    job = load_job(args.job)
    items = load_items(job.dataset.train, job.dataset)
    # The trainer scores the held-out items with the same reward service.
    eval_items = load_items(job.dataset.eval, job.dataset)[: job.dataset.eval_limit] if job.dataset.eval else []

    async def run(stop):
        client = connect(args.redis_url)
        metrics = ControllerMetrics(job.name)
        metrics.serve(args.host, args.metrics_port)
        core = ControllerCore(job, items, metrics=metrics)
        reward_channel = dependency_channel(args.reward) if args.reward else None
        if reward_channel is None:
            log.warning("no --reward: the job's verifiers are not checked before work is admitted")
        reward = reward_pb2_grpc.RewardStub(reward_channel) if reward_channel else None
        server, port, _servicer, background = await serve(
            core,
            TrajectoryStore(client, job.name),
            f"{args.host}:{args.port}",
            reward=reward,
            verifiers=job_verifiers(job, items, eval_items),
        )
        log.info("controller listening on %s:%d (job %s, %d prompts)", args.host, port, job.name, len(items))
        await stop.wait()
        background.cancel()
        await server.stop(grace=2)
        if reward_channel is not None:
            await reward_channel.close()
        await client.aclose()

    run_service("controller", run)


if __name__ == "__main__":
    main()
