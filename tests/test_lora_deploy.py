"""LoRA serving in the deployment files: the Kustomize components and the compose variable give
SGLang the flags `rollout-service serve --lora` gives it (rollout_service/lora_serving.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploy_files import (
    COMPOSE_TEST_ENV,
    K8S_DIR,
    compose_environment,
    compose_services,
    find_container,
    kustomize_command,
    load_compose,
    pod_specs,
    render_kustomization,
)
from rollout_service.lora_serving import LoraServing


def overlay_with(tmp_path: Path, overlay: str, *components: str) -> Path:
    """A kustomization outside the repository: an overlay plus components (kustomize wants relative paths)."""
    folder = tmp_path / f"{overlay}-lora"
    folder.mkdir()
    lines = ["resources:", f"  - {os.path.relpath(K8S_DIR / 'overlays' / overlay, folder)}", "components:"]
    lines += [f"  - {os.path.relpath(K8S_DIR / 'components' / c, folder)}" for c in components]
    (folder / "kustomization.yaml").write_text("\n".join(lines) + "\n")
    return folder


def render_outside(kustomization: Path) -> tuple:
    """Render a kustomization that names overlays and components outside its own folder."""
    command = kustomize_command()
    assert command is not None, "neither kustomize nor kubectl is on PATH"
    done = subprocess.run(
        [*command, "--load-restrictor", "LoadRestrictionsNone", str(kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def sglang_args(kustomization: Path) -> list[str]:
    inside = kustomization.is_relative_to(K8S_DIR)
    pod = pod_specs(render_kustomization(kustomization) if inside else render_outside(kustomization))["rollout"]
    return [str(a) for a in find_container(pod, "sglang")["args"]]


def test_the_lora_component_adds_serve_lora_flags_to_sglang(tmp_path):
    plain = sglang_args(K8S_DIR / "overlays" / "gpu")
    with_lora = sglang_args(overlay_with(tmp_path, "gpu", "lora"))
    assert with_lora[: len(plain)] == plain and with_lora[len(plain) :] == LoraServing().sglang_args("cuda")
    cpu = sglang_args(overlay_with(tmp_path, "cpu-dev", "lora", "lora-cpu"))
    assert cpu[-len(LoraServing().sglang_args("cpu")) :] == LoraServing().sglang_args("cpu")


def overlay_edited(tmp_path: Path, overlay: str, *components: str) -> Path:
    """The documented shape (docs/lora.md): the components listed in the overlay's own
    kustomization.yaml, edited in a copy of deploy/k8s (so its relative paths still hold)."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S_DIR, tree)
    folder = tree / "overlays" / overlay
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert "components" not in kustomization, f"{overlay} already lists components"
    kustomization["components"] = [f"../../components/{c}" for c in components]
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return folder


def without(args: list[str], part: list[str]) -> list[str]:
    """``args`` with the run ``part`` taken out; fails when ``part`` is not one run of ``args``."""
    for start in range(len(args) - len(part) + 1):
        if args[start : start + len(part)] == part:
            return args[:start] + args[start + len(part) :]
    raise AssertionError(f"{part} is not in SGLang's args {args}")


@pytest.mark.parametrize(
    ("overlay", "components", "device"),
    [("gpu", ("lora",), "cuda"), ("cpu-dev", ("lora", "lora-cpu"), "cpu")],
    ids=["gpu", "cpu-dev"],
)
@pytest.mark.parametrize("shape", ["components-in-the-overlay", "overlay-as-a-resource"])
def test_the_lora_components_keep_every_overlay_flag_in_both_documented_shapes(
    tmp_path, overlay, components, device, shape
):
    """kustomize applies an overlay's own patches after its components: a patch that replaced
    SGLang's args would drop the LoRA flags when the components are listed in the overlay itself
    (docs/lora.md); the wrapper shape would keep them. Both must give the overlay's flags plus
    `serve --lora`'s."""
    plain = sglang_args(K8S_DIR / "overlays" / overlay)
    if shape == "components-in-the-overlay":
        args = sglang_args(overlay_edited(tmp_path, overlay, *components))
    else:
        args = sglang_args(overlay_with(tmp_path, overlay, *components))
    lora = LoraServing().sglang_args(device)
    assert without(args, lora) == plain, f"{shape}: {args}"


def test_compose_cpu_profile_passes_rollout_lora_to_serve():
    service = compose_services(load_compose({**COMPOSE_TEST_ENV, "ROLLOUT_LORA": "1"}), "cpu")["rollout-cpu"]
    assert compose_environment(service)["ROLLOUT_LORA"] == "1"
