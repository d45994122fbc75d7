"""The node side of tests/support/kubelet.py: a process inside the test's node network namespace, where the kubelet's
probes and the cluster DNS live.

It reads one JSON request per line on stdin and answers one JSON line on stdout, with the request's id:
  {"op": "dns", "records": {fqdn: [ip, ...]}}    -> {}            replace what the cluster DNS answers
  {"op": "probe", "probe": {...}, "ip": IP}       -> {"ok", "message"}   one httpGet/grpc/tcpSocket probe, as the
                                                                  kubelet sends it: from the node to the pod's IP
  {"op": "job_status", "address": "host:port"}    -> {"status": base64} or {"error": "..."}   the operator's own
                                                                  Controller.GetJobStatus call (handlers.py)
  {"op": "resolve", "name": NAME}                 -> {"addresses": [...]} or {"error": "..."}  a name looked up
                                                                  from the node, through the cluster DNS
  {"op": "hand_off", "address": "host:port"}      -> {"version": N} or {"error": "..."}   the operator's own
                                                                  Trainer.SaveCheckpoint(hand_off) call (handlers.py)
  {"op": "unary", "address": "host:port", "method": "/pkg.Service/Method", "request": base64, "timeout": s}
                                                  -> {"reply": base64} or {"code", "details"}   one gRPC call, as a
                                                                  client in the cluster makes it (a test's request)
  {"op": "http_get", "url": URL}                  -> {"status": N, "body": text}   one GET from the node (a pod's
                                                                  /metrics, as a scraper reads it)
NodeAgent starts it (`ip netns exec NODE python kubelet_node.py DNS_IP`) and sends the requests; they run concurrently.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shlex
import socket
import struct
import sys
from pathlib import Path

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from areal_k8s.k8s_operator.handlers import hand_off_trainer, read_job_status

RECORDS: dict[str, list[str]] = {}


class ClusterDns(asyncio.DatagramProtocol):
    """The cluster DNS (CoreDNS's part that matters here): A records for Service and pod names, TTL 0 so a pod that
    turns ready or unready is seen on the next lookup. A name it knows without addresses answers NODATA, an
    unknown name NXDOMAIN. The wire format is RFC 1035's (no DNS library is among the test dependencies); only
    the first question is answered."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        ident, flags = struct.unpack("!HH", data[:4])
        labels, end = [], 12
        while data[end]:
            labels.append(data[end + 1 : end + 1 + data[end]].decode().lower())
            end += 1 + data[end]
        qtype = struct.unpack("!H", data[end + 1 : end + 3])[0]
        question = data[12 : end + 5]
        addresses = RECORDS.get(".".join(labels))
        answers = (
            [b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 0, 4) + socket.inet_aton(ip) for ip in addresses or []]
            if qtype == 1
            else []
        )
        rcode = 3 if addresses is None else 0
        header = struct.pack("!HHHHHH", ident, 0x8400 | (flags & 0x0100) | 0x0080 | rcode, 1, len(answers), 0, 0)
        self.transport.sendto(header + question + b"".join(answers), addr)


async def probe(spec: dict, ip: str) -> tuple[bool, str]:
    timeout = spec["timeoutSeconds"]
    try:
        if "httpGet" in spec:
            get = spec["httpGet"]
            url = f"{get.get('scheme', 'HTTP').lower()}://{get.get('host') or ip}:{get['port']}{get.get('path', '/')}"
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
                session.get(url, allow_redirects=False) as reply,
            ):
                return 200 <= reply.status < 400, f"HTTP {reply.status}"
        if "grpc" in spec:
            async with grpc.aio.insecure_channel(f"{ip}:{spec['grpc']['port']}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout
                )
                return (
                    reply.status == health_pb2.HealthCheckResponse.SERVING,
                    health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status),
                )
        if "tcpSocket" in spec:
            _, writer = await asyncio.wait_for(asyncio.open_connection(ip, spec["tcpSocket"]["port"]), timeout)
            writer.close()
            return True, "connected"
    except grpc.aio.AioRpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    except (TimeoutError, OSError, aiohttp.ClientError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    raise ValueError(f"probe kind not sent to the node: {sorted(spec)}")


async def job_status(address: str) -> dict:
    try:
        status = await asyncio.to_thread(read_job_status, address)
    except grpc.RpcError as exc:
        return {"error": f"controller {address}: {exc.code().name}: {exc.details()}"}
    return {"status": base64.b64encode(status.SerializeToString()).decode()}


async def hand_off(address: str) -> dict:
    try:
        return {"version": await asyncio.to_thread(hand_off_trainer, address)}
    except grpc.RpcError as exc:
        return {"error": f"trainer {address}: {exc.code().name}: {exc.details()}"}


async def unary(address: str, method: str, request: str, timeout: float) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(method)  # bytes in, bytes out: the caller (de)serializes
        try:
            reply = await call(base64.b64decode(request), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return {"code": exc.code().name, "details": exc.details()}
    return {"reply": base64.b64encode(reply).decode()}


async def http_get(url: str) -> dict:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(url, allow_redirects=False) as reply,
    ):
        return {"status": reply.status, "body": await reply.text()}


async def answer(request: dict, out: asyncio.Lock) -> None:
    op = request["op"]
    try:
        if op == "dns":
            RECORDS.clear()
            RECORDS.update(request["records"])
            reply: dict = {}
        elif op == "probe":
            ok, message = await probe(request["probe"], request["ip"])
            reply = {"ok": ok, "message": message}
        elif op == "resolve":  # as a client in the cluster would, through /etc/resolv.conf and the cluster DNS
            found = await asyncio.get_running_loop().getaddrinfo(request["name"], None, family=socket.AF_INET)
            reply = {"addresses": sorted({address[4][0] for address in found})}
        elif op == "hand_off":
            reply = await hand_off(request["address"])
        elif op == "http_get":
            reply = await http_get(request["url"])
        elif op == "unary":
            reply = await unary(request["address"], request["method"], request["request"], request["timeout"])
        else:
            reply = await job_status(request["address"])
    except Exception as exc:  # a request the agent cannot serve: the harness raises it
        reply = {"error": f"{op}: {type(exc).__name__}: {exc}"}
    async with out:
        sys.stdout.write(json.dumps({"id": request["id"], **reply}) + "\n")
        sys.stdout.flush()


class NodeAgent:
    """The harness's side of the agent: requests written as they come, each reply matched to its request by id."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {0: asyncio.get_running_loop().create_future()}
        self.reader = asyncio.create_task(self.read_replies())

    @classmethod
    async def start(cls, netns: str, ip: str, resolv_conf: Path, log: Path) -> NodeAgent:
        """Run the agent in `netns`, serving DNS at `ip`, with `resolv_conf` (the cluster's search domains) as its
        /etc/resolv.conf."""
        script = (
            f"mount --bind {shlex.quote(str(resolv_conf))} /etc/resolv.conf && exec {shlex.quote(sys.executable)} "
            f"{shlex.quote(str(Path(__file__).resolve()))} {ip}"
        )
        with log.open("ab") as errors:
            process = await asyncio.create_subprocess_exec(
                "ip",
                "netns",
                "exec",
                netns,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=errors,
            )
        agent = cls(process)
        await asyncio.wait_for(agent.waiting[0], 60)  # it serves DNS
        return agent

    async def read_replies(self) -> None:
        while line := await self.process.stdout.readline():
            reply = json.loads(line)
            future = self.waiting.pop(reply.pop("id"), None)
            if future and not future.done():
                future.set_result(reply)
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(RuntimeError("the node agent exited (see its log)"))

    def call(self, op: str, **fields) -> asyncio.Future:
        request_id = next(self.ids)
        future = self.waiting[request_id] = asyncio.get_running_loop().create_future()
        self.process.stdin.write((json.dumps({"id": request_id, "op": op, **fields}) + "\n").encode())
        return future

    async def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()
        self.reader.cancel()


async def main(dns_ip: str) -> None:
    loop = asyncio.get_running_loop()
    await loop.create_datagram_endpoint(ClusterDns, local_addr=(dns_ip, 53))
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out, tasks = asyncio.Lock(), set()
    sys.stdout.write(json.dumps({"id": 0}) + "\n")  # serving DNS
    sys.stdout.flush()
    while line := await reader.readline():
        task = asyncio.create_task(answer(json.loads(line), out))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
