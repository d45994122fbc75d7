"""python -m areal_k8s.rollout --job JOB.yaml --engine-url URL --controller ADDR --reward ADDR --redis-url URL"""

import asyncio
import logging
import os
import socket

from areal_k8s.api.v1 import controller_pb2_grpc, reward_pb2_grpc, rollout_pb2_grpc
from areal_k8s.common.grpcutil import dependency_channel, start_server
from areal_k8s.common.metrics import RolloutMetrics
from areal_k8s.common.prompts import load_tokenizer, require_model_dirs
from areal_k8s.common.service import (
    add_when_done,
    base_parser,
    exit_invalid,
    load_job,
    run_service,
    setup_logging,
    wait_if_asked,
)
from areal_k8s.common.sglang import CpuEngineClient, SGLangClient, UnfitEngine, served_dtype, weight_group_ranks
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.rollout.clients import ControllerClient, RewardScorer
from areal_k8s.rollout.gateway.server import start_gateway
from areal_k8s.rollout.gateway.workflow import AgentWorkflow
from areal_k8s.rollout.server import RolloutServicer
from areal_k8s.rollout.worker import RolloutWorker
from areal_k8s.rollout.workflows import WorkflowError, load_workflow

log = logging.getLogger("areal.rollout")


def main() -> None:
    env = os.environ.get
    parser = base_parser("rollout", default_port=50052)
    add_when_done(parser)
    parser.add_argument("--worker-id", default=env("AREAL_WORKER_ID", socket.gethostname()))
    parser.add_argument(
        "--advertise", default=env("AREAL_ADVERTISE_ADDRESS"), help="host:port the trainer reaches this worker at"
    )
    parser.add_argument("--engine-url", default=env("AREAL_ENGINE_URL", "http://127.0.0.1:30000"))
    parser.add_argument("--controller", default=env("AREAL_CONTROLLER_ADDRESS", "127.0.0.1:50051"))
    parser.add_argument("--reward", default=env("AREAL_REWARD_ADDRESS", "127.0.0.1:50053"))
    parser.add_argument("--redis-url", default=env("AREAL_REDIS_URL"), required=not env("AREAL_REDIS_URL"))
    parser.add_argument(
        "--gateway-port",
        type=int,
        default=int(env("AREAL_GATEWAY_PORT", "0")),
        help="workflow agent: the port of the agents' OpenAI gateway (0: a free one, logged)",
    )
    parser.add_argument(
        "--engine-timeout", type=float, default=600.0, help="seconds to wait for the engine to become healthy"
    )
    args = parser.parse_args()
    setup_logging(f"rollout[{args.worker_id}]", args.log_level)
    job = load_job(args.job)
    require_model_dirs(model=job.model, tokenizer=job.tokenizer_path)
    metrics = RolloutMetrics(job.name)
    try:
        workflow = load_workflow(job, metrics)
    except WorkflowError as exc:
        exit_invalid(str(exc))

    async def run(stop: asyncio.Event) -> None:
        engine = (CpuEngineClient if job.rollout.engine == "cpu" else SGLangClient)(args.engine_url)
        await engine.wait_until_healthy(args.engine_timeout)
        if job.rollout.engine == "cpu":  # its counters (SGLang's are its own sglang:* metrics)
            metrics.watch_engine(args.engine_url)
        redis_client = connect(args.redis_url)
        controller_channel, reward_channel = dependency_channel(args.controller), dependency_channel(args.reward)
        worker = RolloutWorker(
            job=job,
            worker_id=args.worker_id,
            address="",
            controller=ControllerClient(controller_pb2_grpc.ControllerStub(controller_channel)),
            scorer=RewardScorer(reward_pb2_grpc.RewardStub(reward_channel)),
            engine=engine,
            store=TrajectoryStore(redis_client, job.name),
            tokenizer=load_tokenizer(job.tokenizer_path),
            metrics=metrics,
            workflow=workflow,
        )
        worker.metrics.serve(args.host, args.metrics_port)
        try:
            info = await engine.server_info()
            worker.engine_ranks = weight_group_ranks(info, job.rollout.interrupt)
            worker.engine_dtype = served_dtype(info, job.model)
        except UnfitEngine as exc:
            exit_invalid(f"engine {args.engine_url}: {exc}")
        servicer = RolloutServicer(worker)
        await servicer.take_over()
        server, port, _health = await start_server(
            [(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, "areal.v1.Rollout")],
            f"{args.host}:{args.port}",
        )
        worker.address = args.advertise or f"{args.host}:{port}"
        log.info("rollout worker %s listening on %s:%d, engine %s", args.worker_id, args.host, port, args.engine_url)
        gateway = None
        if isinstance(workflow, AgentWorkflow):
            # the job's runners claim with this token (AREAL_CLAIM_TOKEN: set by `arealctl run`, in pods by the
            # operator's Secret <job>-claim-token)
            claim_token = env("AREAL_CLAIM_TOKEN") or None
            # a pod is claimed from through a Service: its sessions go to its own address (AREAL_GATEWAY_ADVERTISE)
            advertise = env("AREAL_GATEWAY_ADVERTISE") or None
            gateway = await start_gateway(workflow.book, args.host, args.gateway_port, claim_token, advertise)
            log.info("agent gateway on http://%s:%d/v1", args.host, gateway.port)
        try:
            await worker.run(stop)
            await wait_if_asked(args.when_done, stop)
        finally:
            if gateway is not None:
                await gateway.stop()
            await server.stop(grace=2)
            await servicer.lease.close()
            await asyncio.gather(controller_channel.close(), reward_channel.close())
            await engine.close()
            await redis_client.aclose()

    run_service("rollout", run)


if __name__ == "__main__":
    main()
