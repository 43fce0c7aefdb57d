"""The command-line arguments every distributed test script takes (a rollout unit and an output)."""

from __future__ import annotations

import argparse


def rollout_unit_parser(steps: int) -> argparse.ArgumentParser:
    """--sglang-url, --sidecar-url, --checkpoint-path, --out (JSON result) and --steps."""
    p = argparse.ArgumentParser()
    p.add_argument("--sglang-url", required=True)
    p.add_argument("--sidecar-url", required=True)
    p.add_argument("--checkpoint-path", required=True)
    p.add_argument("--out", required=True, help="where the main process writes its JSON result")
    p.add_argument("--steps", type=int, default=steps)
    return p
