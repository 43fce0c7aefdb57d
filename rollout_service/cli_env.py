"""argparse helpers: every flag can also come from an environment variable (for containers).

Environment defaults are read only for the command being run, after its command line is parsed:
a variable meant for another command never breaks this one. That matters in Kubernetes, where
kubelet's service links put ``ROLLOUT_PORT=tcp://10.96.0.10:30000`` (and ``ROLLOUT_SERVICE_HOST``,
...) into every pod of a namespace with a Service named ``rollout``; the pod templates set
``enableServiceLinks: false``, and a value that is not valid for the command's flag is refused with
a message naming the variable.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "ROLLOUT_"

_FROM_ENV_OR_DEFAULT = object()
"""The argparse default of an env-backed flag: 'not given on the command line'."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_name(flag: str) -> str:
    """``--checkpoint-path`` -> ``ROLLOUT_CHECKPOINT_PATH``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


@dataclass(frozen=True)
class EnvFlag:
    """One flag whose default may come from its ``ROLLOUT_*`` variable."""

    flag: str
    dest: str
    env: str
    default: Any
    type: Callable[[str], Any]
    required: bool
    is_switch: bool

    def value_from(self, raw: str) -> Any:
        """Convert the variable's text; raises ValueError with a message naming the variable."""
        if self.is_switch:
            text = raw.strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(
                f"environment variable {self.env}={raw!r} is not valid for {self.flag}: "
                f"use one of {', '.join(_TRUE + _FALSE)}"
            )
        try:
            return self.type(raw)
        except (TypeError, ValueError) as exc:
            hint = ""
            if raw.startswith(("tcp://", "udp://")):
                hint = (
                    " (this looks like a Kubernetes service link: a Service named after the prefix"
                    " injects such variables; set `enableServiceLinks: false` in the pod spec or"
                    f" set {self.env} explicitly)"
                )
            raise ValueError(
                f"environment variable {self.env}={raw!r} is not valid for {self.flag}: {exc}{hint}"
            ) from None


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that fills env-backed flags from ``ROLLOUT_*`` after parsing its own line.

    As a subparser class, its ``parse_known_args`` runs only for the command that was chosen, so
    only that command's variables are read.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.env_flags: list[EnvFlag] = []

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        self.apply_env(parsed, os.environ)
        return parsed, extras

    def apply_env(self, namespace: argparse.Namespace, environ: Any) -> None:
        """Replace every env-backed flag not given on the command line by its variable or default."""
        missing = []
        for spec in self.env_flags:
            if getattr(namespace, spec.dest, None) is not _FROM_ENV_OR_DEFAULT:
                continue
            raw = environ.get(spec.env)
            if raw is not None and raw != "":
                try:
                    value = spec.value_from(raw)
                except ValueError as exc:
                    self.error(str(exc))
            elif spec.required:
                missing.append(f"{spec.flag} (or {spec.env})")
                continue
            else:
                value = spec.default
            setattr(namespace, spec.dest, value)
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")


def add_env_argument(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    help: str,
    default: Any = None,
    type: Any = str,
    required: bool = False,
    **kwargs: Any,
) -> None:
    """Add ``flag`` whose default comes from its ``ROLLOUT_*`` variable when that is set.

    The variable is read when this parser's command is the one being run (see
    :class:`EnvArgumentParser`), not when the parser is built.
    """
    if not isinstance(parser, EnvArgumentParser):
        raise TypeError(
            "add_env_argument needs an EnvArgumentParser (build the subparsers with parser_class=EnvArgumentParser)"
        )
    env = env_name(flag)
    is_switch = kwargs.get("action") == "store_true"
    suffix = f" [env {env}" + (f"; default {default}" if default not in (None, False) else "") + "]"
    if required:
        suffix = f" (required) [env {env}]"
    if is_switch:
        action = parser.add_argument(flag, default=_FROM_ENV_OR_DEFAULT, help=help + suffix, **kwargs)
    else:
        action = parser.add_argument(flag, default=_FROM_ENV_OR_DEFAULT, type=type, help=help + suffix, **kwargs)
    parser.env_flags.append(
        EnvFlag(
            flag=flag, dest=action.dest, env=env, default=default, type=type, required=required, is_switch=is_switch
        )
    )
