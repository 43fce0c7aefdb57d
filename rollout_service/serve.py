"""``rollout-service serve``: SGLang and its sidecar as one supervised unit.

The counterpart of ``trl vllm-serve``. SGLang runs as a child process group; a
supervisor thread restarts it when it dies (with exponential back-off) and the
sidecar, seeing the server come back with its base weights, re-applies the newest
checkpoint before reporting ready again. Ctrl-C or SIGTERM stops the sidecar and
the whole SGLang process group.

Restarts are budgeted as systemd's ``StartLimitBurst``/``StartLimitIntervalSec`` do: at
most ``max_restarts`` within any ``restart_window_s`` seconds. A server that crashes now
and then over a long run keeps being restarted; one that crashes again and again (a
request that kills it, a broken GPU) spends the budget, and then ``serve`` stops
restarting it and keeps the sidecar up to say why: ``/readyz`` answers 503 with
``fatal`` (reason ``restart_budget_spent``, SGLang's last log lines) and ``/status``
shows the same in ``fatal``. SIGTERM then exits with code 3.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .sglang_launcher import SGLangServer, SGLangStartError
from .sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)

RESTART_BUDGET_SPENT = "restart_budget_spent"
STARTUP_HINT = "raise `serve --startup-timeout` (ROLLOUT_STARTUP_TIMEOUT)"


@dataclass
class RestartPolicy:
    """How a crashed SGLang server is brought back.

    At most ``max_restarts`` restarts within any ``restart_window_s`` seconds (systemd's
    StartLimitBurst / StartLimitIntervalSec); back-off doubles from ``backoff_s`` up to
    ``max_backoff_s`` and resets after a successful restart. Each start waits
    ``startup_timeout_s`` for ``/health``, longer while the log shows progress (until it has been
    silent for ``progress_grace_s``).
    """

    max_restarts: int = 5
    restart_window_s: float = 600.0
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0
    startup_timeout_s: float = 600.0
    progress_grace_s: float = 120.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    restarts: int = field(default=0, init=False)
    """Restarts over the server's whole life (reported; the budget uses the window)."""
    _recent: collections.deque = field(default_factory=collections.deque, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.restart_window_s <= 0:
            raise ValueError(f"--restart-window must be a positive number of seconds, got"
                             f" {self.restart_window_s}")

    def restarts_in_window(self) -> int:
        """Restarts within the last ``restart_window_s`` seconds."""
        now = self.clock()
        while self._recent and now - self._recent[0] >= self.restart_window_s:
            self._recent.popleft()
        return len(self._recent)

    def may_restart(self) -> bool:
        return self.restarts_in_window() < self.max_restarts

    def record_restart(self) -> int:
        """Count one restart now; returns how many fall in the window, this one included."""
        self.restarts_in_window()
        self._recent.append(self.clock())
        self.restarts += 1
        return len(self._recent)

    def describe(self) -> str:
        return f"{self.max_restarts} restart(s) within {self.restart_window_s:.0f} s"


class Supervisor(threading.Thread):
    """Watches the SGLang process and restarts it; calls ``on_restart`` after each restart.

    When the restart budget is spent it calls ``on_give_up(reason, message)`` once and stops.
    """

    def __init__(self, server: SGLangServer, policy: RestartPolicy,
                 on_restart: Callable[[], None], on_give_up: Callable[[str, str], None],
                 check_interval_s: float = 1.0):
        super().__init__(name="sglang-supervisor", daemon=True)
        self.server = server
        self.policy = policy
        self._on_restart = on_restart
        self._on_give_up = on_give_up
        self._interval = check_interval_s
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        policy = self.policy
        backoff = policy.backoff_s
        while not self._stopping.wait(self._interval):
            if self.server.is_running():
                continue
            if not policy.may_restart():
                message = (f"SGLang exited and {policy.restarts_in_window()} restart(s) already happened"
                           f" within the last {policy.restart_window_s:.0f} s (the budget is"
                           f" {policy.describe()}; --max-restarts, --restart-window); not restarting"
                           f" it. Fix the cause and restart `serve`. SGLang's last log lines"
                           f" (log {self.server.log_path}):\n{self.server.log_tail(40)}")
                log.error("%s", message)
                self._on_give_up(RESTART_BUDGET_SPENT, message)
                return
            in_window = policy.record_restart()
            log.warning("SGLang exited; restart %d of %d in %.0f s (%d within the last %.0f s; %d in"
                        " all)", in_window, policy.max_restarts, backoff, in_window,
                        policy.restart_window_s, policy.restarts)
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, policy.max_backoff_s)
            try:
                # The policy's timeouts, not restart()'s own default (#10).
                self.server.stop()
                self.server.start()
                self.server.wait_healthy(policy.startup_timeout_s, progress_grace_s=policy.progress_grace_s,
                                         timeout_hint=STARTUP_HINT)
            except SGLangStartError as exc:
                log.error("SGLang restart failed: %s", exc)
                continue
            backoff = policy.backoff_s
            log.info("SGLang is back at %s; the sidecar re-applies the newest checkpoint", self.server.url)
            self._on_restart()


def run_serve(server: SGLangServer, settings: SidecarSettings, policy: RestartPolicy) -> int:
    """Start SGLang, then the sidecar in the foreground; return the exit code.

    0 after a signal, 2 when SGLang does not start, 3 when stopped after the restart budget was
    spent (the sidecar stays up until then, reporting why).
    """
    import uvicorn

    from .sidecar.app import create_app

    exit_code = 0
    log.info("starting SGLang on %s (log: %s)", server.url, server.log_path)
    try:
        server.start()
        server.wait_healthy(policy.startup_timeout_s, progress_grace_s=policy.progress_grace_s,
                            timeout_hint=STARTUP_HINT)
        app = create_app(settings)
        controller = app.state.controller
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info")
        http = uvicorn.Server(config)

        def give_up(reason: str, message: str) -> None:
            nonlocal exit_code
            exit_code = 3
            controller.report_fatal(reason, message)  # /readyz: 503 with `fatal`; /status: `fatal`

        supervisor = Supervisor(server, policy, on_restart=lambda: controller.notify("restart"),
                                on_give_up=give_up)
        supervisor.start()
        log.info("sidecar on http://%s:%d (readiness: /readyz)", settings.host, settings.port)
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers installed that lands here instead of killing us before SGLang is stopped.
        previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            http.run()
        finally:
            supervisor.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except SGLangStartError as exc:
        log.error("%s", exc)
        exit_code = 2
    finally:
        server.stop()
    return exit_code


def _note_signal(signum, frame) -> None:
    log.info("received %s; stopping SGLang and the sidecar", signal.Signals(signum).name)
