"""A sidecar in a container of its own can see the model SGLang serves.

The sidecar checks every checkpoint against the tensors of the served model, which it learns from
SGLang's ``model_path`` (``rollout_service/sidecar/served_model.py``): a local folder it reads, a Hub
id it finds in the local Hugging Face cache, or ``--reference-dir``. Without one of them it loads
nothing (``no_reference``). So wherever the sidecar runs beside SGLang rather than inside `serve`
(Kubernetes' rollout pods, compose's gpu profile), the deployment must show it SGLang's model:
``ROLLOUT_REFERENCE_DIR`` naming, in a volume it mounts, the folder SGLang's ``--model-path`` names;
or that path mounted from the same volume at the same place; or, for a Hub id, SGLang's download
cache mounted from the same volume at the same ``HF_HOME``. And the sidecar image must hold what
the Hub-cache lookup imports.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Any

import httpx

from deploy_files import (
    DOCKER_DIR,
    K8S_KUSTOMIZATIONS,
    REPO,
    compose_environment,
    compose_services,
    compose_volumes,
    k8s_argv,
    k8s_env,
    load_compose,
    pod_specs,
    render_kustomization,
    sglang_launch_argv,
    volume_at,
)

SERVED_MODEL = REPO / "rollout_service" / "sidecar" / "served_model.py"
HF_HOME_DEFAULT = "~/.cache/huggingface"


def _sglang_model_path(argv: list[str]) -> str:
    assert "--model-path" in argv, f"no --model-path in {argv}"
    return argv[argv.index("--model-path") + 1]


def _is_sidecar(argv: list[str]) -> bool:
    return argv[:2] == ["rollout-service", "sidecar"]


def _is_sglang(argv: list[str]) -> bool:
    return sglang_launch_argv(argv, {}) is not None


def _why_not_resolvable(
    model: str,
    sglang_mounts: list[tuple[str, str]],
    sglang_env: dict[str, str],
    sidecar_mounts: list[tuple[str, str]],
    sidecar_env: dict[str, str],
) -> str | None:
    """None when the sidecar finds the model SGLang serves, else why it cannot."""
    reference = sidecar_env.get("ROLLOUT_REFERENCE_DIR")
    if reference:
        served = volume_at(sglang_mounts, model) if model.startswith("/") else None
        seen = volume_at(sidecar_mounts, reference)
        if served is None or seen != served:
            return (
                f"ROLLOUT_REFERENCE_DIR={reference} is {seen} in the sidecar, but SGLang's --model-path {model}"
                f" is {served}: it must name the same folder of the same volume"
            )
        return None
    if model.startswith("/"):
        served = volume_at(sglang_mounts, model)
        if served is None:
            return f"SGLang's --model-path {model} is in no volume, so no other container can see it"
        seen = volume_at(sidecar_mounts, model)
        if seen != served:
            return (
                f"SGLang serves {model} from volume {served[0]}, but in the sidecar {model} is"
                f" {seen or 'not mounted'}: mount that volume in the sidecar at the same path (read-only)"
                " or set ROLLOUT_REFERENCE_DIR"
            )
        return None
    # A Hub id: SGLang downloads it into $HF_HOME/hub; the sidecar looks it up in its own $HF_HOME.
    home = sglang_env.get("HF_HOME")
    if not home:
        return f"SGLang serves the Hub id {model} without an explicit HF_HOME: set one on a mounted cache volume"
    cache = volume_at(sglang_mounts, home)
    if cache is None:
        return f"SGLang's HF_HOME {home} is in no volume, so no other container can see its download"
    if sidecar_env.get("HF_HOME") != home:
        return f"the sidecar's HF_HOME is {sidecar_env.get('HF_HOME')!r}, SGLang's {home!r}: they must be the same"
    if volume_at(sidecar_mounts, home) != cache:
        return (
            f"SGLang downloads {model} into volume {cache[0]} at {home}; the sidecar does not mount that volume"
            " there (read-only is enough)"
        )
    return None


def _k8s_cases() -> list[tuple[str, Any]]:
    cases = []
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        for workload, pod in pod_specs(manifests).items():
            resolved = []
            for container in pod["containers"]:
                env = k8s_env(container, manifests)
                argv = k8s_argv(container, env)
                mounts = [(m["name"], m["mountPath"]) for m in container.get("volumeMounts", [])]
                resolved.append((container["name"], argv, env, mounts))
            sidecars = [c for c in resolved if _is_sidecar(c[1])]
            sglangs = [c for c in resolved if _is_sglang(c[1])]
            for sidecar in sidecars:
                url = httpx.URL(sidecar[2]["ROLLOUT_SGLANG_URL"])
                assert url.host == "127.0.0.1" and len(sglangs) == 1, f"{kustomization.name} {workload}"
                cases.append((f"{kustomization.relative_to(REPO)} {workload}/{sidecar[0]}", (sglangs[0], sidecar)))
    return cases


def _compose_cases() -> list[tuple[str, Any]]:
    cases = []
    services = compose_services(load_compose())
    for name, service in services.items():
        argv = [str(t) for t in service["command"]]
        if not _is_sidecar(argv):
            continue
        env = compose_environment(service)
        host = httpx.URL(env["ROLLOUT_SGLANG_URL"]).host
        assert host in services, f"compose service {name}: ROLLOUT_SGLANG_URL names no service"
        target = services[host]
        sglang_argv = [str(t) for t in target["command"]]
        assert _is_sglang(sglang_argv), f"compose service {host} does not run SGLang"
        sidecar = (name, argv, env, [(v, t) for v, t, _ in compose_volumes(service)])
        sglang = (host, sglang_argv, compose_environment(target), [(v, t) for v, t, _ in compose_volumes(target)])
        cases.append((f"compose service {name} ({', '.join(service['profiles'])})", (sglang, sidecar)))
    return cases


def test_every_sidecar_in_its_own_container_can_resolve_the_model_sglang_serves():
    cases = _k8s_cases() + _compose_cases()
    where = {w for w, _ in cases}
    # Every Kubernetes kustomization's rollout pod and compose's gpu profile run the sidecar alone.
    assert len([w for w in where if w.startswith("deploy/k8s")]) == len(K8S_KUSTOMIZATIONS), where
    assert any(w.startswith("compose service sidecar") for w in where), where
    problems = []
    for where, ((_, sglang_argv, sglang_env, sglang_mounts), (_, _, sidecar_env, sidecar_mounts)) in cases:
        model = _sglang_model_path(sglang_argv)
        why = _why_not_resolvable(model, sglang_mounts, sglang_env, sidecar_mounts, sidecar_env)
        if why:
            problems.append(f"{where}: {why}")
    assert not problems, "the sidecar cannot learn the served model's tensors (no_reference):\n" + "\n".join(problems)


def test_the_check_tells_each_shape_apart():
    """The rule above, on hand-made layouts: each way that works, and the ways that do not."""
    models = [("models", "/models")]
    cache = [("cache", "/cache")]
    hub = {"HF_HOME": "/cache/huggingface"}
    assert _why_not_resolvable("/models/tiny", models, {}, models, {}) is None
    assert (
        _why_not_resolvable("/models/tiny", models, {}, [("models", "/ref")], {"ROLLOUT_REFERENCE_DIR": "/ref/tiny"})
        is None
    )
    assert "not mounted" in _why_not_resolvable("/models/tiny", models, {}, [("other", "/x")], {})
    assert "same folder" in _why_not_resolvable(
        "/models/tiny", models, {}, models, {"ROLLOUT_REFERENCE_DIR": "/models/big"}
    )
    assert _why_not_resolvable("org/model", cache, hub, cache, hub) is None
    assert "HF_HOME" in _why_not_resolvable("org/model", cache, hub, cache, {})
    assert "does not mount" in _why_not_resolvable("org/model", cache, hub, [], hub)
    assert "no volume" in _why_not_resolvable("org/model", [], hub, cache, hub)


def _lazy_third_party_imports(path: Path) -> set[str]:
    """Top-level modules imported inside functions of ``path`` that are neither the standard
    library nor this project (optional imports: a missing one silently turns a feature off)."""
    ours = {"rollout_service", "trainer_hooks", "rollout_demo"}
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                names = []
                if isinstance(inner, ast.Import):
                    names = [alias.name for alias in inner.names]
                elif isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                    names = [inner.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        found.add(top)
    return found


def _base_dependencies() -> set[str]:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("-", "_") for req in project["dependencies"]}


def test_the_sidecar_image_installs_what_the_served_model_lookup_imports():
    lazy = _lazy_third_party_imports(SERVED_MODEL)
    assert "huggingface_hub" in lazy, lazy  # the Hub-cache lookup (local_model_dir)
    text = re.sub(r"\\\n", " ", (DOCKER_DIR / "sidecar.Dockerfile").read_text())
    installs = [line for line in text.splitlines() if line.startswith("RUN ") and "pip install" in line]
    assert installs, "sidecar.Dockerfile installs nothing"
    for module in sorted(lazy - _base_dependencies()):
        named = [line for line in installs if re.search(rf"(?<![\w-]){re.escape(module)}(?![\w-])", line)]
        assert named, (
            f"served_model.py imports {module} to find the model SGLang serves, but the slim sidecar image"
            f" does not install it (neither a base dependency in pyproject.toml nor named in sidecar.Dockerfile):"
            " a sidecar beside an SGLang serving a Hub id would never load a checkpoint (no_reference)"
        )
        assert all("-c /tmp/build/src/requirements/cpu.lock" in line for line in named), (
            f"{module}: install it at the version requirements/cpu.lock pins"
        )
        assert re.search(
            rf"^{re.escape(module)}==", (REPO / "requirements" / "cpu.lock").read_text(), flags=re.M | re.I
        )
        assert any(f"import {module}" in line for line in named), f"sidecar.Dockerfile: check that {module} imports"
