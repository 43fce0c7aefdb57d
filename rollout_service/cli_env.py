"""argparse helpers: every flag can also come from an environment variable (for containers)."""

from __future__ import annotations

import argparse
import os
from typing import Any

ENV_PREFIX = "ROLLOUT_"


def env_name(flag: str) -> str:
    """``--checkpoint-path`` -> ``ROLLOUT_CHECKPOINT_PATH``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def add_env_argument(parser: argparse.ArgumentParser, flag: str, *, help: str,
                     default: Any = None, type: Any = str, required: bool = False,
                     **kwargs: Any) -> None:
    """Add ``flag`` whose default comes from its ``ROLLOUT_*`` variable when that is set."""
    env = env_name(flag)
    raw = os.environ.get(env)
    if raw is not None and raw != "":
        if kwargs.get("action") == "store_true":
            default = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                default = type(raw)
            except (TypeError, ValueError) as exc:
                parser.error(f"environment variable {env}={raw!r} is not valid for {flag}: {exc}")
        required = False
    suffix = f" [env {env}" + (f"; default {default}" if default not in (None, False) else "") + "]"
    if kwargs.get("action") == "store_true":
        parser.add_argument(flag, default=default, help=help + suffix, **kwargs)
    else:
        parser.add_argument(flag, default=default, type=type, required=required,
                            help=help + suffix, **kwargs)
