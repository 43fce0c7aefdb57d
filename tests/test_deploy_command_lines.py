"""Every command line in deploy/ parses with the real parser (rollout-service, SGLang, accelerate),
with the container's environment; the docs name only real ROLLOUT_* variables.
"""

from __future__ import annotations

import argparse
import re

from deploy_files import (
    DOCS,
    K8S_DIR,
    K8S_KUSTOMIZATIONS,
    REPO,
    check_cli,
    cli_subcommands,
    compose_environment,
    compose_invocations,
    compose_services,
    dockerfile_images,
    dockerfile_invocations,
    find_container,
    k8s_argv,
    k8s_env,
    k8s_invocations,
    load_compose,
    pod_specs,
    render_kustomization,
    sglang_launch_argv,
)
from rollout_demo.cli import build_parser
from rollout_service.cli_env import env_name


def test_every_rollout_service_command_line_and_env_var_exists_in_the_cli(monkeypatch):
    invocations = [*compose_invocations(), *k8s_invocations()]
    commands = {argv[1] for _, argv, _ in invocations}
    assert {"serve", "sidecar", "make-tiny-model", "demo"} <= commands, commands
    for where, argv, env in invocations:
        if argv[1] != "demo":
            check_cli(argv, env, where, monkeypatch)
    for where, argv, _ in dockerfile_invocations():
        assert argv[1] == "--help" or argv[1] in cli_subcommands(build_parser()), f"{where}: unknown command {argv[1]}"


def test_demo_command_lines_match_the_demo_cli(monkeypatch):
    """`rollout-service demo` (trainer side) as compose and the trainer Job run it."""
    for where, argv, env in [*compose_invocations(), *k8s_invocations()]:
        if argv[1] == "demo":
            check_cli(argv, env, where, monkeypatch)


def test_sglang_and_accelerate_command_lines_parse_with_their_own_parsers():
    from accelerate.commands.launch import launch_command_parser
    from sglang.srt.server_args import ServerArgs

    sglang_parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(sglang_parser)
    command_lines: list[tuple[str, list[str]]] = []
    for name, service in compose_services(load_compose()).items():
        argv = [str(t) for t in service["command"]]
        command_lines.append(
            (f"compose service {name}", sglang_launch_argv(argv, compose_environment(service)) or argv)
        )
    for kustomization in K8S_KUSTOMIZATIONS:
        manifests = render_kustomization(kustomization)
        for workload, pod in pod_specs(manifests).items():
            for container in pod["containers"]:
                env = k8s_env(container, manifests)
                argv = k8s_argv(container, env)
                command_lines.append(
                    (
                        f"{kustomization.relative_to(REPO)} {workload}/{container['name']}",
                        sglang_launch_argv(argv, env) or argv,
                    )
                )
    seen = set()
    for where, argv in command_lines:
        if argv[:3] == ["python3", "-m", "sglang.launch_server"]:
            seen.add("sglang")
            try:
                parsed = sglang_parser.parse_args(argv[3:])
            except (argparse.ArgumentError, SystemExit) as exc:
                raise AssertionError(f"{where}: SGLang rejects {argv[3:]}: {exc}") from None
            # as `serve` starts it: no access-log line per sidecar poll (~43,000 a day)
            assert parsed.log_level_http == "warning", f"{where}: --log-level-http {parsed.log_level_http}"
        elif argv[:2] == ["accelerate", "launch"]:
            seen.add("accelerate")
            args = launch_command_parser().parse_args(argv[2:])
            assert (
                args.module and args.training_script == "rollout_demo.cli"
            ) or args.training_script == "/opt/rollout-service/examples/grpo_tldr_gpu.py", where
    assert seen == {"sglang", "accelerate"}


def test_cpu_dev_sglang_flags_are_the_launchers_cpu_flags():
    from rollout_service.sglang_launcher import SGLangServer

    launcher = SGLangServer("/models/tiny", device="cpu", port=30000, host="0.0.0.0").command()
    cpu_flags = launcher[launcher.index("--port") + 2 :]
    manifests = render_kustomization(K8S_DIR / "overlays" / "cpu-dev")
    sglang = find_container(pod_specs(manifests)["rollout"], "sglang")
    args = sglang["args"]
    assert args[args.index("--port") + 2 :] == cpu_flags
    image = sglang["image"]
    stage = dockerfile_images()[("rollout.Dockerfile", "cpu")]
    assert image.split(":")[0] == stage["labels"]["org.opencontainers.image.title"]
    assert stage["env"]["SGLANG_USE_CPU_ENGINE"] == "1" and stage["env"]["PYTHONPATH"]
    gpu = find_container(pod_specs(render_kustomization(K8S_DIR / "overlays" / "gpu"))["rollout"], "sglang")
    assert not set(cpu_flags) & set(gpu["args"]) - {"--model-path", "--host", "--port"}


def test_docs_mention_only_real_rollout_variables():
    text = DOCS.read_text()
    from rollout_demo.cli import build_parser as demo_parser

    known = set()
    for parser, command in ((build_parser(), "sidecar"), (build_parser(), "serve"), (demo_parser(), "demo")):
        sub = cli_subcommands(parser)[command]
        known |= {
            env_name(flag)
            for action in sub._actions
            for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"
        }
    mentioned = set(re.findall(r"\bROLLOUT_[A-Z_]+[A-Z]\b", text)) - {"ROLLOUT_CACHE_DIR", "ROLLOUT_PYTHON"}
    assert mentioned, "docs/deploy.md should show the ROLLOUT_* configuration"
    assert mentioned <= known, f"docs/deploy.md names unknown variables {sorted(mentioned - known)}"
    for flag in set(re.findall(r"rollout-service (?:sidecar|serve)[^`\n]*?(--[a-z-]+)", text)):
        assert env_name(flag) in known, f"docs/deploy.md uses unknown flag {flag}"


def test_docs_name_exactly_the_commands_a_service_link_rollout_port_breaks():
    """Kubernetes' service link ROLLOUT_PORT=tcp://... breaks only the commands that read ROLLOUT_PORT."""
    readers = sorted(
        name
        for name, sub in cli_subcommands(build_parser()).items()
        if any(spec.env == "ROLLOUT_PORT" for spec in getattr(sub, "env_flags", ()))
    )
    assert readers == ["serve", "sidecar"], readers
    (row,) = [line for line in DOCS.read_text().splitlines() if "ROLLOUT_PORT='tcp://" in line]
    symptom = row.split("|")[1]
    named = sorted(set(re.findall(r"rollout-service ([a-z-]+)", symptom)))
    assert named == readers and "every" not in symptom.lower(), (
        f"docs/deploy.md: the troubleshooting row must name the commands that read ROLLOUT_PORT {readers}: {symptom}"
    )
