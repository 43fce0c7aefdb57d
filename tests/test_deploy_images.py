"""The Dockerfiles: pinned bases, non-root users, health checks; one SGLang version and one image
name and tag (the project version) across Dockerfiles, compose and Kubernetes.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import httpx

from deploy_files import (
    DOCKER_DIR,
    K8S_KUSTOMIZATIONS,
    PROJECT,
    REPO,
    VERSION,
    compose_services,
    dockerfile_images,
    dockerfile_stages,
    expand_args,
    healthcheck_command,
    load_compose,
    option_default,
    pod_specs,
    render_kustomization,
    sidecar_routes,
    urls_in,
)


def test_dockerfiles_pin_bases_run_as_non_root_and_declare_health_checks():
    images = dockerfile_images()
    assert {key[0] for key in images} == {"rollout.Dockerfile", "sidecar.Dockerfile", "trainer.Dockerfile"}
    shared_args = {}
    routes = sidecar_routes()
    for path in sorted(DOCKER_DIR.glob("*.Dockerfile")):
        assert (path.parent / f"{path.name}.dockerignore").is_file(), f"{path.name}: no .dockerignore"
        ignore = (path.parent / f"{path.name}.dockerignore").read_text().splitlines()
        assert "*" in ignore and not any(line.startswith("!.env") for line in ignore)
        for stage in dockerfile_stages(path):
            where = f"{path.name} stage {stage['target'] or 'default'}"
            base = expand_args(stage["from"], stage["args"])
            assert "$" not in base and ":" in base and not base.endswith(":latest"), f"{where}: {base}"
            assert re.fullmatch(r"\d+(:\d+)?", expand_args(stage["user"] or "", stage["args"])), (
                f"{where}: USER must be a numeric non-root uid (Kubernetes runAsNonRoot checks it)"
            )
            assert not expand_args(stage["user"], stage["args"]).startswith("0"), where
            assert stage["healthcheck"], f"{where}: no HEALTHCHECK"
            assert stage["labels"]["org.opencontainers.image.version"] == VERSION, where
            for name, value in stage["env"].items():
                assert not re.search(r"TOKEN|SECRET|PASSWORD|API_KEY", name) or not value, (
                    f"{where}: {name} looks like a secret baked into the image"
                )
            for url in urls_in(stage["healthcheck"]):
                if "sidecar" in path.name:
                    assert httpx.URL(url).path in routes
            if "sidecar" in path.name:
                assert (
                    "/healthz" in stage["healthcheck"]
                    and f"or {option_default('sidecar', '--port')})" in stage["healthcheck"]
                )
            if path.name == "rollout.Dockerfile":
                # SGLang's /health waits on a weight load: the image's check is the load-aware probe,
                # on the ports `serve` uses (its ROLLOUT_* variables, else its defaults).
                argv = shlex.split(healthcheck_command(stage))
                assert argv[:2] == ["rollout-service", "liveness"], argv
                sglang_url = argv[argv.index("--sglang-url") + 1]
                sidecar_url = argv[argv.index("--sidecar-url") + 1]
                assert sglang_url == f"http://127.0.0.1:${{ROLLOUT_PORT:-{option_default('serve', '--port')}}}"
                assert sidecar_url == (
                    f"http://127.0.0.1:${{ROLLOUT_SIDECAR_PORT:-{option_default('serve', '--sidecar-port')}}}"
                )
                interval_timeout = float(re.search(r"--timeout=(\d+)s", stage["healthcheck"]).group(1))
                assert 2 * float(argv[argv.index("--timeout") + 1]) < interval_timeout, (
                    f"{where}: the probe's two calls must end within Docker's --timeout"
                )
        for name in ("PYTHON_VERSION", "DEBIAN_SUITE", "APP_UID"):
            shared_args.setdefault(name, set()).add(dockerfile_stages(path)[0]["args"][name])
    # One Python for the CPU rollout, sidecar and trainer images: the tiny model (its tokenizer is
    # trained on the standard library's sources) is then the same wherever it is built.
    assert all(len(values) == 1 for values in shared_args.values()), shared_args
    sidecar_cmd = images[("sidecar.Dockerfile", None)]["cmd"]
    assert sidecar_cmd == ["rollout-service", "sidecar"]


def test_sglang_version_is_pinned_the_same_everywhere():
    pin = {
        "sglang==" + v
        for v in re.findall(r"^sglang==(\S+)$", (REPO / "requirements" / "cpu.lock").read_text(), flags=re.M)
    }
    extra = {r for r in PROJECT["optional-dependencies"]["rollout"] if r.startswith("sglang")}
    arg = dockerfile_stages(DOCKER_DIR / "rollout.Dockerfile")[0]["args"]["SGLANG_VERSION"]
    assert pin == extra == {f"sglang=={arg}"}
    gpu = dockerfile_images()[("rollout.Dockerfile", "gpu")]
    assert expand_args(gpu["from"], gpu["args"]) == f"lmsysorg/sglang:v{arg}"


def test_image_names_and_tags_agree_between_dockerfiles_compose_and_kubernetes():
    images = dockerfile_images()
    built: dict[str, tuple[str, str | None]] = {}
    compose = load_compose()
    for name, service in compose_services(compose).items():
        if "build" in service:
            build = service["build"]
            assert (REPO / "deploy" / "compose" / build["context"]).resolve() == REPO
            dockerfile = Path(build["dockerfile"])
            assert dockerfile.parent == Path("deploy/docker"), name
            stage = images[(dockerfile.name, build.get("target"))]
            repo, tag = service["image"].rsplit(":", 1)
            assert repo == stage["labels"]["org.opencontainers.image.title"], name
            assert built.setdefault(service["image"], (dockerfile.name, build.get("target"))) == (
                dockerfile.name,
                build.get("target"),
            ), f"{service['image']} built two ways"
    titles = {stage["labels"]["org.opencontainers.image.title"] for stage in images.values()}
    assert {image.rsplit(":", 1)[0] for image in built} == titles, "every image is built by compose"
    for name, service in compose_services(compose).items():
        assert service["image"] in built, f"compose service {name} uses an image nobody builds"
        assert service["image"].rsplit(":", 1)[1] == VERSION
    for kustomization in K8S_KUSTOMIZATIONS:
        for workload, pod in pod_specs(render_kustomization(kustomization)).items():
            for container in pod["containers"] + pod.get("initContainers", []):
                assert container["image"] in built, (
                    f"{kustomization.relative_to(REPO)} {workload}/{container['name']} uses"
                    f" {container['image']}, not one of {sorted(built)}"
                )


def test_the_root_dockerignore_lets_in_only_what_the_per_dockerfile_ones_do():
    """A builder that reads only the context's own .dockerignore (legacy builder, kaniko) must not
    get .env files, .git or virtual environments into a `COPY .` layer."""
    root = (REPO / ".dockerignore").read_text().split("\n")
    rules = [line.strip() for line in root if line.strip() and not line.startswith("#")]
    assert rules[0] == "*" and not any(line.startswith("!.env") or line.startswith("!.git") for line in rules)
    allowed = {line for line in rules if line.startswith("!")}
    per_file = set()
    for path in sorted(DOCKER_DIR.glob("*.Dockerfile.dockerignore")):
        per_file |= {line.strip() for line in path.read_text().splitlines() if line.startswith("!")}
    assert allowed == per_file
