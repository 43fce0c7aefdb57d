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
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

NO_COMPRESSION = {"Accept-Encoding": "identity"}
SMALL_ANSWER_BYTES = 4 << 20
"""The default size limit: a status, a replica report, a weight update's answer."""


class AnswerRefused(httpx.HTTPError):
    """The answer broke a bound: too large, compressed though none was asked for, or too slow."""


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
    """``method url`` through ``client``; the whole answer within ``timeout_s`` and ``limit`` bytes."""
    deadline = time.monotonic() + timeout_s
    headers = {**NO_COMPRESSION, **kw.pop("headers", {})}
    with client.stream(method, url, headers=headers, timeout=_timeout(timeout_s), **kw) as response:
        chunks = _Chunks(response, deadline, limit)
        for chunk in response.iter_bytes():  # not decoded: an encoded answer was refused
            chunks.add(chunk)
        return Answer(response.status_code, response.headers, chunks.joined())


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
        raise AnswerRefused(f"{url} did not answer in full within {timeout_s:g} s") from None


def content_encoding(response: httpx.Response) -> str | None:
    """The answer's ``Content-Encoding`` when it is compressed (None: identity, as asked)."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    return None if encoding in ("", "identity") else encoding


def declared_length(response: httpx.Response) -> int | None:
    """The ``Content-Length`` the answer declares (ASCII digits only), or None."""
    declared = response.headers.get("content-length", "")
    return int(declared) if declared.isascii() and declared.isdigit() else None


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
            raise AnswerRefused(f"{self.url} did not finish its answer in time ({self.size} bytes by then)")

    def joined(self) -> bytes:
        return b"".join(self.parts)
