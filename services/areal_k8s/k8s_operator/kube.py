"""A small Kubernetes REST client: raw dicts in and out, one code path for every kind.

It borrows configuration (in-cluster service account or kubeconfig) and transport from the `kubernetes`
package. Keeping every call a plain method + path makes the RBAC each one needs obvious (operator/rbac.yaml).
"""

from __future__ import annotations

import json
import os

from kubernetes import client, config

from areal_k8s.k8s_operator.names import MANAGER, operator_version

MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_SECONDS = 30
USER_AGENT = f"{MANAGER}/{operator_version()}"


class ApiError(RuntimeError):
    """A request the apiserver answered with an error status."""

    def __init__(self, method: str, path: str, status: int, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def retriable(self) -> bool:
        """Conflicts, throttling and server trouble pass; other 4xx answers mean the request itself is wrong."""
        return self.status in (409, 429) or self.status >= 500


def object_path(
    api_version: str, plural: str, namespace: str, name: str | None = None, subresource: str | None = None
) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class KubeApi:
    def __init__(self, api_client: client.ApiClient):
        self.api_client = api_client
        self.api_client.user_agent = USER_AGENT  # names the operator in the apiserver's audit log

    @classmethod
    def from_environment(cls) -> KubeApi:
        """In a pod: its service account; elsewhere: the current kubeconfig context."""
        configuration = client.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(client_configuration=configuration)
        return cls(client.ApiClient(configuration))

    @classmethod
    def for_url(cls, url: str) -> KubeApi:
        """An unauthenticated client for an apiserver at `url` (a local test apiserver)."""
        return cls(client.ApiClient(client.Configuration(host=url.rstrip("/"))))

    def request(
        self,
        method: str,
        path: str,
        *,
        body: dict | None = None,
        content_type: str = "application/json",
        query: dict[str, str] | None = None,
    ) -> dict:
        method_, url, headers, serialized, _ = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(
            method_, url, header_params=headers, body=serialized, _request_timeout=TIMEOUT_SECONDS
        )
        data = response.read()
        text = data.decode() if isinstance(data, bytes) else data or ""
        if not 200 <= response.status < 300:
            try:
                message = json.loads(text).get("message", text)
            except (ValueError, AttributeError):
                message = text
            raise ApiError(method, path, response.status, message)
        return json.loads(text) if text else {}

    def get(self, path: str) -> dict | None:
        try:
            return self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str) -> list[dict]:
        return self.request("GET", path, query={"labelSelector": label_selector}).get("items") or []

    def create(self, collection_path: str, body: dict) -> dict:
        return self.request("POST", collection_path, body=body)

    def patch(self, path: str, body: dict) -> dict:
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    def delete(self, path: str) -> None:
        try:
            self.request("DELETE", path)
        except ApiError as exc:
            if exc.status != 404:
                raise
