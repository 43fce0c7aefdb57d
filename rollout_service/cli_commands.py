"""The long-running commands (sidecar, serve), registered on the CLI parser."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sidecar.settings import SidecarSettings

AddEnv = Callable[..., Any]
"""`cli_env.add_env_argument`: adds a flag that its ROLLOUT_* variable can set."""

log = logging.getLogger(__name__)


def _add_sidecar_flags(p: argparse.ArgumentParser, add_env: AddEnv, *, with_url: bool) -> None:
    add_env(p, "--checkpoint-path", required=True, help="checkpoint root the trainer publishes step-* directories into")
    if with_url:
        add_env(p, "--sglang-url", required=True, help="SGLang server to load checkpoints into")
    add_env(
        p,
        "--poll",
        type=float,
        default=None,
        help="poll the checkpoint root every N seconds instead of inotify (NFS, CephFS, Lustre)",
    )
    add_env(
        p,
        "--replica-id",
        default="",
        help="name of this replica in acks/<id>.json and /status (default: HOSTNAME-PORT)",
    )
    add_env(p, "--host", default="127.0.0.1", help="address the sidecar binds to")
    add_env(p, "--token", default=None, help="token required by POST endpoints ('Authorization: Bearer TOKEN')")
    add_env(p, "--sglang-api-key", default=None, help="API key SGLang was started with, if any")
    add_env(
        p,
        "--reference-dir",
        default=None,
        help="model directory whose tensor names/shapes new checkpoints must match (default:"
        " the previously loaded checkpoint)",
    )
    add_env(
        p,
        "--check-digests",
        action="store_true",
        help="re-read every byte and check digests before loading (slower, catches bit rot)",
    )
    add_env(p, "--health-interval", type=float, default=2.0, help="seconds between SGLang health checks")
    add_env(
        p,
        "--deep-health-interval",
        type=float,
        default=30.0,
        help="seconds between SGLang /health calls (each runs a one-token generation)",
    )
    add_env(p, "--load-timeout", type=float, default=1800.0, help="seconds to allow one /update_weights_from_disk call")
    add_env(
        p,
        "--stage-dir",
        default=None,
        help="node-local folder (one per replica) where each checkpoint is copied and every"
        " byte verified before SGLang reads it (default: /dev/shm/rollout-stage-REPLICA when"
        " /dev/shm has 8 GiB free, else ~/.cache/rollout-service/stage/REPLICA)",
    )
    add_env(
        p,
        "--no-stage",
        action="store_true",
        help="let SGLang read checkpoints straight from shared storage (no copy; a writer can"
        " then change files between validation and SGLang's read)",
    )
    add_env(
        p,
        "--no-check-finite",
        action="store_true",
        help="do not refuse NaN/Inf weights (checked on bytes that staging or --check-digests reads anyway)",
    )
    add_env(
        p,
        "--validate-timeout",
        type=float,
        default=600.0,
        help="seconds one checkpoint's validation (and staging copy) may take before the step is rejected",
    )
    add_env(
        p,
        "--lora-keep",
        type=int,
        default=3,
        help="LoRA adapter versions kept loaded in SGLang (adapter sync); older ones are unloaded"
        " once no request uses them. At least the trainer's max_staleness + 1",
    )


def _settings(args: argparse.Namespace, sglang_url: str, port: int) -> SidecarSettings:
    from .sidecar.settings import SidecarSettings

    return SidecarSettings(
        checkpoint_path=Path(args.checkpoint_path),
        sglang_url=sglang_url,
        replica_id=args.replica_id,
        poll_interval_s=args.poll,
        host=args.host,
        port=port,
        token=args.token,
        sglang_api_key=args.sglang_api_key,
        reference_dir=Path(args.reference_dir) if args.reference_dir else None,
        check_digests=args.check_digests,
        health_interval_s=args.health_interval,
        deep_health_interval_s=args.deep_health_interval,
        load_timeout_s=args.load_timeout,
        stage=not args.no_stage,
        stage_dir=Path(args.stage_dir) if args.stage_dir else None,
        check_finite=not args.no_check_finite,
        validate_timeout_s=args.validate_timeout,
        lora_keep=args.lora_keep,
    )


def _cmd_sidecar(args: argparse.Namespace) -> int:
    from .sidecar.app import run_sidecar

    run_sidecar(_settings(args, args.sglang_url, args.port))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from .lora_serving import lora_from_args
    from .serve import RestartPolicy, run_serve
    from .sglang_launcher import SGLangServer

    Path(args.checkpoint_path).mkdir(parents=True, exist_ok=True)
    server = SGLangServer(
        model_path=args.model,
        host=args.sglang_host,
        port=args.port,
        device=args.device,
        extra_args=list(args.sglang_args or []),
        max_total_tokens=args.max_total_tokens,
        log_path=Path(args.sglang_log) if args.sglang_log else None,
        die_with_parent=True,
        lora=lora_from_args(args),
    )
    policy = RestartPolicy(
        max_restarts=args.max_restarts, restart_window_s=args.restart_window, startup_timeout_s=args.startup_timeout
    )
    settings = _settings(args, server.url, args.sidecar_port)
    return run_serve(server, settings, policy)


def register_sidecar(sub: Any, add_env: AddEnv) -> None:
    p = sub.add_parser(
        "sidecar",
        help="watch a checkpoint root and load new checkpoints into a running SGLang",
        description="Watch CHECKPOINT_PATH; validate each newly published step-* checkpoint and load"
        " it into SGLang with /update_weights_from_disk (weight_version = step); acknowledge it over"
        " HTTP and in CHECKPOINT_PATH/acks/REPLICA_ID.json. API: GET /healthz /readyz /status"
        " /wait?version=N&timeout=S /metrics, POST /sync.",
    )
    _add_sidecar_flags(p, add_env, with_url=True)
    add_env(p, "--port", type=int, default=8100, help="port of the sidecar's HTTP API")
    p.set_defaults(func=_cmd_sidecar)


def register_serve(sub: Any, add_env: AddEnv) -> None:
    from .lora_serving import add_lora_flags

    p = sub.add_parser(
        "serve",
        help="start SGLang and its sidecar as one supervised unit (like trl vllm-serve)",
        description="Start an SGLang server on MODEL (CPU or GPU flags chosen for this machine) and"
        " a sidecar that keeps it on the newest checkpoint under CHECKPOINT_PATH. A crashed SGLang"
        " is restarted with back-off and the newest checkpoint re-applied. Arguments after '--' go"
        " to sglang.launch_server verbatim, e.g. `rollout-service serve --model M --checkpoint-path"
        " C -- --tp-size 2`.",
    )
    add_env(p, "--model", required=True, help="HF model directory SGLang starts from (base weights)")
    _add_sidecar_flags(p, add_env, with_url=False)
    add_env(p, "--port", type=int, default=30000, help="SGLang's port")
    add_env(p, "--sglang-host", default="127.0.0.1", help="address SGLang binds to")
    add_env(p, "--sidecar-port", type=int, default=8100, help="port of the sidecar's HTTP API")
    add_env(p, "--device", default="auto", help="auto, cpu or cuda")
    add_env(
        p,
        "--max-total-tokens",
        type=int,
        default=16384,
        help="KV cache size on CPU (bounded, or SGLang reserves ~15 GB)",
    )
    add_env(
        p,
        "--max-restarts",
        type=int,
        default=5,
        help="SGLang restarts allowed within --restart-window seconds; once spent, SGLang stays"
        " down and /readyz and /status report `restart_budget_spent` with its last log lines",
    )
    add_env(
        p,
        "--restart-window",
        type=float,
        default=600.0,
        help="the window, in seconds, over which --max-restarts is counted (as systemd's StartLimitIntervalSec)",
    )
    add_env(
        p,
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for SGLang's /health at each start; the wait goes on while SGLang's"
        " log shows progress (a first download, kernel compilation, CUDA graphs)",
    )
    add_env(p, "--sglang-log", default=None, help="file for SGLang's output (default: a temp file)")
    add_lora_flags(p, add_env)
    p.set_defaults(func=_cmd_serve, sglang_args=[])


REGISTRARS = [register_sidecar, register_serve]
