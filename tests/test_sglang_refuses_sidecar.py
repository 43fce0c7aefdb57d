"""Something answers at ``--sglang-url``, but not as SGLang does for the sidecar: SGLang refusing
the sidecar's API key (401; its ``/health`` stays open), or a URL that is not SGLang's (the
sidecar's own port: 404). The sidecar said only "SGLang ... has not answered recently", logged
nothing and left ``last_error`` empty, while the probes saw SGLang answer. It now says which, and
what to do, in ``/readyz``'s reason, ``last_error`` (``sglang_refused``) and its log, once.

The real SGLang with an API key is asked in ``test_sglang_key_secret`` (the client's view names
the key); here the sync loop is real and the server a stdlib stand-in answering as SGLang 0.5.23
does without the key (a real SGLang cannot be given a second key for a test's sake).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.settings import SidecarSettings

KEY = "right-key-123"


class KeyedSGLang(BaseHTTPRequestHandler):
    """/health open; everything else 200 with the key, 401 without (SGLang 0.5.23's auth)."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            body, code = b"", 200
        elif self.headers.get("Authorization") == f"Bearer {KEY}":
            body, code = json.dumps({"weight_version": "default", "model_path": "/m"}).encode(), 200
        else:
            body, code = b'{"error": "Unauthorized"}', 401
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class NotSGLang(KeyedSGLang):
    def do_GET(self) -> None:  # noqa: N802
        body = b'{"detail": "Not Found"}'
        self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def serve() -> Iterator[object]:
    servers: list[ThreadingHTTPServer] = []

    def start(handler: type[BaseHTTPRequestHandler]) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()


def run_sidecar(tmp_path: Path, url: str, key: str | None, seconds: float) -> SyncController:
    settings = SidecarSettings(
        checkpoint_path=tmp_path,
        sglang_url=url,
        replica_id="r",
        stage=False,
        sglang_api_key=key,
        health_interval_s=0.05,
    )
    c = SyncController(settings)

    async def scenario() -> None:
        task = asyncio.create_task(c.run())
        await asyncio.sleep(seconds)
        await c.stop()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(scenario())
    return c


@pytest.mark.parametrize("key", ["wrong-key-456", None], ids=["wrong-key", "no-key"])
def test_a_refused_api_key_is_named_with_what_to_do(tmp_path: Path, serve, key, caplog) -> None:
    caplog.set_level(logging.INFO, logger="rollout_service")
    c = run_sidecar(tmp_path, serve(KeyedSGLang), key, 1.0)
    ready, why = c.readiness()
    assert not ready and "refuses the sidecar's API key" in why and "ROLLOUT_SGLANG_API_KEY" in why, why
    assert c.state.last_error is not None and c.state.last_error["reason"] == "sglang_refused"
    logged = [r for r in caplog.records if "API key" in r.getMessage() and r.levelno >= logging.ERROR]
    assert len(logged) == 1, [r.getMessage() for r in logged]  # once, not every 0.05 s


def test_a_url_that_is_not_sglangs_says_so(tmp_path: Path, serve) -> None:
    c = run_sidecar(tmp_path, serve(NotSGLang), None, 1.0)
    ready, why = c.readiness()
    assert not ready and "HTTP 404" in why and "is --sglang-url SGLang's address" in why, why
    assert c.state.last_error is not None and c.state.last_error["reason"] == "sglang_refused"


def test_the_right_key_serves_and_clears_the_reason(tmp_path: Path, serve) -> None:
    c = run_sidecar(tmp_path, serve(KeyedSGLang), KEY, 1.0)
    assert c.state.sglang_healthy
    assert "refuses" not in c.readiness()[1]
