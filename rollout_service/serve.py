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
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from .cli_env import TIMEOUT_S, bounds_metadata, check_bounds, setting
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
    silent for ``progress_grace_s``). The fields declared with ``setting`` are ``serve``'s flags
    and ``ROLLOUT_*`` variables (see ``rollout_service.cli_env``).
    """

    max_restarts: int = field(
        default=5,
        metadata=setting(
            "--max-restarts",
            "SGLang restarts allowed within --restart-window seconds; once spent, SGLang stays"
            " down and /readyz and /status report `restart_budget_spent` with its last log lines",
            bounds=(0, 1000),
        ),
    )
    restart_window_s: float = field(
        default=600.0,
        metadata=setting(
            "--restart-window",
            "the window, in seconds, over which --max-restarts is counted (as systemd's StartLimitIntervalSec)",
            bounds=(1.0, TIMEOUT_S[1]),
        ),
    )
    backoff_s: float = field(default=2.0, metadata=bounds_metadata(0.0, 3600.0))
    max_backoff_s: float = field(default=60.0, metadata=bounds_metadata(0.0, 3600.0))
    startup_timeout_s: float = field(
        default=600.0,
        metadata=setting(
            "--startup-timeout",
            "seconds to wait for SGLang's /health at each start; the wait goes on while SGLang's"
            " log shows progress (a first download, kernel compilation, CUDA graphs)",
            bounds=(1.0, TIMEOUT_S[1]),
        ),
    )
    progress_grace_s: float = field(default=120.0, metadata=bounds_metadata(1.0, 86400.0))
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    restarts: int = field(default=0, init=False)
    """Restarts over the server's whole life (reported; the budget uses the window)."""
    _recent: collections.deque = field(default_factory=collections.deque, init=False, repr=False)

    def __post_init__(self) -> None:
        check_bounds(self)

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
    """Starts SGLang, watches it and restarts it under one `RestartPolicy`, then stops it.

    Shaped like uvicorn's supervisors: `startup()` starts the server and waits for `/health` with
    the policy's timeouts, `should_restart()` says when the watching thread brings it back,
    `restart()` stops and starts it again through `startup()` (so every start, the first and each
    restart, waits as the policy says: there is one path and no second default), and `shutdown()`
    stops watching and stops the server's whole process group. After each restart it calls
    `on_restart`; once the restart budget is spent it calls `on_give_up(reason, message)` once
    and stops watching, leaving SGLang down.
    """

    def __init__(
        self,
        server: SGLangServer,
        policy: RestartPolicy,
        on_restart: Callable[[], None] = lambda: None,
        on_give_up: Callable[[str, str], None] = lambda reason, message: None,
        check_interval_s: float = 1.0,
    ):
        super().__init__(name="sglang-supervisor", daemon=True)
        self.server = server
        self.policy = policy
        self._on_restart = on_restart
        self._on_give_up = on_give_up
        self._interval = check_interval_s
        self._stopping = threading.Event()

    def startup(self) -> None:
        """Start SGLang and wait until `/health` answers, with the policy's start-up timeouts.

        Raises:
            SGLangStartError: SGLang exited first, or stayed silent past the start-up timeout.
        """
        self.server.start()
        self.server.wait_healthy(
            self.policy.startup_timeout_s, progress_grace_s=self.policy.progress_grace_s, timeout_hint=STARTUP_HINT
        )

    def should_restart(self) -> bool:
        """True when SGLang has exited (overridable, as uvicorn's `should_restart`)."""
        return not self.server.is_running()

    def restart(self) -> None:
        """Stop what is left of SGLang's process group and start it again (`startup`)."""
        self.server.stop()
        self.startup()

    def shutdown(self) -> None:
        """Stop watching and stop SGLang's whole process group."""
        self.stop()
        self.server.stop()

    def stop(self) -> None:
        """Stop watching (SGLang keeps running)."""
        self._stopping.set()

    def run(self) -> None:
        policy = self.policy
        backoff = policy.backoff_s
        while not self._stopping.wait(self._interval):
            if not self.should_restart():
                continue
            if not policy.may_restart():
                message = (
                    f"SGLang exited and {policy.restarts_in_window()} restart(s) already happened"
                    f" within the last {policy.restart_window_s:.0f} s (the budget is"
                    f" {policy.describe()}; --max-restarts, --restart-window); not restarting"
                    f" it. Fix the cause and restart `serve`. SGLang's last log lines"
                    f" (log {self.server.log_path}):\n{self.server.log_tail(40)}"
                )
                log.error("%s", message)
                self._on_give_up(RESTART_BUDGET_SPENT, message)
                return
            in_window = policy.record_restart()
            log.warning(
                "SGLang exited; restart %d of %d in %.0f s (%d within the last %.0f s; %d in all)",
                in_window,
                policy.max_restarts,
                backoff,
                in_window,
                policy.restart_window_s,
                policy.restarts,
            )
            if self._stopping.wait(backoff):
                return
            backoff = min(backoff * 2, policy.max_backoff_s)
            try:
                self.restart()
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

    from .sidecar.app import create_app, uvicorn_config

    exit_code = 0
    controller: Any = None

    def restarted() -> None:
        controller.notify("restart")

    def give_up(reason: str, message: str) -> None:
        nonlocal exit_code
        exit_code = 3
        controller.report_fatal(reason, message)  # /readyz: 503 with `fatal`; /status: `fatal`

    supervisor = Supervisor(server, policy, on_restart=restarted, on_give_up=give_up)
    log.info("starting SGLang on %s (log: %s)", server.url, server.log_path)
    try:
        supervisor.startup()
        app = create_app(settings)
        controller = app.state.controller
        http = uvicorn.Server(uvicorn_config(app, settings))
        supervisor.start()
        log.info("sidecar on http://%s:%d (readiness: /readyz)", settings.host, settings.port)
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers installed that lands here instead of killing us before SGLang is stopped.
        previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            http.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except SGLangStartError as exc:
        log.error("%s", exc)
        exit_code = 2
    finally:
        try:
            supervisor.shutdown()
        finally:
            _remove_stage(controller)
    return exit_code


def _remove_stage(controller: Any) -> None:
    """SGLang is stopped: its staged copies will never be read again (a new ``serve`` starts
    SGLang on the base model and stages the newest checkpoint anew)."""
    from .sidecar.staging import StageError

    stage = getattr(controller, "stage", None)
    if stage is None:
        return
    try:
        freed = stage.remove()
    except (OSError, StageError) as exc:
        log.warning("could not remove the stage directory %s: %s; delete it by hand", stage.path, exc)
        return
    log.info("removed the stage directory %s (%.1f MB)", stage.path, freed / 1e6)


def _note_signal(signum: int, frame: FrameType | None) -> None:
    log.info("received %s; stopping SGLang and the sidecar", signal.Signals(signum).name)
