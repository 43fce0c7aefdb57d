"""Sending one batch of prompts to one or more SGLang endpoints, surviving dead ones.

:class:`SGLangEndpoints` splits a batch of unique prompts into contiguous chunks, one per
live endpoint, posts them concurrently (one ``POST /generate`` per chunk, ``n`` samples per
prompt) and puts the answers back in prompt order. An endpoint that refuses the connection,
times out, or answers 5xx or something that is not JSON is marked dead for a while (with a
warning) and its chunk goes to the endpoints that remain; an overloaded one (HTTP 429 or 503)
is asked again after its ``Retry-After`` (bounded by the deadline). When none remains the call
keeps retrying until its deadline and then raises :class:`SGLangUnavailableError` naming every
endpoint and its last error. The retry budget (:class:`RetryBudget`) counts from the first
failure, not from the call's start: a round of generation longer than the budget still gets its
retries (another endpoint takes a dead one's prompts). A 4xx answer (bad sampling parameters, prompt too long) is the
request's fault and raises at once, as does a redirect (``sglang_urls`` must name the server
itself).

Nothing here can hang or swallow the memory: each request has one total time bound,
``sglang_request_timeout`` from its start to the last byte of its answer (httpx's timeouts only
bound each read; the body is read in a loop that checks the deadline, and :meth:`generate` stops
waiting for a request past it, treating its endpoint as failed), and its answer is read up to
a limit derived from the request (``BODY_LIMIT_BASE_BYTES`` plus ``BODY_BYTES_PER_TOKEN`` per
token it may return).

A request that kills its server (the connection drops mid-request, or a proxy in front answers
502/504, and ``/health`` then fails; or a 5xx other than 502, 503 and 504 comes back) is a
*poison* candidate (an overloaded server, a timeout, a proxy's or router's 502/504 while
``/health`` answers, or an answer that cannot be decoded, such as a proxy's broken gzip, is
not; each distinct prompt counts once per failure): the trainer waits for
a server to come back (``rollout-service serve`` restarts SGLang) and sends those prompts once
more; when a server dies on them again the call raises :class:`SGLangPoisonRequestError` naming
the sampling parameters and SGLang's own last error lines (from ``log_paths``, else the sidecars'
``/status``). It is never sent a third time.

With ``rescore=True`` (sampling parameters that change SGLang's distribution: a grammar,
``logit_bias``, penalties) each answer's logprobs are replaced by the model's own logprobs of the
same tokens, read back with a prefill-only request (docs/trl-conformance.md says why).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from rollout_service.bounded_http import (
    NO_COMPRESSION,
    abort_connections,
    call_deadline,
    content_encoding,
    declared_length,
    parse_json,
    request,
)
from rollout_service.bounded_http import client as bounded_client
from rollout_service.http_auth import bearer_headers
from rollout_service.process_group import LOG_TAIL_BYTES, log_end

from .context_limits import ContextLimits, PromptTooLong, read_context_limits
from .sglang_responses import Completion, parse_generate_response, parse_rescore_response

log = logging.getLogger(__name__)

DEAD_RETRY_S = 10.0
"""How long a failed endpoint is skipped before it is tried again (it may have restarted)."""
CONNECT_TIMEOUT_S = 10.0
RETRY_PAUSE_S = 1.0
SETTINGS_TIMEOUT_S = 5.0
"""How long a start-up question about a server's settings may take."""
OVERLOAD_RETRY_S = 2.0
"""How long an overloaded endpoint (HTTP 429/503) is left alone when it sends no ``Retry-After``."""
WAIT_GRACE_S = 2.0
"""How much longer than its own deadline :meth:`SGLangEndpoints.generate` waits for a request."""
BODY_LIMIT_BASE_BYTES = 16 * 1024 * 1024
"""Room for what does not grow with the tokens (each completion's text and meta info: ~0.5 KB).
Parsed JSON takes up to ~24 times its size in memory (a body of empty objects), so this bounds
what one hostile answer can cost (~400 MB), beside the per-token room below."""
BODY_BYTES_PER_TOKEN = 256
"""An answer may have ``BODY_LIMIT_BASE_BYTES`` plus this per token it may carry (SGLang's are
~50: the id, its logprob entry and its text); a larger one is refused unread."""
UNKNOWN_MAX_NEW_TOKENS = 32768
"""Tokens per completion assumed for the body limit when the request sets no ``max_new_tokens``."""
ERROR_TEXT_BYTES = 4096
"""How much of an error answer is read (to quote it)."""


def requests_per_round(rescoring: bool) -> int:
    """Requests one round of :meth:`SGLangEndpoints.generate` sends an endpoint one after the other,
    each bounded by the request timeout: 2 when the completions are rescored (``/generate``, then the
    rescore), else 1. ``trainer_hooks.config`` sizes its timeouts with it too."""
    return 2 if rescoring else 1


class SGLangUnavailableError(RuntimeError):
    """No SGLang endpoint answered before the deadline."""


class SGLangRequestError(RuntimeError):
    """An SGLang endpoint rejected the request itself (4xx): retrying elsewhere will not help."""


class _ContextRefused(SGLangRequestError):
    """SGLang refused the request as longer than its context (a 400 of its length check)."""


CONTEXT_REFUSALS = (
    "exceeds the model's maximum context length",
    "is longer than the model's context length",
    "exceeds the maximum allowed length",
)
"""What SGLang 0.5.23's 400 says when a prompt (+ ``max_new_tokens``) does not fit its context
(``TokenizerManager._validate_one_request``), or an input its scheduler's ``max_req_input_len``
(``validate_input_length``)."""


class SGLangPoisonRequestError(RuntimeError):
    """A request killed an SGLang server, and again after the server came back."""


class _EndpointFailed(Exception):
    def __init__(
        self,
        url: str,
        reason: str,
        *,
        sent: bool = False,
        retry_after: float | None = None,
        rescore_refused: bool = False,
        gateway: bool = False,
    ):
        super().__init__(reason)
        self.url = url
        self.reason = reason
        self.rescore_refused = rescore_refused
        """The server refused (4xx) to rescore what it had just generated."""
        self.sent = sent
        """True when the server may have died on the request (a poison candidate): it reached the
        server and the connection then broke, or a 5xx other than 502, 503 or 504 came back; not for a
        refused connection, a timeout (504 included), an overloaded server, a proxy's 502 or an answer
        that could not be decoded."""
        self.retry_after = retry_after
        """Seconds to leave an overloaded endpoint (HTTP 429/503) alone; None for other failures."""
        self.gateway = gateway
        """A proxy's or router's 502/504: a poison candidate only when the server behind it then
        fails its health check (a request that killed it comes back as 502 through nginx)."""


HEALTH_PROBE_TIMEOUT_S = 5.0
RESCORE_REFUSALS = 2
"""Refusals (4xx) in a row of an endpoint to rescore what it just generated before the call fails:
the first may be passing (the adapter swapped in between), a second one is the request's."""
ADAPTER_RETRY_S = 2.0
"""How long an endpoint that has not got the requested LoRA adapter is left alone (its sidecar
loads it again within a sync pass)."""
POISON_RETRIES = 1
"""How often prompts whose request killed a server are sent again (then the call fails)."""
GATEWAY_STATUSES = (502, 504)
"""What a proxy or router in front of SGLang answers when its upstream is unreachable or slow (Bad
Gateway, Gateway Timeout): retried as a timeout is, never counted as a request that killed a server."""


@dataclass
class RetryBudget:
    """Until when failed work is retried: ``deadline``, or ``retry_s`` after the first failure,
    whichever is later. A round of generation may take longer than ``retry_s`` (up to
    ``sglang_request_timeout``); counted from the call's start, the budget would be spent before the
    first failure could be retried. Shared by one call's rounds, it is extended once only, so the call
    ends at most ``retry_s`` after its first round plus one round in flight then."""

    deadline: float
    """``time.monotonic()`` value past which no new round starts."""
    retry_s: float
    """How long failed work is retried after the first failure."""
    failed_at: float | None = None
    """``time.monotonic()`` of the first failure (None: none yet)."""

    @classmethod
    def until(cls, deadline: float) -> RetryBudget:
        """A budget of the time ``deadline`` leaves now, granted again from the first failure."""
        return cls(deadline, max(0.0, deadline - time.monotonic()))

    def note_failure(self) -> None:
        """Start the retry budget at this failure, if it is the first one."""
        if self.failed_at is None:
            self.failed_at = time.monotonic()
            self.deadline = max(self.deadline, self.failed_at + self.retry_s)

    def ran_out(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.deadline


@dataclass
class _Endpoint:
    url: str
    dead_until: float = 0.0
    last_error: str | None = None
    failures: int = 0
    prompts_answered: int = 0
    rescore_refusals: int = 0


class SGLangEndpoints:
    """A set of SGLang base URLs that generation batches are spread over."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        request_timeout_s: float,
        vocab_size: int | None = None,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
        log_paths: Sequence[str] = (),
        status_urls: Sequence[str] = (),
    ) -> None:
        """``transport`` replaces the network (``httpx.MockTransport`` replays recorded answers
        in benchmarks); leave it None to talk to the servers. ``log_paths`` (one per URL, or one
        for all) and ``status_urls`` (sidecars, for ``GET /status``) are where SGLang's own error
        lines are read when a request kills a server."""
        if not urls:
            raise ValueError("SGLangEndpoints needs at least one URL, e.g. ['http://127.0.0.1:30000']")
        self._endpoints = [_Endpoint(url.rstrip("/")) for url in urls]
        self._request_timeout_s = request_timeout_s
        self._vocab_size = vocab_size
        self._headers = bearer_headers(api_key)
        self._lock = threading.Lock()
        self._transport = transport
        self._open_lock = threading.Lock()
        self._client_and_pool: tuple[httpx.Client, ThreadPoolExecutor] | None = None
        self._log_paths = [str(p) for p in log_paths]
        self._status_urls = [u.rstrip("/") for u in status_urls]
        self._crashes: dict[tuple[int, ...], int] = {}
        """Per prompt: how many servers died while serving it (see :meth:`forget_crashes`)."""
        self._limits: dict[str, ContextLimits] = {}
        """Per endpoint URL: its length limits, read at its first request (again after it failed)."""

    def forget_crashes(self) -> None:
        """Start counting server deaths per prompt afresh (the trainer calls it once per generate)."""
        self._crashes.clear()

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
            info = request(
                self._client,
                "GET",
                f"{url.rstrip('/')}/server_info",
                headers=self._headers,
                timeout_s=SETTINGS_TIMEOUT_S,
            ).json()
        except (httpx.HTTPError, ValueError):
            return None
        value = info.get("sleep_on_idle") if isinstance(info, dict) else None
        return value if isinstance(value, bool) else None

    @property
    def _client(self) -> httpx.Client:
        return self._open()[0]

    @property
    def _pool(self) -> ThreadPoolExecutor:
        return self._open()[1]

    def _open(self) -> tuple[httpx.Client, ThreadPoolExecutor]:
        """The HTTP client and the request threads, made on first use (again after `close`)."""
        with self._open_lock:
            if self._client_and_pool is None:
                timeout = self._request_timeout_s
                client = bounded_client(
                    headers=NO_COMPRESSION,
                    timeout=httpx.Timeout(timeout, connect=min(CONNECT_TIMEOUT_S, timeout)),
                    limits=httpx.Limits(max_connections=max(4, 2 * len(self._endpoints))),
                    transport=self._transport,
                )
                # Room for one request per endpoint that generate() stopped waiting for (it ends
                # by itself at its deadline) beside the current ones.
                pool = ThreadPoolExecutor(max_workers=2 * len(self._endpoints), thread_name_prefix="sglang-generate")
                self._client_and_pool = (client, pool)
            return self._client_and_pool

    @property
    def is_open(self) -> bool:
        """Whether the HTTP connections and request threads are held (between first use and `close`)."""
        return self._client_and_pool is not None

    def close(self) -> None:
        """Release the HTTP connections and the request threads; a later request opens them again.

        Requests still running (those a failed ``generate`` stopped waiting for) end at once:
        their connections are shut down, so SGLang stops generating for them and no thread is
        left reading until its own timeout (which would also hold the process's exit)."""
        with self._open_lock:
            held, self._client_and_pool = self._client_and_pool, None
        if held is not None:
            client, pool = held
            pool.shutdown(wait=False, cancel_futures=True)
            abort_connections(client)
            pool.shutdown(wait=True)  # quick: every request left was just cut off
            client.close()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict[str, Any],
        *,
        want_logprobs: bool,
        deadline: float | RetryBudget,
        rescore: bool = False,
        lora_path: str | None = None,
    ) -> list[list[Completion]]:
        """Generate ``sampling_params["n"]`` completions for each prompt; groups in prompt order.

        ``deadline`` bounds how long the call keeps retrying failed prompts: a :class:`RetryBudget`
        (shared with the caller, which retries too), or a ``time.monotonic()`` value, whose time left
        now is granted again from the first failure (:meth:`RetryBudget.until`). Each request is bounded
        by ``request_timeout_s`` (twice with ``rescore``: two requests) on top. ``rescore``: replace
        the logprobs by the model's own (temperature 1, no grammar or penalties), or by None where they
        cannot be read back. ``lora_path``: the name of the LoRA adapter every prompt is generated (and
        rescored) with.
        """
        budget = deadline if isinstance(deadline, RetryBudget) else RetryBudget.until(deadline)
        n = int(sampling_params.get("n", 1))
        results: list[list[Completion] | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            live = self._live_endpoints()
            if not live:
                self._wait_for_an_endpoint(budget.deadline)
                continue
            chunks = _split(pending, len(live))
            client, pool = self._open()
            futures = [
                (
                    endpoint,
                    chunk,
                    pool.submit(
                        self._post,
                        client,
                        endpoint.url,
                        [list(prompts[i]) for i in chunk],
                        sampling_params,
                        n,
                        want_logprobs,
                        rescore,
                        lora_path,
                    ),
                )
                for endpoint, chunk in zip(live, chunks)
                if chunk
            ]
            failed: list[int] = []
            requests = requests_per_round(rescore and want_logprobs)
            wait_until = time.monotonic() + requests * self._request_timeout_s + WAIT_GRACE_S
            owners = {future: (endpoint, chunk) for endpoint, chunk, future in futures}
            # In the order they end: a request refused at once raises at once, not after an earlier
            # endpoint's request has run out its whole timeout.
            for future in _as_completed_until(list(owners), wait_until):
                endpoint, chunk = owners.pop(future)
                try:
                    groups = future.result()
                except _EndpointFailed as exc:
                    budget.note_failure()
                    if exc.rescore_refused:
                        self._count_rescore_refusal(endpoint, exc.reason)
                    if exc.retry_after is not None:
                        left = budget.deadline - time.monotonic()
                        self._mark_dead(endpoint, exc.reason, for_s=min(exc.retry_after, left))
                        failed.extend(chunk)
                        continue
                    # Sent, then the connection broke or a 5xx came back: the request may be what failed
                    # (a router in front of a dead server answers 5xx while its own /health is fine).
                    died = (exc.sent or exc.gateway) and not self._answers_health(endpoint.url)
                    self._mark_dead(endpoint, exc.reason + (" (the server died)" if died else ""))
                    failed.extend(chunk)
                    if exc.sent or died:
                        self._count_crash(
                            endpoint.url, [prompts[i] for i in chunk], sampling_params, exc.reason, died=died
                        )
                    continue
                self._mark_alive(endpoint, len(chunk))
                for i, group in zip(chunk, groups):
                    results[i] = group
            for endpoint, chunk in owners.values():  # not done by wait_until
                # Its own deadline checks end it soon; its answer, if any, is dropped.
                budget.note_failure()
                self._mark_dead(
                    endpoint,
                    f"no complete answer within the timeout (sglang_request_timeout={self._request_timeout_s:g} s)",
                )
                failed.extend(chunk)
            pending = sorted(failed)
            if pending and budget.ran_out():
                raise self._unavailable_error()
        return [group for group in results if group is not None]

    def _count_rescore_refusal(self, endpoint: _Endpoint, reason: str) -> None:
        """Raise ``SGLangRequestError`` once ``endpoint`` refused to rescore ``RESCORE_REFUSALS``
        times in a row (each retry generates the chunk again: GPU time for nothing)."""
        with self._lock:
            endpoint.rescore_refusals += 1
            refusals = endpoint.rescore_refusals
        if refusals >= RESCORE_REFUSALS:
            raise SGLangRequestError(
                f"SGLang at {endpoint.url} refused {refusals} times in a row to score the completions it had just"
                f" generated (POST /generate with prompt + completion and their logprobs; last: {reason}). Check"
                " that prompt + completion fit the server's context length (max_completion_length, its"
                " --context-length), and the server's log"
            )

    def _answers_health(self, url: str) -> bool:
        try:
            answer = request(
                self._client, "GET", f"{url}/health", headers=self._headers, timeout_s=HEALTH_PROBE_TIMEOUT_S
            )
            return answer.status_code == 200
        except httpx.HTTPError:
            return False

    def _count_crash(
        self,
        url: str,
        prompts: Sequence[Sequence[int]],
        sampling_params: dict[str, Any],
        reason: str,
        *,
        died: bool = True,
    ) -> None:
        """Record that the server at ``url`` died (or failed with 5xx) serving ``prompts``; raise
        when one of them has now failed a server more than ``POISON_RETRIES`` times. A prompt that
        occurs several times in the batch (a dataset with duplicates) counts once per failure."""
        counts = []
        for key in {tuple(prompt) for prompt in prompts}:
            self._crashes[key] = self._crashes.get(key, 0) + 1
            counts.append(self._crashes[key])
        if max(counts) > POISON_RETRIES:
            what = "died while serving" if died else "failed (5xx or a broken connection) on"
            raise SGLangPoisonRequestError(
                f"SGLang at {url} {what} the same request again after it came back ({max(counts)} failures; "
                f"{len(prompts)} prompt(s), sampling parameters {_describe(sampling_params)}; last failure: {reason}). "
                "The trainer does not send it a third time. " + self._error_lines(url) + " Fix the sampling "
                "parameters (TRL's temperature/top_p/top_k/min_p/repetition_penalty and generation_kwargs, by "
                "SGLang's names) or the server; a supervised server (`rollout-service serve`) is restarted for the "
                "next run"
            )
        log.warning(
            "SGLang at %s %s %d prompt(s) (sampling parameters %s); waiting for a server to come back, "
            "then sending them once more",
            url,
            "died while serving" if died else "failed on",
            len(prompts),
            _describe(sampling_params),
        )

    def _error_lines(self, url: str) -> str:
        """SGLang's own last error lines for the server at ``url``: from its log file when the
        trainer knows it, else the sidecars' ``/status``."""
        index = self.urls.index(url) if url in self.urls else 0
        path = None
        if self._log_paths:
            path = self._log_paths[index] if len(self._log_paths) == len(self.urls) else self._log_paths[0]
        parts: list[str] = []
        if path is not None:
            lines = last_error_lines(_read_tail(path))
            parts.append(
                f"SGLang's last error lines (from {path}):\n    " + "\n    ".join(lines)
                if lines
                else f"SGLang's log {path} has no error lines the trainer could find."
            )
        statuses = self._status_urls
        if len(statuses) == len(self.urls):
            statuses = [statuses[index]]
        for status_url in statuses:
            try:
                status = request(self._client, "GET", f"{status_url}/status", timeout_s=HEALTH_PROBE_TIMEOUT_S).json()
            except (httpx.HTTPError, ValueError):
                continue
            if isinstance(status, dict):
                found = {
                    k: status[k]
                    for k in ("last_error", "sglang_last_exit", "sglang_last_error", "restart_budget", "gave_up")
                    if status.get(k)
                }
                if found:
                    parts.append(f"Sidecar {status_url} /status: {json.dumps(found, default=str)[:1500]}")
        if path is None:
            parts.append(
                "(SGLang's own log is not known to the trainer: set sglang_log_paths to the file SGLang "
                "writes, e.g. the --sglang-log of `rollout-service serve`.)"
            )
        return " ".join(parts) if parts else ""

    def _post(
        self,
        client: httpx.Client,
        url: str,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any],
        n: int,
        want_logprobs: bool,
        rescore: bool = False,
        lora_path: str | None = None,
    ) -> list[list[Completion]]:
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": want_logprobs}
        if lora_path is not None:
            payload["lora_path"] = lora_path
        max_new_tokens = sampling_params.get("max_new_tokens")
        limits: ContextLimits | None = None
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            max_new_tokens = None
        else:  # a prompt near the context length gets fewer new tokens, not a 400 for the batch
            limits = self._context_limits(client, url)
        tokens = len(input_ids) * n * (UNKNOWN_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens)
        for retried in (False, True):
            try:
                if max_new_tokens is not None:
                    payload["sampling_params"] = _capped(
                        url, sampling_params, input_ids, limits, rescoring=rescore and want_logprobs
                    )
                data = self._request(client, url, payload, tokens=tokens)
                break
            except _ContextRefused:
                # Limits read before SGLang restarted with others (no failed request in between
                # told this trainer; smaller: its 400, larger: refused here): read again, and send
                # once more if they changed.
                fresh = None if retried or limits is None else self._context_limits(client, url, forget=True)
                if fresh is None or fresh == limits:
                    raise
                log.warning("SGLang at %s has other length limits than it had (restarted?): %s", url, fresh)
                limits = fresh
        groups = parse_generate_response(
            data,
            num_prompts=len(input_ids),
            n=n,
            want_logprobs=want_logprobs,
            vocab_size=self._vocab_size,
            source=f"SGLang at {url}",
            prompt_lengths=[len(p) for p in input_ids],
            max_new_tokens=max_new_tokens,
        )
        if rescore and want_logprobs:
            self._rescore(client, url, input_ids, groups, lora_path)
        return groups

    def _context_limits(self, client: httpx.Client, url: str, *, forget: bool = False) -> ContextLimits | None:
        """``url``'s length limits (:mod:`~trainer_hooks.context_limits`), read once (``forget``:
        read again); None while they cannot be read (the request then goes as it is)."""
        with self._lock:
            if forget:
                self._limits.pop(url, None)
            known = self._limits.get(url)
        if known is None:
            known = read_context_limits(client, url, headers=self._headers, timeout_s=SETTINGS_TIMEOUT_S)
            if known is not None:
                with self._lock:
                    self._limits[url] = known
        return known

    def _request(
        self, client: httpx.Client, url: str, payload: dict[str, Any], *, tokens: int, rescoring: bool = False
    ) -> Any:
        """POST ``payload`` to ``url``/generate through ``client`` (the one the request was
        started with: never one opened again after a ``close``); its answer as JSON, read within ``request_timeout_s``
        in all and refused beyond the body limit for ``tokens`` tokens. A failure the endpoint
        may get over raises :class:`_EndpointFailed`; a refusal of the request itself
        :class:`SGLangRequestError`."""
        what = "rescoring: " if rescoring else ""
        deadline = time.monotonic() + self._request_timeout_s
        limit = BODY_LIMIT_BASE_BYTES + BODY_BYTES_PER_TOKEN * tokens
        headed = False
        try:
            with (
                call_deadline(deadline),
                client.stream("POST", f"{url}/generate", json=payload, headers=self._headers) as response,
            ):
                headed = True
                lora = payload.get("lora_path")
                self._check_status(url, response, deadline, what, lora if isinstance(lora, str) else None)
                body = _read_body(url, response, deadline, limit, what, self._request_timeout_s)
        except httpx.TimeoutException as exc:
            if time.monotonic() >= deadline:  # cut at the deadline (a server that drips its answer)
                part = "the answer did not arrive in full" if headed else "no complete answer"
                raise _EndpointFailed(
                    url, f"{what}{part} within the timeout (sglang_request_timeout={self._request_timeout_s:g} s)"
                ) from exc
            raise _EndpointFailed(
                url,
                f"{what}no answer within the timeout ({type(exc).__name__}; "
                f"sglang_request_timeout={self._request_timeout_s:g} s)",
            ) from exc
        except httpx.ConnectError as exc:
            raise _EndpointFailed(url, f"{what}{type(exc).__name__}: {exc}") from exc
        except httpx.DecodingError as exc:  # the answer arrived, mangled (a proxy's broken gzip)
            raise _EndpointFailed(
                url,
                f"{what}the answer could not be decoded ({type(exc).__name__}: {exc}); a proxy between the trainer "
                "and SGLang may mangle compressed answers",
            ) from exc
        except httpx.HTTPError as exc:  # sent, then the connection broke
            raise _EndpointFailed(url, f"{what}{type(exc).__name__}: {exc}", sent=True) from exc
        try:
            return parse_json(body)
        except ValueError as exc:
            raise _EndpointFailed(
                url, f"{what}answered HTTP 200 with a body that is not JSON: {_text(body[:200])!r}"
            ) from exc

    def _check_status(
        self, url: str, response: httpx.Response, deadline: float, what: str, adapter: str | None = None
    ) -> None:
        """Raise for anything but HTTP 200, quoting the start of the answer (``adapter``: the
        LoRA adapter the request named, whose absence there is passing, not the request's fault)."""
        status = response.status_code
        if status == 200:
            return
        text = _error_text(response, deadline)
        if status in (429, 503):  # busy, not broken: ask again later, not a poison candidate
            header = response.headers.get("retry-after")
            retry_after = _retry_after_s(header)
            raise _EndpointFailed(
                url,
                f"{what}overloaded: HTTP {status}"
                + (f" (Retry-After: {header})" if header else "")
                + f": {text[:300]}",
                retry_after=max(RETRY_PAUSE_S, OVERLOAD_RETRY_S if retry_after is None else retry_after),
            )
        if status in GATEWAY_STATUSES:  # a proxy's or router's: its upstream is down or slow, not this request
            raise _EndpointFailed(
                url,
                f"{what}HTTP {status} from a proxy or router in front of SGLang (its upstream did not answer in time"
                f" or is down; retried, counted as a request that killed a server only if /health then fails):"
                f" {text[:300]}",
                gateway=True,
            )
        if status >= 500:
            raise _EndpointFailed(url, f"{what}HTTP {status}: {text[:300]}", sent=True)
        if adapter is not None and status == 400 and _adapter_missing(text, adapter):
            # SGLang restarted (or the adapter was retired) and its sidecar loads it again: passing.
            raise _EndpointFailed(
                url,
                f"{what}the LoRA adapter {adapter} is not loaded there (SGLang restarted? its sidecar loads"
                f" it again; see the sidecar's /status): {text[:300]}",
                retry_after=ADAPTER_RETRY_S,
            )
        if what:  # rescoring what /generate just answered: maybe a passing state (an adapter swapped)
            raise _EndpointFailed(url, f"{what}HTTP {status}: {text[:300]}", rescore_refused=True)
        if 300 <= status < 400:
            raise SGLangRequestError(
                f"SGLang at {url} answered POST /generate with a redirect (HTTP {status} to "
                f"{response.headers.get('location')!r}); the trainer does not follow redirects: point sglang_urls at "
                "the SGLang server itself (the http://host:port it listens on), not at an address that forwards"
            )
        if status in (401, 403):
            raise SGLangRequestError(
                f"SGLang at {url} refused POST /generate with HTTP {status}: it was started with "
                "--api-key and the trainer sent "
                + ("a different key" if self._headers else "none")
                + "; set sglang_api_token in the config to that key"
            )
        refused = _ContextRefused if status == 400 and any(r in text for r in CONTEXT_REFUSALS) else SGLangRequestError
        raise refused(
            f"SGLang at {url} rejected POST /generate with HTTP {status}: "
            f"{text[:1000]}. Check the sampling parameters (generation_kwargs use SGLang's "
            "names, e.g. max_new_tokens, stop_token_ids) and that prompts fit the server's context length"
        )

    def _rescore(
        self,
        client: httpx.Client,
        url: str,
        input_ids: list[list[int]],
        groups: list[list[Completion]],
        lora_path: str | None = None,
    ) -> None:
        """Replace each completion's logprobs by the model's own logprobs of its tokens (SGLang's
        prompt logprobs of prompt + completion: temperature 1, no grammar, penalties or bias);
        None for a completion whose weight version changed in between, or whose tokens the answer
        does not score (no IS correction there). The request and its answer are checked as
        ``/generate``'s are (:meth:`_request`, :func:`parse_rescore_response`)."""
        sequences, starts, owners = [], [], []
        with self._lock:
            limits = self._limits.get(url)
        for prompt, group in zip(input_ids, groups):
            for completion in group:
                if (
                    completion.token_ids
                    and limits is not None
                    and not limits.rescorable(len(prompt) + len(completion.token_ids))
                ):
                    # (a prompt the rescore cap would have left no token: generated to the context)
                    completion.logprobs = [None] * len(completion.token_ids)
                elif completion.token_ids:
                    sequences.append(list(prompt) + completion.token_ids)
                    starts.append(len(prompt) - 1)
                    owners.append(completion)
        if not sequences:
            return
        payload = {
            "input_ids": sequences,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": starts,
        }
        if lora_path is not None:
            payload["lora_path"] = lora_path
        data = self._request(client, url, payload, tokens=sum(len(seq) for seq in sequences), rescoring=True)
        scored = parse_rescore_response(
            data, count=len(owners), vocab_size=self._vocab_size, source=f"SGLang at {url} (rescoring)"
        )
        for completion, sequence, start, answer in zip(owners, sequences, starts, scored):
            if not completion.same_weights(answer) or answer.token_ids != sequence[start:]:
                completion.logprobs = [None] * len(completion.token_ids)
            else:
                assert answer.logprobs is not None
                completion.logprobs = answer.logprobs[1:]

    def _live_endpoints(self) -> list[_Endpoint]:
        now = time.monotonic()
        with self._lock:
            return [e for e in self._endpoints if e.dead_until <= now]

    def _mark_dead(self, endpoint: _Endpoint, reason: str, *, for_s: float | None = None) -> None:
        """Skip ``endpoint`` for ``for_s`` seconds (an overloaded one: its Retry-After), by default
        ``DEAD_RETRY_S``."""
        for_s = max(0.0, DEAD_RETRY_S if for_s is None else for_s)
        with self._lock:
            self._limits.pop(endpoint.url, None)  # a restarted server may have other limits
            endpoint.failures += 1
            endpoint.last_error = reason
            endpoint.dead_until = time.monotonic() + for_s
            others = sum(1 for e in self._endpoints if e is not endpoint and e.dead_until <= time.monotonic())
        if others:
            log.warning(
                "SGLang endpoint %s failed (%s); skipping it for %.0f s, %d other endpoint(s) take its prompts",
                endpoint.url,
                reason,
                for_s,
                others,
            )
        else:
            log.warning(
                "SGLang endpoint %s failed (%s); no endpoint is left, retrying until the deadline", endpoint.url, reason
            )

    def _mark_alive(self, endpoint: _Endpoint, answered: int) -> None:
        with self._lock:
            endpoint.prompts_answered += answered
            if endpoint.failures:
                log.info("SGLang endpoint %s answers again", endpoint.url)
            endpoint.failures = 0
            endpoint.rescore_refusals = 0
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
        """The error when prompts are left unanswered after the retry budget: each endpoint's last
        error, or that its last request was answered, or that it was never tried."""
        with self._lock:
            details = "; ".join(f"{e.url}: {_endpoint_state(e)}" for e in self._endpoints)
        return SGLangUnavailableError(
            "some prompts got no answer from any SGLang endpoint before the retry budget ran out (sync_timeout"
            f" after the first failure): {details}."
            " Check the errors quoted there, that the servers run (`rollout-service serve`), are reachable from the"
            " trainer, and that sglang_urls is right"
        )


def _endpoint_state(endpoint: _Endpoint) -> str:
    """How ``endpoint`` last fared, for :meth:`SGLangEndpoints._unavailable_error` (under its lock)."""
    if endpoint.last_error:
        return endpoint.last_error
    if endpoint.prompts_answered:
        return "answered its last request (no error)"
    return "not tried"


def _adapter_missing(text: str, adapter: str) -> bool:
    """Whether SGLang's 400 says it has not got the LoRA adapter ``adapter`` loaded (its words in
    0.5.23: "Got LoRA adapter that has never been loaded", "Failed to implicitly load LoRA adapter")."""
    return adapter in text and ("never been loaded" in text or "Failed to implicitly load LoRA adapter" in text)


def _as_completed_until(futures: list[Future[Any]], until: float) -> Iterator[Future[Any]]:
    """``futures`` as each ends, until ``until`` (``time.monotonic()``); those still running then
    are not yielded (``concurrent.futures.as_completed`` raises instead)."""
    left = set(futures)
    while left:
        done, left = wait(left, timeout=max(0.0, until - time.monotonic()), return_when=FIRST_COMPLETED)
        if not done:
            return
        yield from (f for f in futures if f in done)  # in submission order among those that ended


def _read_body(url: str, response: httpx.Response, deadline: float, limit: int, what: str, timeout_s: float) -> bytes:
    """The whole answer, or :class:`_EndpointFailed` once it passes ``limit`` bytes or ``deadline``
    (a server dripping its answer byte by byte never trips httpx's read timeout). It is never
    decompressed (the trainer asks for none): a compressed answer is refused unread."""
    too_large = (
        f"{what}the answer is larger than the body limit of {limit / 2**20:.0f} MiB ({BODY_LIMIT_BASE_BYTES >> 20} "
        f"MiB plus {BODY_BYTES_PER_TOKEN} bytes per token the request may return)"
    )
    encoding = content_encoding(response)
    if encoding is not None:  # asked for none: decoding could grow it past any limit
        raise _EndpointFailed(
            url,
            f"{what}the answer came with Content-Encoding: {encoding[:40]} though the trainer asks for none (a"
            " proxy between the trainer and SGLang that compresses answers?); it is not decompressed",
        )
    declared = declared_length(response)
    if declared is not None and declared > limit:
        raise _EndpointFailed(url, f"{too_large}: Content-Length {declared}, refused unread")
    chunks: list[bytes] = []
    size = 0
    for chunk in response.iter_bytes():  # not decoded: an encoded answer was refused above
        size += len(chunk)
        if size > limit:
            raise _EndpointFailed(url, f"{too_large}: reading stopped there")
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise _EndpointFailed(
                url,
                f"{what}the answer did not arrive in full within the timeout (sglang_request_timeout={timeout_s:g} s; "
                f"{size} bytes by then)",
            )
    return b"".join(chunks)


def _error_text(response: httpx.Response, deadline: float) -> str:
    """The start of an error answer (up to ``ERROR_TEXT_BYTES``), for the message."""
    if content_encoding(response) is not None:
        return "(a compressed answer, not read)"
    data = b""
    try:
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) >= ERROR_TEXT_BYTES or time.monotonic() > deadline:
                break
    except httpx.HTTPError:
        pass
    return _text(data[:ERROR_TEXT_BYTES])


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _retry_after_s(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a year past what datetime holds
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def _describe(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)[:1000]


def _read_tail(path: str) -> str:
    """The last ``LOG_TAIL_BYTES`` of SGLang's log file at ``path`` (bounded, never blocking,
    credentials redacted: :func:`rollout_service.process_group.log_end`), or why it cannot be read."""
    try:
        return log_end(path, LOG_TAIL_BYTES)
    except OSError as exc:
        return f"(could not read {path}: {exc.strerror or exc})"


def last_error_lines(text: str, limit: int = 6) -> list[str]:
    """The last error SGLang logged in ``text``: the header line of its last traceback and the
    exception lines that end it (or, without a traceback, the last lines naming an error)."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if starts:
        start = starts[-1]
        out = [lines[start].strip()]
        tail: list[str] = []
        for line in lines[start + 1 :]:
            if line.startswith((" ", "\t")) or not line.strip():
                if tail and not line.strip():
                    break
                continue
            if line.startswith("[") and tail:
                break
            tail.append(line.strip())
        return (out + tail)[-limit:]
    hits = [line.strip() for line in lines if "error" in line.lower() or "exception" in line.lower()]
    return hits[-limit:]


def _split(items: list[int], parts: int) -> list[list[int]]:
    """Contiguous, nearly equal chunks (the first ones one longer)."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        chunks.append(items[start:end])
        start = end
    return chunks


def _capped(
    url: str,
    sampling_params: dict[str, Any],
    input_ids: list[list[int]],
    limits: ContextLimits | None,
    *,
    rescoring: bool,
) -> dict[str, Any] | list[dict[str, Any]]:
    """``sampling_params`` as sent for ``input_ids``: one set for all, or one per prompt with the
    ``max_new_tokens`` that fits ``limits`` where any prompt would not fit (``min_new_tokens`` no
    higher: SGLang refuses the batch otherwise). A prompt the server cannot take at all raises
    :class:`SGLangRequestError` naming it."""
    max_new_tokens = sampling_params["max_new_tokens"]
    if limits is None:
        return sampling_params
    try:
        caps = limits.caps([len(p) for p in input_ids], max_new_tokens, rescoring=rescoring)
    except PromptTooLong as exc:
        raise _ContextRefused(
            f"SGLang at {url} cannot take this batch: {exc}. Shorten or filter out the dataset's"
            " longest prompts (in a tool loop, allow fewer turns), or start SGLang with a larger --context-length"
        ) from None
    if caps is None:
        return sampling_params
    least = sampling_params.get("min_new_tokens")
    if isinstance(least, bool) or not isinstance(least, int):
        return [{**sampling_params, "max_new_tokens": cap} for cap in caps]
    return [{**sampling_params, "max_new_tokens": cap, "min_new_tokens": min(least, cap)} for cap in caps]
