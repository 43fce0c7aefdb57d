"""SGLang's API key kept off command lines: handed to SGLang in a file only its user reads.

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
CONFIG_OPTION = "--config"
KEY_FILE_NAME = "sglang-key.yaml"


def take_key(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` without SGLang's ``--api-key`` (``--api-key KEY``, ``--api-key=KEY``, any
    abbreviation SGLang takes), and the key given (the last one, as SGLang's parser takes it)."""
    rest: list[str] = []
    key = None
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if flag in API_KEY_OPTIONS:
            if eq:
                key = value
            elif i + 1 < len(args):
                key = args[i + 1]
                i += 1
            else:
                rest.append(arg)  # no value: SGLang's parser says so
            i += 1
            continue
        rest.append(arg)
        i += 1
    return rest, key


def has_config(args: list[str]) -> bool:
    return any(a == CONFIG_OPTION or a.startswith(CONFIG_OPTION + "=") for a in args)


def write_key_file(key: str) -> Path:
    """A new file holding ``api-key: KEY`` as SGLang's ``--config`` reads it, in a new folder
    only this user may enter (under ``$TMPDIR``); remove it with :func:`remove_key_file`."""
    folder = Path(tempfile.mkdtemp(prefix="sglang-key-"))
    path = folder / KEY_FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            # A JSON string is a YAML double-quoted scalar (as is, not as \u escapes: YAML reads a
            # surrogate pair as two characters)
            f.write(f"api-key: {json.dumps(key, ensure_ascii=False)}\n")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return path


def remove_key_file(path: Path | None) -> None:
    """Remove a file :func:`write_key_file` made, with its folder (quietly when already gone)."""
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


def key_off_command_line(cmd: list[str]) -> tuple[list[str], Path | None]:
    """``cmd`` with its ``--api-key`` moved into a key file (:func:`write_key_file`), and that
    file (None when ``cmd`` gives no key, or gives its own ``--config``: then it is unchanged)."""
    rest, key = take_key(cmd)
    if key is None:
        return cmd, None
    if key.startswith("-"):  # SGLang's config merger hands it on as `--api-key -...`: its parser refuses that
        log.warning(
            "SGLang's --api-key stays on its command line (visible to every user of this machine): a key"
            " starting with '-' cannot go through its --config file; choose a key that does not"
        )
        return cmd, None
    if has_config(rest):
        log.warning(
            "SGLang's --api-key stays on its command line (visible to every user of this machine):"
            " SGLang is given a --config file of its own; put `api-key: ...` into that file instead"
        )
        return cmd, None
    path = write_key_file(key)
    return [*rest, CONFIG_OPTION, str(path)], path
