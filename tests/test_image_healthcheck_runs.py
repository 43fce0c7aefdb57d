"""The rollout image's HEALTHCHECK, run as Docker runs it (``/bin/sh -c``), against the real
SGLang server: it asks the SGLang and the sidecar on the ports `serve` was given through its
``ROLLOUT_PORT`` and ``ROLLOUT_SIDECAR_PORT``, and counts SGLang alive while the sidecar reports
a weight load in flight (SGLang's ``/health`` waits on the load; the old check, a plain
``/health`` request, showed the container unhealthy for the whole load).

The sidecar here is `fake_sglang.CannedServer` answering ``/status`` with a load in flight: a
real sidecar reports one only for the seconds a real tiny model takes to load.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_files import DOCKER_DIR, dockerfile_stages, healthcheck_command
from fake_sglang import CannedServer, canned_reply

STAGES = [stage for stage in dockerfile_stages(DOCKER_DIR / "rollout.Dockerfile") if stage["healthcheck"]]


def run_check(stage: dict, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    return subprocess.run(
        ["/bin/sh", "-c", healthcheck_command(stage)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("stage", STAGES, ids=[s["target"] for s in STAGES])
def test_the_rollout_image_check_asks_serves_ports_and_knows_about_loads(stage, sglang_server, free_port):
    assert len(STAGES) == 2
    sglang_port = sglang_server.url.rsplit(":", 1)[1]
    nothing = str(free_port)

    alive = run_check(stage, {"ROLLOUT_PORT": sglang_port, "ROLLOUT_SIDECAR_PORT": nothing})
    assert alive.returncode == 0, alive.stdout + alive.stderr
    assert f"127.0.0.1:{sglang_port}/health answered 200" in alive.stdout + alive.stderr

    dead = run_check(stage, {"ROLLOUT_PORT": nothing, "ROLLOUT_SIDECAR_PORT": nothing})
    assert dead.returncode == 1, dead.stdout + dead.stderr

    sidecar = CannedServer(lambda path, body, count: canned_reply(200, {"sglang_loading_step": 7}))
    try:
        sidecar_port = sidecar.url.rsplit(":", 1)[1]
        loading = run_check(stage, {"ROLLOUT_PORT": nothing, "ROLLOUT_SIDECAR_PORT": sidecar_port})
        assert loading.returncode == 0, loading.stdout + loading.stderr
        assert "loading step 7" in loading.stdout + loading.stderr
        assert [(m, p) for m, p, _ in sidecar.requests] == [("GET", "/status")]
    finally:
        sidecar.stop()
