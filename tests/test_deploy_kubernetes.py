"""Kubernetes manifests (base, example Secret, cpu-dev and gpu overlays): the 1.31 schemas, probes,
ports, the checkpoint volume, the token Secret and resources.
"""

from __future__ import annotations

import httpx
import pytest
import yaml

from deploy_files import (
    DOCKER_DIR,
    EXAMPLE_SECRET,
    K8S_BASE,
    K8S_DIR,
    K8S_KUSTOMIZATIONS,
    K8S_OVERLAYS,
    REPO,
    by_kind,
    container_port,
    dockerfile_stages,
    find_container,
    find_mount,
    k8s_argv,
    k8s_env,
    option_default,
    pod_specs,
    render_kustomization,
    sidecar_routes,
    url_port,
    urls_in,
    validate_k8s,
    yaml_docs,
)
from rollout_service.cli import build_parser


def test_base_manifest_files_validate_against_the_kubernetes_schema():
    kustomization = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())
    files = [K8S_BASE / name for name in kustomization["resources"]] + [EXAMPLE_SECRET]
    assert sorted(p.name for p in K8S_BASE.glob("*.yaml") if p.name != "kustomization.yaml") == sorted(
        name for name in kustomization["resources"]
    ), "every base file is a listed resource"
    for path in files:
        for doc in yaml_docs(path):
            validate_k8s(doc, str(path.relative_to(REPO)))


@pytest.mark.parametrize("kustomization", K8S_KUSTOMIZATIONS, ids=lambda p: p.name)
def test_rendered_kustomization_validates_against_the_kubernetes_schema(kustomization):
    manifests = render_kustomization(kustomization)
    kinds = sorted(doc["kind"] for doc in manifests)
    assert kinds == sorted(
        [
            "ConfigMap",
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            "Service",
            "Service",
            "PodDisruptionBudget",
            "Job",
        ]
    ), kinds
    for doc in manifests:
        validate_k8s(doc, f"rendered {kustomization.relative_to(REPO)}")


def test_kustomize_overlays_cpu_dev_and_gpu_exist():
    assert {p.name for p in K8S_OVERLAYS} == {"cpu-dev", "gpu"}


def test_kubernetes_probes_and_ports_match_the_sidecar_and_sglang():
    routes = sidecar_routes()
    assert {"/healthz", "/readyz"} <= routes
    sidecar_default_port = option_default("sidecar", "--port")
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        where = kustomization.relative_to(REPO)
        pods = pod_specs(manifests)
        pod = pods["rollout"]
        sidecar, sglang = find_container(pod, "sidecar"), find_container(pod, "sglang")
        sidecar_env = k8s_env(sidecar, manifests)
        sidecar_port = int(sidecar_env.get("ROLLOUT_PORT", sidecar_default_port))
        assert sidecar_env.get("ROLLOUT_HOST") == "0.0.0.0", f"{where}: kubelet probes need 0.0.0.0"
        assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("readinessProbe", "livenessProbe"):
            get = sidecar[probe]["httpGet"]
            assert get["path"] in routes, f"{where}: {probe} path {get['path']} is no sidecar route"
            assert container_port(sidecar, get["port"]) == sidecar_port, f"{where}: {probe} port"
        sglang_argv = k8s_argv(sglang, k8s_env(sglang, manifests))
        sglang_port = int(sglang_argv[sglang_argv.index("--port") + 1])
        assert sglang_argv[sglang_argv.index("--host") + 1] == "0.0.0.0"
        get = sglang["startupProbe"]["httpGet"]
        assert get["path"] == "/health"
        assert container_port(sglang, get["port"]) == sglang_port, f"{where}: sglang startupProbe"
        # Liveness knows about a weight load in flight (SGLang's /health waits on it).
        live = build_parser().parse_args(sglang["livenessProbe"]["exec"]["command"][1:])
        assert live.command == "liveness", f"{where}: sglang livenessProbe"
        assert url_port(live.sglang_url) == sglang_port and url_port(live.sidecar_url) == sidecar_port
        assert sglang["livenessProbe"]["timeoutSeconds"] > 2 * live.timeout
        assert "readinessProbe" not in sglang, "readiness is the sidecar's call (/readyz)"
        assert url_port(sidecar_env["ROLLOUT_SGLANG_URL"]) == sglang_port
        assert httpx.URL(sidecar_env["ROLLOUT_SGLANG_URL"]).host == "127.0.0.1"

        service = by_kind(manifests, "Service")["rollout"]
        assert (
            service["spec"]["selector"].items()
            <= by_kind(manifests, "Deployment")["rollout"]["spec"]["template"]["metadata"]["labels"].items()
        )
        service_ports = {}
        for item in service["spec"]["ports"]:
            target = item["targetPort"]
            owner = sidecar if target == "sidecar" else sglang
            assert item["port"] == container_port(owner, target), f"{where}: Service port {item}"
            service_ports[target] = item["port"]
        pdb = by_kind(manifests, "PodDisruptionBudget")["rollout"]
        assert pdb["spec"]["selector"] == by_kind(manifests, "Deployment")["rollout"]["spec"]["selector"]

        # The trainer reaches both through the Service; its wait loop asks for /readyz.
        trainer_pod = pods["trainer"]
        trainer = find_container(trainer_pod, "trainer")
        argv = k8s_argv(trainer, k8s_env(trainer, manifests))
        for flag, target in (("--sglang-url", "sglang"), ("--sidecar-url", "sidecar")):
            if flag not in argv:  # several replicas: the trainer counts ack files (test below)
                assert flag == "--sidecar-url" and "--expected-replicas" in argv, f"{where}: {flag}"
                continue
            url = httpx.URL(argv[argv.index(flag) + 1])
            host = "rollout" if target == "sglang" else "rollout-sidecar"  # (see the test below)
            assert url.host == host and url.port == service_ports[target], f"{where}: {flag}"
        wait = find_container(trainer_pod, "wait-for-rollout")
        (url,) = urls_in(" ".join(wait["command"]))
        assert httpx.URL(url).path == "/readyz" and url_port(url) == service_ports["sidecar"]
        assert trainer_pod["subdomain"] == "trainer" and "trainer" in by_kind(manifests, "Service")
        assert argv[argv.index("--main_process_ip") + 1] == "trainer-0.trainer"
        assert int(argv[argv.index("--main_process_port") + 1]) == container_port(trainer, "rendezvous")


def test_kubernetes_checkpoint_volume_is_shared_at_the_watched_path():
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        where = kustomization.relative_to(REPO)
        pods = pod_specs(manifests)
        claims = set(by_kind(manifests, "PersistentVolumeClaim"))
        rollout, trainer_pod = pods["rollout"], pods["trainer"]
        for pod in (rollout, trainer_pod):
            (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
            assert volume["persistentVolumeClaim"]["claimName"] in claims
        sidecar, sglang = find_container(rollout, "sidecar"), find_container(rollout, "sglang")
        watched = k8s_env(sidecar, manifests)["ROLLOUT_CHECKPOINT_PATH"]
        assert find_mount(sidecar, "checkpoints")["mountPath"] == watched
        assert not find_mount(sidecar, "checkpoints").get("readOnly"), "the sidecar writes acks/"
        # The sidecar hands SGLang the checkpoint's path: SGLang must see it at the same place.
        assert find_mount(sglang, "checkpoints") == {"name": "checkpoints", "mountPath": watched, "readOnly": True}
        trainer = find_container(trainer_pod, "trainer")
        argv = k8s_argv(trainer, k8s_env(trainer, manifests))
        assert argv[argv.index("--checkpoint-path") + 1] == watched
        assert find_mount(trainer, "checkpoints")["mountPath"] == watched
        assert not find_mount(trainer, "checkpoints").get("readOnly")
        # The model path the trainer and SGLang start from is one ConfigMap key.
        model = argv[argv.index("--model") + 1]
        sglang_argv = k8s_argv(sglang, k8s_env(sglang, manifests))
        assert sglang_argv[sglang_argv.index("--model-path") + 1] == model
        if model.startswith("/"):  # a path: each pod builds/mounts it at that place
            for pod, container in ((rollout, sglang), (trainer_pod, trainer)):
                mounts = [m["mountPath"] for m in container["volumeMounts"]]
                assert any(model.startswith(m + "/") for m in mounts), f"{where}: {model} not mounted"
                makers = [
                    c
                    for c in pod.get("initContainers", [])
                    if c.get("command", [])[:2] == ["rollout-service", "make-tiny-model"]
                ]
                assert makers and makers[0]["command"][-1] == model


def test_kubernetes_token_comes_from_a_secret_and_only_an_example_secret_ships():
    (example,) = yaml_docs(EXAMPLE_SECRET)
    assert example["stringData"] == {
        "token": "REPLACE_WITH_A_RANDOM_TOKEN",
        "sglang-api-key": "REPLACE_WITH_A_RANDOM_KEY",
    }
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        assert "Secret" not in {doc["kind"] for doc in manifests}, "ship no Secret in kustomizations"
        sidecar = find_container(pod_specs(manifests)["rollout"], "sidecar")
        for variable, key in (("ROLLOUT_TOKEN", "token"), ("ROLLOUT_SGLANG_API_KEY", "sglang-api-key")):
            (item,) = [e for e in sidecar["env"] if e["name"] == variable]
            assert item["valueFrom"]["secretKeyRef"] == {"name": example["metadata"]["name"], "key": key}


def test_kubernetes_resources_per_overlay():
    gpu_pods = pod_specs(render_kustomization(K8S_DIR / "overlays" / "gpu"))
    for workload, container in (("rollout", "sglang"), ("trainer", "trainer")):
        resources = find_container(gpu_pods[workload], container)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] >= 1
    assert by_kind(render_kustomization(K8S_DIR / "overlays" / "gpu"), "Deployment")["rollout"]["spec"]["replicas"] >= 2
    for kustomization in (K8S_BASE, K8S_DIR / "overlays" / "cpu-dev"):
        text = yaml.safe_dump_all(render_kustomization(kustomization))
        assert "nvidia.com/gpu" not in text, kustomization
    rwx = by_kind(render_kustomization(K8S_BASE), "PersistentVolumeClaim")["checkpoints"]
    assert rwx["spec"]["accessModes"] == ["ReadWriteMany"]
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        for pod in pod_specs(manifests).values():
            assert pod["securityContext"]["runAsNonRoot"] is True
            uid = pod["securityContext"]["runAsUser"]
            assert str(uid) == dockerfile_stages(DOCKER_DIR / "sidecar.Dockerfile")[0]["args"]["APP_UID"]


def test_a_trainer_beside_several_rollout_replicas_waits_for_each_one():
    # GET /wait through the `rollout` Service asks one replica (the client keeps one connection),
    # so with several replicas the trainer counts their ack files, as many as the Deployment runs.
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        replicas = by_kind(manifests, "Deployment")["rollout"]["spec"]["replicas"]
        trainer = find_container(pod_specs(manifests)["trainer"], "trainer")
        argv = k8s_argv(trainer, k8s_env(trainer, manifests))
        if replicas > 1:
            assert "--sidecar-url" not in argv, f"{kustomization}: /wait through the Service with {replicas} replicas"
            assert argv[argv.index("--expected-replicas") + 1] == str(replicas), kustomization
        else:
            assert "--sidecar-url" in argv or "--expected-replicas" in argv, kustomization


def test_the_trainer_reaches_a_sidecar_that_is_not_ready():
    """A replica is not Ready while it loads a step or once it cannot go on (replica_fatal); the
    trainer's ``--sidecar-url`` pointed at the readiness-gated ``rollout`` Service, so it got
    "connection refused" until sync_timeout instead of the replica's own answer."""
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        trainer = find_container(pod_specs(manifests)["trainer"], "trainer")
        argv = k8s_argv(trainer, k8s_env(trainer, manifests))
        if "--sidecar-url" not in argv:
            continue
        host = httpx.URL(argv[argv.index("--sidecar-url") + 1]).host
        service = by_kind(manifests, "Service")[host]
        assert service["spec"].get("publishNotReadyAddresses") is True, (kustomization, host)
        rollout = by_kind(manifests, "Deployment")["rollout"]["spec"]["template"]["metadata"]["labels"]
        assert all(rollout.get(k) == v for k, v in service["spec"]["selector"].items()), kustomization


def test_the_cpu_dev_overlay_fits_a_two_cpu_node():
    """kind and minikube default to 2 CPUs, of which the control plane takes ~0.8: the rollout pod
    and the trainer (which run at once) requested 2.1 CPUs and one of them stayed Pending."""
    pods = pod_specs(render_kustomization(K8S_DIR / "overlays" / "cpu-dev"))

    def cpus(text: str) -> float:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)

    requested = sum(
        cpus(str(c.get("resources", {}).get("requests", {}).get("cpu", "0")))
        for pod in pods.values()
        for c in pod["containers"]
    )
    assert requested <= 1.2, requested
