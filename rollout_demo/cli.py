"""The ``rollout-service`` console command: rollout_service's commands plus ``demo``.

The demo trains with ``trainer_hooks``, which imports ``rollout_service``; so the command that
wires the demo in lives here, above both packages, and ``rollout_service`` never imports the
trainer. ``python -m rollout_demo.cli`` is the same command (``accelerate launch --module``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollout_service import cli as service_cli
from rollout_service.cli_env import number_type

DEMO_NUMBERS: tuple[tuple[str, Callable[[str], Any], float, tuple[float, float], str], ...] = (
    ("--steps", int, 20, (1, 100_000), "GRPO steps"),
    ("--learning-rate", float, 2e-2, (0.0, 10.0), "learning rate (0: a control run)"),
    # GRPO's advantages compare a prompt's completions with each other: one alone has none.
    ("--num-generations", int, 8, (2, 1024), "completions per prompt"),
    ("--prompts-per-step", int, 4, (1, 4096), "prompts per step"),
    ("--max-completion-length", int, 16, (1, 32768), "new tokens per completion"),
)
"""The demo's number flags: (flag, type, default, inclusive range, help); a value outside the
range (or not finite) is refused with exit code 2 naming the flag, before anything starts."""


def register_demo(sub: Any, add_env: Callable[..., Any]) -> None:
    """Add the `demo` command to the subparsers `sub`."""
    p = sub.add_parser(
        "demo",
        help="GRPO with SGLang rollouts + checkpoint sync on one machine (CPU is fine)",
        description="Train GRPO for a few steps on a tiny local model (or --model) with SGLang"
        " rollouts: starts `serve` (SGLang + sidecar) unless --sglang-url/--sidecar-url are given,"
        " publishes a checkpoint every step and waits for the sidecar to load it, then writes"
        " summary.json and demo.png to --output-dir. Needs the [trainer] extra.",
    )
    add_env(p, "--output-dir", default="runs/demo", help="where summary.json and demo.png go")
    add_env(
        p,
        "--model",
        default=None,
        help="HF model directory or Hub id (default: the tiny local model, built once into"
        " ~/.cache/rollout-service/tiny-models)",
    )
    for flag, kind, default, (low, high), what in DEMO_NUMBERS:
        add_env(p, flag, type=number_type(kind, low, high), default=default, help=f"{what} ({low:g} to {high:g})")
    add_env(
        p,
        "--sglang-url",
        default=None,
        help="use this running SGLang instead of starting `serve` (with --sidecar-url and --checkpoint-path;"
        " default: start `serve`)",
    )
    add_env(p, "--sidecar-url", default=None, help="the sidecar beside --sglang-url (default: the one `serve` starts)")
    add_env(
        p,
        "--checkpoint-path",
        default=None,
        help="checkpoint root (default OUTPUT_DIR/checkpoints; required with --sglang-url: the root the"
        " sidecar at --sidecar-url watches, as this machine mounts it)",
    )
    add_env(
        p,
        "--token",
        default=None,
        help="the sidecars' POST /sync token (their --token), sent by the trainer (GRPOConfig sidecar_token;"
        " default none); prefer the variable: a command line is visible to every user of the machine",
    )
    add_env(
        p,
        "--sglang-api-key",
        default=None,
        help="the --api-key SGLang was started with, sent by the trainer (GRPOConfig sglang_api_token) and,"
        " when the demo starts `serve`, given to SGLang and its sidecar (default none); prefer the variable",
    )
    add_env(
        p,
        "--device",
        type=demo_device,
        default="cpu",
        help="where the trainer runs, 'cpu' or 'cuda' (a GPU), and the device of the SGLang server the demo starts",
    )
    add_env(p, "--seed", type=service_cli.SEED, default=0, help="random seed")
    p.set_defaults(func=_cmd_demo)


DEMO_DEVICES = ("cpu", "cuda")


def demo_device(text: str) -> str:
    """``--device``: the trainer's device and the SGLang server's, one of :data:`DEMO_DEVICES`."""
    if text not in DEMO_DEVICES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device the demo runs on: use 'cpu' or 'cuda'")
    return text


def _cmd_demo(args: argparse.Namespace) -> int:
    if (args.sglang_url is None) != (args.sidecar_url is None):
        raise ValueError("pass both --sglang-url and --sidecar-url, or neither")
    if args.sglang_url is not None and args.checkpoint_path is None:
        raise ValueError(
            "with --sglang-url, pass --checkpoint-path: the checkpoint root the sidecar at --sidecar-url"
            " watches (its GET /status `checkpoint_path`), as this machine mounts it"
        )
    try:
        from .demo import run_demo
    except ImportError as exc:
        print(f"error: the demo needs TRL and torch ({exc}); install the [trainer] extra", file=sys.stderr)
        return 2
    run_demo(
        Path(args.output_dir),
        model=Path(args.model) if args.model else None,
        steps=args.steps,
        learning_rate=args.learning_rate,
        num_generations=args.num_generations,
        prompts_per_step=args.prompts_per_step,
        max_completion_length=args.max_completion_length,
        sglang_url=args.sglang_url,
        sidecar_url=args.sidecar_url,
        checkpoint_path=Path(args.checkpoint_path) if args.checkpoint_path else None,
        device=args.device,
        seed=args.seed,
        sidecar_token=args.token,
        sglang_api_token=args.sglang_api_key,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The whole ``rollout-service`` parser, ``demo`` included."""
    return service_cli.build_parser(extra_commands=[register_demo])


def main(argv: list[str] | None = None) -> int:
    """Run ``rollout-service``; returns the exit code."""
    return service_cli.main(argv, extra_commands=[register_demo])


if __name__ == "__main__":
    sys.exit(main())
