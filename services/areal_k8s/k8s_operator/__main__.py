"""python -m areal_k8s.k8s_operator [--namespace NS]... [--interval SECONDS]: run the RLJob operator.

Run exactly one replica (kopf's peering is not leader election). In a pod it uses its service account, with
the permissions in operator/rbac.yaml; elsewhere the current kubeconfig context.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from areal_k8s.k8s_operator.handlers import Context, register
from areal_k8s.k8s_operator.kube import KubeApi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The operator's flags (the Helm chart's operator Deployment passes them; tests/cluster/test_chart.py parses
    those)."""
    parser = argparse.ArgumentParser(prog="python -m areal_k8s.k8s_operator", description="The RLJob operator.")
    parser.add_argument(
        "--namespace", action="append", default=[], help="watch only this namespace (repeatable); default: all"
    )
    parser.add_argument(
        "--interval", type=float, default=10.0, help="seconds between level-triggered reconciles of each RLJob"
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf's liveness endpoint, for the pod's probes ('' to disable)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s operator %(levelname)s %(name)s: %(message)s")

    registry = kopf.get_default_registry()  # it carries kopf's login handlers (service account, kubeconfig)
    register(registry, Context(kube=KubeApi.from_environment(), interval=args.interval))
    asyncio.run(
        kopf.operator(
            registry=registry,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness or None,
        )
    )


if __name__ == "__main__":
    main()
