"""Answers from servers the code does not trust: the trainer's sidecar waits and the sidecar's
SGLang client read them within a time and size bound, never decompress them, and take a
malformed one for a failed exchange, not a crash.

Driven against `fake_sglang.CannedServer` (a raw socket writing scripted bytes): neither a real
sidecar nor a real SGLang can be made to drip an answer, send a zstd bomb, or nest JSON 100,000
levels deep.
"""

from __future__ import annotations

import asyncio
import functools
import json
import resource
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import zstandard

from fake_sglang import Answer, CannedServer, canned_reply, dead_url
from rollout_service.bounded_http import AnswerRefused, arequest, parse_json, request
from rollout_service.bounded_http import client as bounded_client
from rollout_service.sidecar.sglang_client import (
    SGLangClient,
    SGLangLoadRejected,
    SGLangLoadTimedOut,
    SGLangUnavailable,
)
from trainer_hooks.replica_wait import CheckpointRejected, ReplicaSyncTimeout, SidecarWaiter
from trainer_hooks.sglang_endpoints import SGLangEndpoints, SGLangRequestError

DEEP_JSON = "[" * 100_000 + "]" * 100_000


def canned(servers: list[CannedServer], answer: Any) -> CannedServer:
    server = CannedServer(lambda path, body, count: answer(path, body, count))
    servers.append(server)
    return server


def dripping(length: int = 100_000) -> Answer:
    def write(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
        while not stopped.wait(0.3):  # each byte well within any read timeout
            conn.sendall(b" ")

    return write


def dripping_headers() -> Answer:
    """A status line, then one byte of a header every 0.3 s: no chunk of a body ever comes."""

    def write(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        while not stopped.wait(0.3):
            conn.sendall(b"a")

    return write


@functools.cache
def zstd_bomb_bytes() -> bytes:
    """About 32 KB of zstd that inflates to 1 GiB of zeros (made in 1 MiB pieces)."""
    compressor = zstandard.ZstdCompressor(level=19).compressobj(size=1 << 30)
    zeros = bytes(1 << 20)
    return b"".join(compressor.compress(zeros) for _ in range(1024)) + compressor.flush()


def zstd_bomb() -> Answer:
    return canned_reply(200, zstd_bomb_bytes(), headers="Content-Encoding: zstd\r\n")


def test_an_exchange_is_bounded_in_time_size_and_encoding(servers: list[CannedServer]) -> None:
    drip = canned(servers, lambda path, body, count: dripping())
    with httpx.Client() as client:
        t0 = time.monotonic()
        with pytest.raises(AnswerRefused, match="did not finish its answer in time"):
            request(client, "GET", drip.url + "/status", timeout_s=1.0)
        assert time.monotonic() - t0 < 4
        bomb = canned(servers, lambda path, body, count: zstd_bomb())
        zstd_bomb_bytes()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with pytest.raises(AnswerRefused, match="Content-Encoding: zstd"):
            request(client, "GET", bomb.url + "/status", timeout_s=5.0)
        assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024 < 200
        big = canned(servers, lambda path, body, count: canned_reply(200, b"x" * (2 << 20)))
        with pytest.raises(AnswerRefused, match="over the limit of 1048576"):
            request(client, "GET", big.url + "/status", timeout_s=5.0, limit=1 << 20)
        plain = canned(servers, lambda path, body, count: canned_reply(200, {"ok": True}))
        answer = request(client, "GET", plain.url + "/status", timeout_s=5.0)
        assert answer.status_code == 200 and answer.json() == {"ok": True}
        assert plain.requests[0][1] == "/status"
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json(DEEP_JSON)


def wait_in_thread(waiter: SidecarWaiter, version: int, timeout_s: float) -> tuple[Any, float]:
    out: list[Any] = [None]
    t0 = time.monotonic()

    def run() -> None:
        try:
            out[0] = waiter.wait(version, timeout_s=timeout_s)
        except BaseException as exc:
            out[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s + 30)
    assert not thread.is_alive(), f"SidecarWaiter.wait still running {timeout_s + 30:.0f} s later"
    return out[0], time.monotonic() - t0


@pytest.mark.parametrize(
    "answer",
    [
        lambda path, body, count: dripping(),
        lambda path, body, count: dripping_headers(),
        lambda path, body, count: canned_reply(504, DEEP_JSON),
        lambda path, body, count: canned_reply(504, {"rejected": ["step-00000005"], "loaded_step": 4}),
        lambda path, body, count: canned_reply(504, {"rejected": {"5": ["not", "a", "reason"]}}),
        lambda path, body, count: zstd_bomb(),
    ],
    ids=[
        "dripped",
        "headers-dripped",
        "json-nested-past-the-recursion-limit",
        "rejected-as-a-list",
        "reason-not-a-string",
        "zstd-bomb",
    ],
)
def test_a_sidecar_wait_with_a_malformed_answer_times_out_with_the_trainers_error(
    servers: list[CannedServer], answer: Any
) -> None:
    sidecar = canned(servers, answer)
    result, elapsed = wait_in_thread(SidecarWaiter([sidecar.url]), 5, timeout_s=2.0)
    assert isinstance(result, (ReplicaSyncTimeout, CheckpointRejected)), repr(result)
    assert elapsed < 20


def test_a_sidecar_wait_still_reports_a_rejection(servers: list[CannedServer]) -> None:
    sidecar = canned(
        servers, lambda path, body, count: canned_reply(504, {"rejected": {"5": "non_finite"}, "loaded_step": 4})
    )
    result, _ = wait_in_thread(SidecarWaiter([sidecar.url]), 5, timeout_s=5.0)
    assert isinstance(result, CheckpointRejected) and "non_finite" in str(result), repr(result)


@pytest.mark.parametrize("drip", [dripping, dripping_headers], ids=["body", "headers"])
def test_a_notify_to_a_dripping_sidecar_ends_within_its_bound(servers: list[CannedServer], drip: Any) -> None:
    sidecar = canned(servers, lambda path, body, count: drip())
    done = threading.Event()
    t0 = time.monotonic()
    threading.Thread(target=lambda: (SidecarWaiter([sidecar.url]).notify(5), done.set()), daemon=True).start()
    assert done.wait(12), "a notify to a dripping sidecar did not end"
    assert time.monotonic() - t0 < 12
    assert sidecar.requests[0][:2] == ("POST", "/sync")


def blocking_exchange(url: str, what: str) -> tuple[Exception | None, float]:
    """``request(GET url)`` through a deadline-keeping client with a 1 s bound, in a thread (the
    old code waited for good): the error it raised, if any, and how long it took."""
    out: list[Any] = []

    def go() -> None:
        with bounded_client() as client:
            t0 = time.monotonic()
            try:
                request(client, "GET", url, timeout_s=1.0)
                out.append(None)
            except Exception as exc:  # returned: the caller's assertion names it
                out.append(exc)
            out.append(time.monotonic() - t0)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(15)
    assert not thread.is_alive(), f"the exchange was still waiting on {what} after 15 s"
    return out[0], out[1]


def test_a_blocking_exchange_ends_at_its_deadline_while_the_headers_drip(servers: list[CannedServer]) -> None:
    """No body chunk ever comes, so only the connection's own waits can keep to the deadline."""
    server = canned(servers, lambda path, body, count: dripping_headers())
    error, took = blocking_exchange(server.url + "/status", "dripped headers")
    assert isinstance(error, AnswerRefused) and "did not answer in full within 1 s" in str(error), repr(error)
    assert took < 1.6, f"the exchange took {took:.2f} s for a 1 s bound"


def endless_continues() -> Answer:
    """``100 Continue`` heads without pause: each a whole message, so a read never has to wait."""

    def write(conn: socket.socket, stopped: threading.Event) -> None:
        while not stopped.is_set():
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" * 256)

    return write


def test_a_blocking_exchange_ends_at_its_deadline_while_interim_heads_never_stop(servers: list[CannedServer]) -> None:
    server = canned(servers, lambda path, body, count: endless_continues())
    error, took = blocking_exchange(server.url + "/status", "endless 100 Continue heads")
    assert isinstance(error, AnswerRefused) and "did not answer in full within 1 s" in str(error), repr(error)
    assert took < 1.6, f"the exchange took {took:.2f} s for a 1 s bound"


def test_closing_the_endpoints_ends_a_request_a_failed_generate_left_running(servers: list[CannedServer]) -> None:
    """One endpoint refuses the batch (``generate`` raises at once), the other never answers: its
    request is left running. ``close()`` cuts it off, where it used to run to its own timeout
    (and held the process's exit that long)."""
    before = set(threading.enumerate())  # (threads of other tests' endpoints are not this one's)
    refusing = canned(servers, lambda path, body, count: canned_reply(400, {"error": "bad sampling params"}))
    silent = canned(servers, lambda path, body, count: lambda conn, stopped: stopped.wait(60))
    endpoints = SGLangEndpoints([refusing.url, silent.url], request_timeout_s=60)
    with pytest.raises(SGLangRequestError):
        endpoints.generate(
            [[1, 2], [3, 4]], {"n": 1, "max_new_tokens": 2}, want_logprobs=False, deadline=time.monotonic() + 5
        )
    ours = [t for t in set(threading.enumerate()) - before if t.name.startswith("sglang-generate")]
    assert ours, "nothing left running"
    t0 = time.monotonic()
    endpoints.close()
    took = time.monotonic() - t0
    left = [t.name for t in ours if t.is_alive()]
    assert not left and took < 5, (left, took)
    assert not endpoints.is_open


def test_a_bounded_client_goes_through_the_environments_proxy_and_keeps_its_deadline_there(
    servers: list[CannedServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline-keeping client is httpx's own as to proxies: a trainer that reaches its
    sidecars through HTTP_PROXY still does, and a proxy that drips is cut at the deadline too."""
    proxy = canned(servers, lambda path, body, count: dripping_headers())
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, proxy.url)
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    error, took = blocking_exchange("http://sidecar-0.invalid:8100/status", "a dripping proxy")
    assert proxy.requests and "sidecar-0.invalid" in proxy.requests[0][1], proxy.requests
    assert isinstance(error, AnswerRefused) and took < 1.6, (repr(error), took)


def late_then_silent(after_s: float) -> Answer:
    """Headers, one byte ``after_s`` later, then nothing: the next wait for bytes starts just
    before the deadline."""

    def write(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n")
        if not stopped.wait(after_s):
            conn.sendall(b" ")
        stopped.wait(30)

    return write


def test_the_sidecars_exchanges_end_at_their_deadline_not_a_read_timeout_past_it(
    servers: list[CannedServer],
) -> None:
    """A byte just before the deadline restarts httpx's read timeout: the whole exchange would
    end near twice its bound, with httpx's own error instead of a refusal."""
    server = canned(servers, lambda path, body, count: late_then_silent(0.8))

    async def go() -> float:
        async with httpx.AsyncClient() as client:
            t0 = time.monotonic()
            with pytest.raises(AnswerRefused, match="did not answer in full within 1 s"):
                await arequest(client, "GET", server.url + "/health", timeout_s=1.0)
            return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.9 < took < 1.5, f"the exchange took {took:.2f} s for a 1 s bound"


def with_client(server: CannedServer, call: Any) -> Any:
    """``call(client)`` with the sidecar's SGLang client on ``server``, closed after."""

    async def go() -> Any:
        client = SGLangClient(server.url, timeout_s=3.0)
        try:
            return await call(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def answering(servers: list[CannedServer], body: Any) -> CannedServer:
    raw = body if isinstance(body, str) else json.dumps(body)
    return canned(servers, lambda path, b, count: canned_reply(200, raw))


@pytest.mark.parametrize(
    "body",
    [[], "null", {"model_path": 7, "weight_version": "3"}, {"model_path": "/m\u0000x"}, DEEP_JSON],
    ids=["a-list", "null", "path-not-a-string", "path-with-nul", "nested-past-the-recursion-limit"],
)
def test_the_sidecar_takes_a_malformed_model_info_for_what_it_is(servers: list[CannedServer], body: Any) -> None:
    seen = with_client(answering(servers, body), lambda client: client.view())
    if isinstance(body, dict):  # an object: SGLang's, with the odd field dropped
        assert seen.healthy and seen.model_path is None
    else:
        assert not seen.healthy


@pytest.mark.parametrize(
    "body",
    [{"success": "false", "message": "no"}, ["success"], {"message": "no success field"}, DEEP_JSON],
    ids=["success-as-a-string", "a-list", "no-success", "nested-past-the-recursion-limit"],
)
def test_a_weight_update_counts_only_an_answer_that_says_success_true(servers: list[CannedServer], body: Any) -> None:
    server = answering(servers, body)
    with pytest.raises(SGLangLoadRejected, match="SGLang refused /stage/step-00000001"):
        with_client(server, lambda client: client.load_from_disk("/stage/step-00000001", "1"))


def test_sidecars_that_do_not_answer_are_woken_all_at_once(servers: list[CannedServer]) -> None:
    silent = [canned(servers, lambda path, b, count: lambda conn, stopped: stopped.wait(60)) for _ in range(3)]
    waiter = SidecarWaiter([server.url for server in silent])
    t0 = time.monotonic()
    waiter.notify(1)
    took = time.monotonic() - t0
    assert all(server.requests for server in silent)
    assert took < 8, f"notify took {took:.1f} s for three sidecars that do not answer (5 s each, one after another)"


def test_a_sidecar_slow_to_answer_its_wait_ends_the_wait_near_sync_timeout(servers: list[CannedServer]) -> None:
    slow = canned(servers, lambda path, b, count: lambda conn, stopped: stopped.wait(60))
    waiter = SidecarWaiter([slow.url])
    t0 = time.monotonic()
    with pytest.raises(ReplicaSyncTimeout):
        waiter.wait(1, timeout_s=2.0)
    took = time.monotonic() - t0
    assert took < 7.0, f"the wait ended {took - 2.0:.1f} s past its sync_timeout of 2 s"


@pytest.mark.parametrize("status", [500, 502, 503, 504])
@pytest.mark.parametrize(
    "call",
    [
        lambda client: client.load_from_disk("/stage/step-00000001", "1"),
        lambda client: client.load_lora_adapter("v00000001-run", "/stage/adapter"),
    ],
    ids=["weight-update", "adapter-load"],
)
def test_a_5xx_to_a_load_is_sglang_unavailable_not_a_refusal_of_the_step(
    servers: list[CannedServer], status: int, call: Any
) -> None:
    """SGLang refuses a load with 400; a 5xx is a proxy in front of it (or a server failing as it
    answers): the step is tried again, where it used to be rejected for good."""
    server = canned(servers, lambda path, b, count: canned_reply(status, "<html>Bad Gateway</html>"))
    with pytest.raises(SGLangUnavailable, match=f"HTTP {status}"):
        with_client(server, call)


@pytest.mark.parametrize("answer", ["silent", "dripping"])
def test_a_load_not_answered_within_the_load_timeout_says_it_may_still_be_running(
    servers: list[CannedServer], answer: str
) -> None:
    """A load past --load-timeout is SGLangLoadTimedOut (SGLang may still finish it: the sync
    loop then sends no other step meanwhile), not a plain SGLangUnavailable (SGLang died)."""

    def silent(conn: socket.socket, stopped: threading.Event) -> None:
        stopped.wait(30)

    server = canned(servers, lambda path, b, count: silent if answer == "silent" else dripping())

    async def load(url: str) -> None:
        client = SGLangClient(url, timeout_s=3.0, load_timeout_s=1.0)
        try:
            await client.load_from_disk("/stage/step-00000001", "1")
        finally:
            await client.aclose()

    with pytest.raises(SGLangLoadTimedOut, match="may still be loading /stage/step-00000001"):
        asyncio.run(load(server.url))
    with pytest.raises(SGLangUnavailable) as died:  # nothing listens: SGLang is down, no load runs
        asyncio.run(load(dead_url()))
    assert not isinstance(died.value, SGLangLoadTimedOut)


@pytest.mark.parametrize("body", [["enable_lora"], "null", 7], ids=["a-list", "null", "a-number"])
def test_server_info_that_is_no_object_is_sglang_unavailable(servers: list[CannedServer], body: Any) -> None:
    server = answering(servers, body)
    with pytest.raises(SGLangUnavailable, match="not an object"):
        with_client(server, lambda client: client.server_info())


@pytest.mark.parametrize(
    "body, says",
    [
        (b"<html>proxy login</html>", "not a JSON object"),
        ({"loaded_step": None}, "loaded_step None, not 5 or newer"),
        ({"loaded_step": 3, "run_id": "mine"}, "loaded_step 3, not 5 or newer"),
        ({"loaded_step": True, "run_id": "mine"}, "loaded_step None"),
        ({"loaded_step": 5, "run_id": "someone-else"}, "serves run someone-else, not this run (mine)"),
        ({"loaded_step": 5, "run_id": "mine", "loaded_current": False}, "no longer the published one"),
    ],
    ids=["html", "nothing-loaded", "older-step", "bool-step", "other-run", "not-current"],
)
def test_a_200_from_a_sidecar_wait_acknowledges_only_what_it_reports(
    servers: list[CannedServer], body: Any, says: str
) -> None:
    """Before, any 200 counted as the replica serving the step: a proxy's page, or a sidecar that
    loaded an older step or another run's, advanced the trainer (and retention's protected steps)."""
    sidecar = canned(servers, lambda path, _body, count: canned_reply(200, body))
    waiter = SidecarWaiter([sidecar.url])
    waiter.run_id = "mine"
    result, _ = wait_in_thread(waiter, 5, timeout_s=2.0)
    assert isinstance(result, ReplicaSyncTimeout) and says in str(result), repr(result)
    assert "GET /wait answered 200, but" in str(result)


def test_a_200_naming_the_step_or_a_newer_one_of_this_run_acknowledges(servers: list[CannedServer]) -> None:
    sidecar = canned(servers, lambda path, body, count: canned_reply(200, {"loaded_step": 6, "run_id": "mine"}))
    waiter = SidecarWaiter([sidecar.url])
    waiter.run_id = "mine"
    result, _ = wait_in_thread(waiter, 5, timeout_s=5.0)
    assert isinstance(result, list) and [v.loaded_step for v in result] == [6], repr(result)
    # Acknowledged by the first answer: the waiter asked once, not again until its deadline.
    waits = [path for _, path, _ in sidecar.requests if path.startswith("/wait")]
    assert len(waits) == 1, sidecar.requests
