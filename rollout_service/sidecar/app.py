"""The sidecar's HTTP API (FastAPI) and its lifecycle (watcher + sync loop).

Routes: ``GET /healthz``, ``GET /readyz``, ``GET /status``, ``GET /wait``,
``POST /sync`` (token-protected when a token is set), ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import re
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BeforeValidator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..checkpoint_format import RUN_ID_RE, CheckpointError
from ..http_auth import is_loopback_authority, is_loopback_host
from ..http_urls import url_host
from ..number_text import STEP_PATTERN, digits_value, plain_seconds
from ..redaction import shown_request_target
from .controller import NOT_LOADABLE_NOW, SyncController
from .root_gate import RootGate, RootUnresponsive
from .settings import SidecarSettings, warn_unguarded_listeners
from .watcher import CheckpointWatcher

log = logging.getLogger(__name__)

MAX_WAIT_S = 3600.0
HTTP_ERRORS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    421: "misdirected_request",
}
"""Every error answer names its kind under ``error`` (the others: ``path_escape``, ``root_unresponsive``...)."""
NAME_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EINVAL})
"""Errors of a lookup that come from the name a client sent (400); any other is the storage's (503)."""
MAX_WAITERS = 256
"""``/wait`` requests held at once; more are answered 503 at once (idle long-polls must not use
up the process's file descriptors, which the health probes and the ack file need too)."""
TOKEN_WAITERS = 16
"""``/wait`` requests held beyond :data:`MAX_WAITERS` for clients that send the sidecar's token
(the trainers, when one is configured): ``/wait`` needs none, so anyone who reaches the sidecar
could otherwise hold every slot and keep the trainer from confirming a sync."""
SHUTDOWN_GRACE_S = 5
"""How long a stopping sidecar lets open requests (a /wait of up to an hour) finish."""
MAX_CONNECTIONS = 2 * MAX_WAITERS
"""Connections served at once; past it a request is answered 503 at once (uvicorn's
``limit_concurrency``): a flood of clients cannot use up the sidecar's file descriptors, which
its watcher, its ack writes and its probes need too."""
BODY_TIMEOUT_S = 10.0
"""How long a ``POST /sync`` body may take to arrive (it is at most a few hundred bytes)."""
ROOT_LOOKUP_TIMEOUT_S = 4.0
"""How long ``POST /sync`` waits for the checkpoint root to show the step it names (a hung
network file system answers 503 instead of holding the request, and the event loop, forever).
Its looks have a gate of their own: a client naming a path on some other, hung file system
makes only its own requests fail, not the replica's readiness."""
MAX_SYNC_BODY_BYTES = 4096
"""``POST /sync`` takes at most a small object such as ``{"checkpoint": "step-00000042"}``;
larger bodies are refused before they are read."""
SYNC_BODY_KEYS = ("checkpoint",)
"""The keys a ``POST /sync`` body may have; any other (a typo) is refused."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""Methods that change nothing; any other (``POST /sync``) is a mutating request."""
BODY_MEDIA_TYPE = "application/json"
"""The Content-Type a ``POST /sync`` body must have: a browser sends a cross-site body of this type
only after a CORS preflight, which the sidecar does not answer (a ``text/plain`` one it sends
without asking)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


class SafeJSONResponse(JSONResponse):
    """The app's JSON responses: any text renders, also text that is not valid Unicode.

    A file name that is not UTF-8 reaches messages as lone surrogates (``os.fsdecode``), which
    UTF-8 cannot encode (Starlette's JSONResponse would answer 500) and strict JSON parsers refuse
    as escapes; each is rendered as the visible text ``\\udcff`` instead.
    """

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))
        return _SURROGATE.sub(lambda m: f"\\\\u{ord(m.group()):04x}", text).encode("utf-8")


def create_app(settings: SidecarSettings) -> FastAPI:
    """Build the app; the sync loop and the watcher run for the app's lifetime."""
    controller = SyncController(settings)
    lookups = RootGate(settings.checkpoint_path, min(ROOT_LOOKUP_TIMEOUT_S, settings.root_timeout_s))

    def watching_with(mode: str) -> None:  # inotify may be out of instances, also when watching anew
        controller.state.watch_mode = mode
        controller.notify(f"watch:{mode}")

    watcher = CheckpointWatcher(settings.checkpoint_path, controller.notify, settings.poll_interval_s, watching_with)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(controller.run(), name="sidecar-sync-loop")
        task.add_done_callback(controller.loop_ended)
        try:  # a watcher that cannot start fails the start-up; the loop must stop with it, or exit hangs
            watcher.start()
            controller.state.watch_mode = watcher.mode  # inotify may have been out of instances
            yield
        finally:
            watcher.stop()
            await controller.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(
        title="rollout-service sidecar",
        lifespan=lifespan,
        dependencies=[Depends(_same_site_guard(settings)), Depends(_known_query)],
        redirect_slashes=False,  # a redirect is answered before the Host guard runs (it would name any Host)
        docs_url=None,  # its page loads scripts from a CDN; /openapi.json describes the API
        redoc_url=None,
        description="Loads each new checkpoint from shared storage into SGLang.",
        default_response_class=SafeJSONResponse,
    )
    app.state.controller = controller
    app.state.stopping = False
    """Set when the HTTP server starts to shut down (:func:`http_server`): held ``/wait``s answer."""

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5])
        return SafeJSONResponse({"error": "bad_request", "detail": problems[:1000]}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = HTTP_ERRORS.get(exc.status_code, f"http_{exc.status_code}")
        return SafeJSONResponse(
            {"error": error, "detail": exc.detail}, status_code=exc.status_code, headers=exc.headers
        )

    def has_token(request: Request) -> bool:
        """Whether the request carries the configured token (False when none is configured)."""
        if not settings.token:
            return False
        supplied = request.headers.get("x-rollout-token") or ""
        auth = request.headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            supplied = supplied or auth[7:]
        return hmac.compare_digest(supplied.encode(), settings.token.encode())

    def require_token(request: Request) -> None:
        if settings.token and not has_token(request):
            raise HTTPException(status_code=401, detail="missing or wrong token: send 'Authorization: Bearer <token>'")

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/readyz")
    async def readyz(
        staleness_text: str = Query(
            "0",
            alias="staleness",
            pattern=f"^{STEP_PATTERN}$",
            description="also ready while serving a step at most this many older than the newest"
            " (the trainers' max_staleness, 1-8 ASCII digits; default 0: only the newest)",
        ),
    ) -> JSONResponse:
        s = controller.state
        ready, why = controller.readiness(int(staleness_text))
        body = {
            "ready": ready,
            "reason": why,
            "loaded_step": s.loaded_step,
            "newest_known_step": s.newest_known_step,
            "sglang_healthy": s.sglang_healthy,
            "fatal": s.fatal,
        }
        return SafeJSONResponse(body, status_code=200 if ready else 503)

    waiting: set[asyncio.Future[bool]] = set()
    """The /wait requests held now (at most MAX_WAITERS, and TOKEN_WAITERS more with the token)."""

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return {**controller.state.to_dict(), "open_waits": len(waiting)}

    @app.get("/wait")
    async def wait(
        request: Request,
        version_text: str = Query(
            ...,
            alias="version",
            pattern=f"^{STEP_PATTERN}$",
            description="checkpoint step to wait for (1-8 ASCII digits)",
        ),
        timeout: Annotated[float, Query(gt=0, le=MAX_WAIT_S), BeforeValidator(plain_seconds)] = 60.0,
        run: str | None = Query(
            None,
            max_length=64,
            pattern=f"^{RUN_ID_RE.pattern}$",
            description="the publishing run's id (manifest run_id): only a checkpoint of that run counts",
        ),
    ) -> Response:
        version = int(version_text)
        if len(waiting) >= MAX_WAITERS + (TOKEN_WAITERS if has_token(request) else 0):
            return SafeJSONResponse(
                {
                    "error": "too_many_waits",
                    "detail": f"{MAX_WAITERS} /wait requests are held already; retry shortly, or wait"
                    " with fewer clients (one per trainer is enough)",
                },
                status_code=503,
            )
        why: dict[str, str] = {}
        task = asyncio.ensure_future(controller.wait_for_step(version, timeout, run_id=run, why=why))
        waiting.add(task)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=1.0)
                if not task.done() and await request.is_disconnected():
                    task.cancel()  # the client left: hold nothing for it
                    return Response(status_code=499)
                if not task.done() and app.state.stopping:  # answered, not cut off by the shutdown
                    return SafeJSONResponse(
                        {"error": "shutting_down", "detail": "the sidecar is stopping; ask another replica or again"},
                        status_code=503,
                    )
            ok = task.result()
        finally:
            waiting.discard(task)
            task.cancel()
        body = controller.state.to_dict()
        reason = controller.state.rejected.get(version)
        if reason is not None:  # named whatever else was rejected (reports name the newest 64)
            body["rejected"][str(version)] = reason
        body["waited_for"] = version
        body["waited_for_run"] = run
        if not ok:  # the /status body, and like every error answer the kind under "error"
            if reason is not None:
                body["error"] = "checkpoint_rejected"
            elif controller.state.fatal is not None:
                body["error"] = "replica_fatal"
            else:  # wait_timeout, or why a look at the root ended the wait early (root_unresponsive...)
                body["error"] = why.get("error", "wait_timeout")
                body["detail"] = why.get("detail")
        return SafeJSONResponse(body, status_code=200 if ok else 504)

    @app.post("/sync", dependencies=[Depends(require_token)])
    async def sync(request: Request) -> JSONResponse:
        raw = await _bounded_body(request, MAX_SYNC_BODY_BYTES)
        if raw:
            _require_json_body(request)
        checkpoint = _requested_checkpoint(raw)
        if checkpoint is None:
            controller.notify("api")
            return SafeJSONResponse({"triggered": True}, status_code=202)
        try:  # one bound in all: waiting for a free thread and the look itself
            path = await asyncio.wait_for(
                lookups.call(controller.request_checkpoint, checkpoint, what="POST /sync's lookup"), lookups.timeout_s
            )
        except RootUnresponsive as exc:
            return SafeJSONResponse({"error": RootUnresponsive.reason, "detail": str(exc)}, status_code=503)
        except asyncio.TimeoutError:
            detail = (
                f"looking up {checkpoint[:200]!r} under the checkpoint root took more than {lookups.timeout_s:g} s"
                " (the root is slow or busy); ask again, or send no body to load the newest step"
            )
            return SafeJSONResponse({"error": RootUnresponsive.reason, "detail": detail}, status_code=503)
        except CheckpointError as exc:  # a step the loop would not load is a conflict with its state
            status = 409 if exc.reason in NOT_LOADABLE_NOW else 400
            return SafeJSONResponse({"error": exc.reason, "detail": str(exc)}, status_code=status)
        except OSError as exc:
            if exc.errno not in NAME_ERRNOS:  # EIO, ESTALE...: the storage's fault, not the name's
                detail = (
                    f"looking up {checkpoint[:200]!r} under the checkpoint root failed in the storage"
                    f" ({errno.errorcode.get(exc.errno or 0, type(exc).__name__)}); ask again, and check the root's"
                    " file system if it lasts"
                )
                return SafeJSONResponse({"error": "storage_error", "detail": detail}, status_code=503)
            return SafeJSONResponse(
                {"error": "bad_request", "detail": f"cannot use that checkpoint name: {type(exc).__name__}"},
                status_code=400,
            )
        except ValueError as exc:
            return SafeJSONResponse(
                {"error": "bad_request", "detail": f"cannot use that checkpoint name: {type(exc).__name__}"},
                status_code=400,
            )
        return SafeJSONResponse({"triggered": True, "checkpoint": str(path)}, status_code=202)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(controller.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _same_site_guard(settings: SidecarSettings) -> Callable[[Request], None]:
    """The check every request passes first: what a web page a browser shows cannot do.

    - Bound to a loopback address, the sidecar answers only requests whose ``Host`` names this
      machine (``localhost``, ``127.0.0.0/8``, ``::1``, any port): a page of a name that its DNS
      later points at 127.0.0.1 (DNS rebinding) is the same origin for the browser, which then
      lets it read ``/status`` (421).
    - Without a token, a mutating request (``POST /sync``) that carries ``Origin`` is refused
      (403): browsers send that header with a page's cross-site requests, which need no CORS
      preflight for an empty or form body; the trainer's client sends none.
    """
    loopback_only = is_loopback_host(settings.host)

    def guard(request: Request) -> None:
        host = request.headers.get("host")
        if loopback_only and host is not None and not is_loopback_authority(host):
            raise HTTPException(
                status_code=421,
                detail=f"Host {host[:100]!r} is not this machine: bound to the loopback address {settings.host},"
                " the sidecar answers only loopback names (localhost, 127.0.0.1, [::1]); to serve other names,"
                " bind it to an address they reach (--host) and set --token",
            )
        if not settings.token and request.method not in SAFE_METHODS and "origin" in request.headers:
            raise HTTPException(
                status_code=403,
                detail="this request carries an Origin header (a browser's cross-site request): browsers'"
                " cross-site requests are not served without a token; send it without Origin, or set --token",
            )

    return guard


def _known_query(request: Request) -> None:
    """Refuse (400) a query parameter the route does not declare: a misspelt one (``timout=5``)
    would otherwise be ignored without a word, and the request do something else than asked;
    and one given more than once (``version=1&version=2``: only the last would count)."""
    route = request.scope.get("route")
    allowed = [p.alias for p in route.dependant.query_params] if isinstance(route, APIRoute) else []
    given = Counter(name for name, _ in request.query_params.multi_items())
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        named = ", ".join(repr(name[:64]) for name in unknown[:5])
        takes = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
        raise HTTPException(
            status_code=400, detail=f"unknown query parameter(s) for {request.url.path[:200]}: {named}; {takes}"
        )
    repeated = sorted(name for name, count in given.items() if count > 1)
    if repeated:
        named = ", ".join(repr(name[:64]) for name in repeated[:5])
        raise HTTPException(
            status_code=400,
            detail=f"query parameter(s) given more than once for {request.url.path[:200]}: {named}; give each once",
        )


def _require_json_body(request: Request) -> None:
    """Refuse (415) a body whose Content-Type is not :data:`BODY_MEDIA_TYPE` (any parameters,
    such as ``charset``, allowed)."""
    given = request.headers.get("content-type")
    if given is None or given.split(";", 1)[0].strip().lower() != BODY_MEDIA_TYPE:
        got = "none" if given is None else repr(given[:100])
        raise HTTPException(
            status_code=415,
            detail=f"a request body must be sent as Content-Type: {BODY_MEDIA_TYPE} (got {got}),"
            ' e.g. {"checkpoint": "step-00000003"}; or send no body to load the newest step',
        )


class _RepeatedKey(Exception):
    """A JSON object names one key twice (:func:`_unique_keys`)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: the object, or :class:`_RepeatedKey` for a key given
    twice (JSON takes the last one without a word)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _RepeatedKey(key)
        found[key] = value
    return found


def _requested_checkpoint(raw: bytes) -> str | None:
    """The checkpoint a ``POST /sync`` body names (None: the newest); HTTPException 400 for a bad body."""
    if not raw.strip():
        return None
    example = 'e.g. {"checkpoint": "step-00000003"}'
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:
        raise HTTPException(
            status_code=400, detail=f"the key {str(exc)[:64]!r} is given more than once in the body; give each key once"
        ) from None
    except (ValueError, RecursionError):
        raise HTTPException(status_code=400, detail=f"body must be JSON, {example}") from None
    if not isinstance(data, dict):
        raise HTTPException(status_code=400, detail=f"body must be a JSON object, {example}")
    unknown = sorted(set(data) - set(SYNC_BODY_KEYS))
    if unknown:
        named = ", ".join(repr(key[:64]) for key in unknown[:5])
        raise HTTPException(
            status_code=400,
            detail=f"unknown key(s) in the body: {named}; accepted keys: {', '.join(SYNC_BODY_KEYS)}, {example}",
        )
    checkpoint = data.get("checkpoint")
    if checkpoint is not None and not isinstance(checkpoint, str):
        raise HTTPException(status_code=400, detail="'checkpoint' must be a string")
    return checkpoint


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed ``limit`` bytes, and
    with 408 when it has not come in full within :data:`BODY_TIMEOUT_S` (a client that sends
    a few bytes and stops would hold the connection, and a file descriptor, for good)."""
    try:
        return await asyncio.wait_for(_read_body(request, limit), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise HTTPException(
            status_code=408, detail=f"the request body did not arrive in full within {BODY_TIMEOUT_S:g} s"
        ) from None


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = HTTPException(
        status_code=413,
        detail=f'body larger than {limit} bytes; send {{"checkpoint": "step-00000042"}} (any step) or nothing',
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        length = digits_value(declared)
        if length is None:
            raise HTTPException(status_code=400, detail="Content-Length must be a number in ASCII digits")
        if length > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def run_sidecar(settings: SidecarSettings, listeners: list[socket.socket] | None = None) -> None:
    """Serve the sidecar with uvicorn until interrupted: on ``listeners`` (sockets already
    listening, see `http_urls.listening_sockets`), else on ``settings.host:port``."""

    warn_unguarded_listeners(settings)
    log.info("sidecar on %s (readiness: /readyz)", listen_url(settings))
    try:
        http_server(create_app(settings), settings).run(sockets=listeners)
    finally:
        for sock in listeners or ():
            sock.close()


def listen_url(settings: SidecarSettings) -> str:
    """The address the sidecar listens on, for its start-up log line."""
    return f"http://{url_host(settings.host)}:{settings.port}"


def http_server(app: FastAPI, settings: SidecarSettings) -> Any:
    """The sidecar's uvicorn server (``sidecar`` and ``serve``). Its shutdown first tells the app
    (``app.state.stopping``), so that a ``/wait`` held then answers 503 ``shutting_down`` within
    a second rather than being cancelled after the grace period (a 500 and a traceback)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            app.state.stopping = True
            await super().shutdown(sockets=sockets)

    return Server(uvicorn_config(app, settings))


def uvicorn_config(app: FastAPI, settings: SidecarSettings) -> Any:
    """The HTTP server's settings (``sidecar`` and ``serve``): a stop waits at most
    :data:`SHUTDOWN_GRACE_S` for open requests."""
    import uvicorn

    from .request_heads import HeadTimeoutH11Protocol

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        limit_concurrency=MAX_CONNECTIONS,
        http=HeadTimeoutH11Protocol,  # a connection that sends no request head is closed in time
    )
    access_log = logging.getLogger(ACCESS_LOGGER)  # configured by the Config just made: filter it now
    if not any(isinstance(f, AccessLogQueryFilter) for f in access_log.filters):
        access_log.addFilter(AccessLogQueryFilter())
    return config


ACCESS_LOGGER = "uvicorn.access"
"""uvicorn's access log: one line per request, ``client - "METHOD target HTTP/1.1" status``."""


class AccessLogQueryFilter(logging.Filter):
    """Shows no query string's text in uvicorn's access log (``POST /sync?...`` for
    ``POST /sync?token=SECRET``: the API refuses such a request, but the line would keep the
    secret); method, path and status stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], shown_request_target(args[2]), *args[3:])
        return True
