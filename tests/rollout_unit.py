"""A real rollout unit for trainer tests: `rollout-service serve` (SGLang + sidecar) in a subprocess.

`launch_unit` starts one and returns at once (so that two units' slow start-ups can overlap),
`wait_ready` waits for the sidecar's `/readyz`, `stop_unit` stops it (`serve` stops SGLang's own
process group; the process helper kills whatever of it is left); `ready_unit` does all three for
a module-scoped fixture.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from helpers import free_port
from rollout_service.process_group import ProcessGroup
from sidecar_helpers import serve_argv

UNIT_READY_TIMEOUT_S = 600.0
UNIT_STOP_TIMEOUT_S = 60.0


@dataclass
class RolloutUnit:
    """One `rollout-service serve` process: an SGLang server and the sidecar that keeps it synced."""

    model_dir: Path
    checkpoint_root: Path
    sglang_url: str
    sidecar_url: str
    group: ProcessGroup

    @property
    def process(self) -> subprocess.Popen[bytes]:
        assert self.group.process is not None
        return self.group.process

    @property
    def log_path(self) -> Path:
        return self.group.log_path


def _serve_command() -> list[str]:
    script = Path(sys.executable).parent / "rollout-service"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout_service.cli"]


def launch_unit(model_dir: Path, workdir: Path) -> RolloutUnit:
    """Start `rollout-service serve` in its own session; returns at once (see `wait_ready`)."""
    root = workdir / "ckpts"
    root.mkdir(parents=True)
    sglang_port, sidecar_port = free_port(), free_port()
    cmd = _serve_command() + serve_argv(
        model_dir,
        root,
        sglang_port,
        sidecar_port,
        f"test-{sidecar_port}",
        "--sglang-log",
        str(workdir / "sglang.log"),
        "--stage-dir",  # the default, /dev/shm/rollout-stage-REPLICA, would outlive the test
        str(workdir / "stage"),
        health_interval=None,
    )
    group = ProcessGroup(cmd, workdir / "serve.log", name="rollout-service serve", die_with_parent=True)
    group.start()
    return RolloutUnit(model_dir, root, f"http://127.0.0.1:{sglang_port}", f"http://127.0.0.1:{sidecar_port}", group)


def wait_ready(unit: RolloutUnit) -> None:
    """Wait for the unit's sidecar to answer /readyz 200 (SGLang up and on the newest checkpoint)."""
    unit.group.wait_http(f"{unit.sidecar_url}/readyz", UNIT_READY_TIMEOUT_S)


def stop_unit(unit: RolloutUnit) -> None:
    """SIGTERM serve's group (serve stops SGLang's); SIGKILL what is left of its process groups."""
    unit.group.stop(UNIT_STOP_TIMEOUT_S)


@contextlib.contextmanager
def ready_unit(model_dir: Path, work_dir: Path) -> Iterator[RolloutUnit]:
    """A started and ready rollout unit (`serve`), stopped on exit: for module-scoped fixtures."""
    unit = launch_unit(model_dir, work_dir)
    try:
        wait_ready(unit)
        yield unit
    finally:
        stop_unit(unit)
