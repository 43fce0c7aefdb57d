"""`serve`'s supervisor spends its restart budget on every kind of failed restart, and shutdown
never races a restart.

A restart that never gets SGLang healthy counts: one that crashes while loading (however long the
load takes), one that hangs past the start-up timeout (it is stopped, and counted), one that
cannot even be launched (fork refused, the log unwritable). A server that crashes right after each
of its long loads spends the window's budget too (the time restarts take is not counted). And a
`shutdown()` that lands while the watching thread is restarting SGLang leaves no server behind.

These drive `Supervisor` with stand-in server objects and a fake clock (what is tested is the
policy and the thread's bookkeeping; no process is started), as tests/test_serve_supervisor.py
does. The same failures with processes: tests/test_serve_supervision_processes.py.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path

from rollout_service.serve import RESTART_BUDGET_SPENT, SUPERVISOR_FAILED, RestartPolicy, Supervisor
from rollout_service.sglang_launcher import SGLangStartError


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StandInServer:
    """A server object whose restarts behave as the test says: `load_s` of (fake) loading, then
    healthy, or `outcome` "crash" (exits while loading), "hang" (keeps running, never healthy) or
    "unlaunchable" (start() raises as a refused fork does)."""

    url = "http://127.0.0.1:1"
    log_path = Path("/nonexistent/sglang.log")

    def __init__(self, clock: FakeClock, load_s: float = 0.0, outcome: str = "healthy") -> None:
        self.clock = clock
        self.load_s = load_s
        self.outcome = outcome
        self.running = True  # the first start (the supervisor's caller did it)
        self.calls: list[str] = []

    def is_running(self) -> bool:
        return self.running

    def start(self) -> None:
        self.calls.append("start")
        if self.outcome == "unlaunchable":
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        self.running = True

    def wait_healthy(self, timeout_s: float = 300.0, **kwargs) -> None:
        self.clock.now += self.load_s
        if self.outcome == "crash":
            self.running = False
            raise SGLangStartError("SGLang server exited with code 1 before /health answered")
        if self.outcome == "hang":
            raise SGLangStartError("/health did not answer within 1 s (process still running)")

    def stop(self, *a, **k) -> None:
        self.calls.append("stop")
        self.running = False

    def log_tail(self, n: int = 40) -> str:
        return "RuntimeError: the last words of SGLang"


def _supervise(server: StandInServer, policy: RestartPolicy, *, crash_after_restart=None, max_starts: int = 30):
    """Crash the server once, then let the supervisor go on until it gives up or has started the
    server `max_starts` times; `crash_after_restart(server)` runs after each successful restart."""
    restarts: list[int] = []
    gave_up: list[tuple[str, str]] = []

    def restarted() -> None:
        restarts.append(1)
        if crash_after_restart is not None:
            crash_after_restart(server)

    supervisor = Supervisor(
        server,
        policy,
        on_restart=restarted,
        on_give_up=lambda reason, message: gave_up.append((reason, message)),
        check_interval_s=0.005,
    )
    server.running = False
    supervisor.start()
    deadline = time.monotonic() + 30
    try:
        while (
            supervisor.is_alive()
            and not gave_up
            and server.calls.count("start") < max_starts
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
    finally:
        supervisor.stop()
        supervisor.join(5)
    return supervisor, restarts, gave_up


def test_restarts_that_crash_while_a_long_load_runs_spend_the_budget():
    """A big model that crashes 150 s into every load: before, each load slid the 600 s window
    past the earlier restarts, and SGLang was restarted forever."""
    clock = FakeClock()
    server = StandInServer(clock, load_s=150.0, outcome="crash")
    policy = RestartPolicy(max_restarts=5, restart_window_s=600.0, backoff_s=0.0, clock=clock)
    _, restarts, gave_up = _supervise(server, policy)
    assert not restarts
    assert server.calls.count("start") == 5, server.calls
    [(reason, message)] = gave_up
    assert reason == RESTART_BUDGET_SPENT
    assert "the last 5 restart(s) in a row failed" in message and "--max-restarts" in message
    assert "the last words of SGLang" in message


def test_a_server_that_crashes_right_after_each_long_load_spends_the_budget():
    """Each restart gets healthy after 150 s of loading, and dies at once (a request that kills it,
    replayed by the trainer): the loads are not counted in the window, so 5 restarts fit in it."""
    clock = FakeClock()
    server = StandInServer(clock, load_s=150.0)
    policy = RestartPolicy(max_restarts=5, restart_window_s=600.0, backoff_s=0.0, clock=clock)

    def crash(s: StandInServer) -> None:
        s.running = False

    _, restarts, gave_up = _supervise(server, policy, crash_after_restart=crash)
    assert len(restarts) == 5
    [(reason, message)] = gave_up
    assert reason == RESTART_BUDGET_SPENT
    assert "5 restart(s) already happened within the last 600 s" in message


def test_a_server_that_serves_for_long_between_crashes_keeps_being_restarted():
    """The other side of the window: 150 s loads and 700 s of serving between crashes."""
    clock = FakeClock()
    server = StandInServer(clock, load_s=150.0)
    policy = RestartPolicy(max_restarts=2, restart_window_s=600.0, backoff_s=0.0, clock=clock)

    def serve_then_crash(s: StandInServer) -> None:
        clock.now += 700
        s.running = False

    _, restarts, gave_up = _supervise(server, policy, crash_after_restart=serve_then_crash, max_starts=12)
    assert not gave_up and len(restarts) >= 11


def test_a_restart_that_hangs_past_the_startup_timeout_is_stopped_and_counted():
    """The restarted process runs but never answers /health: before, it was left running (hung)
    forever, with no restart, no give-up and nothing reported."""
    clock = FakeClock()
    server = StandInServer(clock, outcome="hang")
    policy = RestartPolicy(max_restarts=3, backoff_s=0.0, clock=clock)
    _, restarts, gave_up = _supervise(server, policy)
    assert not restarts and not server.running
    assert server.calls.count("start") == 3
    # each hung start is stopped before the next one
    assert server.calls[-2:] == ["start", "stop"] or server.calls[-3:-1] == ["start", "stop"], server.calls
    [(reason, message)] = gave_up
    assert reason == RESTART_BUDGET_SPENT and "in a row failed" in message


def test_a_restart_that_cannot_launch_is_logged_and_counted_not_a_silent_end(caplog):
    """fork refused (EAGAIN under a pids limit, ENOMEM): before, the exception ended the watching
    thread silently, and SGLang stayed down with /readyz saying nothing of it."""
    caplog.set_level(logging.ERROR, logger="rollout_service.serve")
    clock = FakeClock()
    server = StandInServer(clock, outcome="unlaunchable")
    policy = RestartPolicy(max_restarts=2, backoff_s=0.0, clock=clock)
    supervisor, restarts, gave_up = _supervise(server, policy)
    assert not restarts and server.calls.count("start") == 2
    [(reason, message)] = gave_up
    assert reason == RESTART_BUDGET_SPENT and "the last 2 restart(s) in a row failed" in message
    assert "SGLang restart failed (1 in a row)" in caplog.text
    assert "Resource temporarily unavailable" in caplog.text  # the traceback is logged


def test_a_launch_failure_then_a_good_restart_goes_on_supervising():
    clock = FakeClock()
    server = StandInServer(clock, outcome="unlaunchable")
    policy = RestartPolicy(max_restarts=3, backoff_s=0.0, clock=clock)

    real_start = server.start

    def start_once_failing() -> None:
        try:
            real_start()
        finally:
            server.outcome = "healthy"

    server.start = start_once_failing  # type: ignore[method-assign]
    restarts: list[int] = []
    supervisor = Supervisor(server, policy, on_restart=lambda: restarts.append(1), check_interval_s=0.005)
    server.running = False
    supervisor.start()
    deadline = time.monotonic() + 10
    while not restarts and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        assert restarts == [1] and server.running and supervisor.is_alive()
        assert policy.failed_in_a_row == 0
    finally:
        supervisor.shutdown(5)


class SlowStopServer(StandInServer):
    """The supervisor thread's stop() (the first half of a restart) takes until the test says."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.in_restart = threading.Event()
        self.release = threading.Event()

    def stop(self, *a, **k) -> None:
        if threading.current_thread().name == "sglang-supervisor" and not self.release.is_set():
            self.in_restart.set()
            self.release.wait(10)
        super().stop()


def test_shutdown_during_a_restart_leaves_no_server_started_after_it():
    """`shutdown()` lands between the restart's stop and its start: before, the thread went on to
    start a new SGLang after shutdown had stopped the old one (and was not joined)."""
    clock = FakeClock()
    server = SlowStopServer(clock)
    policy = RestartPolicy(max_restarts=3, backoff_s=0.0, clock=clock)
    supervisor = Supervisor(server, policy, check_interval_s=0.005)
    server.running = False
    supervisor.start()
    assert server.in_restart.wait(10)
    shutting = threading.Thread(target=supervisor.shutdown)
    shutting.start()
    time.sleep(0.3)
    server.release.set()
    shutting.join(15)
    assert not shutting.is_alive()
    assert not supervisor.is_alive(), "shutdown() returns once the watching thread has ended"
    time.sleep(0.2)
    assert not server.running, f"a server was started after shutdown: {server.calls}"
    assert server.calls[-1] == "stop", server.calls


def test_sglang_exiting_while_serve_stops_is_neither_restarted_nor_counted():
    """systemd's control-group kill (or Ctrl-C in a terminal) signals SGLang together with
    ``serve``: while the sidecar's HTTP server is told to exit, SGLang exiting is expected, not a
    crash to restart (nor, with the budget spent, a give-up and exit code 3)."""
    clock = FakeClock()
    server = StandInServer(clock)
    policy = RestartPolicy(max_restarts=5, restart_window_s=600.0, backoff_s=0.0, clock=clock)
    exiting = threading.Event()
    gave_up: list[tuple[str, str]] = []
    supervisor = Supervisor(
        server, policy, on_give_up=lambda reason, message: gave_up.append((reason, message)), check_interval_s=0.005
    )
    supervisor.stop_when(exiting.is_set)
    supervisor.start()
    exiting.set()  # the signal reached serve's HTTP server ...
    server.running = False  # ... and SGLang
    supervisor.join(5)
    assert not supervisor.is_alive()
    assert server.calls.count("start") == 0 and policy.restarts == 0 and not gave_up


class BreakingServer(StandInServer):
    """Healthy after its first restart; then asking whether it runs raises (a bug, an error
    nothing expected) on the watching thread."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.break_after_starts = 1

    def is_running(self) -> bool:
        if self.calls.count("start") >= self.break_after_starts:
            raise OSError(errno.EIO, "Input/output error")
        return super().is_running()


def test_a_failing_watch_is_reported_and_stops_what_it_started():
    """Before, an error outside a restart ended the watching thread silently: SGLang ran on
    unsupervised (never restarted again) while /readyz said ready."""
    clock = FakeClock()
    server = BreakingServer(clock)
    policy = RestartPolicy(max_restarts=5, restart_window_s=600.0, backoff_s=0.0, clock=clock)
    supervisor, restarts, gave_up = _supervise(server, policy)
    assert restarts == [1]  # the one restart happened before the watch broke
    [(reason, message)] = gave_up
    assert reason == SUPERVISOR_FAILED
    assert "OSError" in message and "Input/output error" in message and "restart `serve`" in message
    assert not supervisor.is_alive()
    assert server.calls[-1] == "stop", server.calls  # the server this thread started did not outlive it
