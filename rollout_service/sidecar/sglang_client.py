"""The few SGLang HTTP calls the sidecar makes, each with a timeout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from ..bounded_http import Answer, AnswerTimedOut, arequest
from ..http_auth import bearer_headers


class SGLangUnavailable(RuntimeError):
    """SGLang did not answer (down, restarting, or timed out)."""


class SGLangErrorAnswer(SGLangUnavailable):
    """A load was answered with a 5xx: a proxy in between (502/503/504), not SGLang refusing the
    step (it answers 400) nor dying of it (the connection would drop): not counted as a crash."""


class SGLangNotReached(SGLangUnavailable):
    """A load that never reached SGLang (connection refused, or none made in time: SGLang down,
    restarting, or its accept queue full): SGLang cannot have died of a step it was never sent,
    so it is not counted as a crash."""


NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""httpx's errors for a request that was never sent."""


class SGLangLoadTimedOut(SGLangUnavailable):
    """A load sent to SGLang was not answered within ``--load-timeout``: SGLang may still be
    loading it (and serve it once done), or be stuck in it."""


class SGLangLoadRejected(RuntimeError):
    """SGLang answered a weight update with a failure."""


@dataclass
class ServerView:
    """What SGLang says about itself: ``model_path`` is where its weights came from
    (``/model_info``: it moves with every weight update), ``launch_model_path`` the model it was
    started from (``/server_info``'s launch arguments, read on deep checks: None when unknown)."""

    healthy: bool
    weight_version: str | None = None
    model_path: str | None = None
    launch_model_path: str | None = None
    refusal: str | None = None
    """Not healthy, though something answered at SGLang's URL: what, and what to do (a wrong
    API key, a URL that is not SGLang's); None when nothing answered."""


class SGLangClient:
    """Async client for one SGLang server's health, model info and weight updates."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout_s: float = 10.0, load_timeout_s: float = 1800.0
    ):
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout_s
        self._load_timeout = load_timeout_s
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=bearer_headers(api_key), trust_env=False)
        self._launch_model_path: str | None = None
        """``/server_info``'s ``model_path`` at the last deep check (None: unknown, or SGLang was
        seen down since: it may have been started on another model)."""

    async def aclose(self) -> None:
        await self._http.aclose()

    async def view(self, deep: bool = False) -> ServerView:
        """The served weight version; ``healthy=False`` when SGLang does not answer.

        ``deep`` also calls ``/health``, which in SGLang 0.5.23 runs a one-token generation
        (it proves the scheduler works, but costs a forward pass, and ~1 s on a busy CPU), so
        the sidecar does it only when SGLang (re)appears and every ``deep_health_interval``;
        and ``/server_info``, for the model SGLang was started from (``launch_model_path``,
        kept until a deep check reads another; forgotten when SGLang does not answer ``/health``
        or ``/model_info``: it may have been restarted on another model).
        """
        try:
            if deep:
                health = await self._get("/health", self._timeout)
                if health.status_code != 200:
                    self._launch_model_path = None
                    return ServerView(healthy=False, refusal=self._refusal("/health", health.status_code))
            info = await self._get("/model_info", self._timeout)
            if info.status_code != 200:
                self._launch_model_path = None
                return ServerView(healthy=False, refusal=self._refusal("/model_info", info.status_code))
            data = info.json()
        except (httpx.HTTPError, ValueError):
            self._launch_model_path = None
            return ServerView(healthy=False)
        if not isinstance(data, dict):  # an answer that is not SGLang's: not a server to load into
            self._launch_model_path = None
            return ServerView(
                healthy=False,
                refusal=f"{self.base_url}/model_info answered with something that is not SGLang's model info:"
                " is --sglang-url SGLang's address?",
            )
        if deep:  # one /server_info that fails keeps what was read: the same server answered /model_info
            self._launch_model_path = await self._launch_model() or self._launch_model_path
        version, path = data.get("weight_version"), data.get("model_path")
        return ServerView(
            healthy=True,
            weight_version=None if version is None else str(version)[:200],
            model_path=path if isinstance(path, str) and "\0" not in path else None,
            launch_model_path=self._launch_model_path,
        )

    def _refusal(self, route: str, status: int) -> str | None:
        """What an answer other than 200 says, and what to do; None for a 5xx or 429 (busy,
        starting, or a proxy's: SGLang counts as not answering)."""
        where = f"{self.base_url}{route} answered HTTP {status}"
        if status in (401, 403):
            return (
                f"{where}: SGLang refuses the sidecar's API key. Give the sidecar SGLang's --api-key"
                " (--sglang-api-key, or ROLLOUT_SGLANG_API_KEY)"
            )
        if status >= 500 or status == 429:
            return None
        return f"{where}: is --sglang-url SGLang's address (not the sidecar's, nor a proxy's)?"

    async def _launch_model(self) -> str | None:
        """``/server_info``'s ``model_path``: SGLang's ``--model-path`` as it was started (its
        launch arguments; a weight update changes ``/model_info``'s ``model_path`` only). None
        when SGLang does not say (it stays healthy: this is only where a reference comes from)."""
        try:
            return _path_or_none((await self.server_info()).get("model_path"))
        except SGLangUnavailable:
            return None

    async def _get(self, route: str, timeout_s: float) -> Answer:
        return await arequest(self._http, "GET", route, timeout_s=timeout_s)

    async def _post(self, route: str, body: dict[str, Any], timeout_s: float) -> Answer:
        return await arequest(self._http, "POST", route, json=body, timeout_s=timeout_s)

    async def load_from_disk(self, model_path: str, weight_version: str) -> dict:
        """``/update_weights_from_disk``; in-flight requests finish on the old weights first."""
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": False,
            "flush_cache": True,
        }
        try:
            resp = await self._post("/update_weights_from_disk", body, self._load_timeout)
        except (httpx.ReadTimeout, AnswerTimedOut) as exc:  # not answered in time: the load may still run
            raise SGLangLoadTimedOut(
                f"SGLang at {self.base_url} did not answer the weight update within --load-timeout"
                f" ({self._load_timeout:g} s); it may still be loading {model_path}"
            ) from exc
        except NOT_SENT as exc:
            raise SGLangNotReached(f"the weight update never reached SGLang at {self.base_url}: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise SGLangUnavailable(f"SGLang at {self.base_url} failed during the weight update: {exc!r}") from exc
        _not_sglangs_answer(resp, self.base_url, "the weight update")
        data = _answer_object(resp, "message")
        if resp.status_code != 200 or data.get("success") is not True:
            raise SGLangLoadRejected(
                f"SGLang refused {model_path} (HTTP {resp.status_code}): {str(data.get('message'))[:500]}"
            )
        return data

    # --- LoRA adapters (adapter sync; see ``sidecar/adapter_sync.py``) ------------------------
    async def server_info(self) -> dict:
        """``/server_info``: SGLang's start-up arguments (``enable_lora``, ``max_lora_rank``, ...)."""
        try:
            resp = await self._get("/server_info", self._timeout)
            if resp.status_code != 200:
                raise SGLangUnavailable(f"SGLang at {self.base_url} answered /server_info with HTTP {resp.status_code}")
            data = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SGLangUnavailable(f"SGLang at {self.base_url} did not answer /server_info: {exc!r}") from exc
        if not isinstance(data, dict):
            raise SGLangUnavailable(
                f"SGLang at {self.base_url} answered /server_info with JSON that is not an object"
                f" ({type(data).__name__}): a proxy in between, or not SGLang?"
            )
        return data

    async def loaded_adapters(self) -> dict[str, str | None]:
        """The LoRA adapters SGLang has loaded (from ``/v1/models``): name -> the path it loaded
        them from (the card's ``root`` in SGLang 0.5.23; None when not a string)."""
        try:
            resp = await self._get("/v1/models", self._timeout)
            _not_sglangs_answer(resp, self.base_url, "/v1/models")
            if resp.status_code != 200:
                raise SGLangUnavailable(f"SGLang at {self.base_url} answered /v1/models with HTTP {resp.status_code}")
            cards = resp.json().get("data") or []
            cards = cards if isinstance(cards, list) else []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise SGLangUnavailable(f"SGLang at {self.base_url} did not answer /v1/models: {exc!r}") from exc
        return {
            str(c.get("id")): c["root"] if isinstance(c.get("root"), str) else None
            for c in cards
            if isinstance(c, dict) and c.get("parent")
        }

    async def load_lora_adapter(self, name: str, path: str) -> dict:
        """``/load_lora_adapter``: SGLang reads the adapter's files now (they may go afterwards)."""
        return await self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> dict:
        """``/unload_lora_adapter``: SGLang frees it once the requests already using it have
        finished (it waits for them); a later request naming it makes SGLang load it again from
        the path it last loaded it from (SGLang 0.5.23), so a name is never refused after this."""
        return await self._adapter_call("/unload_lora_adapter", {"lora_name": name})

    async def _adapter_call(self, route: str, body: dict) -> dict:
        try:
            resp = await self._post(route, body, self._load_timeout)
        except NOT_SENT as exc:
            raise SGLangNotReached(f"{route} never reached SGLang at {self.base_url}: {exc!r}") from exc
        except httpx.HTTPError as exc:
            raise SGLangUnavailable(f"SGLang at {self.base_url} failed during {route}: {exc!r}") from exc
        _not_sglangs_answer(resp, self.base_url, route)
        data = _answer_object(resp, "error_message")
        if resp.status_code != 200 or data.get("success") is not True:
            raise SGLangLoadRejected(
                f"SGLang refused {route} {body} (HTTP {resp.status_code}):"
                f" {str(data.get('error_message') or data.get('message'))[:500]}"
            )
        return data


def _path_or_none(path: Any) -> str | None:
    """A path from SGLang's answer, or None when it is not a string a path can be."""
    return path if isinstance(path, str) and path and "\0" not in path else None


def _not_sglangs_answer(resp: Answer, base_url: str, what: str) -> None:
    """Raise ``SGLangUnavailable`` for a 5xx: SGLang answers a load it refuses with 400, so a
    5xx comes from a proxy in between (502/503/504) or a server failing as it answers, and says
    nothing against the step (tried again; a step SGLang dies of is counted as such)."""
    if resp.status_code >= 500:
        raise SGLangErrorAnswer(f"{base_url} answered {what} with HTTP {resp.status_code}: {resp.text[:300]}")


def _answer_object(resp: Answer, message_key: str) -> dict[str, Any]:
    """A weight update's answer as a JSON object; anything else stands for a failure, quoted."""
    try:
        data = resp.json()
    except ValueError:
        data = None
    return data if isinstance(data, dict) else {"success": False, message_key: resp.text[:500]}
