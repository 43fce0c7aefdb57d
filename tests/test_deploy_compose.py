"""The compose stack: validated by Docker Compose itself for each profile, its token and .env.example,
its probes, ports and volumes against the CLI and the sidecar.
"""

from __future__ import annotations

import re

import httpx
import pytest

from deploy_files import (
    COMPOSE_DIR,
    COMPOSE_FILE,
    COMPOSE_TEST_ENV,
    ENV_EXAMPLE,
    TEST_SGLANG_API_KEY,
    TEST_TOKEN,
    VERSION,
    compose_environment,
    compose_services,
    compose_volumes,
    docker_compose_config,
    load_compose,
    option_default,
    sidecar_routes,
    url_port,
    urls_in,
)
from rollout_service.cli_env import ENV_PREFIX


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_file_validates_with_docker_compose(profile, tmp_path):
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    model = docker_compose_config(profile, empty_env_file, COMPOSE_TEST_ENV)
    ours = compose_services(load_compose(), profile)
    assert set(model["services"]) == set(ours)
    # The interpolation these tests use (and the cpu-profile run below) agrees with Compose's.
    for name, service in ours.items():
        normalized = model["services"][name]
        assert normalized["command"] == service["command"], name
        assert normalized.get("environment", {}) == compose_environment(service), name
        assert normalized["image"] == service["image"], name
        assert [
            (v["source"], v["target"], v.get("read_only", False)) for v in normalized.get("volumes", [])
        ] == compose_volumes(service), name
        if "healthcheck" in service:
            assert normalized["healthcheck"]["test"] == service["healthcheck"]["test"], name

    # The shipped .env.example is a working configuration with a placeholder token.
    docker_compose_config(profile, ENV_EXAMPLE, {})


def test_compose_requires_a_token_and_an_sglang_api_key_and_the_example_env_documents_every_variable():
    text = COMPOSE_FILE.read_text()
    variables = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    example = dict(
        line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line.strip() and not line.startswith("#")
    )
    assert variables == set(example), "compose.yaml's variables and .env.example's must match"
    assert example["ROLLOUT_TOKEN"] == "REPLACE_WITH_A_RANDOM_TOKEN"
    assert example["ROLLOUT_SGLANG_API_KEY"] == "REPLACE_WITH_A_RANDOM_KEY"
    assert example["IMAGE_TAG"] == VERSION
    for name in COMPOSE_TEST_ENV:  # each one required on its own
        with pytest.raises(AssertionError, match=name):
            load_compose({k: v for k, v in COMPOSE_TEST_ENV.items() if k != name})
    assert (COMPOSE_DIR / ".gitignore").read_text().splitlines()[-1] == ".env"


def test_compose_probes_ports_and_volumes_match_the_cli_and_sidecar():
    routes = sidecar_routes()
    compose = load_compose()
    services = compose_services(compose)
    assert set(compose["volumes"]) >= {"checkpoints", "models"}
    sidecar_like = {"rollout-cpu": "ROLLOUT_SIDECAR_PORT", "sidecar": "ROLLOUT_PORT"}
    for name, port_variable in sidecar_like.items():
        service = services[name]
        env = compose_environment(service)
        command = service["command"][1]
        flag = "--" + port_variable[len(ENV_PREFIX) :].lower().replace("_", "-")
        port = int(env.get(port_variable) or option_default(command, flag))
        assert env["ROLLOUT_HOST"] == "0.0.0.0", f"{name}: other containers must reach the sidecar"
        (url,) = urls_in(" ".join(service["healthcheck"]["test"]))
        assert httpx.URL(url).path == "/readyz" and "/readyz" in routes
        assert url_port(url) == port, f"{name}: healthcheck port"
        assert any(str(p).endswith(f":{port}") for p in service["ports"]), f"{name}: published port"
        watched = env["ROLLOUT_CHECKPOINT_PATH"]
        assert ("checkpoints", watched, False) in compose_volumes(service), (
            f"{name}: the checkpoint volume must be mounted read-write at {watched} (acks/)"
        )
        assert env["ROLLOUT_TOKEN"] == TEST_TOKEN
        assert env["ROLLOUT_SGLANG_API_KEY"] == TEST_SGLANG_API_KEY
    gpu = compose_services(compose, "gpu")
    sglang_argv = [str(t) for t in gpu["sglang"]["command"]]
    sglang_port = int(sglang_argv[sglang_argv.index("--port") + 1])
    sidecar_env = compose_environment(gpu["sidecar"])
    assert httpx.URL(sidecar_env["ROLLOUT_SGLANG_URL"]) == httpx.URL(f"http://sglang:{sglang_port}")
    assert ("checkpoints", sidecar_env["ROLLOUT_CHECKPOINT_PATH"], True) in compose_volumes(gpu["sglang"])
    # SGLang's check is the load-aware probe (its /health waits on a weight load), asking this
    # SGLang and its sidecar, both calls within the healthcheck's timeout.
    probe = [str(t) for t in gpu["sglang"]["healthcheck"]["test"]]
    assert probe[:3] == ["CMD", "rollout-service", "liveness"], probe
    health = probe[probe.index("--sglang-url") + 1]
    assert httpx.URL(health) == httpx.URL(f"http://127.0.0.1:{sglang_port}")
    sidecar_url = probe[probe.index("--sidecar-url") + 1]
    assert httpx.URL(sidecar_url) == httpx.URL(f"http://sidecar:{sidecar_env['ROLLOUT_PORT']}")
    assert 2 * float(probe[probe.index("--timeout") + 1]) < float(
        str(gpu["sglang"]["healthcheck"]["timeout"]).removesuffix("s")
    )

    # The trainers write where the sidecars watch and talk to the right services and ports.
    cpu = compose_services(compose, "cpu")
    cpu_env = compose_environment(cpu["rollout-cpu"])
    targets = {
        "demo": (
            cpu_env["ROLLOUT_CHECKPOINT_PATH"],
            f"http://rollout-cpu:{cpu_env['ROLLOUT_PORT']}",
            f"http://rollout-cpu:{cpu_env['ROLLOUT_SIDECAR_PORT']}",
        ),
        "trainer": (
            sidecar_env["ROLLOUT_CHECKPOINT_PATH"],
            f"http://sglang:{sglang_port}",
            f"http://sidecar:{sidecar_env['ROLLOUT_PORT']}",
        ),
    }
    for name, (checkpoints, sglang_url, sidecar_url) in targets.items():
        argv = [str(t) for t in services[name]["command"]]
        assert argv[argv.index("--checkpoint-path") + 1] == checkpoints
        assert ("checkpoints", checkpoints, False) in compose_volumes(services[name])
        assert argv[argv.index("--sglang-url") + 1] == sglang_url
        assert argv[argv.index("--sidecar-url") + 1] == sidecar_url

    # The tiny model: built once into the models volume, read from there by both sides.
    out = cpu["tiny-model"]["command"][cpu["tiny-model"]["command"].index("--out") + 1]
    assert cpu_env["ROLLOUT_MODEL"] == out
    demo_argv = [str(t) for t in cpu["demo"]["command"]]
    assert demo_argv[demo_argv.index("--model") + 1] == out
    for name in ("tiny-model", "rollout-cpu", "demo"):
        assert any(
            volume == "models" and out.startswith(target + "/") for volume, target, _ in compose_volumes(cpu[name])
        ), name
