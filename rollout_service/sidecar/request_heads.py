"""A bound on how long a connection to the sidecar may take to send a request's head.

uvicorn's HTTP/1.1 server (h11) closes an idle keep-alive connection after ``timeout_keep_alive``,
but it has no bound before a request's head is complete: a connection that sends nothing, or
drips a header line now and then (every byte restarts its keep-alive timer), is held open for
ever. The sidecar serves at most ``MAX_CONNECTIONS`` at once, so a few hundred such connections,
which need no token, would answer every later request, ``/healthz`` and ``/readyz`` included,
with 503 (a Kubernetes pod then goes unready and its liveness probe restarts it).

:class:`HeadTimeoutH11Protocol` closes a connection whose request head has not arrived
:data:`REQUEST_HEAD_TIMEOUT_S` after it opened or after its last response was sent. A request
being answered (a ``/wait`` may rightly take minutes) is never cut; its body has its own bound
(``app.BODY_TIMEOUT_S``); the head's size is bounded by h11 (16 KiB).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

REQUEST_HEAD_TIMEOUT_S = 10.0
"""Seconds a connection has to send a complete request head: from when it opened, or from its
last response (longer than uvicorn's 5 s keep-alive, which still closes idle ones first)."""


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections that do not send a request head in time."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT_S, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered: re-armed when its response is sent
        self.logger.debug("closing a connection that sent no request within %g s", REQUEST_HEAD_TIMEOUT_S)
        self.transport.close()
