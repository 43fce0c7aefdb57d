"""SGLang endpoints under broken HTTP: every request ends by its deadline, answers are read up to a
limit, an overloaded server is waited for, and passing problems are not taken for poison requests.

These drive the real `SGLangEndpoints` against `fake_sglang.CannedServer`, a raw socket writing
scripted bytes: a real SGLang server cannot be made to drip its answer byte by byte, send 300 MB,
answer 429/503 with Retry-After, redirect, or come back through a proxy that breaks gzip on demand.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import closing
from typing import Any

import pytest

import trainer_hooks.sglang_endpoints as module
from fake_sglang import Answer, CannedServer, canned_answer, canned_reply
from trainer_hooks.sglang_endpoints import (
    SGLangEndpoints,
    SGLangRequestError,
    SGLangUnavailableError,
)
from trainer_hooks.sglang_responses import Completion

PROMPTS = [[1, 2, 3]]
PARAMS = {"n": 1, "max_new_tokens": 4}


def serve(servers: list[CannedServer], answer: Any) -> CannedServer:
    """A canned server answering POST /generate with ``answer(body, count)``, ``count`` its
    /generate requests so far (GETs, e.g. /health or the length limits: 200 with ``{}``)."""
    server = CannedServer(
        lambda path, body, count: answer(body, len(server.generate_requests)) if path == "/generate" else None
    )
    servers.append(server)
    return server


def generate_in_thread(
    endpoints: SGLangEndpoints, deadline_s: float, join_s: float = 20.0, params: dict[str, Any] | None = None
) -> tuple[list[list[Completion]] | BaseException | None, float]:
    """``endpoints.generate`` in a thread (the old code hung forever): its result or error, and its time."""
    out: list[Any] = [None]
    started = time.monotonic()

    def run() -> None:
        try:
            out[0] = endpoints.generate(
                PROMPTS, params or PARAMS, want_logprobs=True, deadline=time.monotonic() + deadline_s
            )
        except BaseException as exc:
            out[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(join_s)
    assert not thread.is_alive(), f"generate() still running after {join_s} s"
    return out[0], time.monotonic() - started


def headers(length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{size}{extra}\r\n".encode()


def test_a_body_dripped_byte_by_byte_ends_at_the_request_deadline(servers: list[CannedServer]) -> None:
    def drip(body: Any, count: int) -> Answer:
        def write(conn: socket.socket, stopped: threading.Event) -> None:
            conn.sendall(headers(10**6))
            while not stopped.wait(0.2):  # each read comes well within httpx's read timeout
                conn.sendall(b" ")

        return write

    server = serve(servers, drip)
    with closing(SGLangEndpoints([server.url], request_timeout_s=1.0)) as endpoints:
        result, elapsed = generate_in_thread(endpoints, deadline_s=0.5)
    assert isinstance(result, SGLangUnavailableError), result
    assert "did not arrive in full within the timeout (sglang_request_timeout=1 s" in str(result)
    assert elapsed < 6


def test_generate_stops_waiting_for_a_request_past_its_deadline(
    servers: list[CannedServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The headers themselves dripped: no read ever times out and no body loop runs yet.
    monkeypatch.setattr(module, "WAIT_GRACE_S", 0.5)

    def drip_headers(body: Any, count: int) -> Answer:
        def write(conn: socket.socket, stopped: threading.Event) -> None:
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not stopped.wait(0.2):
                conn.sendall(b"a")

        return write

    server = serve(servers, drip_headers)
    with closing(SGLangEndpoints([server.url], request_timeout_s=1.0)) as endpoints:
        result, elapsed = generate_in_thread(endpoints, deadline_s=0.5)
    assert isinstance(result, SGLangUnavailableError), result
    assert "no complete answer within the timeout (sglang_request_timeout=1 s)" in str(result)
    assert elapsed < 5


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_answer_beyond_the_body_limit_is_refused(
    servers: list[CannedServer], monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    monkeypatch.setattr(module, "BODY_LIMIT_BASE_BYTES", 1 << 20)
    pad = 6 << 20  # valid JSON (whitespace), six times the limit

    def huge(body: Any, count: int) -> Answer:
        raw = json.dumps(canned_answer(body)).encode()

        def write(conn: socket.socket, stopped: threading.Event) -> None:
            if chunked:
                conn.sendall(headers(None))
                block = b" " * (1 << 16)
                for _ in range(pad >> 16):
                    conn.sendall(b"%x\r\n%s\r\n" % (len(block), block))
                conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(raw), raw))
            else:
                conn.sendall(headers(len(raw) + pad) + b" " * pad + raw)

        return write

    server = serve(servers, huge)
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        result, _ = generate_in_thread(endpoints, deadline_s=0.5)
    assert isinstance(result, SGLangUnavailableError), result
    assert "larger than the body limit of 1 MiB (1 MiB plus 256 bytes per token" in str(result)


def test_the_body_limit_grows_with_what_the_request_may_return(
    servers: list[CannedServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(module, "BODY_LIMIT_BASE_BYTES", 1 << 20)

    def padded(body: Any, count: int) -> Answer:
        return canned_reply(200, json.dumps(canned_answer(body)) + " " * (3 << 20))

    server = serve(servers, padded)
    with closing(
        SGLangEndpoints([server.url], request_timeout_s=10)
    ) as endpoints:  # 16384 tokens x 256 bytes: 4 MiB more than the base
        result, _ = generate_in_thread(endpoints, deadline_s=5, params={"n": 1, "max_new_tokens": 16384})
    assert isinstance(result, list) and result[0][0].token_ids == [1, 7], result


@pytest.mark.parametrize("status", [429, 503])
def test_an_overloaded_server_is_asked_again_after_its_retry_after(servers: list[CannedServer], status: int) -> None:
    def busy_once(body: Any, count: int) -> Answer:
        if count == 1:
            return canned_reply(status, {"error": "too many requests"}, headers="Retry-After: 2\r\n")
        return canned_reply(200, canned_answer(body))

    server = serve(servers, busy_once)
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        result, elapsed = generate_in_thread(endpoints, deadline_s=20)
    assert isinstance(result, list) and result[0][0].token_ids == [1, 7], result
    assert len(server.generate_requests) == 2
    assert 1.8 <= elapsed < 10  # waited for the Retry-After, not the 10 s a failed endpoint is skipped


def test_retry_after_is_bounded_by_the_deadline(servers: list[CannedServer]) -> None:
    server = serve(servers, lambda body, count: canned_reply(429, {}, headers="Retry-After: 3600\r\n"))
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        result, elapsed = generate_in_thread(endpoints, deadline_s=1.5)
    assert isinstance(result, SGLangUnavailableError), result
    assert "overloaded: HTTP 429 (Retry-After: 3600)" in str(result)
    assert elapsed < 6


def broken_gzip(body: Any, count: int) -> Answer:
    return canned_reply(200, b"\x1f\x8b not gzip at all", headers="Content-Encoding: gzip\r\n")


@pytest.mark.parametrize(
    "answer, reason",
    [
        (lambda body, count: canned_reply(503, {"error": "overloaded"}), "overloaded: HTTP 503"),
        (lambda body, count: canned_reply(429, {"error": "slow down"}), "overloaded: HTTP 429"),
        (broken_gzip, "Content-Encoding: gzip though the trainer asks for none"),
    ],
    ids=["503", "429", "broken-gzip"],
)
def test_passing_failures_are_retried_until_the_deadline_not_taken_for_a_poison_request(
    servers: list[CannedServer], monkeypatch: pytest.MonkeyPatch, answer: Any, reason: str
) -> None:
    monkeypatch.setattr(module, "DEAD_RETRY_S", 0.3)
    monkeypatch.setattr(module, "OVERLOAD_RETRY_S", 0.3)
    server = serve(servers, answer)
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        result, _ = generate_in_thread(endpoints, deadline_s=3.5)
    assert type(result) is SGLangUnavailableError, result  # not SGLangPoisonRequestError after two
    assert reason in str(result)
    assert len(server.generate_requests) >= 3


def test_a_redirect_says_to_point_sglang_urls_at_the_server_itself(servers: list[CannedServer]) -> None:
    server = serve(servers, lambda body, count: canned_reply(307, "", headers="Location: /v2/generate\r\n"))
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        result, _ = generate_in_thread(endpoints, deadline_s=5)
    assert isinstance(result, SGLangRequestError), result
    assert "redirect (HTTP 307 to '/v2/generate')" in str(result)
    assert "point sglang_urls at the SGLang server itself" in str(result)
    assert "sampling parameters" not in str(result)


def test_a_compressed_answer_is_refused_unread_not_inflated(servers: list[CannedServer]) -> None:
    """32 KB of zstd that would inflate to 1 GiB: the trainer asks for no compression, and an
    answer compressed anyway is refused before anything is decompressed."""
    import resource

    import zstandard

    compressor = zstandard.ZstdCompressor(level=19).compressobj(size=1 << 30)
    bomb = b"".join(compressor.compress(bytes(1 << 20)) for _ in range(1024)) + compressor.flush()
    server = serve(servers, lambda body, count: canned_reply(200, bomb, headers="Content-Encoding: zstd\r\n"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with closing(SGLangEndpoints([server.url], request_timeout_s=5)) as endpoints:
        result, _ = generate_in_thread(endpoints, deadline_s=1.5)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert type(result) is SGLangUnavailableError and "Content-Encoding: zstd" in str(result), result
    assert grown_mib < 200, f"the trainer's memory grew by {grown_mib:.0f} MiB"
    assert all(body is not None for body in server.generate_requests)


def test_a_health_probe_that_drips_does_not_hold_generate_past_its_deadline(servers: list[CannedServer]) -> None:
    """After a failed /generate the trainer asks /health whether the server died; a /health that
    drips its answer is given up on at its own bound, so generate() ends by its deadline."""

    def answer(path: str, body: Any, count: int) -> Answer:
        if path == "/generate":
            return canned_reply(500, {"error": "boom"})

        def drip(conn: socket.socket, stopped: threading.Event) -> None:
            conn.sendall(headers(100_000))
            while not stopped.wait(0.5):
                conn.sendall(b" ")

        return drip

    server = CannedServer(answer)
    servers.append(server)
    with closing(SGLangEndpoints([server.url], request_timeout_s=2)) as endpoints:
        result, elapsed = generate_in_thread(endpoints, deadline_s=3.0, join_s=30)
    assert isinstance(result, SGLangUnavailableError), result
    assert elapsed < 15


@pytest.mark.parametrize(
    "bad",
    [
        lambda body, count: canned_reply(200, "[" * 100_000 + "]" * 100_000),
        lambda body, count: canned_reply(
            503, {"error": "busy"}, headers="Retry-After: Fri, 01 Jan 99999999999 00:00:00 GMT\r\n"
        ),
    ],
    ids=["json-nested-past-the-recursion-limit", "retry-after-past-year-9999"],
)
def test_a_malformed_answer_fails_that_endpoint_over_to_a_healthy_one(servers: list[CannedServer], bad: Any) -> None:
    broken = serve(servers, bad)
    healthy = serve(servers, lambda body, count: canned_reply(200, canned_answer(body)))
    with closing(SGLangEndpoints([broken.url, healthy.url], request_timeout_s=5)) as endpoints:
        result, _ = generate_in_thread(endpoints, deadline_s=10)
    assert isinstance(result, list) and len(result) == len(PROMPTS), result
    assert broken.generate_requests, "the broken endpoint was never tried"


def test_a_replica_that_has_not_got_the_adapter_yet_is_asked_again_not_taken_for_a_bad_request(
    servers: list[CannedServer],
) -> None:
    """A restarted SGLang answers 400 for an adapter it has not loaded (yet): its sidecar loads it
    again within a sync pass, so that is passing, where it used to end training as a bad request."""
    adapter = "v00000007-run"

    def missing_then_loaded(body: Any, count: int) -> Answer:
        if count <= 2:
            return canned_reply(
                400, {"error": {"message": f"Got LoRA adapter that has never been loaded: {adapter}\nAll loaded: []"}}
            )
        return canned_reply(200, canned_answer(body))

    server = serve(servers, missing_then_loaded)
    out: list[Any] = []
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        thread = threading.Thread(
            target=lambda: out.append(
                endpoints.generate(
                    PROMPTS, PARAMS, want_logprobs=True, deadline=time.monotonic() + 20, lora_path=adapter
                )
            ),
            daemon=True,
        )
        thread.start()
        thread.join(20)
    assert out and out[0][0][0].token_ids == [1, 7], out
    assert len(server.generate_requests) == 3


def test_a_400_about_another_adapter_or_the_request_stays_a_bad_request(servers: list[CannedServer]) -> None:
    server = serve(servers, lambda body, count: canned_reply(400, {"error": "max_new_tokens must be positive"}))
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        with pytest.raises(SGLangRequestError, match="max_new_tokens must be positive"):
            endpoints.generate(
                PROMPTS, PARAMS, want_logprobs=True, deadline=time.monotonic() + 5, lora_path="v00000007-run"
            )
