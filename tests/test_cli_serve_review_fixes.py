"""What a review of the commands found, each now as the README says:

- ``serve --stage-dir`` naming a folder the sidecar refuses (entries it did not make) was found
  only once SGLang had started (minutes on a GPU); ``serve`` then ran unready for good and exited
  0 when stopped. The stage is checked before SGLang starts (exit 2), and a ``serve`` stopped
  while its sidecar reports an error it cannot recover from exits 3.
- The commands logged every HTTP call at INFO (httpx: the sidecar asks SGLang every
  ``--health-interval``, ~45,000 lines a day): shown at ``--log-level DEBUG`` only.
- ``demo`` (and the other one-shot commands) died of SIGHUP (a closed terminal) on the spot, its
  ``serve`` SIGKILLed behind it with a half-written stage: SIGHUP interrupts like Ctrl-C.
- ``--device cuda`` on a machine with no GPU blamed the NVIDIA driver.

SGLang is not started in the ``serve`` tests: what is tested happens before it, or around it
(``Supervisor`` stubbed), which a real server would only make minutes slower.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import free_port
from rollout_service.cli import main
from rollout_service.serve import RestartPolicy, Supervisor, run_serve
from rollout_service.sglang_launcher import SGLangServer, cuda_unavailable_message
from rollout_service.sidecar.settings import SidecarSettings
from sidecar_helpers import serve_argv


def test_serve_refuses_a_stage_dir_the_sidecar_would_refuse_before_sglang_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def started(self: SGLangServer) -> None:
        raise AssertionError("SGLang was started before the stage was checked")

    monkeypatch.setattr(SGLangServer, "start", started)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "notes.txt").write_text("someone else's")
    root = tmp_path / "root"
    argv = serve_argv(tmp_path / "model", root, free_port(), free_port(), "r0", "--stage-dir", str(stage))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--stage-dir" in err and "notes.txt" in err, err
    assert (stage / "notes.txt").read_text() == "someone else's"


def test_serve_stopped_with_its_sidecar_unable_to_recover_exits_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang "started" (the supervisor stubbed); the sidecar's stage is refused at its start (the
    check before SGLang raced: another process put an entry there); SIGTERM then ends ``serve``,
    with 3, not 0 (systemd's Restart=on-failure, compose's restart policies see a failure)."""
    for name in ("startup", "start", "shutdown"):
        monkeypatch.setattr(Supervisor, name, lambda self, *a, **k: None)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "notes.txt").write_text("someone else's")
    root = tmp_path / "root"
    root.mkdir()
    server = SGLangServer(tmp_path, device="cpu", port=free_port(), log_path=tmp_path / "s.log")
    port = free_port()
    settings = SidecarSettings(checkpoint_path=root, sglang_url=server.url, port=port, stage_dir=stage)

    def stop_once_fatal() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/status", timeout=2).json().get("fatal"):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_fatal, daemon=True).start()
    assert run_serve(server, settings, RestartPolicy()) == 3


def test_http_calls_are_logged_only_at_debug(tmp_path: Path) -> None:
    script = (
        "import logging, sys\n"
        "from rollout_service import cli\n"
        "cli.main(sys.argv[1:])\n"
        "for name in ('httpx', 'httpcore'):\n"
        "    print(name, logging.getLogger(name).getEffectiveLevel())\n"
    )
    for level, quiet in (("INFO", True), ("DEBUG", False)):
        done = subprocess.run(
            [sys.executable, "-c", script, "--log-level", level, "make-tiny-model", "--out", str(tmp_path / level)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        levels = dict(line.split() for line in done.stdout.splitlines() if line.startswith("http"))
        assert all((int(v) >= logging.WARNING) == quiet for v in levels.values()), (level, levels)


def test_a_one_shot_command_stops_on_sighup_as_on_ctrl_c(tmp_path: Path) -> None:
    """A closed terminal's SIGHUP interrupts like Ctrl-C: the command's clean-up runs and it exits
    128 + 1 saying so (``demo`` stops its ``serve`` that way instead of dying on the spot)."""
    script = (
        "import os, signal, sys, threading\n"
        "from rollout_service import cli\n"
        "def hang(args):\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGHUP)\n"
        "        threading.Event().wait(30)\n"
        "    finally:\n"
        "        print('cleaned up', flush=True)\n"
        "def register(sub, add_env):\n"
        "    sub.add_parser('hang').set_defaults(func=hang)\n"
        "sys.exit(cli.main(['hang'], extra_commands=[register]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGHUP, (done.returncode, done.stderr[-2000:])
    assert "cleaned up" in done.stdout and "interrupted by SIGHUP" in done.stderr


def test_no_gpu_at_all_is_not_blamed_on_the_driver() -> None:
    message = cuda_unavailable_message([], "SGLang on CUDA")
    assert "no NVIDIA GPU found" in message and "--device cpu" in message
    assert "upgrade the driver" not in message and "lists 0 GPU" not in message
    listed = cuda_unavailable_message(["GPU 0: NVIDIA H200"], "SGLang on CUDA")
    assert "nvidia-smi lists 1 GPU(s)" in listed and "driver" in listed
