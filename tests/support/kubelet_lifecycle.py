"""The kubelet's pod workers (kubelet.py's Cluster hands them its pods): a pod's network namespace on the node's
bridge and its hosts, resolv.conf and hostname files; each container resolved (kubelet_spec.py), started by its
runtime (kubelet_runtime.py), probed, and restarted as the pod's restartPolicy says with the kubelet's back-off;
stopped with SIGTERM, the grace period, then SIGKILL.

Probes (startup, readiness, liveness) follow Kubernetes' defaults and thresholds: httpGet, grpc and tcpSocket from
the node to the pod's IP (the node agent, kubelet_node.py), exec inside the container (its runtime's exec); a
failed liveness or startup probe restarts the container; restarts back off 0 s, 10 s, 20 s, ... 300 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from support.kubelet_spec import PodConfigError, SpecResolver, expand

PROBE_DEFAULTS = {
    "initialDelaySeconds": 0,
    "periodSeconds": 10,
    "timeoutSeconds": 1,
    "successThreshold": 1,
    "failureThreshold": 3,
}
BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 10, 300


async def ip(*args: str) -> None:
    process = await asyncio.create_subprocess_exec(
        "ip", *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, error = await process.communicate()
    if process.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {error.decode().strip()}")


class PodWorkers:
    """Runs pods on the node: `node` is its network namespace (with the bridge br0 at `node_ip`), `node_call` sends
    the node agent a request, `publish` tells the cluster DNS that readiness changed."""

    def __init__(
        self,
        resolver: SpecResolver,
        node: str,
        node_ip: str,
        logs: Path,
        node_call: Callable[..., Awaitable[dict]],
        publish: Callable[[], None],
    ):
        self.resolver, self.node, self.node_ip, self.logs = resolver, node, node_ip, logs
        self.node_call, self.publish = node_call, publish

    async def run_pod(self, pod, index: int, domain: str) -> None:
        for command in (
            f"netns add {pod.netns}",
            f"-n {self.node} link add veth{index} type veth peer name eth0 netns {pod.netns}",
            f"-n {self.node} link set veth{index} master br0 up",
            f"-n {pod.netns} addr add {pod.ip}/24 dev eth0",
            f"-n {pod.netns} link set eth0 up",
            f"-n {pod.netns} link set lo up",
            f"-n {pod.netns} route add default via {self.node_ip}",
        ):
            await ip(*command.split())
        pod.directory.mkdir(parents=True)
        subdomain = pod.spec.get("subdomain")
        fqdn = f"{pod.hostname}.{subdomain}.{pod.namespace}.svc.{domain}\t" if subdomain else ""
        (pod.directory / "hosts").write_text(
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"
            f"::1\tlocalhost ip6-localhost ip6-loopback\n{pod.ip}\t{fqdn}{pod.hostname}\n"
        )
        (pod.directory / "resolv.conf").write_text(
            f"search {pod.namespace}.svc.{domain} svc.{domain} {domain}\nnameserver {self.node_ip}\noptions ndots:5\n"
        )
        (pod.directory / "hostname").write_text(pod.hostname + "\n")
        await asyncio.gather(*(self.run_container(pod, c) for c in pod.containers))

    async def run_container(self, pod, container) -> None:
        """Start, probe and restart one container as its pod's restartPolicy says, until the pod is deleted."""
        policy = pod.spec.get("restartPolicy", "Always")
        while not pod.deleted:
            try:
                config = self.resolver.container(pod, container.spec)
                with (self.logs / f"{pod.name}_{container.spec['name']}.log").open("ab") as log:
                    log.write(f"--- start {container.restarts}\n".encode())
                    log.flush()
                    await container.runtime.start(pod, container, config, log)
            except PodConfigError as exc:
                container.state = {"waiting": {"reason": exc.reason, "message": str(exc)}}
                await asyncio.sleep(1)
                continue
            container.state = {"running": {}}
            prober = asyncio.create_task(self.probe(pod, container, asyncio.get_running_loop().time()))
            try:
                code = await container.runtime.wait(container)
            finally:  # the pod's task cancelled as well (a cluster shut down): its prober goes with it, never alone
                prober.cancel()
                await asyncio.gather(prober, return_exceptions=True)
            await container.runtime.reap(container)
            container.started = container.ready = False
            container.last_state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
            self.publish()
            if pod.deleted or policy == "Never" or (policy == "OnFailure" and code == 0):
                container.state = container.last_state
                return
            container.restarts += 1
            delay = (
                0
                if container.restarts == 1
                else min(BACKOFF_SECONDS * 2 ** (container.restarts - 2), MAX_BACKOFF_SECONDS)
            )
            container.state = {"waiting": {"reason": "CrashLoopBackOff" if delay else "Restarting"}}
            await asyncio.sleep(delay)

    @staticmethod
    async def stop_container(container, grace: float) -> None:
        process = container.process
        if process is None or process.returncode is not None:
            return
        container.runtime.terminate(container)
        try:
            await asyncio.wait_for(asyncio.shield(process.wait()), grace)
        except TimeoutError:
            container.runtime.kill(container)

    # -- probes -------------------------------------------------------------------------------------------------

    async def probe(self, pod, container, started_at: float) -> None:
        """The kubelet's probe workers for one running container. Readiness and liveness wait for the startup probe
        to succeed; the pod sync its result triggers runs the readiness probe at once (prober_manager.go)."""
        spec = container.spec
        try:
            if "startupProbe" in spec and not await self.probe_loop(pod, container, "startup", started_at):
                return
            container.started = True
            if "readinessProbe" not in spec:
                container.ready = True
                self.publish()
            await asyncio.gather(
                *(
                    self.probe_loop(pod, container, kind, started_at)
                    for kind in ("readiness", "liveness")
                    if f"{kind}Probe" in spec
                )
            )
        except Exception as exc:  # a fault of the harness: say so where a failing test looks
            container.events.append(f"prober failed: {exc!r}")
            raise

    async def probe_loop(self, pod, container, kind: str, started_at: float) -> bool:
        """Probe every period (initialDelaySeconds counted from the container's start); a result counts once it
        repeats successThreshold or failureThreshold times. Startup returns True on success; failed startup and
        liveness probes kill the container (returning False); readiness runs for the container's life."""
        probe = {**PROBE_DEFAULTS, **container.spec[f"{kind}Probe"]}
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, started_at + probe["initialDelaySeconds"] - loop.time()))
        last, run = None, 0
        while True:
            tick = loop.time()
            ok, message = await self.probe_once(pod, container, probe)
            last, run = ok, run + 1 if ok == last else 1
            if not ok:
                container.events.append(f"{kind} probe failed: {message}")
            if run >= probe["successThreshold" if ok else "failureThreshold"]:
                if kind == "readiness" and container.ready != ok:
                    container.ready = ok
                    self.publish()
                elif kind == "startup" and ok:
                    return True
                elif kind != "readiness" and not ok:
                    container.events.append(f"killed: {kind} probe failed {run} times")
                    await self.stop_container(container, pod.spec.get("terminationGracePeriodSeconds", 30))
                    return False
            await asyncio.sleep(max(0.0, tick + probe["periodSeconds"] - loop.time()))

    async def probe_once(self, pod, container, probe: dict) -> tuple[bool, str]:
        if "exec" in probe:
            # like the kubelet, `$(VAR)` in the command expands only the container's literal env values
            literal = {var["name"]: var["value"] for var in container.spec.get("env", []) if "value" in var}
            command = [expand(part, literal) for part in probe["exec"]["command"]]
            code, output = await container.runtime.exec(container, command, probe["timeoutSeconds"])
            if code is None:
                return False, f"timed out after {probe['timeoutSeconds']} s"
            return code == 0, f"exit {code}: {output.strip()[-200:]}"
        network = {k: dict(v) for k, v in probe.items() if k in ("httpGet", "grpc", "tcpSocket")}
        for action in network.values():  # a named port is the container's port of that name
            if isinstance(action.get("port"), str):
                action["port"] = next(
                    p["containerPort"] for p in container.spec.get("ports", []) if p.get("name") == action["port"]
                )
        reply = await self.node_call("probe", probe={**network, "timeoutSeconds": probe["timeoutSeconds"]}, ip=pod.ip)
        if "error" in reply:
            raise RuntimeError(f"node agent: {reply['error']}")
        return reply["ok"], reply["message"]
