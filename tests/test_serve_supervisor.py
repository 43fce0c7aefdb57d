"""`serve`'s supervisor: a windowed restart budget, the policy's timeouts on every restart, start-up
waits that follow visible progress, and a spent budget reported by the sidecar.

The unit tests drive the supervisor with a stand-in server object (what is tested is the policy,
not SGLang); the start-up tests run a stand-in server *process* that prints progress like a first
SGLang start (download, kernel compilation) and then answers /health; the last test kills a real
SGLang under `rollout-service serve`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from helpers import free_port
from rollout_service.serve import RESTART_BUDGET_SPENT, STARTUP_HINT, RestartPolicy, Supervisor
from rollout_service.sglang_launcher import SGLangServer, SGLangStartError
from sidecar_helpers import CLIProcess, serve_argv, wait_http


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_restart_budget_counts_restarts_within_the_window_only():
    clock = FakeClock()
    policy = RestartPolicy(max_restarts=3, restart_window_s=600.0, clock=clock)
    for _ in range(3):
        assert policy.may_restart()
        policy.record_restart()
        clock.now += 100
    assert not policy.may_restart() and policy.restarts_in_window() == 3
    clock.now += 301  # the first restart (at t=1000) is now more than 600 s ago
    assert policy.restarts_in_window() == 2 and policy.may_restart()
    # A server that crashes once an hour over a long run is never given up on.
    slow = RestartPolicy(max_restarts=2, restart_window_s=600.0, clock=clock)
    for _ in range(50):
        assert slow.may_restart()
        slow.record_restart()
        clock.now += 3600
    assert slow.restarts == 50


def test_restart_policy_rejects_nonsense():
    with pytest.raises(ValueError, match="--restart-window"):
        RestartPolicy(restart_window_s=0)
    with pytest.raises(ValueError, match="--max-restarts"):
        RestartPolicy(max_restarts=-1)


class StandInServer:
    """Records what the supervisor asks of a server; "dies" whenever the test says so."""

    url = "http://127.0.0.1:1"
    log_path = Path("/nonexistent/sglang.log")

    def __init__(self) -> None:
        self.running = True
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def is_running(self) -> bool:
        return self.running

    def stop(self, *a, **k) -> None:
        self.calls.append(("stop",))

    def start(self) -> None:
        self.calls.append(("start",))
        self.running = True

    def wait_healthy(self, timeout_s: float = 300.0, **kwargs) -> None:
        self.calls.append(("wait_healthy", timeout_s, kwargs))

    def restart(self, timeout_s: float = 300.0, **kwargs) -> None:  # what the old supervisor called
        self.stop()
        self.start()
        self.wait_healthy(timeout_s, **kwargs)

    def log_tail(self, n: int = 40) -> str:
        return "RuntimeError: the last words of SGLang"


def _supervisor(server, policy, restarts: list, gave_up: list, **kwargs) -> Supervisor:
    """A supervisor of ``server`` checking every 10 ms, recording its restarts and give-ups."""
    return Supervisor(
        server,
        policy,
        on_restart=lambda: restarts.append(1),
        on_give_up=lambda reason, message: gave_up.append((reason, message)),
        check_interval_s=0.01,
        **kwargs,
    )


def _run_supervisor(server, policy, crashes: int, timeout_s: float = 20.0):
    restarts, gave_up = [], []
    supervisor = _supervisor(server, policy, restarts, gave_up)
    supervisor.start()
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(crashes):
            server.running = False
            while not server.running and not gave_up and time.monotonic() < deadline:
                time.sleep(0.01)
        while supervisor.is_alive() and not gave_up and time.monotonic() < deadline and crashes > len(restarts):
            time.sleep(0.01)
    finally:
        supervisor.stop()
        supervisor.join(5)
    return restarts, gave_up


def test_a_restart_waits_with_the_policys_startup_timeout_not_a_default():
    server = StandInServer()
    policy = RestartPolicy(max_restarts=2, backoff_s=0.0, startup_timeout_s=1234.0, progress_grace_s=77.0)
    restarts, gave_up = _run_supervisor(server, policy, crashes=1)
    assert restarts == [1] and not gave_up
    waits = [c for c in server.calls if c[0] == "wait_healthy"]
    assert waits == [("wait_healthy", 1234.0, {"progress_grace_s": 77.0, "timeout_hint": STARTUP_HINT})]


def test_a_spent_budget_gives_up_once_with_the_reason_and_sglangs_last_words():
    server = StandInServer()
    policy = RestartPolicy(max_restarts=2, restart_window_s=600.0, backoff_s=0.0)
    restarts, gave_up = _run_supervisor(server, policy, crashes=3)
    assert len(restarts) == 2
    [(reason, message)] = gave_up
    assert reason == RESTART_BUDGET_SPENT
    assert "2 restart(s) already happened within the last 600 s" in message
    assert "--max-restarts" in message and "the last words of SGLang" in message


# --------------------------------------------------- start-up that shows progress (item 10)

STAND_IN_SGLANG = r'''#!__PYTHON__
"""Stands in for `python -m sglang.launch_server`: prints progress for a while, then serves /health."""
import http.server, os, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode, seconds = os.environ["STAND_IN_MODE"], float(os.environ["STAND_IN_SECONDS"])
t0 = time.time()
while time.time() - t0 < seconds:
    if mode == "progress":
        print(f"Downloading model.safetensors: {100 * (time.time() - t0) / seconds:.0f}%", flush=True)
    time.sleep(0.2)
if mode == "silent":
    time.sleep(3600)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "stand-in-python"
    script.write_text(STAND_IN_SGLANG.replace("__PYTHON__", sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_startup_waits_past_the_timeout_while_the_log_shows_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "progress")
    monkeypatch.setenv("STAND_IN_SECONDS", "4")
    server = SGLangServer(tmp_path, device="cpu", python=str(_stand_in(tmp_path)), log_path=tmp_path / "s.log")
    server.start()
    try:
        t0 = time.monotonic()
        # 2.5 s: the wait past the timeout is capped at 3 times it (7.5 s), past the 4 s of progress
        server.wait_healthy(2.5, progress_grace_s=2.0, timeout_hint=STARTUP_HINT)
        assert time.monotonic() - t0 >= 3.5  # it waited well past the 2.5 s timeout
    finally:
        server.stop()


def test_a_silent_startup_fails_after_the_timeout_naming_the_flag_to_raise(tmp_path, monkeypatch):
    monkeypatch.setenv("STAND_IN_MODE", "silent")
    monkeypatch.setenv("STAND_IN_SECONDS", "0")
    server = SGLangServer(tmp_path, device="cpu", python=str(_stand_in(tmp_path)), log_path=tmp_path / "s.log")
    server.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(SGLangStartError) as exc:
            server.wait_healthy(1.0, progress_grace_s=1.0, timeout_hint=STARTUP_HINT)
        assert time.monotonic() - t0 < 10
    finally:
        server.stop()
    assert "serve --startup-timeout" in str(exc.value) and "ROLLOUT_STARTUP_TIMEOUT" in str(exc.value)
    assert "showed no progress" in str(exc.value)


def test_serve_fails_a_stalled_start_with_exit_2_naming_startup_timeout(tmp_path, checkpoint_root, monkeypatch, caplog):
    from rollout_service.serve import run_serve
    from rollout_service.sidecar.settings import SidecarSettings

    monkeypatch.setenv("STAND_IN_MODE", "silent")
    monkeypatch.setenv("STAND_IN_SECONDS", "0")
    server = SGLangServer(tmp_path, device="cpu", python=str(_stand_in(tmp_path)), log_path=tmp_path / "s.log")
    settings = SidecarSettings(
        checkpoint_path=checkpoint_root, sglang_url=server.url, port=free_port(), replica_id="stalled", stage=False
    )
    policy = RestartPolicy(startup_timeout_s=1.0, progress_grace_s=1.0)
    assert run_serve(server, settings, policy) == 2
    assert "raise `serve --startup-timeout` (ROLLOUT_STARTUP_TIMEOUT)" in caplog.text
    assert not server.is_running()


# ------------------------------------------------------ a spent budget, with a real SGLang


@pytest.mark.sglang
def test_serve_reports_a_spent_restart_budget_on_readyz_and_status(tiny_model_dir, checkpoint_root, tmp_path):
    port, sidecar_port = free_port(), free_port()
    serve = CLIProcess(
        serve_argv(
            tiny_model_dir,
            checkpoint_root,
            port,
            sidecar_port,
            "budget",
            "--max-restarts",
            "0",
            "--stage-dir",
            str(tmp_path / "stage"),
        ),
        tmp_path / "serve.log",
    )
    sidecar = f"http://127.0.0.1:{sidecar_port}"
    try:
        wait_http(f"{sidecar}/readyz", 400, serve)
        sglang = [
            p
            for p in psutil.Process(serve.proc.pid).children(recursive=True)
            if "sglang.launch_server" in " ".join(p.cmdline())
        ]
        os.killpg(os.getpgid(sglang[0].pid), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready = httpx.get(f"{sidecar}/readyz", timeout=10)
            if ready.json().get("fatal"):
                break
            time.sleep(0.5)
        assert ready.status_code == 503
        fatal = ready.json()["fatal"]
        assert fatal["reason"] == RESTART_BUDGET_SPENT and "0 restart(s) within 600 s" in fatal["message"]
        status = httpx.get(f"{sidecar}/status", timeout=10).json()
        assert status["fatal"]["reason"] == RESTART_BUDGET_SPENT
        assert serve.proc.poll() is None, "serve keeps the sidecar up to say why"
        time.sleep(2)
        assert not [
            p
            for p in psutil.Process(serve.proc.pid).children(recursive=True)
            if "sglang.launch_server" in " ".join(p.cmdline())
        ], "SGLang must not be restarted"
    finally:
        serve.kill(signal.SIGTERM)
    assert serve.proc.returncode == 3, serve.log_tail()


def test_the_demo_waits_for_serve_while_its_logs_grow_and_names_the_timeout_after(tmp_path):
    from rollout_demo.demo import ServeProcess
    from rollout_service.process_group import ProcessGroup

    unit = object.__new__(ServeProcess)  # the waiting logic, with a stand-in for serve that never gets ready
    unit.group = ProcessGroup(["sleep", "60"], tmp_path / "serve.log", name="stand-in serve")
    unit.group.start()
    unit.sglang_log = tmp_path / "sglang.log"
    unit.sidecar_url = f"http://127.0.0.1:{free_port()}"  # never ready
    stop = threading.Event()

    def progress():
        for i in range(20):
            if stop.wait(0.15):
                return
            with open(unit.sglang_log, "a") as f:
                f.write(f"Downloading {i}\n")

    writer = threading.Thread(target=progress)
    writer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as exc:
            unit.wait_ready(2.0, progress_grace_s=1.0)  # 2 s: the wait is capped at 3 times it (6 s)
    finally:
        stop.set()
        writer.join()
        unit.group.stop(5.0, signal.SIGKILL)
    assert time.monotonic() - t0 >= 3.5  # 3 s of progress, then 1 s of silence
    assert "serve --startup-timeout" in str(exc.value)


def _until_it_gives_up(supervisor: Supervisor, gave_up: list, timeout_s: float = 20.0) -> None:
    """Run ``supervisor`` until it gives up (or ``timeout_s``), then stop it."""
    supervisor.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not gave_up and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        supervisor.stop()
        supervisor.join(5)


def test_a_hung_sglang_is_restarted_and_counted_like_a_crash():
    """An SGLang that still runs but no longer answers (a wedged GPU or scheduler: SIGSTOPped
    here in spirit) was never restarted by `serve`: only an exit was. ``hung`` (serve asks its
    sidecar how long SGLang has not answered) now makes the supervisor stop and start it again,
    counted against the budget, and the restarted server gets a fresh ``healthy_since``."""
    server = StandInServer()
    policy = RestartPolicy(max_restarts=1, backoff_s=0.0)
    asked: list[float] = []
    restarts, gave_up = [], []

    def hung(healthy_since: float) -> str | None:
        asked.append(healthy_since)
        return "it has not answered for 301 s" if len(asked) in (3, 9) else None

    supervisor = _supervisor(server, policy, restarts, gave_up, hung=hung)
    _until_it_gives_up(supervisor, gave_up)
    assert restarts == [1] and ("stop",) in server.calls and server.calls.count(("start",)) == 1
    assert asked[3] > asked[2], "the restarted server's healthy_since is its own start's"
    [(reason, message)] = gave_up
    assert reason == RESTART_BUDGET_SPENT and "is hung: it has not answered for 301 s" in message


def test_a_hung_sglang_the_budget_gives_up_on_is_stopped_whoever_started_it():
    """With the budget spent (--max-restarts 0 here) a hung SGLang that the main thread started
    stayed up, holding its GPU and port, while /readyz said "not restarting it"; one a restart had
    started was stopped. Now it is stopped in both cases."""
    server = StandInServer()
    restarts, gave_up = [], []
    policy = RestartPolicy(max_restarts=0, backoff_s=0.0)
    supervisor = _supervisor(server, policy, restarts, gave_up, hung=lambda since: "x")
    _until_it_gives_up(supervisor, gave_up)
    assert gave_up and gave_up[0][0] == RESTART_BUDGET_SPENT
    assert ("stop",) in server.calls and ("start",) not in server.calls


def test_the_watch_trims_the_log_of_an_sglang_that_runs_on(tmp_path: Path) -> None:
    """Between restarts SGLang's log grew without bound; the watch trims it (see process_group.trim_log)."""
    from rollout_service.process_group import LOG_ROTATE_BYTES

    server = StandInServer()
    server.log_path = tmp_path / "sglang.log"
    with open(server.log_path, "wb") as f:
        f.write(b"old lines\n")
        f.truncate(LOG_ROTATE_BYTES + 1)
    restarts, gave_up = [], []
    supervisor = _supervisor(server, RestartPolicy(max_restarts=1, backoff_s=0.0), restarts, gave_up)
    supervisor.start()
    try:
        deadline = time.monotonic() + 20
        while server.log_path.stat().st_size and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        supervisor.stop()
        supervisor.join(5)
    assert server.log_path.stat().st_size == 0 and not restarts and not gave_up
    assert (tmp_path / "sglang.log.1").read_bytes().startswith(b"old lines\n")


def test_what_counts_as_hung():
    from types import SimpleNamespace

    from rollout_service.serve import hang_reason

    state = SimpleNamespace(sglang_seen_mono=1000.0, sglang_loading_step=None)
    assert hang_reason(state, 900.0, 300.0, 1299.0) is None  # answered 299 s ago
    assert "301 s" in str(hang_reason(state, 900.0, 300.0, 1301.0))
    assert hang_reason(state, 1200.0, 300.0, 1301.0) is None  # restarted since: its own start counts
    assert hang_reason(state, 900.0, 0.0, 9999.0) is None  # --hang-timeout 0: off
    state.sglang_loading_step = 7  # a weight load in flight: /health waits on it
    assert hang_reason(state, 900.0, 300.0, 9999.0) is None
    never = SimpleNamespace(sglang_seen_mono=None, sglang_loading_step=None)
    assert hang_reason(never, 900.0, 300.0, 1201.0) is not None  # never answered the sidecar at all


def test_a_step_of_the_wall_clock_makes_no_live_sglang_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    """Silence was wall-clock time: a forward step past --hang-timeout (a resumed VM, an NTP step)
    made an SGLang that had just answered look hung, and serve restarted it."""
    from rollout_service.serve import hang_reason
    from rollout_service.sidecar.state import SidecarState

    state = SidecarState(replica_id="r", checkpoint_path="/c", sglang_url="http://x")
    started = time.monotonic()
    state.saw_sglang()
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 400.0)  # the wall clock jumps
    assert hang_reason(state, started, 300.0, time.monotonic()) is None
    assert hang_reason(state, started, 300.0, time.monotonic() + 301.0) is not None  # real silence still counts
    assert "sglang_seen_mono" not in state.to_dict() and state.to_dict()["sglang_seen_at"] is not None


@pytest.mark.sglang
def test_serve_gives_a_hung_real_sglang_up_as_hung(tiny_model_dir, checkpoint_root, tmp_path):
    """A real SGLang whose scheduler is stopped (SIGSTOP: a wedged GPU or scheduler in spirit) keeps
    running but answers no /health: past --hang-timeout `serve` counts it as a restart it needs
    (here the budget is 0, so it gives up at once, naming the hang; with a budget it restarts it)."""
    port, sidecar_port = free_port(), free_port()
    serve = CLIProcess(
        serve_argv(
            tiny_model_dir,
            checkpoint_root,
            port,
            sidecar_port,
            "hung",
            "--max-restarts",
            "0",
            "--hang-timeout",
            "10",
            "--deep-health-interval",
            "1",
            "--stage-dir",
            str(tmp_path / "stage"),
        ),
        tmp_path / "serve.log",
    )
    sidecar = f"http://127.0.0.1:{sidecar_port}"
    scheduler = None
    try:
        wait_http(f"{sidecar}/readyz", 400, serve)
        [scheduler] = [
            p for p in psutil.Process(serve.proc.pid).children(recursive=True) if "scheduler" in " ".join(p.cmdline())
        ]
        scheduler.suspend()
        deadline = time.monotonic() + 120
        fatal = None
        while time.monotonic() < deadline and not fatal:
            time.sleep(1)
            fatal = httpx.get(f"{sidecar}/status", timeout=10).json().get("fatal")
        assert fatal is not None, serve.log_tail()
        assert fatal["reason"] == RESTART_BUDGET_SPENT and "SGLang is hung" in fatal["message"], fatal
        assert "--hang-timeout 10 s" in fatal["message"]
    finally:
        if scheduler is not None:
            with contextlib.suppress(psutil.Error):
                scheduler.resume()
        serve.kill(signal.SIGTERM)
    assert serve.proc.returncode == 3, serve.log_tail()
