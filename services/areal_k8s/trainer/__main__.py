"""python -m areal_k8s.trainer --job JOB.yaml --controller ADDR --redis-url URL"""

import asyncio
import logging
import os
from functools import partial

import torch

from areal_k8s.api.v1 import trainer_pb2_grpc
from areal_k8s.common.grpcutil import dependency_channel, start_server
from areal_k8s.common.metrics import TrainerMetrics
from areal_k8s.common.prompts import load_tokenizer, require_model_dirs
from areal_k8s.common.service import (
    add_when_done,
    base_parser,
    load_job,
    run_service,
    run_until_stopped,
    setup_logging,
    wait_if_asked,
)
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.data.dataset import load_items
from areal_k8s.trainer.clients import ControllerClient
from areal_k8s.trainer.loop.trainer import Trainer
from areal_k8s.trainer.server import TrainerServicer
from areal_k8s.trainer.weights.targets import RolloutTarget
from areal_k8s.trainer.world import World, WorldSpec

log = logging.getLogger("areal.trainer")


def main() -> None:
    env = os.environ.get
    parser = base_parser("trainer", default_port=50054)
    add_when_done(parser)
    parser.add_argument("--controller", default=env("AREAL_CONTROLLER_ADDRESS", "127.0.0.1:50051"))
    parser.add_argument("--redis-url", default=env("AREAL_REDIS_URL"), required=not env("AREAL_REDIS_URL"))
    parser.add_argument("--consumer", default=env("AREAL_CONSUMER", "trainer-0"), help="stream consumer name")
    parser.add_argument(
        "--master-address",
        default=env("AREAL_MASTER_ADDRESS", "127.0.0.1"),
        help="address the rollout engines reach this trainer at for the weight-update group",
    )
    args = parser.parse_args()
    setup_logging("trainer", args.log_level)
    job = load_job(args.job)
    require_model_dirs(model=job.model, tokenizer=job.tokenizer_path)
    torch.set_num_threads(job.trainer.threads)
    # Formed before the engines are made (they read their rank from it); every rank waits here for the others.
    spec = WorldSpec.from_env()
    world = World(spec).join(job.trainer.device)
    eval_items = load_items(job.dataset.eval, job.dataset)[: job.dataset.eval_limit] if job.dataset.eval else []

    async def run(stop: asyncio.Event) -> None:
        redis_client = connect(args.redis_url)
        controller_channel = dependency_channel(args.controller)
        trainer = Trainer(
            job=job,
            store=TrajectoryStore(redis_client, job.name),
            controller=ControllerClient(controller_channel),
            tokenizer=load_tokenizer(job.tokenizer_path),
            eval_items=eval_items,
            consumer=args.consumer,
            master_address=args.master_address,
            metrics=TrainerMetrics(job.name),
            world=world,
            # rank 0 alone pushes and evaluates; it announces every version it pushes, naming the engines
            connect_worker=partial(RolloutTarget, announced=True) if world.leads else None,
        )
        # the ranks torchrun starts in one pod listen on the ports after the pod's (probes and scrapes see rank 0's)
        trainer.metrics.serve(args.host, spec.port_for(args.metrics_port))
        server, port, _health = await start_server(
            [(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerServicer(trainer), "areal.v1.Trainer")],
            f"{args.host}:{spec.port_for(args.port)}",
        )
        log.info("trainer listening on %s:%d (job %s)", args.host, port, job.name)
        try:
            if await run_until_stopped(trainer.run(), stop):
                await asyncio.to_thread(trainer.trackers.close)  # finished: the tracker runs too, not at pod exit
                await wait_if_asked(args.when_done, stop)
        finally:
            await asyncio.to_thread(trainer.trackers.close)
            await trainer.publisher.close()
            await server.stop(grace=2)
            await controller_channel.close()
            await redis_client.aclose()

    run_service("trainer", run)


if __name__ == "__main__":
    main()
