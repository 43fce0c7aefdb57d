"""`serve`'s supervision of SGLang: its port, the bound on its start-up wait, its log, SIGHUP.

- Another process holding SGLang's port fails a start at once, naming the port and the process
  (SGLang used to be launched anyway and fail minutes later, the restart budget spent on that).
- Another process that answers ``/health`` on SGLang's port while SGLang loads is not taken for
  SGLang (it used to be: the restart counted a success and the sidecar pushed weights to it); the
  real SGLang then exits (EADDRINUSE) and the error says the port was taken. Real SGLang, and a
  real SGLang killed under a supervisor whose port a stranger then takes.
- The start-up wait past the timeout while the log grows has a hard cap (3 x the timeout): a
  process that logs forever and never listens no longer keeps ``serve`` starting for good. That
  process is a fake SGLang (`CHATTER_SGLANG`): a real one cannot be made to log forever without
  ever listening (what a hung multi-node rendezvous that keeps printing does).
- SGLang's log is moved to ``<log>.1`` past 64 MiB at each start (real SGLang, on a model folder
  that does not exist: it is stopped at once), and SGLang runs with ``--log-level-http warning``
  (every sidecar poll was an access line in its log) unless the arguments after ``--`` set it.
- SIGHUP (a closed terminal or SSH session) stops ``serve`` cleanly with exit code 0 (it used to
  die with 129, SGLang SIGKILLed behind it). Real ``serve`` and SGLang.
"""

from __future__ import annotations

import http.server
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import free_port
from rollout_service import process_group
from rollout_service.process_group import ProcessGroup, group_alive
from rollout_service.serve import RESTART_BUDGET_SPENT, RestartPolicy, Supervisor
from rollout_service.sglang_launcher import SGLangServer, SGLangStartError
from sidecar_helpers import CLIProcess, serve_argv

LOG_CAP = 64 * 1024 * 1024
"""`process_group.LOG_ROTATE_BYTES`: the size past which SGLang's log is moved aside."""
LOAD_TIMEOUT_S = 300.0
"""A real SGLang's start on the tiny model takes ~30 s here; CI machines are slower."""


class Stranger:
    """Another process's server on a port (run in this test process: not of SGLang's group) that
    answers every GET with 200, as another ``serve``'s SGLang on the same ``--port`` would."""

    def __init__(self, port: int) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"stranger")

            def log_message(self, *args: object) -> None:
                pass

        deadline = time.monotonic() + 30
        while True:  # the port of a process just killed is free a moment later
            try:
                self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _sglang(model: Path, tmp_path: Path, **settings: object) -> SGLangServer:
    return SGLangServer(
        model, device="cpu", python=sys.executable, log_path=tmp_path / "sglang.log", die_with_parent=True, **settings
    )


# --- the port ---------------------------------------------------------------------------------


def test_start_fails_at_once_naming_the_process_that_holds_sglangs_port(tmp_path):
    """No SGLang is launched: the check comes first (the old code launched it, and it failed only
    once its model was loaded)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    server = _sglang(tmp_path / "no-model", tmp_path, port=port)
    try:
        t0 = time.monotonic()
        with pytest.raises(SGLangStartError) as caught:
            server.start()
        assert time.monotonic() - t0 < 10
        assert server.pid is None, "SGLang was launched on a port another process holds"
    finally:
        server.stop()
        holder.close()
    message = str(caught.value)
    assert f"port {port} on 127.0.0.1 is in use by another process (pid {os.getpid()}" in message, message
    assert "another --port" in message


def test_wait_http_takes_its_own_servers_answer_and_any_answer_where_proc_cannot_tell(tmp_path, monkeypatch):
    port = free_port()
    script = tmp_path / "serve.py"
    script.write_text(
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
    )
    group = ProcessGroup([sys.executable, str(script), str(port)], tmp_path / "s.log", die_with_parent=True)
    group.start()
    try:
        group.wait_http(f"http://127.0.0.1:{port}/", 60, listen_port=port)
        assert group.listens_on(port) is True and group.stranger is None
        monkeypatch.setattr(process_group, "listening_inodes", lambda port: None)  # no /proc/net/tcp
        assert group.listens_on(port) is None
        group.wait_http(f"http://127.0.0.1:{port}/", 60, listen_port=port)
    finally:
        group.stop()


@pytest.mark.slow
@pytest.mark.sglang
def test_a_stranger_answering_on_sglangs_port_while_it_loads_is_not_taken_for_sglang(tiny_model_dir, tmp_path):
    server = _sglang(tiny_model_dir, tmp_path)
    server.start()
    stranger = Stranger(server.port)  # SGLang listens only once its model is loaded: seconds from now
    try:
        with pytest.raises(SGLangStartError) as caught:
            server.wait_healthy(LOAD_TIMEOUT_S, progress_grace_s=60)
    finally:
        stranger.close()
        server.stop()
    message = str(caught.value)
    assert f"port {server.port} on 127.0.0.1 was taken by another process (pid {os.getpid()}" in message, message
    assert "SGLang server exited" in message and "address already in use" in message  # SGLang's own EADDRINUSE


@pytest.mark.slow
@pytest.mark.sglang
def test_restarts_onto_a_port_a_stranger_took_fail_at_once_and_never_count_as_sglang_back(tiny_model_dir, tmp_path):
    server = _sglang(tiny_model_dir, tmp_path)
    policy = RestartPolicy(max_restarts=2, backoff_s=1.0, max_backoff_s=1.0, startup_timeout_s=LOAD_TIMEOUT_S)
    restarted: list[float] = []
    gave_up: list[tuple[str, str]] = []
    supervisor = Supervisor(
        server,
        policy,
        on_restart=lambda: restarted.append(time.monotonic()),
        on_give_up=lambda reason, message: gave_up.append((reason, message)),
        check_interval_s=0.1,
    )
    supervisor.startup()
    stranger = None
    try:
        supervisor.start()
        assert server.pgid is not None
        os.killpg(server.pgid, signal.SIGKILL)  # SGLang crashes; another process takes its port at once
        stranger = Stranger(server.port)
        deadline = time.monotonic() + 60
        while not gave_up and time.monotonic() < deadline:
            time.sleep(0.1)
        assert restarted == [], "a stranger's answer was taken for SGLang back (the sidecar would load into it)"
        assert [reason for reason, _ in gave_up] == [RESTART_BUDGET_SPENT], server.log_tail()
        message = gave_up[0][1]
        assert "The last restart failed: SGLang was not started:" in message, message
        assert f"port {server.port} on 127.0.0.1 is in use by another process (pid {os.getpid()}" in message
    finally:
        supervisor.shutdown(30)
        if stranger is not None:
            stranger.close()


# --- the start-up wait's cap ------------------------------------------------------------------

CHATTER_SGLANG = r'''#!__PYTHON__
"""Fake `python -m sglang.launch_server`: prints that it waits, every 0.2 s, forever; never listens."""
import time
while True:
    print("still waiting for the NCCL rendezvous...", flush=True)
    time.sleep(0.2)
'''


def test_a_start_that_logs_forever_and_never_listens_ends_at_three_times_the_timeout(tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(CHATTER_SGLANG.replace("__PYTHON__", sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    server = SGLangServer(tmp_path, device="cpu", python=str(fake), log_path=tmp_path / "s.log", die_with_parent=True)
    supervisor = Supervisor(server, RestartPolicy(startup_timeout_s=2.0, progress_grace_s=2.0))
    ended: list[BaseException | None] = []

    def start() -> None:
        try:
            supervisor.startup()
            ended.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            ended.append(exc)

    waiter = threading.Thread(target=start, daemon=True)
    t0 = time.monotonic()
    waiter.start()
    waiter.join(30)
    took = time.monotonic() - t0
    if waiter.is_alive():
        supervisor.interrupt()
        waiter.join(30)
    supervisor.shutdown(10)
    assert took < 30, "startup() still waits on a start that logs forever (2 s timeout, 2 s grace)"
    [error] = ended
    assert isinstance(error, SGLangStartError), error
    assert 5.5 <= took < 20, took
    assert "nor within 6 s (3 times that)" in str(error) and "--startup-timeout" in str(error)
    assert not group_alive(server.pgid or 0)


# --- SGLang's log -----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_log_past_64_mib_is_moved_aside_at_each_start(tmp_path):
    log = tmp_path / "sglang.log"
    with open(log, "wb") as f:
        f.write(b"the first run's lines\n")
        f.truncate(LOG_CAP + 1)  # sparse: no 64 MiB written
    server = _sglang(tmp_path / "no-model", tmp_path)
    server.start()  # the real SGLang; it is stopped at once (no model there anyway)
    server.stop()
    older = tmp_path / "sglang.log.1"
    assert older.is_file() and older.stat().st_size == LOG_CAP + 1
    assert older.read_bytes().startswith(b"the first run's lines\n")
    assert log.stat().st_size < LOG_CAP
    small = log.stat().st_size
    server.start()  # a small log stays where it is, appended to
    server.stop()
    assert log.stat().st_size >= small and older.stat().st_size == LOG_CAP + 1
    assert process_group.LOG_ROTATE_BYTES == LOG_CAP


def test_a_running_processs_log_past_the_cap_is_trimmed_in_place_and_it_writes_on(tmp_path):
    """A long-lived SGLang's log was bounded only at a (re)start: one that logged a traceback per
    bad request grew --sglang-log without end. serve's watch now trims it while SGLang runs: the
    bytes go to ``.1`` and the file is emptied in place, SGLang's append descriptor writing on."""
    import subprocess
    import sys

    log = tmp_path / "sglang.log"
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfor i in range(400):\n    print(f'line {i:04d} ' + 'x' * 2000, flush=True)\n"
            "    time.sleep(0.01)",
        ],
        stdout=process_group.open_log(log, "--sglang-log"),
    )
    try:
        deadline = time.monotonic() + 30
        while log.stat().st_size <= 200_000:
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.05)
        older = process_group.trim_log(log, max_bytes=200_000)
        assert older == tmp_path / "sglang.log.1" and older.stat().st_size > 200_000
        assert writer.wait(30) == 0
    finally:
        writer.kill()
    kept = log.read_bytes()
    assert kept and len(kept) < 800_000 and b"\0" not in kept  # written on from the start, no hole
    assert older.read_bytes().startswith(b"line 0000 ") and kept.rstrip().endswith(b"x")
    assert b"line 0399 " in kept and process_group.trim_log(log, max_bytes=10**9) is None


def test_a_log_named_through_a_link_is_never_moved(tmp_path):
    """``--sglang-log /dev/stdout`` is a link: renaming it would move the link, not the file."""
    target = tmp_path / "big.log"
    with open(target, "wb") as f:
        f.truncate(LOG_CAP + 1)
    link = tmp_path / "stdout"
    link.symlink_to(target)
    assert process_group.rotate_log(link) is None
    assert link.is_symlink() and target.stat().st_size == LOG_CAP + 1
    assert process_group.rotate_log(target) == tmp_path / "big.log.1"


def test_sglang_logs_no_access_line_per_request_unless_told_to(tmp_path):
    for device in ("cpu", "cuda"):
        cmd = SGLangServer(tmp_path, device=device, port=30000).command()
        assert cmd[cmd.index("--log-level-http") + 1] == "warning" and cmd.count("--log-level-http") == 1, cmd
        for given in (["--log-level-http", "info"], ["--log-level-h=debug"]):
            cmd = SGLangServer(tmp_path, device=device, port=30000, extra_args=given).command()
            assert "warning" not in cmd and cmd[-len(given) :] == given, cmd


# --- SIGHUP -----------------------------------------------------------------------------------


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.slow
@pytest.mark.sglang
def test_sighup_stops_serve_cleanly_with_exit_code_0(tiny_model_dir, checkpoint_root, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    argv = serve_argv(tiny_model_dir, checkpoint_root, free_port(), free_port(), "hup")
    argv += ["--stage-dir", str(tmp_path / "stage"), "--sglang-log", str(tmp_path / "sglang.log")]
    serve = CLIProcess(argv, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while "sidecar on" not in serve.log_tail(200):
            assert serve.proc.poll() is None and time.monotonic() < deadline, serve.log_tail(200)
            time.sleep(0.2)
        sglang = [
            p for p in psutil.Process(serve.proc.pid).children(recursive=True) if "sglang" in " ".join(p.cmdline())
        ]
        assert sglang
        os.kill(serve.proc.pid, signal.SIGHUP)  # the terminal or SSH session `serve` ran in closed
        code = serve.proc.wait(timeout=90)
        log = serve.log_tail(200)
        assert code == 0, f"serve ended with {code} on SIGHUP:\n{log}"
        assert "received SIGHUP; stopping SGLang and the sidecar" in log
        deadline = time.monotonic() + 30
        while _alive(sglang) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(sglang)
    finally:
        serve.kill(signal.SIGKILL)
