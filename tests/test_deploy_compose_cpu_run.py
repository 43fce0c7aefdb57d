"""The compose `cpu` profile run on this machine without containers: its rollout service's command
and environment as a subprocess (volume paths and ports rewritten), ready by its own healthcheck,
loads a published checkpoint and labels completions with it; SGLang answers only with the API key
from the compose environment, which the sidecar sends.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy_files import (
    STARTUP_TIMEOUT_S,
    compose_environment,
    compose_services,
    compose_volumes,
    load_compose,
)
from helpers import free_port
from rollout_service.cli_env import ENV_PREFIX
from rollout_service.process_group import ProcessGroup, descendant_groups, signal_group


def _rewrite(value: str, paths: dict[str, Path], ports: dict[int, int]) -> str:
    """Map container volume paths to host folders and container ports to free host ports."""
    for target in sorted(paths, key=len, reverse=True):
        if value == target or value.startswith(target + "/"):
            value = str(paths[target]) + value[len(target) :]
            break
    if value.isdigit() and int(value) in ports:
        return str(ports[int(value)])
    return re.sub(r":(\d+)(?=[/'\"]|$)", lambda m: f":{ports.get(int(m.group(1)), int(m.group(1)))}", value)


@pytest.mark.sglang
def test_compose_cpu_profile_serves_and_syncs_a_published_checkpoint(tmp_path):
    """The cpu profile's rollout service, run as a plain process with the compose command and
    environment, becomes ready, loads a published checkpoint and labels completions with it.

    The tiny-model service's output is put in place from the cached build of the same function
    (``ensure_tiny_model``); the demo trainer is stood in for by ``rollout-service publish``, which
    writes a checkpoint the way the trainer does."""
    from rollout_service.tiny_model import ensure_tiny_model

    cpu = compose_services(load_compose(), "cpu")
    rollout = cpu["rollout-cpu"]
    paths: dict[str, Path] = {}
    for service in cpu.values():
        for volume, target, _ in compose_volumes(service):
            paths[target] = tmp_path / "volumes" / volume
            paths[target].mkdir(parents=True, exist_ok=True)
    ports = {int(str(mapping).rsplit(":", 1)[1]): free_port() for mapping in rollout["ports"]}

    maker = [str(t) for t in cpu["tiny-model"]["command"]]
    assert maker[:2] == ["rollout-service", "make-tiny-model"] and "--tied" not in maker
    model_dir = Path(_rewrite(maker[maker.index("--out") + 1], paths, ports))
    shutil.copytree(ensure_tiny_model(tied=False), model_dir)

    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    compose_env = {k: _rewrite(v, paths, ports) for k, v in compose_environment(rollout).items()}
    env.update(compose_env)
    argv = [_rewrite(str(t), paths, ports) for t in rollout["command"]]
    health = rollout["healthcheck"]["test"]
    assert health[0] == "CMD"
    health_argv = [_rewrite(str(t), paths, ports) for t in health[1:]]

    sidecar_url = f"http://127.0.0.1:{compose_env['ROLLOUT_SIDECAR_PORT']}"
    sglang_url = f"http://127.0.0.1:{compose_env['ROLLOUT_PORT']}"
    checkpoints = Path(compose_env["ROLLOUT_CHECKPOINT_PATH"])
    assert checkpoints.is_relative_to(tmp_path) and Path(compose_env["ROLLOUT_MODEL"]) == model_dir
    assert int(compose_env["ROLLOUT_SIDECAR_PORT"]) in ports.values()

    group = ProcessGroup(
        argv,
        tmp_path / "rollout-cpu.log",
        name="compose service rollout-cpu",
        env=env,
        cwd=tmp_path,
        die_with_parent=True,
    )
    group.start()
    assert group.process is not None
    process = group.process
    groups: set[int] = set()  # SGLang's own group and any other a descendant starts, while seen

    def log_tail() -> str:
        return group.log_tail(60)

    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            groups |= descendant_groups(process.pid)
            assert process.poll() is None, f"`{shlex.join(argv)}` exited {process.returncode}:\n{log_tail()}"
            check = subprocess.run(health_argv, env=env, capture_output=True, timeout=30, check=False)
            if check.returncode == 0:
                break
            assert time.monotonic() < deadline, (
                f"the compose healthcheck did not pass within {STARTUP_TIMEOUT_S:.0f} s:\n{log_tail()}"
            )
            time.sleep(3)
        assert httpx.get(f"{sidecar_url}/readyz", timeout=10).status_code == 200

        published = subprocess.run(
            [
                "rollout-service",
                "publish",
                "--model-dir",
                str(model_dir),
                "--checkpoint-path",
                str(checkpoints),
                "--step",
                "1",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert published.returncode == 0, published.stderr

        waited = httpx.get(f"{sidecar_url}/wait", params={"version": 1, "timeout": 240}, timeout=260)
        assert waited.status_code == 200, f"{waited.text}\n{log_tail()}"
        status = httpx.get(f"{sidecar_url}/status", timeout=10).json()
        assert status["loaded_step"] == 1 and status["replica_id"] == compose_env["ROLLOUT_REPLICA_ID"]
        assert httpx.get(f"{sidecar_url}/readyz", timeout=10).status_code == 200

        # `serve` started SGLang with the compose environment's API key (the sidecar sent it to
        # load step 1): without it SGLang refuses requests, the weight update included.
        api_key = compose_env["ROLLOUT_SGLANG_API_KEY"]
        assert api_key and "--api-key" not in argv  # given once, in the environment
        request = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        assert httpx.post(f"{sglang_url}/generate", timeout=60, json=request).status_code == 401
        refused = httpx.post(
            f"{sglang_url}/update_weights_from_disk",
            timeout=60,
            json={"model_path": str(checkpoints / "step-00000001")},
        )
        assert refused.status_code == 401, refused.text
        completion = httpx.post(
            f"{sglang_url}/generate", timeout=300, json=request, headers={"Authorization": f"Bearer {api_key}"}
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["meta_info"]["weight_version"] == "1"

        ack = checkpoints / "acks" / f"{compose_env['ROLLOUT_REPLICA_ID']}.json"
        deadline = time.monotonic() + 30
        while not (ack.is_file() and json.loads(ack.read_text()).get("loaded_step") == 1):
            assert time.monotonic() < deadline, f"no ack for step 1 in {ack}"
            time.sleep(0.5)

        # The token from the compose environment guards POST /sync.
        assert httpx.post(f"{sidecar_url}/sync", timeout=10).status_code == 401
        synced = httpx.post(
            f"{sidecar_url}/sync", timeout=10, headers={"Authorization": f"Bearer {compose_env['ROLLOUT_TOKEN']}"}
        )
        assert synced.status_code == 202
    finally:
        group.stop(60.0)
        for leftover in groups:
            signal_group(leftover, signal.SIGKILL)
