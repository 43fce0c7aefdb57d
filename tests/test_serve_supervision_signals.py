"""`serve`'s signals, exit codes and clean stops, with a real SGLang where it can show them.

- SIGTERM while SGLang first starts: `serve` stops SGLang (SIGTERM) and exits 0 (it used to die
  at once with -15, SGLang SIGKILLed behind it and nothing logged).
- A second SIGTERM while `serve` is stopping SGLang is logged, not fatal (the default handler
  used to be back by then). This needs an SGLang that ignores SIGTERM for the stop to take long
  enough to signal into, so it is a fake SGLang process (`FAKE_SGLANG`): a real one stops in
  seconds.
- The sidecar's port is held from `serve`'s check on: SGLang's start-up cannot take it (exit 4,
  `test_sidecar_port_held.py` has the rest).
- A restarted SGLang is stopped with SIGTERM and drains (it used to be SIGKILLed by its
  parent-death signal when the supervisor thread that started it ended).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import sys
import threading
import time

import httpx
import psutil
import pytest

from helpers import free_port
from rollout_service.process_group import ProcessGroup
from rollout_service.serve import RestartPolicy, Supervisor
from rollout_service.sglang_launcher import SGLangServer
from sidecar_helpers import CLIProcess, serve_argv

pytestmark = pytest.mark.slow


def _wait_for(predicate, timeout_s: float, what: str, log=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; log:\n{log()}")


def _sglang_processes(serve_pid: int, needle: str = "sglang.launch_server") -> list[psutil.Process]:
    found = []
    try:
        children = psutil.Process(serve_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in children:
        try:
            if needle in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.sglang
def test_sigterm_while_sglang_first_starts_stops_it_and_exits_0(tiny_model_dir, checkpoint_root, tmp_path):
    serve = CLIProcess(
        serve_argv(
            tiny_model_dir,
            checkpoint_root,
            free_port(),
            free_port(),
            "early",
            "--stage-dir",
            str(tmp_path / "stage"),
            "--sglang-log",
            str(tmp_path / "sglang.log"),
        ),
        tmp_path / "serve.log",
    )
    try:
        _wait_for(lambda: _sglang_processes(serve.proc.pid), 120, "SGLang to be launched", serve.log_tail)
        sglang = _sglang_processes(serve.proc.pid)
        time.sleep(2.0)  # SGLang is importing, far from answering /health
        assert "answered at" not in serve.log_tail(200)
        os.kill(serve.proc.pid, signal.SIGTERM)
        code = serve.proc.wait(timeout=90)
        log = serve.log_tail(200)
        assert code == 0, log
        assert "received SIGTERM during SGLang's start-up" in log
        assert "stopped during SGLang's start-up by SIGTERM" in log
        assert "ignored SIGTERM" not in log
        _wait_for(lambda: not _alive(sglang), 30, "SGLang to be gone", serve.log_tail)
    finally:
        serve.kill(signal.SIGKILL)


@pytest.mark.sglang
def test_the_sidecar_port_is_held_while_sglang_starts_and_sglang_does_not_inherit_it(
    tiny_model_dir, checkpoint_root, tmp_path
):
    """CI once saw SGLang's start-up take the sidecar's port between `serve`'s check and the
    sidecar's bind (exit 4). The port is now held from the check: nobody can take it meanwhile,
    the sidecar answers on it, and SGLang's processes hold no copy of it."""
    sidecar_port = free_port()
    serve = CLIProcess(
        serve_argv(
            tiny_model_dir,
            checkpoint_root,
            free_port(),
            sidecar_port,
            "held",
            "--stage-dir",
            str(tmp_path / "stage"),
        ),
        tmp_path / "serve.log",
    )
    try:
        _wait_for(lambda: "starting SGLang on" in serve.log_tail(200), 120, "SGLang's start", serve.log_tail)
        with socket.socket() as grab, pytest.raises(OSError) as caught:
            grab.bind(("127.0.0.1", sidecar_port))  # someone else tries to take the port serve checked
        assert caught.value.errno == errno.EADDRINUSE
        _wait_for(lambda: _sglang_processes(serve.proc.pid), 60, "SGLang to be launched", serve.log_tail)
        _wait_for(lambda: _answers(f"http://127.0.0.1:{sidecar_port}/healthz"), 400, "the sidecar", serve.log_tail)
        for process in _sglang_processes(serve.proc.pid):
            ports = {c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
            assert sidecar_port not in ports, (process.pid, ports)
        os.kill(serve.proc.pid, signal.SIGTERM)
        assert serve.proc.wait(timeout=120) == 0, serve.log_tail(200)
    finally:
        serve.kill(signal.SIGKILL)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.sglang
def test_a_restarted_sglang_is_stopped_with_sigterm_not_killed_with_its_supervisor_thread(tiny_model_dir, tmp_path):
    """SGLang (0.5.x) answers SIGTERM by draining, waiting 5 s, and then cleaning up its process
    tree (which SIGKILLs itself: its exit code says nothing). A restarted SGLang dies with the
    supervisor thread that started it (PR_SET_PDEATHSIG), so that thread must outlive the stop:
    before, it ended at once and SGLang was SIGKILLed in the middle of its clean-up."""
    server = SGLangServer(
        tiny_model_dir,
        device="cpu",
        python=sys.executable,
        log_path=tmp_path / "sglang.log",
        extra_args=("--dtype", "float32"),
        die_with_parent=True,
    )
    policy = RestartPolicy(max_restarts=2, backoff_s=0.0, startup_timeout_s=300.0)
    restarted: list[int] = []
    supervisor = Supervisor(server, policy, on_restart=lambda: restarted.append(1), check_interval_s=0.5)
    stops: list[tuple[str, bool]] = []
    real_stop = server.stop

    def stop(*args, **kwargs) -> None:
        real_stop(*args, **kwargs)
        stops.append((threading.current_thread().name, supervisor.is_alive()))

    server.stop = stop  # type: ignore[method-assign]
    try:
        supervisor.startup()
        supervisor.start()
        first = server.pgid
        assert first is not None
        os.killpg(first, signal.SIGKILL)
        _wait_for(lambda: restarted, 400, "the restart", server.log_tail)
        assert server.pgid != first and server.is_running()
        stops.clear()
    finally:
        supervisor.shutdown()
    assert stops and stops[0] == ("MainThread", True), f"the supervisor thread ended before SGLang was stopped: {stops}"
    assert not supervisor.is_alive()
    log = server.log_tail(80)
    assert "SIGTERM received" in log
    after = log[log.rindex("SIGTERM received") :]
    assert "kill_process_tree called" in after, f"SGLang was killed before its own clean-up:\n{after}"


FAKE_SGLANG = r'''#!__PYTHON__
"""Fake `python -m sglang.launch_server ... --port P` that ignores SIGTERM and serves /health."""
import http.server, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
signal.signal(signal.SIGTERM, lambda *a: print("fake SGLang ignores SIGTERM", flush=True))
print("fake SGLang serving", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

SERVE_WITH = """
import functools, sys
import rollout_service.cli as cli
cli.SGLangServer = functools.partial(cli.SGLangServer, python=sys.argv[1])
sys.exit(cli.main(sys.argv[2:]))
"""


def test_a_second_sigterm_while_stopping_sglang_does_not_kill_serve(checkpoint_root, tmp_path):
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_SGLANG.replace("__PYTHON__", sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    argv = serve_argv(tmp_path / "model", checkpoint_root, free_port(), free_port(), "deaf")
    argv += ["--stage-dir", str(tmp_path / "stage"), "--sglang-log", str(tmp_path / "sglang.log")]
    serve = ProcessGroup(
        [sys.executable, "-c", SERVE_WITH, str(fake), *argv], tmp_path / "serve.log", name="serve", die_with_parent=True
    )
    serve.start()
    assert serve.process is not None
    try:
        _wait_for(lambda: "Application startup complete" in serve.log_tail(200), 120, "the sidecar", serve.log_tail)
        fake_sglang = _sglang_processes(serve.process.pid, str(fake))
        assert fake_sglang
        os.kill(serve.process.pid, signal.SIGTERM)
        _wait_for(lambda: "stopping SGLang server" in serve.log_tail(200), 60, "serve to stop SGLang", serve.log_tail)
        time.sleep(1.0)
        os.kill(serve.process.pid, signal.SIGTERM)  # impatient: a second SIGTERM while SGLang ignores the first
        code = serve.process.wait(timeout=90)
        log = serve.log_tail(200)
        assert code == 0, log
        assert "received SIGTERM; already stopping" in log
        assert "ignored SIGTERM for 20 s; sending SIGKILL" in log
        _wait_for(lambda: not _alive(fake_sglang), 30, "the fake SGLang to be gone", serve.log_tail)
    finally:
        serve.stop(5.0, signal.SIGKILL)
        for p in _alive(fake_sglang if "fake_sglang" in locals() else []):
            p.kill()


FAKE_DEAF_START = r'''#!__PYTHON__
"""Fake `python -m sglang.launch_server` whose start never ends: it ignores SIGTERM (a handler, a
C call) and logs loading progress every second without ever listening."""
import signal, time
signal.signal(signal.SIGTERM, lambda *a: print("fake SGLang ignores SIGTERM", flush=True))
while True:
    print("Loading safetensors checkpoint shards: ...", flush=True)
    time.sleep(1)
'''


def test_sigterm_while_an_sglang_that_ignores_it_first_starts_ends_serve_within_the_stop_bound(
    checkpoint_root, tmp_path
):
    """The wait for SGLang's first /health went on after the signal until the start-up timeout
    ran out, three times it while the log grew (30 minutes by default): `serve` now stops waiting
    at once and stops SGLang as everywhere else (SIGTERM, SIGKILL 20 s later). A fake SGLang: a
    real one exits on SIGTERM."""
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_DEAF_START.replace("__PYTHON__", sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    argv = serve_argv(tmp_path / "model", checkpoint_root, free_port(), free_port(), "deaf-start")
    argv += ["--stage-dir", str(tmp_path / "stage"), "--sglang-log", str(tmp_path / "sglang.log")]
    argv += ["--startup-timeout", "120"]
    serve = ProcessGroup(
        [sys.executable, "-c", SERVE_WITH, str(fake), *argv], tmp_path / "serve.log", name="serve", die_with_parent=True
    )
    serve.start()
    assert serve.process is not None
    log_file = tmp_path / "sglang.log"
    try:
        _wait_for(
            lambda: log_file.exists() and "Loading safetensors" in log_file.read_text(), 120, "the fake", serve.log_tail
        )
        fake_sglang = _sglang_processes(serve.process.pid, str(fake))
        assert fake_sglang
        t0 = time.monotonic()
        os.kill(serve.process.pid, signal.SIGTERM)
        code = serve.process.wait(timeout=90)
        took = time.monotonic() - t0
        log = serve.log_tail(200)
        assert code == 0, log
        assert took < 60, f"serve took {took:.0f} s to stop (the start-up timeout is 120 s): {log}"
        assert "ignored SIGTERM for 20 s; sending SIGKILL" in log, log
        _wait_for(lambda: not _alive(fake_sglang), 30, "the fake SGLang to be gone", serve.log_tail)
    finally:
        serve.stop(5.0, signal.SIGKILL)
        for p in _alive(fake_sglang if "fake_sglang" in locals() else []):
            p.kill()
