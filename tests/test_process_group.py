"""The process helper (`rollout_service.process_group`): a started process group is waited on
over HTTP, its failures name the exit code or the timeout with the log's last lines, and `stop`
leaves nothing behind, not even a process group a descendant started of its own."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port
from rollout_service.process_group import (
    ProcessExitedError,
    ProcessGroup,
    ProcessStartError,
    StartTimeoutError,
    group_alive,
)

SERVE_AFTER = """
import http.server, sys, time
print("starting", flush=True)
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(204); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

DETACHED_GRANDCHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def _python(tmp_path: Path, code: str, *args: str, name: str = "stand-in") -> ProcessGroup:
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    return ProcessGroup([sys.executable, str(script), *args], tmp_path / f"{name}.log", name=name, die_with_parent=True)


def test_wait_http_returns_once_the_endpoint_answers_the_expected_status(tmp_path):
    port = free_port()
    group = _python(tmp_path, SERVE_AFTER, str(port), "0.5")
    group.start()
    try:
        waited = group.wait_http(f"http://127.0.0.1:{port}/", 60, status=204)
        assert waited >= 0.4 and group.is_running()
        assert "starting" in group.log_tail()
    finally:
        group.stop()
    assert not group.is_running() and group.returncode is not None


def test_a_process_that_exits_first_is_named_with_its_exit_code_and_last_log_lines(tmp_path):
    group = _python(tmp_path, "import sys; print('the last words'); sys.exit(7)")
    group.start()
    with pytest.raises(ProcessExitedError, match=r"stand-in exited with code 7 before .* answered") as caught:
        group.wait_http(f"http://127.0.0.1:{free_port()}/health", 60)
    assert isinstance(caught.value, RuntimeError)
    assert "last log lines:\nthe last words" in str(caught.value)


def test_a_silent_start_times_out_naming_the_hint_and_the_silence(tmp_path):
    group = _python(tmp_path, "import time; print('hello', flush=True); time.sleep(600)")
    group.start()
    try:
        started = time.monotonic()
        with pytest.raises(StartTimeoutError) as caught:
            group.wait_http(
                f"http://127.0.0.1:{free_port()}/health",
                1.0,
                progress_grace_s=1.0,
                timeout_hint="raise --startup-timeout",
            )
        assert time.monotonic() - started < 15
    finally:
        group.stop()
    message = str(caught.value)
    assert isinstance(caught.value, TimeoutError)
    assert "did not answer within 1 s" in message and "showed no progress" in message
    assert "raise --startup-timeout" in message and message.endswith("hello\n")


def test_stop_ends_the_group_and_a_group_a_descendant_started(tmp_path):
    group = _python(tmp_path, DETACHED_GRANDCHILD)
    group.start()
    deadline = time.monotonic() + 30
    while not group.log_tail().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchild = int(group.log_tail().split()[0])
    assert os.getpgid(grandchild) == grandchild != group.pid  # a session of its own
    group.stop(timeout_s=5)
    assert group.returncode is not None and not group_alive(group.pid)
    deadline = time.monotonic() + 10
    while group_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not group_alive(grandchild), "the grandchild's own process group outlived stop()"
    group.stop()  # a second stop is harmless


def test_a_process_that_reports_it_cannot_become_ready_ends_the_wait_at_once(tmp_path):
    # The endpoint answers, but never the wanted status; the process says why (as a sidecar's
    # /status "fatal" does) while its log keeps growing: no waiting out the progress grace.
    port = free_port()
    group = _python(tmp_path, SERVE_AFTER, str(port), "0")
    group.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ProcessStartError, match="cannot become ready: stage_failed: taken"):
            group.wait_http(
                f"http://127.0.0.1:{port}/",
                1,
                status=200,
                progress_grace_s=600,
                failed=lambda client: "stage_failed: taken",
            )
        assert time.monotonic() - t0 < 30
    finally:
        group.stop()


def _child_of_a_thread_that_ended(tmp_path) -> ProcessGroup:
    """A ``die_with_parent`` child started by a thread that has ended since."""
    import threading

    started: list[ProcessGroup] = []

    def start() -> None:
        command = [sys.executable, "-c", "import time; time.sleep(60)"]
        group = ProcessGroup(command, tmp_path / "child.log", name="child", die_with_parent=True)
        group.start()
        started.append(group)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    [group] = started
    assert group.process is not None
    return group


def test_a_child_dies_with_the_thread_that_started_it(tmp_path):
    """``die_with_parent``: the child is SIGKILLed when the starting thread ends, with only what
    the parent resolved called between fork and exec (no import nor dlopen there)."""
    group = _child_of_a_thread_that_ended(tmp_path)
    assert group.process is not None and group.process.wait(timeout=20) == -9  # SIGKILL once its thread ended


def test_nothing_is_loaded_between_fork_and_exec(tmp_path, monkeypatch):
    """``libc`` is resolved in the parent, once: a ``dlopen`` in the forked child (the old
    ``preexec_fn``) can deadlock on a loader lock another thread of the parent held at the fork.
    With loading made to fail now, the child still starts and still dies with its thread."""
    import ctypes

    def no_loading(*args, **kwargs):
        raise OSError("dlopen after start-up (a loader lock another thread may hold at the fork)")

    monkeypatch.setattr(ctypes, "CDLL", no_loading)
    group = _child_of_a_thread_that_ended(tmp_path)
    assert group.process is not None and group.process.wait(timeout=20) == -9
