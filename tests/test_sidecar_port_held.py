"""The sidecar's port is bound when its settings are checked and held until its HTTP server serves on it.

CI once failed a `serve` start with "address already in use": the CLI checked that the sidecar's
port was free, SGLang then started for 16 s and picked its own ports, and only then did uvicorn
bind the sidecar's port, which was taken meanwhile (`serve` exited 4). `listening_sockets` now
binds and listens at the check and the HTTP server is handed those sockets. The real `serve` with
SGLang is checked in `test_serve_supervision_signals.py`; here the sockets themselves, and exit 4
for a sidecar whose start-up fails on a held port, without SGLang (`Supervisor.startup` replaced).
"""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from helpers import free_port
from rollout_service.cli import main
from rollout_service.http_urls import bindable_port, listening_sockets
from rollout_service.serve import RestartPolicy, Supervisor, run_serve
from rollout_service.sglang_launcher import SGLangServer
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.watcher import CheckpointWatcher


def _bind(port: int) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))


def test_a_held_port_cannot_be_taken_until_closed_and_is_not_inherited():
    sockets = listening_sockets("127.0.0.1", 0, "--port")
    port = sockets[0].getsockname()[1]
    try:
        assert len(sockets) == 1 and not sockets[0].get_inheritable()
        with pytest.raises(OSError) as caught:
            _bind(port)
        assert caught.value.errno == errno.EADDRINUSE
        with pytest.raises(ValueError, match=f"--port: port {port} on 127.0.0.1 is in use"):
            listening_sockets("127.0.0.1", port, "--port")
        code = f"import os, socket; s = socket.socket(fileno={sockets[0].fileno()}); print(s.getsockname())"
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert child.returncode != 0 and "Bad file descriptor" in child.stderr  # a child process has no copy
    finally:
        for sock in sockets:
            sock.close()
    _bind(port)  # free again once closed


def test_a_host_name_is_held_on_every_address_it_resolves_to():
    addresses = {info[4][0] for info in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)}
    port = bindable_port("127.0.0.1", 0, "test")
    sockets = listening_sockets("localhost", port, "--host/--port")
    try:
        held = {sock.getsockname()[0] for sock in sockets}
        assert held <= addresses and "127.0.0.1" in held
        assert len(held) == len(sockets)  # no address twice (getaddrinfo repeats them per protocol)
    finally:
        for sock in sockets:
            sock.close()


def test_a_connection_made_before_the_server_runs_is_answered_once_it_does(tmp_path: Path):
    """A client that connects while the port is held (SGLang still starting) waits in the kernel's
    queue and is answered by the sidecar once it serves on the held sockets: one request, no retry."""
    root = tmp_path / "root"
    root.mkdir()
    code = (
        "import sys, time; from rollout_service import http_urls; from rollout_service.sidecar import app, settings;"
        " held = http_urls.listening_sockets('127.0.0.1', 0, 'x');"
        " print(held[0].getsockname()[1], flush=True); time.sleep(3);"  # stand-in for SGLang's start-up
        f" app.run_sidecar(settings.SidecarSettings(checkpoint_path={str(root)!r},"
        f" sglang_url='http://127.0.0.1:{free_port()}', port=held[0].getsockname()[1],"
        f" stage_dir={str(tmp_path / 'stage')!r}), held)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        started = time.monotonic()
        answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=60)  # sent while only held
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started > 1.0  # it did wait for the server
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    assert out.count('"GET /healthz HTTP/1.1" 200') == 1, out  # the one request, served


def test_a_sidecar_whose_start_up_fails_on_its_held_port_exits_4_and_frees_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    def no_watch(self) -> None:
        raise OSError(errno.EMFILE, "stand-in: out of inotify instances and threads")

    monkeypatch.setattr(Supervisor, "startup", lambda self: None)  # SGLang not started
    monkeypatch.setattr(Supervisor, "start", lambda self: None)  # nor watched
    monkeypatch.setattr(CheckpointWatcher, "start", no_watch)
    root = tmp_path / "root"
    root.mkdir()
    server = SGLangServer(tmp_path, device="cpu", port=free_port(), log_path=tmp_path / "s.log")
    sockets = listening_sockets("127.0.0.1", 0, "--sidecar-port")
    port = sockets[0].getsockname()[1]
    settings = SidecarSettings(
        checkpoint_path=root, sglang_url=server.url, port=port, stage_dir=tmp_path / "stage", replica_id="held"
    )
    with caplog.at_level(logging.ERROR):
        assert run_serve(server, settings, RestartPolicy(), listeners=sockets) == 4
    assert f"the sidecar's HTTP server could not start on 127.0.0.1:{port}" in caplog.text
    assert all(sock.fileno() == -1 for sock in sockets)  # closed
    _bind(port)


def test_serve_refuses_a_sidecar_port_in_use_before_starting_anything(tmp_path: Path, capsys):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        rc = main(
            ["serve", "--model", str(tmp_path), "--checkpoint-path", str(tmp_path / "root"), "--device", "cpu"]
            + ["--sidecar-port", str(port)]
        )
    assert rc != 0
    assert f"--host/--sidecar-port: port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
    assert not (tmp_path / "root").exists()  # nothing made
