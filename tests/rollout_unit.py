"""A real rollout unit for trainer tests: `rollout-service serve` (SGLang + sidecar) in a subprocess.

`launch_unit` starts one and returns at once (so that two units' slow start-ups can overlap),
`wait_ready` waits for the sidecar's `/readyz`, `stop_unit` stops it; `ready_unit` does all three
for a module-scoped fixture.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from helpers import free_port
from rollout_service.sglang_launcher import kill_me_with_parent

UNIT_READY_TIMEOUT_S = 600.0

@dataclass
class RolloutUnit:
    """One `rollout-service serve` process: an SGLang server and the sidecar that keeps it synced."""

    model_dir: Path
    checkpoint_root: Path
    sglang_url: str
    sidecar_url: str
    process: subprocess.Popen
    log_path: Path


def _serve_command() -> list[str]:
    script = Path(sys.executable).parent / "rollout-service"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout_service.cli"]


def launch_unit(model_dir: Path, workdir: Path) -> RolloutUnit:
    """Start `rollout-service serve` in its own session; returns at once (see `wait_ready`)."""
    root = workdir / "ckpts"
    root.mkdir(parents=True)
    sglang_port, sidecar_port = free_port(), free_port()
    log_path = workdir / "serve.log"
    cmd = _serve_command() + [
        "serve", "--model", str(model_dir), "--checkpoint-path", str(root), "--port", str(sglang_port),
        "--sidecar-port", str(sidecar_port), "--device", "cpu", "--sglang-log", str(workdir / "sglang.log"),
        "--replica-id", f"test-{sidecar_port}"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=kill_me_with_parent)
    return RolloutUnit(model_dir, root, f"http://127.0.0.1:{sglang_port}", f"http://127.0.0.1:{sidecar_port}",
                       proc, log_path)


def wait_ready(unit: RolloutUnit) -> None:
    deadline = time.monotonic() + UNIT_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if unit.process.poll() is not None:
            raise RuntimeError(f"rollout-service serve exited with {unit.process.returncode}:\n{_tail(unit.log_path)}")
        try:
            if httpx.get(f"{unit.sidecar_url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the rollout unit was not ready within {UNIT_READY_TIMEOUT_S:.0f} s:\n{_tail(unit.log_path)}")


def stop_unit(proc: subprocess.Popen) -> None:
    """SIGTERM serve (it stops SGLang's own process group); SIGKILL what is left of its descendants."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # Belt and braces: whatever of serve's process tree outlived it (SGLang runs in its own group).
    alive = [child for child in descendants if child.is_running()]
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(alive, timeout=20)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


@contextlib.contextmanager
def ready_unit(model_dir: Path, work_dir: Path) -> Iterator[RolloutUnit]:
    """A started and ready rollout unit (`serve`), stopped on exit: for module-scoped fixtures."""
    unit = launch_unit(model_dir, work_dir)
    try:
        wait_ready(unit)
        yield unit
    finally:
        stop_unit(unit.process)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
