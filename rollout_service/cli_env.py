"""Settings declared once, as dataclass fields; their CLI flags and ``ROLLOUT_*`` variables derived.

A setting is a dataclass field whose metadata is :func:`setting`: the field gives its name, type
and default, :func:`setting` its flag and help. :class:`SettingFlags` derives the rest from the
fields: one flag per setting (``--poll``), its environment variable (``ROLLOUT_POLL``, see
:func:`env_name`), the help line (``[env ROLLOUT_POLL]``, the default, "required"), the text
conversion, and the dataclass built back from a parsed command line. Flags that are not settings
of a dataclass (``serve --model``, the demo's) use :func:`add_env_argument` directly, as the
generator does.

How values are read (the same for every setting):

- Precedence: the command line, then the variable, then the field's default. A field without a
  default is a required flag; ``--flag (or ROLLOUT_FLAG)`` is named when neither is given.
- A ``bool`` setting is a switch that flips its default: ``--check-digests`` for a field that
  defaults to False, ``--no-stage`` for one that defaults to True. Its variable holds the switch's
  value: ``1/true/yes/on`` or ``0/false/no/off`` (``ROLLOUT_NO_STAGE=1`` turns staging off).
- ``int``, ``float``, ``str`` and ``Path`` fields convert the text with the type. An empty
  variable counts as unset; an optional (``X | None``) non-text field given ``""`` on the command
  line is None. Other types declare ``parse=``.
- A required setting refuses an empty or blank value, on the command line or in its variable
  (``--checkpoint-path ""`` would otherwise be ``Path("")``, the current directory).
- A help text may name another setting's flag on the same command as ``{field}``
  (``{port}``: ``--port`` on ``sidecar``, ``--sidecar-port`` on ``serve``).
- A value that does not convert is refused (exit 2) with a message naming the variable.
- Where each value came from, the flag or the variable, is recorded in the parse
  (:func:`given_as`), so that a later check can name it (``ROLLOUT_PORT``, not only ``--port``)
  and tell a setting given from its default.
- A number setting declares its range (``setting(..., bounds=(low, high))``; a knob without a flag
  :func:`bounds_metadata`): a value that is not a finite number in it is refused by the flag (exit 2, naming
  the flag or the variable) and by the dataclass (:func:`check_bounds`, a ValueError naming the
  flag), and ``--help`` shows the range. :func:`number_type` is the same check for plain flags.

Environment defaults are read only for the command being run, after its command line is parsed:
a variable meant for another command never breaks this one. That matters in Kubernetes, where
kubelet's service links put ``ROLLOUT_PORT=tcp://10.96.0.10:30000`` (and ``ROLLOUT_SERVICE_HOST``,
...) into every pod of a namespace with a Service named ``rollout``; the pod templates set
``enableServiceLinks: false``, and a value that is not valid for the command's flag is refused with
a message naming the variable.

Why a small generator over the dataclass and not pydantic-settings: the settings stay plain
dataclasses that tests and embedders construct directly, validated in ``__post_init__``; the
slim sidecar image gains no dependency; and the behaviour that matters here is argparse's, which
pydantic-settings would not give: variables read only for the chosen command (the service-link
case above), one field exposed under another flag on another command (``serve --sidecar-port``
is the sidecar's ``--port``), ``--no-*`` switches, and the exact variable semantics above, which
its boolean and empty-string parsing would change. The generator is the first half of this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .number_text import text_parser
from .redaction import redact_text

ENV_PREFIX = "ROLLOUT_"

TIMEOUT_S = (0.01, 7 * 86400.0)
"""The range of every timeout setting and flag, in seconds (10 ms up to a week)."""
SHARD_MB_RANGE = (0.001, float(1 << 20))
"""The range of a shard size in MiB (about 1 KiB to 1 TiB): ``publish --max-shard-mb`` and the
trainer's ``checkpoint_max_shard_mb``."""

_FROM_ENV_OR_DEFAULT = object()
"""The argparse default of an env-backed flag: 'not given on the command line'."""

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

_SETTING = "rollout_service.setting"
"""The key of a field's :class:`Setting` in its metadata."""

_BOUNDS = "rollout_service.bounds"
"""The key of a number field's ``(low, high)`` range in its metadata."""

_TEXT_TYPES: tuple[type, ...] = (str, int, float, Path)
"""Field types converted from text by calling the type."""


def env_name(flag: str) -> str:
    """``--checkpoint-path`` -> ``ROLLOUT_CHECKPOINT_PATH``."""
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


# ---------------------------------------------------------------------------- declaration


@dataclass(frozen=True)
class Setting:
    """What a field declares for the command line; its type and default are the field's."""

    flag: str
    """``--poll``; the variable is derived from it (:func:`env_name`)."""
    help: str
    parse: Callable[[str], Any] | None = None
    """Text -> value, for a type outside ``str``/``int``/``float``/``Path``/``bool``."""


def setting(
    flag: str,
    help: str,
    *,
    parse: Callable[[str], Any] | None = None,
    bounds: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The metadata of a dataclass field that is also a CLI flag and a ``ROLLOUT_*`` variable.

    ``port: int = field(default=8100, metadata=setting("--port", "...", bounds=(1, 65535)))``; a
    field without a default is a required flag. ``bounds``: the inclusive range of a number
    setting (None, for an optional one, is always allowed). (``dataclasses.field`` itself, so that
    mypy still checks the constructor's required arguments and each default's type.)
    """
    return {_SETTING: Setting(flag, help, parse), **(bounds_metadata(*bounds) if bounds else {})}


def bounds_metadata(low: float, high: float) -> dict[str, tuple[float, float]]:
    """The metadata of a number field without a flag whose value must lie in ``[low, high]``."""
    return {_BOUNDS: (low, high)}


def declared_settings(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Setting]]:
    """The fields of dataclass ``cls`` declared with :func:`setting`, with their declarations."""
    for f in dataclasses.fields(cls):
        declaration = f.metadata.get(_SETTING)
        if declaration is not None:
            yield f, declaration


def range_problem(value: Any, low: float, high: float) -> str | None:
    """Why ``value`` is not a finite number from ``low`` to ``high`` (None when it is)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if number and (isinstance(value, int) or math.isfinite(value)) and low <= value <= high:
        return None
    return f"must be a finite number from {range_text(low, high)}, got {value!r}"


def _number(value: float) -> str:
    """``604800`` for 604800.0, ``0.01`` for 0.01: a bound as a person writes it."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else f"{value:g}"


def range_text(low: float, high: float) -> str:
    """``0.01 to 604800``: a number flag's range as ``--help`` shows it (and its errors name it)."""
    return f"{_number(low)} to {_number(high)}"


def check_range(name: str, value: Any, low: float, high: float) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is a finite number from ``low`` to ``high``."""
    problem = range_problem(value, low, high)
    if problem:
        raise ValueError(f"{name} {problem}")


def declared_bounds(f: dataclasses.Field[Any]) -> tuple[float, float] | None:
    """The ``(low, high)`` range field ``f`` declares (``setting(bounds=...)``, :func:`bounds_metadata`)."""
    return f.metadata.get(_BOUNDS)


def check_bounds(obj: Any) -> None:
    """Check every field of dataclass ``obj`` that declares a range; a ValueError names its flag."""
    for f in dataclasses.fields(obj):
        span = declared_bounds(f)
        value = getattr(obj, f.name)
        if span is not None and value is not None:
            declaration = f.metadata.get(_SETTING)
            check_range(declaration.flag if declaration else f.name, value, *span)


def number_type(kind: Callable[[str], Any], low: float, high: float) -> Callable[[str], Any]:
    """An argparse ``type``: the text as a ``kind`` number, refused unless finite and in ``[low, high]``.

    argparse then reports ``argument --flag: must be a finite number from ...``; a ``kind`` that
    does not convert the text keeps argparse's ``invalid float value: 'x'``. None (an optional
    setting's empty text) passes.
    """

    parse = text_parser(kind)

    def convert(text: str) -> Any:
        value = parse(text)
        problem = None if value is None else range_problem(value, low, high)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = getattr(kind, "__name__", "number")  # argparse's "invalid <name> value"
    return convert


# ---------------------------------------------------------------------------- derivation


@dataclass(frozen=True)
class SettingFlag:
    """One setting as one command exposes it."""

    field: str
    flag: str
    help: str
    default: Any
    """The flag's default: the field's, or False for a switch; None when required."""
    required: bool
    parse: Callable[[str], Any] | None
    """Text -> value; None for a switch."""
    invert: bool
    """A switch for a field that defaults to True (``--no-stage`` sets ``stage=False``)."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")  # argparse's rule

    @property
    def env(self) -> str:
        return env_name(self.flag)


class SettingFlags:
    """The flags of a settings dataclass on one command: added to its parser, read back into it.

    ``exclude`` leaves fields off (the command supplies them to :meth:`build`); ``flags`` exposes a
    field under another flag (and so another variable) on this command; ``defaults`` gives a field
    this command's own default (``serve --port`` is 30000 where the library picks a free port).
    """

    def __init__(
        self,
        cls: type,
        *,
        exclude: Collection[str] = (),
        flags: Mapping[str, str] | None = None,
        defaults: Mapping[str, Any] | None = None,
    ) -> None:
        renamed = dict(flags or {})
        own_defaults = dict(defaults or {})
        unknown = (set(exclude) | set(renamed) | set(own_defaults)) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
        self.cls = cls
        hints = typing.get_type_hints(cls)
        self.flags: list[SettingFlag] = []
        for f, declaration in declared_settings(cls):
            if f.name in exclude:
                continue
            where = f"{cls.__name__}.{f.name}"
            flag = renamed.get(f.name, declaration.flag)
            field_default = own_defaults.get(f.name, f.default)
            required = field_default is dataclasses.MISSING
            if hints[f.name] is bool:
                if required or flag.startswith("--no-") != bool(field_default):
                    raise TypeError(
                        f"{where}: a bool setting is a switch that flips its default;"
                        " name it --no-... exactly when the default is True"
                    )
                spec = SettingFlag(f.name, flag, declaration.help, False, False, None, invert=bool(field_default))
            else:
                parse = declaration.parse or _text_converter(hints[f.name], where)
                if required:
                    parse = not_blank(parse)
                help_text = declaration.help
                span = declared_bounds(f)
                if span is not None:
                    parse = number_type(parse, *span)
                    help_text += f" ({range_text(*span)})"
                default = None if required else field_default
                spec = SettingFlag(f.name, flag, help_text, default, required, parse, invert=False)
            self.flags.append(spec)
        self._name_flags_in_help(cls)

    def _name_flags_in_help(self, cls: type) -> None:
        """Replace each ``{field}`` in a help text by that field's flag on this command."""
        by_field = {spec.field: spec.flag for spec in self.flags}

        def flag_of(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in by_field:
                raise TypeError(f"{cls.__name__}: a help text names {{{name}}}, which has no flag on this command")
            return by_field[name]

        self.flags = [dataclasses.replace(spec, help=re.sub(r"\{(\w+)\}", flag_of, spec.help)) for spec in self.flags]

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add one env-backed flag per setting to ``parser`` (an :class:`EnvArgumentParser`)."""
        for spec in self.flags:
            if spec.parse is None:
                add_env_argument(parser, spec.flag, help=spec.help, default=False, action="store_true")
            else:
                add_env_argument(
                    parser, spec.flag, help=spec.help, default=spec.default, type=spec.parse, required=spec.required
                )

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields' values from a parse, by field name (only the fields with a flag here)."""
        kwargs = {}
        for spec in self.flags:
            value = getattr(args, spec.dest)
            kwargs[spec.field] = (not value) if spec.invert else value
        return kwargs

    def build(self, args: argparse.Namespace, **values: Any) -> Any:
        """An instance of the dataclass from a parse (fields without a flag: ``values``, or defaults)."""
        return self.cls(**{**self.values(args), **values})


def _text_converter(hint: Any, where: str) -> Callable[[str], Any]:
    """The text -> value function of a field's type (see the module docstring)."""
    members = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in members
    if optional:
        rest = [m for m in members if m is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    if hint not in _TEXT_TYPES:
        raise TypeError(f"{where}: no text conversion for {hint!r}; declare setting(..., parse=...)")
    convert: Callable[[str], Any] = text_parser(hint)
    if not optional or hint is str:
        return convert

    def optional_value(text: str) -> Any:
        return None if text == "" else convert(text)

    optional_value.__name__ = convert.__name__  # argparse names it: "invalid float value: 'x'"
    return optional_value


def not_blank(convert: Callable[[str], Any], what_to_do: str = "give a value") -> Callable[[str], Any]:
    """``convert``, refusing an empty or blank text first (saying ``what_to_do``): the value of a
    required setting (``Path("")`` is the current directory, ``str("")`` no model or URL at all)."""

    def checked(text: str) -> Any:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"must not be empty, got {text!r}: {what_to_do}")
        return convert(text)

    checked.__name__ = getattr(convert, "__name__", "value")  # argparse names it: "invalid float value: 'x'"
    return checked


# ------------------------------------------------------------------- env-backed argparse flags


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
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
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


class RedactingArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose error messages hide credentials: ``unrecognized arguments:
    --api-key KEY`` (SGLang's flag given to ``serve`` without ``--``) would print the key into
    the container's or the journal's log."""

    def error(self, message: str) -> NoReturn:
        super().error(redact_text(message))


class EnvArgumentParser(RedactingArgumentParser):
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

    def apply_env(self, namespace: argparse.Namespace, environ: Mapping[str, str]) -> None:
        """Replace every env-backed flag not given on the command line by its variable or default,
        and record where each value that is no default came from (:func:`given_as`)."""
        missing = []
        given: dict[str, str] = getattr(namespace, _GIVEN, {})
        setattr(namespace, _GIVEN, given)
        for spec in self.env_flags:
            if getattr(namespace, spec.dest, None) is not _FROM_ENV_OR_DEFAULT:
                given[spec.dest] = spec.flag
                continue
            raw = environ.get(spec.env)
            if raw is not None and raw != "":
                try:
                    value = spec.value_from(raw)
                except ValueError as exc:
                    self.error(str(exc))
                given[spec.dest] = spec.env
            elif spec.required:
                missing.append(f"{spec.flag} (or {spec.env})")
                continue
            else:
                value = spec.default
            setattr(namespace, spec.dest, value)
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")


_GIVEN = "env_flags_given"
"""The namespace attribute where :class:`EnvArgumentParser` records where values came from."""


def given_as(args: argparse.Namespace, dest: str) -> str | None:
    """Where the env-backed flag ``dest`` got its value: its flag (``--port``) when given on the
    command line, its variable (``ROLLOUT_PORT``) when read from it; None when it holds its default."""
    given: dict[str, str] = getattr(args, _GIVEN, {})
    return given.get(dest)


def add_env_argument(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    help: str,
    default: Any = None,
    type: Any = str,
    required: bool = False,
    **kwargs: Any,
) -> str:
    """Add ``flag`` whose default comes from its ``ROLLOUT_*`` variable when that is set; returns its dest.

    The variable is read when this parser's command is the one being run (see
    :class:`EnvArgumentParser`), not when the parser is built.
    """
    if not isinstance(parser, EnvArgumentParser):
        raise TypeError(
            "add_env_argument needs an EnvArgumentParser (build the subparsers with parser_class=EnvArgumentParser)"
        )
    env = env_name(flag)
    is_switch = kwargs.get("action") == "store_true"
    shown = _default_text(default)
    suffix = f" [env {env}" + (f"; default {shown}" if shown is not None else "") + "]"
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
    return action.dest


def _default_text(default: Any) -> str | None:
    """A flag's default as ``--help`` shows it: None (shown not at all) for None, False and "".

    Identity checks, so that ``0`` and ``0.0`` are shown; a list or tuple is written as the flag
    takes it, its items joined with commas (``q_proj,v_proj``, not a Python repr).
    """
    if default is None or default is False or (isinstance(default, str) and default == ""):
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(str(item) for item in default) or None
    return str(default)
