"""A fake SGLang server and sidecar in one in-process HTTP server, for the trainer's failure cases.

`FakeRollout` speaks SGLang's `POST /generate` and the sidecar's `GET /wait` and `POST /sync`,
with knobs for what real servers do only rarely (float token ids, stale, older or aborted answers, hung
requests, a sidecar that reports a rejection or a down SGLang), so those tests are fast and exact.
`FakeRoutes` answers fixed JSON per path, or hangs first (a `/health` stuck behind a weight load),
for the liveness probe. `CannedServer` answers from a raw socket with scripted bytes, for what no
HTTP framework writes on purpose (a body dripped byte by byte, a lying Content-Length, a broken
gzip). `dead_url` names an address nothing listens on.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from helpers import free_port

VOCAB_SIZE = 4096
"""The tiny model's vocabulary: the fake's token ids stay below it."""


@dataclass
class FakeRollout:
    """Speaks SGLang's POST /generate and the sidecar's GET /wait and POST /sync, with knobs.

    Completions start with their prompt's first token (so order can be checked) and report
    `weight_version` = the newest version a /wait confirmed, unless `fixed_version` is set.
    """

    float_token_ids: bool = False
    fixed_version: str | None = None
    stale_answers: int = 0
    """How many /generate answers to label with SGLang's start-up version "default"."""
    older_answers: int = 0
    """How many /generate answers to label with the version before the newest one loaded
    (``str(loaded - 1)``: this run's weights, older than the staleness bound allows)."""
    abort_answers: int = 0
    generate_delay_s: float = 0.0
    generate_status: int = 200
    """Anything else makes /generate fail with it (a router whose upstream died answers 502)."""
    wait_status: int = 200
    wait_body: dict[str, Any] = field(default_factory=dict)
    loaded: int = 0
    generate_requests: list[dict[str, Any]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeRollout:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up first (the hung-server tests time out on purpose)

            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path == "/health":
                    return self._reply(200, {})
                if url.path != "/wait":
                    return self._reply(404, {"detail": "not found"})
                query = parse_qs(url.query)
                version = int(query["version"][0])
                if fake.wait_status == 200:  # as a sidecar's: it serves the step of the run waited for
                    fake.loaded = max(fake.loaded, version)
                    run = query.get("run", [None])[0]
                    return self._reply(200, {"loaded_step": fake.loaded, "run_id": run, "sglang_healthy": True})
                time.sleep(min(0.2, float(parse_qs(url.query)["timeout"][0])))
                return self._reply(fake.wait_status, fake.wait_body)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/sync":
                    return self._reply(202, {"triggered": True})
                if self.path != "/generate":
                    return self._reply(404, {"detail": "not found"})
                fake.generate_requests.append(body)
                if fake.generate_delay_s:
                    time.sleep(fake.generate_delay_s)
                if fake.generate_status != 200:
                    return self._reply(fake.generate_status, {"detail": "upstream died"})
                self._reply(200, fake.answer(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def answer(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        params = body["sampling_params"]
        n, length = int(params.get("n", 1)), min(int(params["max_new_tokens"]), 6)
        if self.fixed_version is not None:
            version = self.fixed_version
        elif self.stale_answers > 0:
            self.stale_answers -= 1
            version = "default"
        elif self.older_answers > 0:
            self.older_answers -= 1
            version = str(self.loaded - 1)
        else:
            version = str(self.loaded)
        finish = "length"
        if self.abort_answers > 0:
            self.abort_answers -= 1
            finish = "abort"
        rng = random.Random(len(self.generate_requests))
        out = []
        for prompt in body["input_ids"]:
            for _ in range(n):
                ids = [prompt[0]] + [rng.randrange(10, VOCAB_SIZE) for _ in range(length - 1)]
                wire = [float(t) for t in ids] if self.float_token_ids else ids
                out.append(
                    {
                        "output_ids": wire,
                        "meta_info": {
                            "weight_version": version,
                            "finish_reason": {"type": finish},
                            "output_token_logprobs": [[-8.0, t, None] for t in wire],
                        },
                    }
                )
        return out

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def dead_url() -> str:
    """A URL nothing listens on (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


class FakeRoutes:
    """A tiny HTTP server whose routes answer JSON, or hang for a while (a busy /health).

    ``routes`` maps a path to ``(status, body, delay_s)``; change it while the server runs.
    """

    def __init__(self, routes: dict[str, tuple[int, Any, float]]) -> None:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                route = owner.routes.get(self.path)
                if route is None:
                    self.send_response(404)
                    self.end_headers()
                    return
                status, body, delay = route
                time.sleep(delay)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.routes = routes
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


Answer = Callable[[socket.socket, threading.Event], None]
"""Writes one scripted answer to the connection; may wait on the event (set when the server stops)."""


class CannedServer:
    """A raw-socket HTTP/1.1 server: each request is answered by ``handler(path, body, count)``,
    which returns an :data:`Answer` (``canned_reply`` for an ordinary one). ``GET`` requests get
    ``{}`` with 200 (``/health``) unless the handler says otherwise; one request per connection.
    ``requests`` records ``(method, path, body)``."""

    def __init__(self, handler: Callable[[str, Any, int], Answer | None]) -> None:
        self.handler = handler
        self.requests: list[tuple[str, str, Any]] = []
        self.stopped = threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def generate_requests(self) -> list[Any]:
        return [body for method, path, body in self.requests if path == "/generate"]

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, rest = data.split(b"\r\n\r\n", 1)
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ")
                headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                while len(rest) < int(headers.get("content-length", 0)):
                    rest += conn.recv(65536)
                body = json.loads(rest) if rest else None
                self.requests.append((method, path, body))
                answer = self.handler(path, body, len(self.requests))
                (answer or canned_reply(200, {}))(conn, self.stopped)
            except OSError:
                pass  # the client gave up first

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()


def canned_reply(status: int, body: Any, *, headers: str = "", content_type: str = "application/json") -> Answer:
    """An ordinary answer: ``body`` (JSON unless bytes or str) with its Content-Length, then close."""
    raw = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()

    def write(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(raw)}\r\n"
            f"Connection: close\r\n{headers}\r\n".encode()
            + raw
        )

    return write


def canned_answer(body: dict[str, Any], *, version: Any = "5", prompt_tokens: bool = True) -> list[dict[str, Any]]:
    """What SGLang answers to a ``/generate`` body: per prompt and sample, two tokens (the prompt's
    first, then 7) with logprobs -0.5, ``version`` as ``weight_version`` and ``prompt_tokens``."""
    params = body["sampling_params"]
    n = int((params[0] if isinstance(params, list) else params).get("n", 1))  # one n for all, as SGLang's
    out = []
    for prompt in body["input_ids"]:
        for _ in range(n):
            ids = [prompt[0], 7]
            meta: dict[str, Any] = {
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
                "weight_version": version,
                "finish_reason": {"type": "length"},
            }
            if prompt_tokens:
                meta["prompt_tokens"] = len(prompt)
            out.append({"text": "", "output_ids": ids, "meta_info": meta})
    return out
