"""Stopping and restarting server processes the way `serve` does, where the process misbehaves.

- A restarted SGLang that runs but never answers /health is stopped after the start-up timeout and
  counted against the budget, which is then spent (it used to be left hung forever). The server
  is a fake SGLang process (`FAKE_SGLANG`): a real one cannot be made to hang on its restart only.
- ``serve`` as a container's PID 1 (or any child subreaper) inherits the children of an SGLang
  whose main process died; `ProcessGroup.stop` reaps their zombies and does not count them as
  alive (it used to wait out the full SIGTERM timeout, warn that SGLang "ignored SIGTERM", and
  leave them). The subreaper runs in a child Python process, so this test run is left as it was;
  the group is a plain Python process that forks (what is tested is the process-group helper).
- `ProcessGroup.stop` returns after SIGKILL even when the process never ends (uninterruptible
  sleep: a hung driver or network file system), simulated by a `wait` that never returns.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout_service.process_group import ProcessGroup, group_alive
from rollout_service.serve import RESTART_BUDGET_SPENT, RestartPolicy, Supervisor
from rollout_service.sglang_launcher import SGLangServer

pytestmark = pytest.mark.slow

FAKE_SGLANG = r'''#!__PYTHON__
"""Fake `python -m sglang.launch_server ... --port P`: each start does what $FAKE_PLAN says
(comma list, the last entry repeats): "ok" serves /health, "hang" never does."""
import http.server, os, signal, sys, threading, time
port = int(sys.argv[sys.argv.index("--port") + 1])
count = os.path.join(os.environ["FAKE_DIR"], "count")
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
plan = os.environ["FAKE_PLAN"].split(",")
mode = plan[min(n, len(plan) - 1)]
print(f"fake start #{n} mode={mode} pid={os.getpid()}", flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
if mode == "hang":
    while True:
        time.sleep(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def fake_sglang(tmp_path: Path, plan: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake-python"
    script.write_text(FAKE_SGLANG.replace("__PYTHON__", sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_PLAN", plan)
    return script


def test_a_restart_that_hangs_is_stopped_counted_and_the_budget_spent(tmp_path, monkeypatch):
    python = fake_sglang(tmp_path, "ok,hang", monkeypatch)
    server = SGLangServer(tmp_path, device="cpu", python=str(python), log_path=tmp_path / "s.log", die_with_parent=True)
    policy = RestartPolicy(max_restarts=2, backoff_s=0.0, startup_timeout_s=1.0, progress_grace_s=1.0)
    gave_up: list[str] = []
    supervisor = Supervisor(
        server, policy, on_give_up=lambda reason, message: gave_up.append(reason), check_interval_s=0.1
    )
    supervisor.startup()
    supervisor.start()
    try:
        assert server.pgid is not None
        os.killpg(server.pgid, signal.SIGKILL)  # the crash; every restart then hangs
        deadline = time.monotonic() + 60
        while not gave_up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gave_up == [RESTART_BUDGET_SPENT], server.log_tail()
        assert (tmp_path / "count").read_text() == "3"  # the first start and two restarts
        assert not server.is_running() and not group_alive(server.pgid), "the hung restart was left running"
    finally:
        supervisor.shutdown(10)


STOP_GRACE_S = 20.0
"""The subreaper tests' stop() grace: long, so that a stop that waited it out stands apart."""

SUBREAPER = r"""
import ctypes, json, logging, os, sys, time
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
ctypes.CDLL("libc.so.6").prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: what PID 1 of a container is
from rollout_service.process_group import ProcessGroup, group_alive
# The server forks a worker and its main process dies; the worker exits after `worker_s`
# (as SGLang's schedulers do once their parent is gone), re-parented to this process.
worker_s = float(sys.argv[2])
code = f"import os, time\nif os.fork() == 0:\n    time.sleep({worker_s}); os._exit(0)\ntime.sleep(0.1); os._exit(1)"
group = ProcessGroup([sys.executable, "-c", code], sys.argv[1], name="server")
group.start()
time.sleep(1.0 if worker_s < 1 else 0.5)
t0 = time.monotonic()
group.stop(timeout_s=float(sys.argv[3]))
took = time.monotonic() - t0
zombies = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] == "Z":
            zombies.append(int(pid))
print(json.dumps({"took": took, "alive": group_alive(group.pid), "zombies": zombies}))
"""


def _run_subreaper(tmp_path: Path, worker_s: float) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", SUBREAPER, str(tmp_path / "server.log"), str(worker_s), str(STOP_GRACE_S)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_stop_as_a_subreaper_reaps_the_servers_orphans_at_once(tmp_path):
    result, stderr = _run_subreaper(tmp_path, worker_s=0.3)
    assert result["zombies"] == [], "the server's orphan was left a zombie"
    assert not result["alive"]
    # Waiting for a zombie would take stop()'s whole grace (STOP_GRACE_S): half of it is a margin
    # no loaded machine eats.
    assert result["took"] < STOP_GRACE_S / 2, f"stop() waited {result['took']:.1f} s for a zombie"
    assert "ignored SIGTERM" not in stderr


def test_stop_as_a_subreaper_still_stops_a_live_orphan(tmp_path):
    """Zombies do not count as alive; a live orphan of the group still does, and is stopped (by
    SIGTERM: well before the grace would run out and SIGKILL follow)."""
    result, _ = _run_subreaper(tmp_path, worker_s=600)
    assert not result["alive"] and result["zombies"] == []
    assert result["took"] < STOP_GRACE_S / 2


def test_stop_returns_when_the_process_does_not_end_even_after_sigkill(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="rollout_service.process_group")
    group = ProcessGroup(["sleep", "600"], tmp_path / "sleep.log", name="stuck server")
    group.start()
    process = group.process
    assert process is not None
    release = threading.Event()
    real_wait = process.wait

    def never_ends(timeout: float | None = None) -> int:
        """As for a process in uninterruptible sleep: no exit status, whatever is sent."""
        if timeout is None:
            release.wait()
            return real_wait()
        time.sleep(min(timeout, 0.2))
        raise subprocess.TimeoutExpired(process.args, timeout)

    process.wait = never_ends  # type: ignore[method-assign]
    stopper = threading.Thread(target=group.stop, kwargs={"timeout_s": 1.0}, daemon=True)
    try:
        stopper.start()
        stopper.join(30)
        assert not stopper.is_alive(), "stop() hangs on a process that SIGKILL does not end"
        assert "did not end" in caplog.text and "after SIGKILL" in caplog.text
    finally:
        release.set()
        process.wait = real_wait  # type: ignore[method-assign]
        group.stop(1.0, signal.SIGKILL)
