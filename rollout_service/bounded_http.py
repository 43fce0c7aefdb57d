"""One HTTP exchange with a server this process does not trust, bounded in time and in size.

httpx's timeouts bound each wait for bytes, not the whole answer: a server that drips one byte
a second never trips them. And httpx decompresses what a server compressed before its caller
can count it: 32 KB of zstd can become 1 GiB in memory. So every exchange made here asks for
no compression (``Accept-Encoding: identity``), refuses an answer that comes compressed anyway,
stops reading once the answer passes its size limit, and gives up at a total deadline, each
with an :class:`AnswerRefused` (an ``httpx.HTTPError``, so callers that handle a failed
exchange handle these too). :func:`parse_json` turns JSON nested past Python's recursion
limit into a ``ValueError`` like any other bad JSON.

Used for the small calls (health, status, ``/wait``, ``/sync``, model info, weight updates);
the trainer's ``/generate`` reads its large answers with the same rules in
``trainer_hooks/sglang_endpoints.py``.

The deadline also bounds each wait for bytes before the body, where no chunk loop can check it
(a server that drips its status line and headers): :func:`arequest` by ``asyncio.wait_for``,
:func:`request` through a client made by :func:`client`, whose connections cut every socket wait
at the deadline of the :func:`call_deadline` in force on the calling thread (a network backend
of httpcore's, the library under httpx). With a client made otherwise, :func:`request` checks its
deadline as each chunk of the body comes, so it ends within one read timeout past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from .number_text import digits_value

NO_COMPRESSION = {"Accept-Encoding": "identity"}
SMALL_ANSWER_BYTES = 4 << 20
"""The default size limit: a status, a replica report, a weight update's answer."""


class AnswerRefused(httpx.HTTPError):
    """The answer broke a bound: too large, compressed though none was asked for, or too slow."""


class AnswerTimedOut(AnswerRefused):
    """The exchange did not end within its deadline (the request may still be running there)."""


@dataclass
class Answer:
    """A whole answer, read within its bounds."""

    status_code: int
    headers: httpx.Headers
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return parse_json(self.content)


def parse_json(data: bytes | str) -> Any:
    """``json.loads``, with nesting past the recursion limit a ``ValueError`` too."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply to read") from None


def request(
    client: httpx.Client, method: str, url: str, *, timeout_s: float, limit: int = SMALL_ANSWER_BYTES, **kw: Any
) -> Answer:
    """``method url`` through ``client`` (one made by :func:`client`: see the module's
    docstring); the whole answer within ``timeout_s`` and ``limit`` bytes."""
    deadline = time.monotonic() + timeout_s
    headers = {**NO_COMPRESSION, **kw.pop("headers", {})}
    with call_deadline(deadline):
        try:
            with client.stream(method, url, headers=headers, timeout=_timeout(timeout_s), **kw) as response:
                chunks = _Chunks(response, deadline, limit)
                for chunk in response.iter_bytes():  # not decoded: an encoded answer was refused
                    chunks.add(chunk)
                return Answer(response.status_code, response.headers, chunks.joined())
        except httpx.TimeoutException:
            if time.monotonic() < deadline:
                raise  # httpx's own timeout (connect, or a silence of timeout_s)
            raise AnswerTimedOut(f"{url} did not answer in full within {timeout_s:g} s") from None


async def arequest(
    client: httpx.AsyncClient, method: str, url: str, *, timeout_s: float, limit: int = SMALL_ANSWER_BYTES, **kw: Any
) -> Answer:
    """:func:`request` for an ``httpx.AsyncClient``, whose deadline also cuts a wait for bytes
    short (the blocking one checks it as each chunk comes, so it ends within one read timeout
    past it)."""
    deadline = time.monotonic() + timeout_s
    headers = {**NO_COMPRESSION, **kw.pop("headers", {})}

    async def exchange() -> Answer:
        async with client.stream(method, url, headers=headers, timeout=_timeout(timeout_s), **kw) as response:
            chunks = _Chunks(response, deadline, limit)
            async for chunk in response.aiter_bytes():  # not decoded: an encoded answer was refused
                chunks.add(chunk)
            return Answer(response.status_code, response.headers, chunks.joined())

    try:
        return await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        raise AnswerTimedOut(f"{url} did not answer in full within {timeout_s:g} s") from None


_deadlines = threading.local()


@contextlib.contextmanager
def call_deadline(deadline: float) -> Iterator[None]:
    """Within this block, every wait for bytes of a :func:`client` on this thread ends by
    ``deadline`` (a ``time.monotonic()`` value); an outer, earlier deadline stays in force."""
    outer = getattr(_deadlines, "at", None)
    _deadlines.at = deadline if outer is None else min(outer, deadline)
    try:
        yield
    finally:
        _deadlines.at = outer


def _cut(timeout: float | None, past: type[Exception] = httpcore.ReadTimeout) -> float | None:
    """A socket wait's timeout, cut at the calling thread's deadline (if any). Past the deadline
    it raises ``past`` at once: bytes already waiting would otherwise be read without a wait
    (a server sending ``100 Continue`` heads without end never lets a read wait)."""
    at = getattr(_deadlines, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise past("the call's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, backend: _DeadlineBackend | None = None):
        self._inner = inner
        self._backend = backend
        if backend is not None:
            backend.opened(self)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _cut(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _cut(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        if self._backend is not None:
            self._backend.closed(self)
        self._inner.close()

    def abort(self) -> None:
        """Shut the socket down from any thread: a read blocked on it ends at once (end of
        stream) and the server sees the connection end (SGLang then aborts the request)."""
        sock = self._inner.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> Any:
        wrapped = self._inner.start_tls(ssl_context, server_hostname, _cut(timeout))
        if self._backend is not None:
            self._backend.closed(self)  # the TLS stream below stands for this connection from now on
        return _DeadlineStream(wrapped, self._backend)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's own blocking backend, each stream's waits cut at the thread's deadline."""

    def __init__(self, inner: httpcore.NetworkBackend):
        self._inner = inner
        self._lock = threading.Lock()
        self._live: set[_DeadlineStream] = set()
        """Streams opened and not yet closed: what :func:`abort_connections` shuts down."""
        self._aborted = False
        """Set by :func:`abort_connections`: no connection is opened any more."""

    def opened(self, stream: _DeadlineStream) -> None:
        with self._lock:
            self._live.add(stream)
            aborted = self._aborted
        if aborted:  # connected while the client was being aborted: cut at once too
            stream.abort()

    def _check_open(self) -> None:
        if self._aborted:
            raise httpcore.ConnectError("the client's connections were aborted (it is closing)")

    def closed(self, stream: _DeadlineStream) -> None:
        with self._lock:
            self._live.discard(stream)

    def abort_all(self) -> int:
        with self._lock:
            self._aborted = True
            live = list(self._live)
        for stream in live:
            stream.abort()
        return len(live)

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        self._check_open()
        return _DeadlineStream(
            self._inner.connect_tcp(host, port, _cut(timeout, httpcore.ConnectTimeout), local_address, socket_options),
            self,
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        self._check_open()
        return _DeadlineStream(
            self._inner.connect_unix_socket(path, _cut(timeout, httpcore.ConnectTimeout), socket_options), self
        )

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def client(**kw: Any) -> httpx.Client:
    """An ``httpx.Client`` (``kw`` as for it) whose socket waits keep to :func:`call_deadline`.

    Its transports stay httpx's own, so the proxy settings of the environment apply as for any
    client (``trust_env``); only the network backend of each transport's pool (httpcore's, whose
    version is pinned) is wrapped. A transport given in ``kw`` is left as it is."""
    given = kw.get("transport") is not None
    made = httpx.Client(**kw)
    if not given:
        for transport in [made._transport, *made._mounts.values()]:
            pool = getattr(transport, "_pool", None)
            if pool is not None:
                pool._network_backend = _DeadlineBackend(pool._network_backend)
    return made


def abort_connections(made: httpx.Client) -> int:
    """Shut down every connection of ``made`` (a :func:`client`) that is open now, and refuse
    new ones (``httpx.ConnectError``), from any thread: requests blocked reading them end at
    once, with an ``httpx`` error, where
    ``Client.close()`` alone leaves a read in another thread waiting until its deadline (the
    socket is not woken) and the server generating for a client that is gone. Returns how many
    were shut down."""
    aborted = 0
    for transport in [made._transport, *made._mounts.values()]:
        backend = getattr(getattr(transport, "_pool", None), "_network_backend", None)
        if isinstance(backend, _DeadlineBackend):
            aborted += backend.abort_all()
    return aborted


def content_encoding(response: httpx.Response) -> str | None:
    """The answer's ``Content-Encoding`` when it is compressed (None: identity, as asked)."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    return None if encoding in ("", "identity") else encoding


def declared_length(response: httpx.Response) -> int | None:
    """The ``Content-Length`` the answer declares (ASCII digits only), or None."""
    declared = response.headers.get("content-length", "")
    return digits_value(declared)


def _timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0))


class _Chunks:
    """An answer's bytes as they come, checked against its limit and deadline at each chunk
    (and, before any, its encoding and declared length)."""

    def __init__(self, response: httpx.Response, deadline: float, limit: int):
        self.url, self.deadline, self.limit = response.request.url, deadline, limit
        self.parts: list[bytes] = []
        self.size = 0
        encoding = content_encoding(response)
        if encoding is not None:
            raise AnswerRefused(
                f"{self.url} answered with Content-Encoding: {encoding[:40]} though none was asked for (a"
                " proxy in between that compresses answers?); it is not decompressed, to keep its size bounded"
            )
        declared = declared_length(response)
        if declared is not None and declared > limit:
            raise AnswerRefused(f"{self.url} declared a {declared}-byte answer, over the limit of {limit}; not read")

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise AnswerRefused(f"{self.url} answered with more than {self.limit} bytes; reading stopped there")
        self.parts.append(chunk)
        if time.monotonic() > self.deadline:
            raise AnswerTimedOut(f"{self.url} did not finish its answer in time ({self.size} bytes by then)")

    def joined(self) -> bytes:
        return b"".join(self.parts)
