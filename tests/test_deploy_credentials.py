"""Credentials in the deployment files: the sidecars' POST /sync token and SGLang's API key.

- Every SGLang is started with ``--api-key`` (its port is reachable by every pod of the cluster or
  container of the network: without a key anyone could POST ``/update_weights_from_disk`` with any
  path, past the sidecar's checks and token), and the probes the deploy files point at SGLang are
  paths SGLang answers without the key.
- The sidecar beside it sends that key (``ROLLOUT_SGLANG_API_KEY``), and every trainer gets both
  the sidecars' token (``ROLLOUT_TOKEN``) and the key from the same source as the sidecars (the
  Secret's key in Kubernetes, the ``.env`` variable in compose).
- ``rollout-service demo`` and the GPU example put those variables into GRPOConfig's
  ``sidecar_token`` and ``sglang_api_token``, which the trainer sends.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from deploy_files import (
    COMPOSE_TEST_ENV,
    DOCKER_DIR,
    K8S_KUSTOMIZATIONS,
    REPO,
    TEST_SGLANG_API_KEY,
    TEST_TOKEN,
    compose_environment,
    compose_services,
    dockerfile_images,
    healthcheck_command,
    k8s_argv,
    k8s_env,
    load_compose,
    pod_specs,
    render_kustomization,
    rollout_service_argv,
    sglang_launch_argv,
    split_passthrough,
)
from rollout_service.cli import _one_sglang_api_key
from rollout_service.cli_env import env_name
from rollout_service.sglang_key import API_KEY_OPTIONS

TOKEN_ENV = env_name("--token")  # the sidecar's --token
SGLANG_API_KEY_ENV = env_name("--sglang-api-key")  # the sidecar's --sglang-api-key
EXAMPLE = REPO / "examples" / "grpo_tldr_gpu.py"
EXAMPLE_IN_IMAGE = "/opt/rollout-service/examples/grpo_tldr_gpu.py"


def _role(argv: list[str]) -> str | None:
    """What a container's command line runs: sglang, sidecar, serve (SGLang + sidecar), trainer."""
    if sglang_launch_argv(argv, {}) is not None:
        return "sglang"
    service = rollout_service_argv(argv)
    if service is not None:
        return {"sidecar": "sidecar", "serve": "serve", "demo": "trainer"}.get(service[1])
    if argv[:2] == ["accelerate", "launch"] and EXAMPLE_IN_IMAGE in argv:
        return "trainer"
    return None


def _sglang_flags(argv: list[str], env: dict[str, str]) -> list[str]:
    """An SGLang command line, or the flags `serve` (with the environment ``env``) adds to SGLang's
    own: its passthrough after `--` and the API key it starts SGLang with."""
    if _role(argv) != "serve":
        return sglang_launch_argv(argv, env) or argv
    _, passthrough = split_passthrough(argv)
    return _one_sglang_api_key(passthrough, env.get(SGLANG_API_KEY_ENV))[0]


def _api_key_flag(argv: list[str], where: str) -> str:
    """The value of SGLang's --api-key in an SGLang command line (see `_sglang_flags`)."""
    assert "--api-key" in argv, f"{where}: SGLang is started without --api-key: {argv}"
    return argv[argv.index("--api-key") + 1]


def _sglang_parses(flags: list[str], where: str) -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        parser.parse_args(["--model-path", "/models/m", *flags])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise AssertionError(f"{where}: SGLang rejects {flags}: {exc}") from None


# ------------------------------------------------------------------------------ Kubernetes


def _k8s_containers() -> list[tuple[str, str, dict[str, Any], dict[str, str], list[str], tuple]]:
    """(where, role, container, resolved env, argv, manifests) of each container with a role."""
    found = []
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        for workload, pod in pod_specs(manifests).items():
            for container in pod["containers"]:
                env = k8s_env(container, manifests)
                argv = k8s_argv(container, env)
                role = _role(argv)
                if role:
                    where = f"{kustomization.relative_to(REPO)} {workload}/{container['name']}"
                    found.append((where, role, container, env, argv, manifests))
    return found


def _env_source(container: dict[str, Any], name: str) -> dict[str, Any] | None:
    for item in container.get("env", []):
        if item["name"] == name:
            return item.get("valueFrom") or {"value": item.get("value")}
    return None


def test_kubernetes_sglang_requires_a_secret_api_key_that_sidecar_and_trainer_send():
    by_kustomization: dict[str, dict[str, list]] = {}
    for where, role, container, env, argv, _ in _k8s_containers():
        by_kustomization.setdefault(where.split(" ")[0], {}).setdefault(role, []).append((where, container, env, argv))
    assert len(by_kustomization) == len(K8S_KUSTOMIZATIONS)
    for kustomization, roles in by_kustomization.items():
        assert {"sglang", "sidecar", "trainer"} <= set(roles), f"{kustomization}: {sorted(roles)}"
        sources = {}
        for where, container, env, argv in roles["sglang"]:
            raw = [str(a) for a in container["command"] + container.get("args", [])]
            assert not any(a.split("=", 1)[0] in API_KEY_OPTIONS for a in raw), (
                f"{where}: SGLang's --api-key is on its command line (ps, the pod spec) and in its log:"
                " start it with `rollout-service sglang`, the key in ROLLOUT_SGLANG_API_KEY"
            )
            assert raw[:2] == ["rollout-service", "sglang"], f"{where}: {raw[:3]}"
            source = _env_source(container, SGLANG_API_KEY_ENV)
            assert source and "secretKeyRef" in source, f"{where}: {SGLANG_API_KEY_ENV} is not read from a Secret"
            sources[where] = source["secretKeyRef"]
            flags = _sglang_flags(argv, {**env, SGLANG_API_KEY_ENV: "k"})
            assert _api_key_flag(flags, where) == "k"
            _sglang_parses(flags[flags.index("--api-key") : flags.index("--api-key") + 2], where)
        for role in ("sidecar", "trainer"):
            for where, container, _, _ in roles[role]:
                source = _env_source(container, SGLANG_API_KEY_ENV)
                assert source and "secretKeyRef" in source, f"{where}: no {SGLANG_API_KEY_ENV} from the Secret"
                sources[where] = source["secretKeyRef"]
        assert len({json.dumps(s, sort_keys=True) for s in sources.values()}) == 1, (
            f"{kustomization}: SGLang's --api-key and the sidecar's and trainer's keys: one Secret key, not {sources}"
        )


def test_kubernetes_trainers_get_the_sidecar_token_from_the_sidecars_secret():
    sidecar_sources: dict[str, dict] = {}
    trainers = []
    for where, role, container, _, _, _ in _k8s_containers():
        kustomization = where.split(" ")[0]
        if role == "sidecar":
            source = _env_source(container, TOKEN_ENV)
            assert source and "secretKeyRef" in source, f"{where}: the sidecar's token must come from a Secret"
            sidecar_sources[kustomization] = source["secretKeyRef"]
        elif role == "trainer":
            trainers.append((kustomization, where, container))
    assert {k for k, _, _ in trainers} == set(sidecar_sources) and len(sidecar_sources) == len(K8S_KUSTOMIZATIONS)
    for kustomization, where, container in trainers:
        source = _env_source(container, TOKEN_ENV)
        assert source is not None, f"{where}: the trainer has no {TOKEN_ENV}: every POST /sync would get 401"
        assert source.get("secretKeyRef") == sidecar_sources[kustomization], (
            f"{where}: {TOKEN_ENV} must come from the sidecars' Secret key {sidecar_sources[kustomization]}: {source}"
        )


# ---------------------------------------------------------------------------------- compose


def _compose_roles(env: dict[str, str]) -> dict[str, dict[str, list[tuple[str, list[str], dict[str, str]]]]]:
    roles: dict[str, dict[str, list]] = {}
    compose = load_compose(env)
    for profile in ("cpu", "gpu"):
        for name, service in compose_services(compose, profile).items():
            argv = [str(t) for t in service["command"]]
            role = _role(argv)
            if role:
                roles.setdefault(profile, {}).setdefault(role, []).append((name, argv, compose_environment(service)))
    return roles


def test_compose_sglang_requires_the_api_key_that_sidecars_and_trainers_send():
    env = {"ROLLOUT_TOKEN": "token-from-env-file", "ROLLOUT_SGLANG_API_KEY": "key-from-env-file"}
    roles = _compose_roles(env)
    assert set(roles) == {"cpu", "gpu"}
    for profile, found in roles.items():
        servers = found.get("sglang", []) + found.get("serve", [])
        clients = found.get("sidecar", []) + found.get("serve", []) + found.get("trainer", [])
        assert servers and found.get("trainer"), f"profile {profile}: {found}"
        for name, argv, service_env in servers:
            where = f"compose service {name}"
            flags = _sglang_flags(argv, service_env)
            assert _api_key_flag(flags, where) == env["ROLLOUT_SGLANG_API_KEY"], (
                f"{where}: SGLang's --api-key must be the .env variable ROLLOUT_SGLANG_API_KEY"
            )
            assert env["ROLLOUT_SGLANG_API_KEY"] not in " ".join(argv), (
                f"{where}: SGLang's key is in the container's command line (docker inspect, ps)"
            )
            if _role(argv) == "serve":
                _sglang_parses(flags, where)
        for name, _, service_env in clients:
            assert service_env.get(SGLANG_API_KEY_ENV) == env["ROLLOUT_SGLANG_API_KEY"], (
                f"compose service {name}: {SGLANG_API_KEY_ENV} must be the key SGLang was started with"
            )
    # Required, like the token: a stack without a key does not start.
    with pytest.raises(AssertionError, match="ROLLOUT_SGLANG_API_KEY"):
        load_compose({"ROLLOUT_TOKEN": "t"})


def test_compose_trainers_get_the_sidecar_token_the_sidecars_require():
    env = {"ROLLOUT_TOKEN": "token-from-env-file", "ROLLOUT_SGLANG_API_KEY": "key-from-env-file"}
    for profile, found in _compose_roles(env).items():
        sidecars = found.get("sidecar", []) + found.get("serve", [])
        assert sidecars and found.get("trainer"), f"profile {profile}: {found}"
        for name, _, service_env in sidecars:
            assert service_env.get(TOKEN_ENV) == env["ROLLOUT_TOKEN"], f"compose service {name}"
        for name, _, service_env in found["trainer"]:
            assert service_env.get(TOKEN_ENV) == env["ROLLOUT_TOKEN"], (
                f"compose service {name} (profile {profile}): the trainer has no {TOKEN_ENV} from .env,"
                " so every POST /sync to the sidecar gets 401"
            )


# ------------------------------------------------------------------------- SGLang's probes


def _checked_path(argv: list[str]) -> str:
    """The SGLang path a health check command asks: `rollout-service liveness` asks ``/health``
    (and the sidecar's ``/status``, which needs no key either)."""
    assert argv[:2] == ["rollout-service", "liveness"], argv
    return "/health"


def _sglang_probe_paths() -> list[tuple[str, str]]:
    paths = []
    for where, role, container, _, _, _ in _k8s_containers():
        if role != "sglang":
            continue
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            spec = container.get(probe, {})
            if "httpGet" in spec:
                paths.append((f"{where} {probe}", spec["httpGet"]["path"]))
            if "exec" in spec:
                command = spec["exec"]["command"]
                assert command[:2] == ["rollout-service", "liveness"], f"{where} {probe}: {command}"
                paths.append((f"{where} {probe} (rollout-service liveness)", "/health"))
    for name, service in compose_services(load_compose()).items():
        argv = [str(t) for t in service["command"]]
        if _role(argv) == "sglang":
            test = [str(t) for t in service["healthcheck"]["test"]]
            paths.append((f"compose service {name} healthcheck", _checked_path(test[1:])))
    for (dockerfile, target), stage in dockerfile_images().items():
        if dockerfile == "rollout.Dockerfile" and stage["healthcheck"]:
            argv = shlex.split(healthcheck_command(stage))
            paths.append((f"{dockerfile} {target} HEALTHCHECK", _checked_path(argv)))
    return paths


def test_sglang_answers_the_deploy_files_probes_without_its_api_key():
    """SGLang 0.5.23's own auth decision: the probes need no key, the weight update does."""
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    def allowed(path: str, header: str | None) -> bool:
        return decide_request_auth(
            method="GET",
            path=path,
            authorization_header=header,
            api_key="k",
            admin_api_key=None,
            auth_level=AuthLevel.NORMAL,
        ).allowed

    paths = _sglang_probe_paths()
    assert len(paths) >= len(K8S_KUSTOMIZATIONS) * 2 + 2, paths
    for where, path in paths:
        assert allowed(path, None), f"{where}: SGLang refuses {path} without its API key: the probe would fail"
    assert (DOCKER_DIR / "rollout.Dockerfile").is_file()
    update = decide_request_auth(
        method="POST",
        path="/update_weights_from_disk",
        authorization_header=None,
        api_key="k",
        admin_api_key=None,
        auth_level=AuthLevel.ADMIN_OPTIONAL,
    )
    assert not update.allowed  # what the key is for
    assert allowed("/generate", "Bearer k") and not allowed("/generate", None)


# --------------------------------------------------- the trainers put them into GRPOConfig


class _Stop(Exception):
    """Raised by the stand-in trainer once it has the config."""


def _capture_config(monkeypatch: pytest.MonkeyPatch, owner: Any) -> list[Any]:
    seen: list[Any] = []

    class Trainer:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            seen.append(kwargs["args"])
            raise _Stop

    monkeypatch.setattr(owner, "GRPOTrainer", Trainer)
    return seen


def _clean_rollout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ROLLOUT_"):
            monkeypatch.delenv(name)


def test_demo_passes_the_token_and_key_variables_into_the_trainer_config(monkeypatch, tmp_path, tiny_model_dir):
    import trainer_hooks
    from rollout_demo import cli

    _clean_rollout_env(monkeypatch)
    monkeypatch.setenv(TOKEN_ENV, TEST_TOKEN)
    monkeypatch.setenv(SGLANG_API_KEY_ENV, TEST_SGLANG_API_KEY)
    seen = _capture_config(monkeypatch, trainer_hooks)
    argv = [
        "demo",
        "--output-dir",
        str(tmp_path / "out"),
        "--model",
        str(tiny_model_dir),
        "--sglang-url",
        "http://127.0.0.1:9",
        "--sidecar-url",
        "http://127.0.0.1:9",
        "--checkpoint-path",
        str(tmp_path / "checkpoints"),
        "--steps",
        "1",
    ]
    args = cli.build_parser().parse_args(argv)
    assert (args.token, args.sglang_api_key) == (TEST_TOKEN, TEST_SGLANG_API_KEY)
    with pytest.raises(_Stop):
        cli.main(argv)
    (config,) = seen
    assert config.sidecar_token == TEST_TOKEN and config.sglang_api_token == TEST_SGLANG_API_KEY
    # A flag wins over its variable; without either there is none.
    assert cli.build_parser().parse_args([*argv, "--token", "other"]).token == "other"
    _clean_rollout_env(monkeypatch)
    args = cli.build_parser().parse_args(argv)
    assert args.token is None and args.sglang_api_key is None


def test_demo_gives_the_serve_it_starts_the_token_and_key(monkeypatch, tmp_path):
    from rollout_demo import demo

    started: list[Any] = []

    class Group:
        def __init__(self, argv: list[str], log_path: Path, **kwargs: Any) -> None:
            started.append((argv, kwargs))

        def start(self) -> None:
            pass

    monkeypatch.setattr(demo, "ProcessGroup", Group)
    demo.ServeProcess(tmp_path / "m", tmp_path / "c", tmp_path / "serve.log", "cpu", token="tok", sglang_api_key="key")
    ((argv, kwargs),) = started
    assert kwargs["env"][TOKEN_ENV] == "tok" and kwargs["env"][SGLANG_API_KEY_ENV] == "key"
    assert argv[argv.index("serve") :][-3:] == ["--", "--api-key", "key"]
    assert "tok" not in argv  # the token travels in the environment only


def _example_module() -> Any:
    spec = importlib.util.spec_from_file_location("grpo_tldr_gpu_credentials", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_example_passes_the_token_and_key_variables_into_the_trainer_config(monkeypatch, tmp_path):
    example = _example_module()
    data = tmp_path / "tldr.jsonl"
    data.write_text(json.dumps({"prompt": "POST: a post\nTL;DR:", "completion": " a summary"}) + "\n")
    (tmp_path / "checkpoints").mkdir()
    argv = [
        "--device",
        "cpu",
        "--model",
        "unused",
        "--dataset",
        str(data),
        "--checkpoint-path",
        str(tmp_path / "checkpoints"),
        "--sglang-url",
        "http://127.0.0.1:9",
        "--sidecar-url",
        "http://127.0.0.1:9",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    _clean_rollout_env(monkeypatch)
    monkeypatch.setenv(TOKEN_ENV, TEST_TOKEN)
    monkeypatch.setenv(SGLANG_API_KEY_ENV, TEST_SGLANG_API_KEY)
    seen = _capture_config(monkeypatch, example)
    with pytest.raises(_Stop):
        example.main(argv)
    with pytest.raises(_Stop):
        example.main([*argv, "--token", "flag-token", "--sglang-api-key", "flag-key"])
    _clean_rollout_env(monkeypatch)
    with pytest.raises(_Stop):
        example.main(argv)
    from_env, from_flags, without = seen
    assert (from_env.sidecar_token, from_env.sglang_api_token) == (TEST_TOKEN, TEST_SGLANG_API_KEY)
    assert (from_flags.sidecar_token, from_flags.sglang_api_token) == ("flag-token", "flag-key")
    assert without.sidecar_token is None and without.sglang_api_token is None
    # --help never shows a secret from the environment.
    monkeypatch.setenv(TOKEN_ENV, TEST_TOKEN)
    assert TEST_TOKEN not in example.build_parser().format_help()


def test_compose_test_env_sets_every_required_variable():
    assert set(COMPOSE_TEST_ENV) == {"ROLLOUT_TOKEN", "ROLLOUT_SGLANG_API_KEY"}
    load_compose(COMPOSE_TEST_ENV)
