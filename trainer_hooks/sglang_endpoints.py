"""Sending one batch of prompts to one or more SGLang endpoints, surviving dead ones.

:class:`SGLangEndpoints` splits a batch of unique prompts into contiguous chunks, one per
live endpoint, posts them concurrently (one ``POST /generate`` per chunk, ``n`` samples per
prompt) and puts the answers back in prompt order. An endpoint that refuses the connection,
times out or answers 5xx is marked dead for a while (with a warning) and its chunk goes to
the endpoints that remain; when none remains the call keeps retrying until its deadline and
then raises :class:`SGLangUnavailableError` naming every endpoint and its last error. A 4xx
answer (bad sampling parameters, prompt too long) is the request's fault and raises at once.
Every HTTP call has a timeout: nothing here can hang.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from rollout_service.http_auth import bearer_headers

from .sglang_responses import Completion, parse_generate_response

log = logging.getLogger(__name__)

DEAD_RETRY_S = 10.0
"""How long a failed endpoint is skipped before it is tried again (it may have restarted)."""
CONNECT_TIMEOUT_S = 10.0
RETRY_PAUSE_S = 1.0
SETTINGS_TIMEOUT_S = 5.0
"""How long a start-up question about a server's settings may take."""


class SGLangUnavailableError(RuntimeError):
    """No SGLang endpoint answered before the deadline."""


class SGLangRequestError(RuntimeError):
    """An SGLang endpoint rejected the request itself (4xx): retrying elsewhere will not help."""


class _EndpointFailed(Exception):
    def __init__(self, url: str, reason: str):
        super().__init__(reason)
        self.url = url
        self.reason = reason


@dataclass
class _Endpoint:
    url: str
    dead_until: float = 0.0
    last_error: str | None = None
    failures: int = 0
    prompts_answered: int = 0


class SGLangEndpoints:
    """A set of SGLang base URLs that generation batches are spread over."""

    def __init__(self, urls: Sequence[str], *, request_timeout_s: float,
                 vocab_size: int | None = None, api_key: str | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        """``transport`` replaces the network (``httpx.MockTransport`` replays recorded answers
        in benchmarks); leave it None to talk to the servers."""
        if not urls:
            raise ValueError("SGLangEndpoints needs at least one URL, e.g. ['http://127.0.0.1:30000']")
        self._endpoints = [_Endpoint(url.rstrip("/")) for url in urls]
        self._request_timeout_s = request_timeout_s
        self._vocab_size = vocab_size
        self._headers = bearer_headers(api_key)
        self._lock = threading.Lock()
        self._client = httpx.Client(
            timeout=httpx.Timeout(request_timeout_s, connect=min(CONNECT_TIMEOUT_S, request_timeout_s)),
            limits=httpx.Limits(max_connections=max(4, 2 * len(urls))),
            transport=transport,
        )
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="sglang-generate")

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self._endpoints]

    def prompts_answered(self) -> dict[str, int]:
        """How many prompts (each with its ``n`` samples) every endpoint has answered so far."""
        with self._lock:
            return {e.url: e.prompts_answered for e in self._endpoints}

    def sleeps_on_idle(self, url: str) -> bool | None:
        """SGLang's ``sleep_on_idle`` setting from ``GET /server_info``; None when it cannot be read."""
        try:
            info = self._client.get(f"{url.rstrip('/')}/server_info", headers=self._headers,
                                    timeout=SETTINGS_TIMEOUT_S).json()
        except (httpx.HTTPError, ValueError):
            return None
        value = info.get("sleep_on_idle") if isinstance(info, dict) else None
        return value if isinstance(value, bool) else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict[str, Any],
        *,
        want_logprobs: bool,
        deadline: float,
    ) -> list[list[Completion]]:
        """Generate ``sampling_params["n"]`` completions for each prompt; groups in prompt order.

        ``deadline`` (a ``time.monotonic()`` value) bounds how long the call keeps retrying
        when every endpoint is down.
        """
        n = int(sampling_params.get("n", 1))
        results: list[list[Completion] | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            live = self._live_endpoints()
            if not live:
                self._wait_for_an_endpoint(deadline)
                continue
            chunks = _split(pending, len(live))
            futures = [
                (endpoint, chunk,
                 self._pool.submit(self._post, endpoint.url, [list(prompts[i]) for i in chunk],
                                   sampling_params, n, want_logprobs))
                for endpoint, chunk in zip(live, chunks) if chunk
            ]
            failed: list[int] = []
            for endpoint, chunk, future in futures:
                try:
                    groups = future.result()
                except _EndpointFailed as exc:
                    self._mark_dead(endpoint, exc.reason)
                    failed.extend(chunk)
                    continue
                self._mark_alive(endpoint, len(chunk))
                for i, group in zip(chunk, groups):
                    results[i] = group
            pending = sorted(failed)
            if pending and time.monotonic() >= deadline:
                raise self._unavailable_error()
        return [group for group in results if group is not None]

    def _post(self, url: str, input_ids: list[list[int]], sampling_params: dict[str, Any], n: int,
              want_logprobs: bool) -> list[list[Completion]]:
        payload = {"input_ids": input_ids, "sampling_params": sampling_params,
                   "return_logprob": want_logprobs}
        try:
            response = self._client.post(f"{url}/generate", json=payload, headers=self._headers)
        except httpx.TimeoutException as exc:
            raise _EndpointFailed(url, f"no answer within the timeout ({type(exc).__name__}; "
                                       f"sglang_request_timeout={self._request_timeout_s:g} s)") from exc
        except httpx.HTTPError as exc:
            raise _EndpointFailed(url, f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise _EndpointFailed(url, f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code in (401, 403):
            raise SGLangRequestError(
                f"SGLang at {url} refused POST /generate with HTTP {response.status_code}: it was started with "
                "--api-key and the trainer sent " + ("a different key" if self._headers else "none") +
                "; set sglang_api_token in the config to that key"
            )
        if response.status_code != 200:
            raise SGLangRequestError(
                f"SGLang at {url} rejected POST /generate with HTTP {response.status_code}: "
                f"{response.text[:1000]}. Check the sampling parameters (generation_kwargs use SGLang's "
                "names, e.g. max_new_tokens, stop_token_ids) and that prompts fit the server's context length"
            )
        try:
            data = response.json()
        except ValueError as exc:
            raise _EndpointFailed(url, f"answered HTTP 200 with a body that is not JSON: {response.text[:200]!r}") from exc
        return parse_generate_response(data, num_prompts=len(input_ids), n=n, want_logprobs=want_logprobs,
                                       vocab_size=self._vocab_size, source=f"SGLang at {url}")

    def _live_endpoints(self) -> list[_Endpoint]:
        now = time.monotonic()
        with self._lock:
            return [e for e in self._endpoints if e.dead_until <= now]

    def _mark_dead(self, endpoint: _Endpoint, reason: str) -> None:
        with self._lock:
            endpoint.failures += 1
            endpoint.last_error = reason
            endpoint.dead_until = time.monotonic() + DEAD_RETRY_S
            others = sum(1 for e in self._endpoints if e.dead_until <= time.monotonic())
        if others:
            log.warning("SGLang endpoint %s failed (%s); skipping it for %.0f s, %d other endpoint(s) take "
                        "its prompts", endpoint.url, reason, DEAD_RETRY_S, others)
        else:
            log.warning("SGLang endpoint %s failed (%s); no endpoint is left, retrying until the deadline",
                        endpoint.url, reason)

    def _mark_alive(self, endpoint: _Endpoint, answered: int) -> None:
        with self._lock:
            endpoint.prompts_answered += answered
            if endpoint.failures:
                log.info("SGLang endpoint %s answers again", endpoint.url)
            endpoint.failures = 0
            endpoint.last_error = None
            endpoint.dead_until = 0.0

    def _wait_for_an_endpoint(self, deadline: float) -> None:
        """Sleep until the first dead endpoint is due again (or the deadline, for one last try)."""
        now = time.monotonic()
        if now >= deadline:
            raise self._unavailable_error()
        with self._lock:
            soonest = min(e.dead_until for e in self._endpoints)
        wake = min(deadline, max(soonest, now + RETRY_PAUSE_S))
        time.sleep(max(0.0, wake - now))
        if wake >= deadline:
            with self._lock:
                for e in self._endpoints:
                    e.dead_until = 0.0

    def _unavailable_error(self) -> SGLangUnavailableError:
        with self._lock:
            details = "; ".join(f"{e.url}: {e.last_error or 'not tried'}" for e in self._endpoints)
        return SGLangUnavailableError(
            f"no SGLang endpoint answered POST /generate before the deadline (sync_timeout): {details}. "
            "Check that the servers run (`rollout-service serve`), are reachable from the trainer, and that "
            "sglang_urls is right"
        )


def _split(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous, nearly equal chunks (the first ones one longer)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks
