"""python -m areal_k8s.controller --job JOB.yaml --redis-url URL [--port 50051]"""

import logging
import os

from areal_k8s.common.metrics import ControllerMetrics
from areal_k8s.common.service import base_parser, load_items, load_job, run_service, setup_logging
from areal_k8s.common.store import TrajectoryStore, connect
from areal_k8s.controller.core import ControllerCore
from areal_k8s.controller.server import serve

log = logging.getLogger("areal.controller")


def main() -> None:
    parser = base_parser("controller", default_port=50051)
    parser.add_argument("--redis-url", default=os.environ.get("AREAL_REDIS_URL"), required=not os.environ.get("AREAL_REDIS_URL"))
    parser.add_argument("--lease-seconds", type=float, default=60.0, help="a worker silent this long loses its groups")
    args = parser.parse_args()
    setup_logging("controller", args.log_level)
    job = load_job(args.job)
    items = load_items(job.dataset.train, job.dataset.format)

    async def run(stop):
        client = connect(args.redis_url)
        metrics = ControllerMetrics(job.name)
        metrics.serve(args.host, args.metrics_port)
        core = ControllerCore(job, items, lease_seconds=args.lease_seconds, metrics=metrics)
        server, port, _servicer, reaper = await serve(core, TrajectoryStore(client, job.name), f"{args.host}:{args.port}")
        log.info("controller listening on %s:%d (job %s, %d prompts)", args.host, port, job.name, len(items))
        await stop.wait()
        reaper.cancel()
        await server.stop(grace=2)
        await client.aclose()

    run_service("controller", run)


if __name__ == "__main__":
    main()
