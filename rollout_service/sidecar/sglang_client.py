"""The few SGLang HTTP calls the sidecar makes, each with a timeout."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from ..http_auth import bearer_headers


class SGLangUnavailable(RuntimeError):
    """SGLang did not answer (down, restarting, or timed out)."""


class SGLangLoadRejected(RuntimeError):
    """SGLang answered a weight update with a failure."""


@dataclass
class ServerView:
    """What SGLang says about itself."""

    healthy: bool
    weight_version: str | None = None
    model_path: str | None = None


class SGLangClient:
    """Async client for one SGLang server's health, model info and weight updates."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 10.0,
                 load_timeout_s: float = 1800.0):
        self.base_url = base_url.rstrip("/")
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0))
        self._load_timeout = httpx.Timeout(load_timeout_s, connect=min(timeout_s, 3.0))
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=bearer_headers(api_key),
                                       trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def view(self, deep: bool = False) -> ServerView:
        """The served weight version; ``healthy=False`` when SGLang does not answer.

        ``deep`` also calls ``/health``, which in SGLang 0.5.23 runs a one-token generation
        (it proves the scheduler works, but costs a forward pass, and ~1 s on a busy CPU), so
        the sidecar does it only when SGLang (re)appears and every ``deep_health_interval``.
        """
        try:
            if deep:
                health = await self._http.get("/health", timeout=self._timeout)
                if health.status_code != 200:
                    return ServerView(healthy=False)
            info = await self._http.get("/model_info", timeout=self._timeout)
            info.raise_for_status()
            data = info.json()
        except (httpx.HTTPError, ValueError):
            return ServerView(healthy=False)
        version = data.get("weight_version")
        return ServerView(healthy=True, weight_version=None if version is None else str(version),
                          model_path=data.get("model_path"))

    async def load_from_disk(self, model_path: str, weight_version: str) -> dict:
        """``/update_weights_from_disk``; in-flight requests finish on the old weights first."""
        body = {"model_path": model_path, "weight_version": weight_version,
                "abort_all_requests": False, "flush_cache": True}
        try:
            resp = await self._http.post("/update_weights_from_disk", json=body,
                                         timeout=self._load_timeout)
        except httpx.HTTPError as exc:
            raise SGLangUnavailable(f"SGLang at {self.base_url} failed during the weight update:"
                                    f" {exc!r}") from exc
        try:
            data = resp.json()
        except ValueError:
            data = {"success": False, "message": resp.text[:500]}
        if resp.status_code != 200 or not data.get("success", False):
            raise SGLangLoadRejected(
                f"SGLang refused {model_path} (HTTP {resp.status_code}): {data.get('message')}"
            )
        return data
