"""The runner's client of one rollout worker's gateway (HTTP): claim an episode, end or give up its session. The
job's claim token goes with a claim; a session's calls are the program's, under the session's own key."""

from __future__ import annotations

import httpx

from areal_k8s.agent_runner.runner import ClaimRefused, GatewayUnavailable, SessionGone


class GatewayClient:
    def __init__(self, url: str, http: httpx.AsyncClient, claim_token: str | None = None):
        self.name, self.http = url.rstrip("/"), http
        self.claim_headers = {"Authorization": f"Bearer {claim_token}"} if claim_token else {}

    async def claim(self, wait_seconds: float) -> dict | None:
        response = await self.post("/v1/episodes/claim", {"wait_seconds": wait_seconds}, wait_seconds + 10.0,
                                   self.claim_headers)  # fmt: skip
        if response.status_code == 204:
            return None
        if response.status_code != 200:
            raise ClaimRefused(f"claim answered {response.status_code}: {error_message(response)}")
        return response.json()

    async def end(self, key: str, reward: float | None) -> None:
        await self.settle(f"/v1/sessions/{key}/end", {} if reward is None else {"reward": reward})

    async def give_up(self, key: str) -> None:
        await self.settle(f"/v1/sessions/{key}/give-up", {})

    async def settle(self, path: str, body: dict) -> None:
        response = await self.post(path, body, 30.0)
        if response.status_code == 409 or response.status_code == 401:
            raise SessionGone(error_message(response))
        if response.status_code != 200:
            raise GatewayUnavailable(f"{path} answered {response.status_code}: {error_message(response)}")

    async def post(self, path: str, body: dict, timeout: float, headers: dict | None = None) -> httpx.Response:
        try:
            return await self.http.post(f"{self.name}{path}", json=body, timeout=timeout, headers=headers)
        except httpx.HTTPError as exc:
            raise GatewayUnavailable(f"{type(exc).__name__}: {exc}") from None


def error_message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
