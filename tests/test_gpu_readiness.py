"""Issue #15: what a first run on GPUs and in clusters hits, checked on a CPU machine.

Templates are parsed and rendered, the launcher's command and environment are unit-tested
against a fake `nvidia-smi` (tests/fake_nvidia.py), and the GPU example's device choice runs
with torch as installed here (it sees no GPU).

The liveness probe's test uses fake SGLang and sidecar routes (`fake_sglang.FakeRoutes`): a real
SGLang's /health hangs only while a weight load holds its lock, and a real sidecar reports
``loading_step`` only during that load, for however long the load happens to take on the machine;
the fake holds /health for a set time and says whether a load is in flight, so both answers of
the probe are checked on demand.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy_files import (
    DOCKER_DIR,
    K8S_DIR,
    K8S_KUSTOMIZATIONS,
    compose_services,
    k8s_argv,
    k8s_env,
    load_compose,
    pod_specs,
    render_kustomization,
)
from fake_nvidia import install_fake_nvidia_smi
from fake_sglang import FakeRoutes
from rollout_service import sglang_launcher
from rollout_service.cli import build_parser, main
from rollout_service.sglang_launcher import CPU_SHIMS_DIR, SGLangServer, SGLangStartError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "grpo_tldr_gpu.py"
EXAMPLE_IN_IMAGE = "/opt/rollout-service/examples/grpo_tldr_gpu.py"


def _example():
    spec = importlib.util.spec_from_file_location("grpo_tldr_gpu_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_gpu_tools(monkeypatch, tmp_path):
    """PATH without nvidia-smi (this machine has none; keep it so whatever PATH says)."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", f"{empty}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return empty


@pytest.fixture
def fake_gpus(monkeypatch, tmp_path):
    """Install a fake nvidia-smi first on PATH; returns a function taking the GPUs/apps."""

    def install(gpus, apps=(), driver="570.86.15"):
        bin_dir = tmp_path / "fake-bin"
        install_fake_nvidia_smi(bin_dir, gpus, list(apps), driver)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    return install


# ------------------------------------------------------ 1. Kubernetes service-link variables


def test_a_kubernetes_service_link_variable_does_not_break_other_commands(monkeypatch, tmp_path):
    # kubelet injects ROLLOUT_PORT=tcp://... for a Service named `rollout`.
    monkeypatch.setenv("ROLLOUT_PORT", "tcp://10.96.0.10:30000")
    monkeypatch.setenv("ROLLOUT_SERVICE_HOST", "10.96.0.10")
    args = build_parser().parse_args(["make-tiny-model", "--out", str(tmp_path / "m")])
    assert args.command == "make-tiny-model" and args.out == str(tmp_path / "m")
    args = build_parser().parse_args(["publish", "--model-dir", "a", "--checkpoint-path", "b", "--step", "1"])
    assert args.step == 1
    assert main(["validate", str(tmp_path / "missing")]) == 1  # runs (and reports the missing dir)


def test_an_invalid_environment_value_is_refused_naming_the_variable_for_that_command(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ROLLOUT_PORT", "tcp://10.96.0.10:30000")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["sidecar", "--checkpoint-path", str(tmp_path), "--sglang-url", "http://x:1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "ROLLOUT_PORT='tcp://10.96.0.10:30000' is not valid for --port" in err
    assert "enableServiceLinks: false" in err
    # A flag on the command line wins over the variable, which is then not read at all.
    args = build_parser().parse_args(
        ["sidecar", "--checkpoint-path", str(tmp_path), "--sglang-url", "http://x:1", "--port", "8101"]
    )
    assert args.port == 8101


def test_environment_defaults_fill_only_the_chosen_command_and_required_flags_name_their_variable(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setenv("ROLLOUT_PORT", "8200")
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_PATH", str(tmp_path))
    monkeypatch.setenv("ROLLOUT_SGLANG_URL", "http://127.0.0.1:30001")
    monkeypatch.setenv("ROLLOUT_CHECK_DIGESTS", "yes")
    args = build_parser().parse_args(["sidecar"])
    assert (args.port, args.checkpoint_path, args.sglang_url, args.check_digests) == (
        8200,
        tmp_path,  # a Path: the flag converts with SidecarSettings.checkpoint_path's type
        "http://127.0.0.1:30001",
        True,
    )
    assert args.poll is None and args.health_interval == 2.0  # unset variables: the defaults
    monkeypatch.delenv("ROLLOUT_CHECKPOINT_PATH")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar"])
    assert "--checkpoint-path (or ROLLOUT_CHECKPOINT_PATH)" in capsys.readouterr().err
    monkeypatch.setenv("ROLLOUT_CHECK_DIGESTS", "maybe")
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_PATH", str(tmp_path))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar"])
    assert "ROLLOUT_CHECK_DIGESTS='maybe' is not valid for --check-digests" in capsys.readouterr().err


def test_the_cli_process_survives_kubernetes_service_links(tmp_path):
    env = {**os.environ, "ROLLOUT_PORT": "tcp://10.96.0.10:30000", "ROLLOUT_PORT_30000_TCP": "tcp://10.96.0.10:30000"}
    done = subprocess.run(
        [sys.executable, "-m", "rollout_service.cli", "validate", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1 and "INVALID" in done.stderr, done.stderr


def test_every_pod_template_disables_service_links():
    seen = 0
    for kustomization in K8S_KUSTOMIZATIONS:
        for workload, pod in pod_specs(render_kustomization(kustomization)).items():
            assert pod.get("enableServiceLinks") is False, f"{kustomization.name} {workload}"
            seen += 1
    assert seen >= 2 * len(K8S_KUSTOMIZATIONS)


# ------------------------------------------------------- 2. GPU trainers train on the GPU


def _gpu_trainer_command_lines() -> list[tuple[str, list[str]]]:
    lines = [("compose gpu trainer", [str(t) for t in compose_services(load_compose(), "gpu")["trainer"]["command"]])]
    manifests = render_kustomization(K8S_DIR / "overlays" / "gpu")
    pod = pod_specs(manifests)["trainer"]
    [trainer] = [c for c in pod["containers"] if c["name"] == "trainer"]
    lines.append(("k8s gpu trainer", k8s_argv(trainer, k8s_env(trainer, manifests))))
    return lines


def test_gpu_templates_run_the_gpu_example_on_cuda_with_real_model_settings():
    from accelerate.commands.launch import launch_command_parser

    example = _example()
    for where, argv in _gpu_trainer_command_lines():
        assert argv[:2] == ["accelerate", "launch"], where
        launch = launch_command_parser().parse_args(argv[2:])
        assert not launch.module and launch.training_script == EXAMPLE_IN_IMAGE, where
        assert "demo" not in launch.training_script_args, f"{where} runs the CPU demo"
        args = example.build_parser().parse_args(launch.training_script_args)
        assert args.device == "cuda", f"{where}: must insist on a GPU, never fall back to the CPU"
        assert args.learning_rate <= 1e-5, f"{where}: the tiny model's learning rate"
        assert launch.mixed_precision == "bf16", where


def test_the_trainer_image_ships_the_gpu_example_at_the_path_the_templates_run():
    text = (DOCKER_DIR / "trainer.Dockerfile").read_text()
    assert "cp -r /tmp/build/src/examples /opt/rollout-service/examples" in text
    assert '"/tmp/build/src[trainer,examples]"' in text  # rouge-score for the example's reward
    ignore = (DOCKER_DIR / "trainer.Dockerfile.dockerignore").read_text().split()
    assert "!examples/" in ignore


# ---------------------------------------------- 3. named volumes are writable by the image's user


def _run_lines(stage_text: str) -> list[str]:
    return [line[4:] for line in stage_text.splitlines() if line.startswith("RUN ")]


def _stage_texts(path: Path) -> dict[str | None, str]:
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str | None, str] = {}
    current: str | None = None
    order = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.upper().startswith("FROM "):
            m = re.search(r"\s+AS\s+(\S+)", stripped, flags=re.I)
            current = m.group(1) if m else f"stage{len(order)}"
            order.append(current)
            stages[current] = ""
        elif current is not None:
            stages[current] += stripped + "\n"
    stages[None] = stages[order[-1]]
    return stages


def _created_and_owned(stage_text: str, target: str) -> bool:
    """mkdir -p creates ``target`` and a chown to APP_UID covers it (itself, or -R on a parent)."""
    made = owned = False
    for run in _run_lines(stage_text):
        for command in re.split(r"&&|;", run):
            words = command.split()
            if words[:2] == ["mkdir", "-p"] and target in words[2:]:
                made = True
            if words[:1] == ["chown"] and any("${APP_UID}" in w for w in words):
                recursive = "-R" in words
                paths = [w for w in words[1:] if w.startswith("/")]
                if target in paths or (recursive and any(target.startswith(p.rstrip("/") + "/") for p in paths)):
                    owned = True
    return made and owned


def test_every_named_volume_mount_point_exists_in_the_image_and_belongs_to_its_user():
    compose = load_compose()
    services = compose["services"]
    builds = {svc["image"]: svc["build"] for svc in services.values() if "build" in svc}
    checked = []
    for name, svc in services.items():
        build = builds[svc["image"]]
        stage = _stage_texts(REPO / build["dockerfile"])[build.get("target")]
        for entry in svc.get("volumes", []):
            source, target, *_ = entry.split(":")
            if source in compose.get("volumes", {}):
                assert _created_and_owned(stage, target), (
                    f"compose service {name} mounts volume {source} at {target}, which"
                    f" {build['dockerfile']} ({build.get('target') or 'default'} stage) does not create and"
                    " chown to the image's user: Docker would create it root-owned, unwritable"
                )
                checked.append((name, target))
    assert ("sglang", "/home/rollout/.cache/huggingface") in checked
    assert ("trainer", "/home/rollout/.cache/huggingface") in checked


# ------------------------------------------ 4. GPUs listed but torch sees none: fail loudly


def test_example_refuses_to_train_on_the_cpu_when_gpus_are_listed_but_torch_sees_none(fake_gpus):
    import torch

    assert not torch.cuda.is_available()
    fake_gpus([{}, {}], driver="535.104.05")
    example = _example()
    with pytest.raises(SystemExit) as exc:
        example.resolve_device("auto")
    message = str(exc.value)
    assert "nvidia-smi lists 2 GPU(s)" in message and "driver >= 580" in message
    assert "535.104.05" in message and "download.pytorch.org/whl/cu" in message
    assert "Not falling back to the CPU" in message
    assert example.resolve_device("cpu") == "cpu"  # on purpose only


def test_example_device_cuda_without_a_gpu_fails_and_auto_on_a_gpu_less_machine_is_the_cpu(no_gpu_tools):
    example = _example()
    with pytest.raises(SystemExit) as exc:
        example.resolve_device("cuda")
    assert "torch.cuda.is_available() is False" in str(exc.value)
    # No GPU at all: not a driver to upgrade (the message said "nvidia-smi lists 0 GPU(s)").
    assert "no NVIDIA GPU found" in str(exc.value) and "--device cpu" in str(exc.value)
    assert "upgrade the driver" not in str(exc.value)
    assert example.resolve_device("auto") == "cpu"


@pytest.mark.slow  # subprocesses with torch start-ups: several seconds
def test_example_process_exits_before_training_when_gpus_are_listed_but_unusable(fake_gpus, tmp_path):
    fake_gpus([{}])
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--checkpoint-path",
            str(tmp_path),
            "--sglang-url",
            "http://127.0.0.1:9",
            "--sidecar-url",
            "http://127.0.0.1:9",
            "--dataset",
            str(tmp_path / "never-read.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert done.returncode != 0 and "driver >= 580" in done.stderr, done.stderr[-2000:]
    assert "never-read" not in done.stderr  # it stopped before loading data


def test_sglang_on_cuda_without_a_usable_gpu_fails_at_start_naming_the_driver_floor(fake_gpus, tmp_path):
    fake_gpus([{}])
    server = SGLangServer(tmp_path, device="auto", python=sys.executable, log_path=tmp_path / "s.log")
    assert server.device == "cuda"  # nvidia-smi lists a GPU
    with pytest.raises(SGLangStartError, match="driver >= 580"):
        server.start()
    assert server.pid is None  # nothing was started


# ------------------------------------------ 6. SGLang beside a trainer on the same GPU


def test_sglang_gets_a_memory_fraction_that_fits_beside_other_processes_on_its_gpu(
    fake_gpus, tmp_path, monkeypatch, caplog
):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # GPU 0 holds a 40 GiB trainer, GPU 1 is free.
    fake_gpus(
        [{"memory_used": 41000}, {}],
        apps=[{"gpu_uuid": "GPU-00000000-fake", "pid": 4242, "process_name": "python", "used_memory": 40960}],
    )
    server = SGLangServer(tmp_path, device="cuda", log_path=tmp_path / "s.log")
    cmd = server.command()
    fraction = float(cmd[cmd.index("--mem-fraction-static") + 1])
    free = (143771 - 41000) / 143771
    assert fraction == pytest.approx(round(free - 0.1, 2)) and fraction < free
    fraction_msg = server.cuda_memory_plan()[1]
    assert "pid 4242 python" in fraction_msg and "CUDA_VISIBLE_DEVICES" in fraction_msg
    # The same server on the free GPU keeps SGLang's own choice.
    free_gpu = SGLangServer(tmp_path, device="cuda", env={"CUDA_VISIBLE_DEVICES": "1"}, log_path=tmp_path / "t.log")
    assert "--mem-fraction-static" not in free_gpu.command()
    # --tp-size 2 spans both: the busy one decides.
    tp2 = SGLangServer(tmp_path, device="cuda", extra_args=["--tp-size", "2"], log_path=tmp_path / "u.log")
    assert "--mem-fraction-static" in tp2.command()
    # An explicit value always wins.
    explicit = SGLangServer(
        tmp_path, device="cuda", extra_args=["--mem-fraction-static", "0.3"], log_path=tmp_path / "v.log"
    )
    assert explicit.command().count("--mem-fraction-static") == 1


def test_cuda_visible_devices_uuids_select_the_servers_gpu(fake_gpus, tmp_path):
    fake_gpus([{}, {"memory_used": 90000}])
    server = SGLangServer(
        tmp_path, device="cuda", env={"CUDA_VISIBLE_DEVICES": "GPU-00000001"}, log_path=tmp_path / "s.log"
    )
    assert "--mem-fraction-static" in server.command()


def test_cuda_visible_devices_is_read_as_cuda_reads_it_the_first_item_naming_no_gpu_hides_the_rest():
    gpus = [sglang_launcher.GPUMemory(i, f"GPU-0000000{i}-fake", 100.0, 0.0) for i in range(3)]

    def pick(visible, base=0, count=3):
        return [g.index for g in sglang_launcher.gpus_for_server(gpus, visible, range(base, base + count))]

    assert pick("2,0") == [2, 0] and pick(None) == [0, 1, 2] and pick(" ") == [0, 1, 2]
    assert pick("GPU-00000001,2") == [1, 2]
    # An empty item, another script's digits, a bare "GPU-" (which every UUID starts with), an
    # index or UUID that is not there, a repeat: CUDA sees only the GPUs before it.
    for visible in ("1,,2", "1,\u0662", "1,GPU-", "1,7,2", "1,GPU-ffff,2", "1,1,2", "1,-1,2"):
        assert pick(visible) == [1], visible
    assert pick("\u0661") == [] and pick("2,1", base=1, count=1) == [1]
    assert pick("0,1", base=-1, count=1) == [] and pick("0,1", count=0) == [] and pick("1" * 400) == []


@pytest.mark.parametrize(
    "extra", [["--tp-size", "two"], ["--tp", "\u0662"], ["--tensor-parallel-size=1.5"], ["--base-gpu-id", "-1"]]
)
def test_a_gpu_count_sglang_will_refuse_leaves_its_memory_share_to_sglang_instead_of_a_traceback(
    fake_gpus, tmp_path, extra
):
    fake_gpus([{"memory_used": 90000}, {}])  # a busy GPU 0: a plan would add a fraction
    server = SGLangServer(tmp_path, device="cuda", extra_args=extra, log_path=tmp_path / "s.log")
    cmd = server.command()  # SGLang's own parser names the bad flag when it starts
    assert "--mem-fraction-static" not in cmd and cmd[-len(extra) :] == extra
    good = SGLangServer(tmp_path, device="cuda", extra_args=["--tp-size", " 2 "], log_path=tmp_path / "t.log")
    assert "--mem-fraction-static" in good.command()


@pytest.mark.parametrize(
    "extra, ids",
    [
        ([], [0]),
        (["--tp-size", "2"], [0, 1]),
        (["--tp", "2", "--base-gpu-id", "2"], [2, 3]),
        (["--pp-size", "2"], [0, 1]),
        (["--dp-size", "2"], [0, 1]),
        (["--dp-size", "2", "--enable-dp-attention"], [0]),
        (["--tp-si", "2", "--data-parallel-size=2"], [0, 1, 2, 3]),
        (["--tp-size", "2", "--gpu-id-step", "2"], [0, 2]),
        (["--tp-size", "2", "--dp-size", "2", "--gpu-id-step", "2"], [0, 2, 4, 6]),
        (["--tp-size", "2", "--pp-size", "2", "--base-gpu-id", "1"], [1, 2, 3, 4]),
        (["--nnodes", "2", "--tp-size", "2"], None),
        (["--tp-size", "1" * 12], None),
        (["--gpu-id-step", "0"], None),
    ],
)
def test_the_gpus_a_server_uses_are_placed_as_sglang_places_its_workers(extra, ids):
    assert sglang_launcher.server_gpu_ids(extra) == ids


def test_a_busy_gpu_that_only_pipeline_or_data_parallel_ranks_reach_gets_a_memory_share(fake_gpus, tmp_path):
    fake_gpus([{}, {"memory_used": 90000}])  # GPU 1 holds a trainer
    for extra in (["--pp-size", "2"], ["--dp-size", "2"], ["--tp-si", "2"], ["--base-gpu-id", "1"]):
        server = SGLangServer(tmp_path, device="cuda", extra_args=extra, log_path=tmp_path / "s.log")
        assert "--mem-fraction-static" in server.command(), extra
    alone = SGLangServer(tmp_path, device="cuda", extra_args=["--dp-size", "2", "--enable-dp-attention"])
    assert "--mem-fraction-static" not in alone.command()  # dp attention: the dp ranks share GPU 0


def test_a_gpu_row_nvidia_smi_cannot_read_leaves_the_memory_share_to_sglang(fake_gpus, tmp_path):
    """Leaving the row out shifted every GPU after it: the free GPU 0 was planned as the busy GPU 1."""
    fake_gpus([{"memory_total": "[N/A]"}, {"memory_used": 90000}])
    assert sglang_launcher.query_gpu_memory() == []
    server = SGLangServer(tmp_path, device="cuda", log_path=tmp_path / "s.log")
    assert "--mem-fraction-static" not in server.command()


def test_the_gpu_placement_options_listed_are_sglangs_with_the_abbreviations_its_parser_takes():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    actions = {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}
    for key, (names, default) in sglang_launcher.GPU_LAYOUT_OPTIONS.items():
        full = [n for n in names if n in actions]
        assert full and len({actions[n].dest for n in full}) == 1, key  # one setting, under each name
        assert actions[full[0]].default == default and actions[full[0]].type is int, key
        for name in names:  # every abbreviation listed is one SGLang takes for that setting only
            assert {actions[o].dest for o in actions if o.startswith(name)} == {actions[full[0]].dest}, name
        assert set(full) == set(actions[full[0]].option_strings), key  # no alias left out


# ------------------------------------------- 7. liveness that knows about weight loads in flight


def test_liveness_counts_sglang_alive_during_a_load_and_dead_when_health_hangs_without_one(capsys):
    sglang = FakeRoutes({"/health": (200, {}, 3.0)})  # /health waits on the weight-update lock
    sidecar = FakeRoutes({"/status": (200, {"loading_step": 7}, 0.0)})
    try:
        argv = ["liveness", "--sglang-url", sglang.url, "--sidecar-url", sidecar.url, "--timeout", "1"]
        assert main(argv) == 0
        assert "loading step 7" in capsys.readouterr().out
        sidecar.routes["/status"] = (200, {"loading_step": None}, 0.0)
        t0 = time.monotonic()
        assert main(argv) == 1
        assert time.monotonic() - t0 < 2.9
        err = capsys.readouterr().err
        assert "/health failed: AnswerTimedOut" in err and "within 1 s" in err, err
        sglang.routes["/health"] = (200, {}, 0.0)
        assert main(argv) == 0
        sidecar.close()  # a sidecar outage: /health alone decides
        assert main(argv) == 0
        sglang.routes["/health"] = (503, {"error": "unhealthy"}, 0.0)
        assert main(argv) == 1
    finally:
        sglang.close()


# ------------------------------------------------ 11. the CPU stand-in never reaches a GPU


def test_cuda_strips_the_cpu_stand_in_and_cpu_engine_from_an_inherited_environment(monkeypatch, tmp_path, caplog):
    link = tmp_path / "rollout-cpu-shims"  # as the CPU image links it
    link.symlink_to(CPU_SHIMS_DIR)
    copy = tmp_path / "copied-shims"
    shutil.copytree(CPU_SHIMS_DIR, copy)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(CPU_SHIMS_DIR), "/opt/mine", str(link), str(copy)]))
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    cuda = SGLangServer(tmp_path, device="cuda", log_path=tmp_path / "s.log")
    env = cuda.environment()
    assert env["PYTHONPATH"] == "/opt/mine" and "SGLANG_USE_CPU_ENGINE" not in env
    assert "not passing the CPU-only settings" in caplog.text
    cpu = SGLangServer(tmp_path, device="cpu", log_path=tmp_path / "c.log")
    assert cpu.environment()["PYTHONPATH"].split(os.pathsep)[0] == str(CPU_SHIMS_DIR)
    assert cpu.environment()["SGLANG_USE_CPU_ENGINE"] == "1"


def test_auto_device_asks_torch_when_nvidia_smi_is_missing(no_gpu_tools, tmp_path):
    # A container with the GPU but without nvidia-smi: torch decides.
    says_cuda = tmp_path / "python-with-cuda"
    says_cuda.write_text("#!/bin/sh\nexit 0\n")
    says_cuda.chmod(0o755)
    assert sglang_launcher.detect_device(str(says_cuda)) == "cuda"
    assert sglang_launcher.detect_device(sys.executable) == "cpu"  # this torch sees no GPU
    assert SGLangServer(tmp_path, device="auto", python=str(says_cuda), log_path=tmp_path / "s.log").device == "cuda"


def test_the_sgl_kernel_stand_in_refuses_to_import_where_cuda_is_available():
    code = (
        "import sys, torch; torch.cuda.is_available = lambda: True; sys.path.insert(0, sys.argv[1]); import sgl_kernel"
    )
    done = subprocess.run([sys.executable, "-c", code, str(CPU_SHIMS_DIR)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "ImportError" in done.stderr
    assert "must not be imported here" in done.stderr and "PYTHONPATH" in done.stderr
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import sgl_kernel; print(sgl_kernel.IS_STAND_IN)",
            str(CPU_SHIMS_DIR),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.stdout.strip() == "True", ok.stderr


# --------------------------------------------------------- 12. gpu_check.sh's production path


def test_gpu_check_runs_sglang_with_cuda_graphs():
    script = (REPO / "benchmarks" / "gpu_check.sh").read_text()
    assert "--disable-cuda-graph" not in script
    assert "graph-check.json" in script


@pytest.mark.sglang
def test_gpu_check_compares_greedy_logprobs_before_and_after_a_load(tmp_path):
    results = tmp_path / "results"
    env = {
        **os.environ,
        "OUT": str(results),
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_SIZES": " ",
        "ROLLOUT_GPU_PYTHON": sys.executable,
    }
    done = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True, timeout=900, env=env
    )
    log = (results / "gpu-check.log").read_text()
    check = json.loads((results / "graph-check.json").read_text())
    assert check["passed"], log[-4000:]
    assert check["same_tokens_after_reload"] and check["max_abs_logprob_diff"] <= check["tolerance"]
    assert check["perturbed_changed_output"], "a load that changes the weights must change the answers"
    assert check["cuda_graphs"] == "n/a on cpu"
    assert "graph check: PASS" in log and done.returncode == 0, log[-4000:]
    [cast] = [json.loads(line.split("cast check: ", 1)[1]) for line in log.splitlines() if "cast check: {" in line]
    assert cast["cast_then_copy_s"] > 0 and cast["copy_then_cast_s"] > 0 and cast["publish_fp32_to_bf16_s"] > 0
