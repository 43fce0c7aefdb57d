"""SGLang's API key (and its other credentials) kept off command lines: handed to SGLang in a
file only its user reads.

SGLang 0.5.23 takes its key as ``--api-key KEY``, where every user of the machine (``ps``,
``/proc/PID/cmdline``) and anyone who can read the process list sees it. It
also reads a YAML ``--config`` file (its values count under the command line's), so the launchers
(``serve``'s :class:`~rollout_service.sglang_launcher.SGLangServer`, the containers' ``rollout-service
sglang``) take ``--api-key`` out of SGLang's arguments and put it into such a file: mode 0600, in a
folder of mode 0700 made for it, removed once SGLang answers (``serve``: it has read it) or when
it stops. (SGLang then still logs its arguments,
key included, at start: its logs are redacted where this project shows them, see
:mod:`rollout_service.redaction`, and the log files it writes are its user's alone.)

Where SGLang is already given a ``--config`` of the user's, the key stays on the command line (two
config files are refused by SGLang): put ``api-key`` into that file instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .redaction import SGLANG_CREDENTIAL_OPTIONS, spellings

log = logging.getLogger(__name__)

API_KEY_OPTIONS = spellings("--api-key", SGLANG_CREDENTIAL_OPTIONS["--api-key"])
"""SGLang's ``--api-key`` as its parser takes it (abbreviations included)."""
CREDENTIAL_SPELLINGS = {option: spellings(option, shortest) for option, shortest in SGLANG_CREDENTIAL_OPTIONS.items()}
"""Each of SGLang's credential options (``--api-key``, ``--admin-api-key``, ``--ssl-keyfile-password``)
with the spellings its parser takes."""
CONFIG_OPTION = "--config"
KEY_FILE_NAME = "sglang-key.yaml"


def take_option(args: list[str], spelled: tuple[str, ...]) -> tuple[list[str], str | None]:
    """``args`` without the option spelled any of ``spelled`` (``--opt V``, ``--opt=V``), and its
    value (the last one given, as SGLang's parser takes it)."""
    rest: list[str] = []
    value = None
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, given = arg.partition("=")
        if flag in spelled:
            if eq:
                value = given
            elif i + 1 < len(args):
                value = args[i + 1]
                i += 1
            else:
                rest.append(arg)  # no value: SGLang's parser says so
            i += 1
            continue
        rest.append(arg)
        i += 1
    return rest, value


def take_key(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` without SGLang's ``--api-key`` (``--api-key KEY``, ``--api-key=KEY``, any
    abbreviation SGLang takes), and the key given (the last one, as SGLang's parser takes it)."""
    return take_option(args, API_KEY_OPTIONS)


def take_credentials(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """``args`` without any of SGLang's credential options, and the values given, by option."""
    found: dict[str, str] = {}
    for option, spelled in CREDENTIAL_SPELLINGS.items():
        args, value = take_option(args, spelled)
        if value is not None:
            found[option] = value
    return args, found


def has_config(args: list[str]) -> bool:
    return any(a == CONFIG_OPTION or a.startswith(CONFIG_OPTION + "=") for a in args)


def write_key_file(key: str | dict[str, str]) -> Path:
    """A new file holding ``api-key: KEY`` (or each ``option: value`` of a dict of SGLang's
    credential options) as SGLang's ``--config`` reads it, in a new folder only this user may
    enter (under ``$TMPDIR``); remove it with :func:`remove_key_file`."""
    values = {"--api-key": key} if isinstance(key, str) else key
    folder = Path(tempfile.mkdtemp(prefix="sglang-key-"))
    path = folder / KEY_FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # A JSON string is a YAML double-quoted scalar (as is, not as \u escapes: YAML reads a
            # surrogate pair as two characters)
            for option, value in values.items():
                f.write(f"{option.removeprefix('--')}: {json.dumps(value, ensure_ascii=False)}\n")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return path


def remove_key_file(path: Path | None) -> None:
    """Remove a file :func:`write_key_file` made, with its folder (quietly when already gone)."""
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


def key_off_command_line(cmd: list[str]) -> tuple[list[str], Path | None]:
    """``cmd`` with SGLang's credential options (``--api-key``, ``--admin-api-key``,
    ``--ssl-keyfile-password``) moved into a key file (:func:`write_key_file`), and that file
    (None when ``cmd`` gives none, or gives its own ``--config``: then it is unchanged). A value
    starting with ``-`` stays on the command line (SGLang's config merger cannot pass it on)."""
    rest, found = take_credentials(cmd)
    if not found:
        return cmd, None
    if has_config(rest):
        log.warning(
            "SGLang's %s stays on its command line (visible to every user of this machine):"
            " SGLang is given a --config file of its own; put it into that file instead",
            ", ".join(found),
        )
        return cmd, None
    dashed = {option: value for option, value in found.items() if value.startswith("-")}
    for option in dashed:  # SGLang's config merger hands it on as `--option -...`: its parser refuses that
        log.warning(
            "SGLang's %s stays on its command line (visible to every user of this machine): a value"
            " starting with '-' cannot go through its --config file; choose one that does not",
            option,
        )
    moved = {option: value for option, value in found.items() if option not in dashed}
    if not moved:
        return cmd, None
    kept = [f"{option}={value}" for option, value in dashed.items()]  # (argparse takes "-..." only so)
    path = write_key_file(moved)
    return [*rest, *kept, CONFIG_OPTION, str(path)], path
