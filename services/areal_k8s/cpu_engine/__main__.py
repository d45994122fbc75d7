"""`python -m areal_k8s.cpu_engine --model-path P [--port 0]`: serve the CPU engine over SGLang's HTTP API.

Logs one line "CPU engine ready on http://HOST:PORT" once the port accepts connections (`--port 0` binds a free
port; the line gives the one chosen).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket

from aiohttp import web

from areal_k8s.common.prompts import require_model_dirs
from areal_k8s.common.service import exit_now
from areal_k8s.cpu_engine.engine import CpuEngine
from areal_k8s.cpu_engine.server import create_app

log = logging.getLogger("areal_k8s.cpu_engine")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m areal_k8s.cpu_engine", description=__doc__)
    parser.add_argument("--model-path", required=True, help="local Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device",
        default=os.environ.get("AREAL_ENGINE_DEVICE", "cpu"),
        help="where the model lives: cpu, or cuda[:N] (make gpu-smoke receives weights there over NCCL); default "
        "$AREAL_ENGINE_DEVICE, else cpu (how scripts/gpu_check.py puts the engines of an `arealctl run` on a GPU)",
    )
    parser.add_argument("--weight-version", default="0")
    parser.add_argument(
        "--weight-update-timeout",
        type=float,
        default=600.0,
        help="seconds joining a weight-update group or receiving one broadcast may take (the job's "
        "trainer.weight_sync_timeout_seconds): a trainer gone in the middle of a push leaves the engine waiting no "
        "longer than the trainer itself waits, so the next trainer's group can form",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_model_dirs(model=args.model_path, tokenizer=args.model_path)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = CpuEngine(
        args.model_path,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        num_threads=args.threads,
        seed=args.seed,
        weight_version=args.weight_version,
        weight_update_timeout=args.weight_update_timeout,
        device=args.device,
    )
    app = create_app(engine)

    async def stop_engine(_: web.Application) -> None:
        engine.shutdown()

    app.on_cleanup.append(stop_engine)
    # Bind and listen before announcing, so the announced port already accepts connections.
    sock = socket.create_server((args.host, args.port))
    host, port = sock.getsockname()[:2]
    log.info("CPU engine ready on http://%s:%d", host, port)
    web.run_app(app, sock=sock, print=None, access_log=None)
    exit_now(0)


if __name__ == "__main__":
    main()
