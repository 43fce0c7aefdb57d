"""``rollout-service serve``: SGLang and its sidecar as one supervised unit.

The counterpart of ``trl vllm-serve``. SGLang runs as a child process group; a
supervisor thread restarts it when it dies (with exponential back-off) and the
sidecar, seeing the server come back with its base weights, re-applies the newest
checkpoint before reporting ready again. Ctrl-C, SIGTERM or SIGHUP (a closed terminal or
SSH session) stops the sidecar and the whole SGLang process group.

Restarts are budgeted as systemd's ``StartLimitBurst``/``StartLimitIntervalSec`` do: at
most ``max_restarts`` within any ``restart_window_s`` seconds, not counting the time the
restarts themselves take (stopping SGLang, loading the model until ``/health`` answers), so a
model that takes minutes to load is judged as one that loads at once; and at most
``max_restarts`` restarts in a row that never get SGLang healthy (it crashes while loading, or
hangs past the start-up timeout and is stopped). A server that crashes now and then over a
long run keeps being restarted; one that crashes again and again (a request that kills it, a
broken GPU) spends the budget, and then ``serve`` stops restarting it and keeps the sidecar
up to say why: ``/readyz`` answers 503 with ``fatal`` (reason ``restart_budget_spent``,
SGLang's last log lines) and ``/status`` shows the same in ``fatal``. SIGTERM then exits
with code 3.

Exit codes: 0 after SIGTERM, SIGINT or SIGHUP (also during SGLang's first start), 2 when a setting
is refused (the CLI's ``error: ...``: among them a sidecar port or SGLang port in use, found when
the settings are checked, before SGLang starts) or SGLang does not start, 3 after the restart
budget was spent, 4 when the sidecar's HTTP server cannot start once SGLang is up (its start-up
failed). The CLI binds the sidecar's port when it checks it and hands the listening sockets to the
HTTP server, so SGLang's start-up cannot take it.
"""

from __future__ import annotations

import collections
import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from .cli_env import TIMEOUT_S, bounds_metadata, check_bounds, setting
from .process_group import trim_log
from .sglang_launcher import SGLangServer, SGLangStartError
from .sidecar.settings import SidecarSettings, warn_unguarded_listeners

log = logging.getLogger(__name__)

RESTART_BUDGET_SPENT = "restart_budget_spent"
SUPERVISOR_FAILED = "supervisor_failed"
"""The watching thread itself failed (a bug, or an error nothing expected): SGLang is no longer
supervised, so the sidecar reports it as after a spent budget (/readyz 503, `fatal`), not
silently on."""
STARTUP_HINT = "raise `serve --startup-timeout` (ROLLOUT_STARTUP_TIMEOUT)"
EXIT_SIDECAR_FAILED = 4
"""``serve``'s exit code when the sidecar's HTTP server cannot start once SGLang is up (uvicorn exits
3 for that, which is ``serve``'s code for a spent restart budget). A port in use is not among the
causes when the CLI runs ``serve``: it binds the port when it checks the settings (exit 2)."""
SHUTDOWN_JOIN_S = 60.0
_LOG_LINES = re.compile(r"[;.]?\s*last log lines:\n", re.IGNORECASE)
"""Where a start error's quote of SGLang's log begins."""


@dataclass
class RestartPolicy:
    """How a crashed SGLang server is brought back.

    At most ``max_restarts`` restarts within any ``restart_window_s`` seconds (systemd's
    StartLimitBurst / StartLimitIntervalSec), the time restarts take not counted (`discount`), and
    at most ``max_restarts`` failed restarts in a row (`record_failure`); back-off doubles from
    ``backoff_s`` up to ``max_backoff_s`` and resets after a successful restart. Each start waits
    ``startup_timeout_s`` for ``/health``, longer while the log shows progress (until it has been
    silent for ``progress_grace_s``), but never more than 3 times ``startup_timeout_s`` in all
    (`process_group.PROGRESS_CAP_FACTOR`: a server that logs forever and never answers is stopped
    too). The fields declared with ``setting`` are ``serve``'s flags and ``ROLLOUT_*`` variables
    (see ``rollout_service.cli_env``).
    """

    max_restarts: int = field(
        default=5,
        metadata=setting(
            "--max-restarts",
            "SGLang restarts allowed within --restart-window seconds (the time restarts spend starting"
            " SGLang not counted), and restarts in a row that never get it healthy; once spent, SGLang"
            " stays down and /readyz and /status report `restart_budget_spent` with its last log lines",
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
            " log shows progress (a first download, kernel compilation, CUDA graphs), up to 3 times"
            " this in all",
            bounds=(1.0, TIMEOUT_S[1]),
        ),
    )
    progress_grace_s: float = field(default=120.0, metadata=bounds_metadata(1.0, 86400.0))
    hang_timeout_s: float = field(
        default=300.0,
        metadata=setting(
            "--hang-timeout",
            "seconds SGLang may go without answering its /health (while no weight load is in flight,"
            " which /health waits on) before it is restarted as hung (a wedged GPU or scheduler),"
            " counted against --max-restarts; 0: only an SGLang that exited is restarted",
            bounds=(0.0, TIMEOUT_S[1]),
        ),
    )
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    restarts: int = field(default=0, init=False)
    """Restarts over the server's whole life (reported; the budget uses the window)."""
    failed_in_a_row: int = field(default=0, init=False)
    """The latest restarts that all failed to get SGLang healthy (0 after one that did)."""
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
        return self.restarts_in_window() < self.max_restarts and self.failed_in_a_row < self.max_restarts

    def record_restart(self) -> int:
        """Count one restart now; returns how many fall in the window, this one included."""
        self.restarts_in_window()
        self._recent.append(self.clock())
        self.restarts += 1
        return len(self._recent)

    def discount(self, seconds: float) -> None:
        """Leave ``seconds`` (the time a restart just spent stopping and starting SGLang) out of
        the window: the restarts counted so far move that much later. Without this a model that
        loads for two minutes and then crashes would never have ``max_restarts`` restarts within
        the window (each one's start-up time slides the window past the earlier ones)."""
        if seconds > 0:
            self._recent = collections.deque(t + seconds for t in self._recent)

    def record_failure(self) -> int:
        """A restart failed to get SGLang healthy; returns how many in a row have."""
        self.failed_in_a_row += 1
        return self.failed_in_a_row

    def record_success(self) -> None:
        """A restart got SGLang healthy."""
        self.failed_in_a_row = 0

    def describe(self) -> str:
        return f"{self.max_restarts} restart(s) within {self.restart_window_s:.0f} s"


class Supervisor(threading.Thread):
    """Starts SGLang, watches it and restarts it under one `RestartPolicy`, then stops it.

    Shaped like uvicorn's supervisors: `startup()` starts the server and waits for `/health` with
    the policy's timeouts, `should_restart()` says when the watching thread brings it back,
    `restart()` stops and starts it again through `startup()` (so every start, the first and each
    restart, waits as the policy says: there is one path and no second default), and `shutdown()`
    stops the server's whole process group and then the watching thread. After each restart it
    calls `on_restart`; a restart that fails (SGLang exits while loading, stays unhealthy past the
    start-up timeout, or cannot be launched at all) stops what it started and counts against the
    budget; once the budget is spent it calls `on_give_up(reason, message)` once and stops
    watching, leaving SGLang down. Should the watching itself fail, it calls `on_give_up` with
    `SUPERVISOR_FAILED` and stops SGLang if it started it.

    A restarted SGLang is launched from the watching thread, and `kill_me_with_parent`'s
    PR_SET_PDEATHSIG is tied to the thread that forks, not the process: SGLang is SIGKILLed when
    that thread ends. So the thread never ends with a server it started still running: it stops
    the server (SIGTERM first) itself, or waits for `shutdown()` to have stopped it. Starts and
    stops hold one lock, so a restart never launches a server after `shutdown()` stopped SGLang.
    """

    def __init__(
        self,
        server: SGLangServer,
        policy: RestartPolicy,
        on_restart: Callable[[], None] = lambda: None,
        on_give_up: Callable[[str, str], None] = lambda reason, message: None,
        check_interval_s: float = 1.0,
        hung: Callable[[float], str | None] = lambda healthy_since: None,
    ):
        super().__init__(name="sglang-supervisor", daemon=True)
        self.server = server
        self.policy = policy
        self._on_restart = on_restart
        self._on_give_up = on_give_up
        self._interval = check_interval_s
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        """Held while SGLang is started or stopped."""
        self._started_here = False
        """Whether this thread launched SGLang (it then dies with the thread)."""
        self._interrupted = False
        """Set by `interrupt()` (a signal handler): no start, and the start under way ends."""
        self._stop_when: Callable[[], bool] = lambda: False
        self._hung = hung
        """Why SGLang is hung though running (None: it is not), given when its latest start got
        healthy (``time.monotonic()``): ``serve`` asks its sidecar how long SGLang has not answered."""
        self.healthy_since = time.monotonic()
        """When SGLang's latest start answered ``/health`` (``time.monotonic()``: a step of the
        wall clock must not make a live SGLang look hung)."""
        self._why = "exited"
        """Why the latest restart was needed (the log line says it)."""
        self._last_failure: str | None = None
        """Why the latest restart failed (None after one that succeeded): the budget's give-up
        message says it, since a restart that failed before SGLang ran (its port taken) left
        nothing in SGLang's log."""

    def startup(self) -> None:
        """Start SGLang and wait until `/health` answers, with the policy's start-up timeouts.

        Raises:
            SGLangStartError: SGLang exited first, or stayed silent past the start-up timeout, or
                the supervisor is stopping (`shutdown()`, `interrupt()`) and SGLang was not started
                or was stopped.
        """
        with self._lock:
            if self._stopping.is_set() or self._interrupted:
                raise SGLangStartError("serve is stopping: SGLang is not started")
            self.server.start()
            if threading.current_thread() is self:
                self._started_here = True
        if self._interrupted:  # a signal came while SGLang was being launched
            raise SGLangStartError("serve is stopping: SGLang was started as the signal came")
        self.server.wait_healthy(
            self.policy.startup_timeout_s, progress_grace_s=self.policy.progress_grace_s, timeout_hint=STARTUP_HINT
        )
        self.healthy_since = time.monotonic()

    def interrupt(self, sig: int = signal.SIGTERM) -> None:
        """End a `startup()` under way in the main thread (called from a signal handler there).

        `SGLangServer.interrupt`: a CUDA probe in flight is killed, SGLang is not launched if it was
        not yet (checked again just before the launch, which the CUDA checks can delay for
        minutes), and a launched SGLang's process group gets `sig`, so its wait for `/health` ends
        as it exits; and `startup()` does not wait for it. Takes no lock (the interrupted thread
        may hold it). `shutdown()` then stops what is left.
        """
        self._interrupted = True
        self.server.interrupt(sig)

    def stop_when(self, asked: Callable[[], bool]) -> None:
        """Stop watching as soon as ``asked()`` is true (``serve``: the sidecar's HTTP server was
        told to exit by a signal). SGLang may have got the same signal (systemd's control-group
        kill, a terminal's Ctrl-C): it must not be restarted, nor the budget spent, meanwhile."""
        self._stop_when = asked

    def _halted(self) -> bool:
        return self._stopping.is_set() or self._stop_when()

    def should_restart(self) -> bool:
        """True when SGLang has exited, or is hung (``hung``: it has not answered for
        ``--hang-timeout``); overridable, as uvicorn's `should_restart`."""
        if not self.server.is_running():
            self._why = "exited"
            return True
        hung = self._hung(self.healthy_since)
        if hung is not None:
            self._why = f"is hung: {hung}"
            log.error("SGLang at %s %s; stopping it to start it again", self.server.url, self._why)
            return True
        return False

    def restart(self) -> None:
        """Stop what is left of SGLang's process group and start it again (`startup`)."""
        self._stop_server()
        self.startup()

    def shutdown(self, join_timeout_s: float = SHUTDOWN_JOIN_S) -> None:
        """Stop SGLang's whole process group (SIGTERM, then SIGKILL after its timeout), then stop
        watching and wait up to `join_timeout_s` for the watching thread to end.

        SGLang is stopped while the watching thread still runs (a server that thread restarted
        would be SIGKILLed the moment it ended), and under the start/stop lock, so a restart under
        way either finishes starting first (and that server is stopped) or does not start at all.
        """
        with self._lock:
            self._stopping.set()
            self.server.stop()
            self._started_here = False
        if self.is_alive() and threading.current_thread() is not self:
            self.join(join_timeout_s)
            if self.is_alive():
                log.warning("the SGLang supervisor thread did not end within %.0f s", join_timeout_s)

    def stop(self) -> None:
        """Stop watching. SGLang started by `startup()` from another thread keeps running; one this
        thread restarted is stopped by it (SIGTERM first) as it ends, since it could not outlive
        the thread (PR_SET_PDEATHSIG). `shutdown()` stops SGLang in either case."""
        self._stopping.set()

    def _stop_server(self) -> None:
        with self._lock:
            self.server.stop()
            self._started_here = False

    def run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # never a silent end: SGLang would run on unwatched
            log.exception("the SGLang supervisor failed")
            if not self._stopping.is_set():
                self._on_give_up(
                    SUPERVISOR_FAILED,
                    f"the thread watching SGLang failed ({type(exc).__name__}: {exc}); SGLang is no longer"
                    " restarted if it exits, so this replica reports itself not ready: restart `serve`, and"
                    " report the traceback above if it happens again",
                )
        finally:
            # Waits for a shutdown() under way (it holds the lock) to have stopped SGLang.
            with self._lock:
                if self._started_here:
                    self._stop_server()

    def _watch(self) -> None:
        policy = self.policy
        backoff = policy.backoff_s
        while not self._stopping.wait(self._interval):
            trim_log(self.server.log_path)  # a long-lived SGLang's log is bounded too, not only at a start
            if not self.should_restart():
                continue
            if self._halted():
                return
            if not policy.may_restart():
                if self.server.is_running():  # hung, not exited: it is left down, whoever started it
                    self._stop_server()
                self._give_up()
                return
            in_window = policy.record_restart()
            log.warning(
                "SGLang %s; restart %d of %d in %.0f s (%d within the last %.0f s; %d in all)",
                self._why,
                in_window,
                policy.max_restarts,
                backoff,
                in_window,
                policy.restart_window_s,
                policy.restarts,
            )
            if self._stopping.wait(backoff) or self._halted():
                return
            backoff = min(backoff * 2, policy.max_backoff_s)
            began = policy.clock()
            try:
                self.restart()
            except Exception as exc:  # SGLangStartError, and fork's EAGAIN/ENOMEM, an unwritable log
                if self._stopping.is_set():
                    return
                failed = policy.record_failure()
                if isinstance(exc, SGLangStartError):
                    self._last_failure = _LOG_LINES.split(str(exc), maxsplit=1)[0]  # the tail is quoted below
                    log.error("SGLang restart failed (%d in a row): %s", failed, exc)
                else:
                    self._last_failure = f"{type(exc).__name__}: {exc}"
                    log.exception("SGLang restart failed (%d in a row)", failed)
                try:  # one that hangs past the start-up timeout still runs: stop it, so it counts
                    self._stop_server()
                except Exception:
                    log.exception("could not stop SGLang after the failed restart")
                continue
            finally:
                policy.discount(policy.clock() - began)
            policy.record_success()
            self._last_failure = None
            backoff = policy.backoff_s
            log.info("SGLang is back at %s; the sidecar re-applies the newest checkpoint", self.server.url)
            try:
                self._on_restart()
            except Exception:
                log.exception("the restart notification failed")

    def _give_up(self) -> None:
        policy = self.policy
        if policy.max_restarts and policy.failed_in_a_row >= policy.max_restarts:
            why = (
                f"SGLang {self._why} and the last {policy.failed_in_a_row} restart(s) in a row failed (it"
                f" never became healthy again; the budget is {policy.describe()}, and as many failed"
                " restarts in a row; --max-restarts, --restart-window)"
            )
        else:
            why = (
                f"SGLang {self._why} and {policy.restarts_in_window()} restart(s) already happened"
                f" within the last {policy.restart_window_s:.0f} s, not counting the time the restarts"
                f" took (the budget is {policy.describe()}; --max-restarts, --restart-window)"
            )
        last = f" The last restart failed: {self._last_failure}." if self._last_failure else ""
        message = (
            f"{why}; not restarting it.{last} Fix the cause and restart `serve`. SGLang's last log lines"
            f" (log {self.server.log_path}):\n{self.server.log_tail(40)}"
        )
        log.error("%s", message)
        self._on_give_up(RESTART_BUDGET_SPENT, message)


def run_serve(
    server: SGLangServer,
    settings: SidecarSettings,
    policy: RestartPolicy,
    listeners: list[socket.socket] | None = None,
) -> int:
    """Start SGLang, then the sidecar in the foreground; return the exit code.

    ``listeners``: the sidecar's listening sockets, bound before SGLang starts (see
    `http_urls.listening_sockets`); they are closed on return. Without them the HTTP server binds
    ``settings.host:port`` once SGLang is up.

    0 after a signal (SIGTERM, SIGINT or SIGHUP, also during SGLang's first start), 2 when SGLang
    does not start, 3 when stopped after the restart budget was spent, the supervisor failed, or
    the sidecar reported another error it cannot recover from (``stage_failed``, ...; the sidecar
    stays up until then, reporting why), 4 when the sidecar's HTTP server cannot start
    (`EXIT_SIDECAR_FAILED`: its start-up failed; or, without ``listeners``, its port cannot be bound).
    SIGTERM, SIGINT and SIGHUP are handled from before SGLang's first start until SGLang is stopped.
    """
    from .sidecar.app import create_app, http_server, listen_url

    exit_code = 0
    controller: Any = None

    def restarted() -> None:
        controller.notify("restart")

    def give_up(reason: str, message: str) -> None:
        nonlocal exit_code
        exit_code = 3
        controller.report_fatal(reason, message)  # /readyz: 503 with `fatal`; /status: `fatal`

    def hung(healthy_since: float) -> str | None:
        state = None if controller is None else controller.state
        return None if state is None else hang_reason(state, healthy_since, policy.hang_timeout_s, time.monotonic())

    supervisor = Supervisor(server, policy, on_restart=restarted, on_give_up=give_up, hung=hung)
    signals = _Signals(supervisor)
    signals.install()
    warn_unguarded_listeners(settings, sglang_host=server.config.host)
    try:
        log.info("starting SGLang on %s (log: %s)", server.url, server.log_path)
        try:
            supervisor.startup()
            app = create_app(settings)
            controller = app.state.controller
            http = http_server(app, settings)
            if signals.serve_with(http):
                supervisor.stop_when(lambda: bool(http.should_exit))
                supervisor.start()
                log.info("sidecar on %s (readiness: /readyz)", listen_url(settings))
                # uvicorn re-raises the signal that stopped it once it has shut down; with our
                # handlers installed that lands here instead of killing us before SGLang is stopped.
                try:
                    http.run(sockets=listeners)
                except SystemExit as exc:  # uvicorn's sys.exit(3): port not bound, lifespan failed
                    log.error(
                        "the sidecar's HTTP server could not start on %s:%d (uvicorn exit code %s: the"
                        " port is in use or not bindable, or the app's start-up failed; see above);"
                        " stopping SGLang",
                        settings.host,
                        settings.port,
                        exc.code,
                    )
                    exit_code = EXIT_SIDECAR_FAILED
        except SGLangStartError as exc:
            if signals.received:
                log.info("stopped during SGLang's start-up by %s", signals.name())
            else:
                log.error("%s", exc)
                exit_code = 2
        finally:
            signals.stopping()
            try:
                supervisor.shutdown()
            finally:
                _remove_stage(controller)
        fatal = None if controller is None else controller.state.fatal
        if exit_code == 0 and fatal is not None:  # the sidecar could not go on (stage_failed, ...)
            log.error("stopped with the replica unable to recover (%s): %s", fatal["reason"], fatal["message"])
            exit_code = 3
    finally:
        signals.restore()
        for sock in listeners or ():
            sock.close()
    return exit_code


def hang_reason(state: Any, healthy_since: float, limit_s: float, now: float) -> str | None:
    """Why SGLang counts as hung, or None: it has answered neither the sidecar's checks
    (``state``: the sidecar's ``SidecarState``, its ``sglang_seen_mono``) nor, when it was just
    started, its start-up wait (``healthy_since``) for ``limit_s`` (``--hang-timeout``; 0: never),
    while no weight load is in flight (``sglang_loading_step``: SGLang's ``/health`` waits on it).
    Times are ``time.monotonic()``'s (``now`` too)."""
    if not limit_s or state.sglang_loading_step is not None:
        return None
    silent = now - max(state.sglang_seen_mono or 0.0, healthy_since)
    if silent <= limit_s:
        return None
    return f"it has not answered the sidecar's health checks for {silent:.0f} s (--hang-timeout {limit_s:g} s)"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that stop ``serve`` cleanly (SGLang stopped first): SIGHUP too, which a closed
terminal or SSH session sends, and whose default action would end ``serve`` at once, SGLang
SIGKILLed behind it by its parent-death signal and nothing cleaned up."""


class _Signals:
    """``serve``'s `STOP_SIGNALS` handlers, from before SGLang's first start until it is stopped.

    While SGLang first starts (`Supervisor.startup()` in the main thread) a signal interrupts the
    start: SGLang's group gets SIGTERM (SIGKILL for a second signal), so the wait for ``/health``
    ends and ``serve`` stops cleanly. Once the sidecar's HTTP server exists a signal stops it
    (uvicorn's own handlers take over SIGTERM and SIGINT while it runs, and re-raise the signal
    here afterwards; SIGHUP, which uvicorn leaves alone, comes here and stops it the same way).
    While stopping, further signals are only logged: a second SIGTERM must not kill ``serve``
    between SIGTERM and SIGKILL of SGLang. The handlers do no more than set flags and send
    signals (they may run while the main thread holds any lock). Only the main thread can set
    them; elsewhere (an embedder's thread) this does nothing.
    """

    def __init__(self, supervisor: Supervisor) -> None:
        self.received: list[int] = []
        self._supervisor = supervisor
        self._http: Any = None
        self._stopping = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def name(self) -> str:
        return signal.Signals(self.received[0]).name if self.received else "no signal"

    def serve_with(self, http: Any) -> bool:
        """From now on a signal stops `http`; False when one already came (do not start it)."""
        self._http = http
        return not self.received

    def stopping(self) -> None:
        self._stopping = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if self._stopping:
            log.info("received %s; already stopping SGLang and the sidecar", name)
        elif self._http is not None:
            self._http.should_exit = True
            log.info("received %s; stopping SGLang and the sidecar", name)
        else:
            again = len(self.received) > 1
            log.info("received %s during SGLang's start-up; stopping it%s", name, " (SIGKILL)" if again else "")
            self._supervisor.interrupt(signal.SIGKILL if again else signal.SIGTERM)


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
