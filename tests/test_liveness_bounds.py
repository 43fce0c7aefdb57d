"""`rollout-service liveness` (SGLang's Kubernetes exec probe) against answers no real sidecar
or SGLang gives on purpose: it ends within its bound, reads a bounded amount, takes a malformed
sidecar answer for "sidecar unknown" (SGLang's /health then decides) and names a malformed URL
instead of crashing.

Driven in-process through ``cli.main`` against `fake_sglang.CannedServer` (a raw socket writing
scripted bytes). Each scripted answer gives up on its own after a few seconds, so that the old,
unbounded probe fails these tests instead of hanging them.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from fake_sglang import Answer, CannedServer, canned_reply
from rollout_service.cli import main

TIMEOUT_S = 1.0
BOUND_S = 2 * TIMEOUT_S + 0.5
"""The probe's promise: at most --timeout per HTTP call, two calls (plus start-up slack)."""
GIVE_UP_S = 6.0
"""How long a scripted slow answer keeps going before it stops by itself."""
DEEP_JSON = "[" * 100_000 + "]" * 100_000


def canned(servers: list[CannedServer], routes: dict[str, Answer]) -> CannedServer:
    """A server answering ``routes[path]``, and ``{}`` with 200 for any other path."""
    server = CannedServer(lambda path, body, count: routes.get(path))
    servers.append(server)
    return server


def body_drip() -> Answer:
    """Headers promising 100 kB, then a byte every 0.2 s (each well within any read timeout)."""

    def write(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        end = time.monotonic() + GIVE_UP_S
        while time.monotonic() < end and not stopped.wait(0.2):
            conn.sendall(b" ")

    return write


def header_drip() -> Answer:
    """A status line, then one header line every 0.2 s: the answer's head never ends."""

    def write(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        end = time.monotonic() + GIVE_UP_S
        while time.monotonic() < end and not stopped.wait(0.2):
            conn.sendall(b"X-Drip: 1\r\n")

    return write


class Flood:
    """A close-delimited 200 answer of ``size`` bytes (no Content-Length to refuse it by),
    counting what the client took before it hung up."""

    def __init__(self, size: int) -> None:
        self.size, self.sent = size, 0

    def __call__(self, conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
        piece = b'"' + b"x" * ((1 << 20) - 1)  # a JSON string that never closes
        while self.sent < self.size and not stopped.is_set():
            conn.sendall(piece)
            self.sent += len(piece)


def probe(capsys: pytest.CaptureFixture[str], sglang: str, sidecar: str) -> tuple[int, float, str, str]:
    argv = ["liveness", "--sglang-url", sglang, "--sidecar-url", sidecar, "--timeout", str(TIMEOUT_S)]
    t0 = time.monotonic()
    code = main(argv)
    took = time.monotonic() - t0
    out = capsys.readouterr()
    return code, took, out.out, out.err


@pytest.mark.parametrize("slow", [body_drip, header_drip], ids=["body-dripped", "head-dripped"])
def test_a_dripping_sidecar_neither_holds_the_probe_past_its_bound_nor_kills_a_live_sglang(
    servers: list[CannedServer], capsys: pytest.CaptureFixture[str], slow: Any
) -> None:
    sidecar = canned(servers, {"/status": slow()})
    sglang = canned(servers, {})
    code, took, out, err = probe(capsys, sglang.url, sidecar.url)
    assert code == 0 and "/health answered 200" in out, (out, err)
    assert took < BOUND_S, f"the probe took {took:.1f} s with --timeout {TIMEOUT_S:g}"


@pytest.mark.parametrize("slow", [body_drip, header_drip], ids=["body-dripped", "head-dripped"])
def test_a_dripping_health_is_not_alive_within_the_bound(
    servers: list[CannedServer], capsys: pytest.CaptureFixture[str], slow: Any
) -> None:
    sidecar = canned(servers, {"/status": canned_reply(200, {"loading_step": None})})
    sglang = canned(servers, {"/health": slow()})
    code, took, out, err = probe(capsys, sglang.url, sidecar.url)
    assert code == 1 and "/health failed" in err and "Traceback" not in err, (out, err)
    assert took < BOUND_S, f"the probe took {took:.1f} s with --timeout {TIMEOUT_S:g}"
    # While the sidecar loads weights, /health waits on the load: SGLang counts as alive.
    loading = canned(servers, {"/status": canned_reply(200, {"loading_step": 12, "ready": False})})
    code, took, out, err = probe(capsys, sglang.url, loading.url)
    assert code == 0 and "loading step 12" in out, (out, err)
    assert took < BOUND_S


@pytest.mark.parametrize(
    "status",
    [
        canned_reply(200, DEEP_JSON),
        canned_reply(500, {"loading_step": 7}),
        canned_reply(200, {"loading_step": {"not": "a step"}}),
        canned_reply(200, {"loading_step": -3}),
    ],
    ids=["nested-past-the-recursion-limit", "an-error-status", "step-an-object", "step-negative"],
)
def test_a_malformed_sidecar_status_leaves_the_verdict_to_health(
    servers: list[CannedServer], capsys: pytest.CaptureFixture[str], status: Answer
) -> None:
    sidecar = canned(servers, {"/status": status})
    sglang = canned(servers, {})
    code, _, out, err = probe(capsys, sglang.url, sidecar.url)
    assert code == 0 and "/health answered 200" in out, (out, err)
    assert "loading step" not in out
    sick = canned(servers, {"/status": status, "/health": canned_reply(503, {"error": "unhealthy"})})
    code, _, out, err = probe(capsys, sick.url, sick.url)
    assert code == 1 and "/health answered 503" in err, (out, err)


def test_a_flood_from_the_sidecar_or_sglang_is_read_only_up_to_a_small_limit(
    servers: list[CannedServer], capsys: pytest.CaptureFixture[str]
) -> None:
    size = 128 << 20
    flood = Flood(size)
    sidecar = canned(servers, {"/status": flood})
    sglang = canned(servers, {})
    code, _, out, err = probe(capsys, sglang.url, sidecar.url)
    assert code == 0 and "/health answered 200" in out, (out, err)
    assert flood.sent < 16 << 20, f"the probe took {flood.sent} of {size} bytes from the sidecar"
    flood = Flood(size)
    sglang = canned(servers, {"/health": flood})
    code, _, out, err = probe(capsys, sglang.url, sidecar.url)
    assert code == 1 and "/health failed" in err and "more than" in err, (out, err)
    assert flood.sent < 16 << 20, f"the probe took {flood.sent} of {size} bytes from SGLang"


@pytest.mark.parametrize(
    "flag, url, why",
    [
        ("--sglang-url", "http://[::1", "--sglang-url is not a valid URL"),
        ("--sidecar-url", "http://[::1", "--sidecar-url is not a valid URL"),
        ("--sglang-url", "http://::1:30000", "IPv6 host in brackets"),
        ("--sidecar-url", "ftp://127.0.0.1:8100", "--sidecar-url must start with http://"),
        ("--sglang-url", "http://127.0.0.1:99999", "outside 1-65535"),
    ],
)
def test_a_malformed_url_is_named_not_a_traceback(
    capsys: pytest.CaptureFixture[str], flag: str, url: str, why: str
) -> None:
    argv = ["liveness", "--sglang-url", "http://127.0.0.1:30000", "--sidecar-url", "http://127.0.0.1:8100"]
    argv[argv.index(flag) + 1] = url
    assert main([*argv, "--timeout", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and why in err and "Traceback" not in err, err
