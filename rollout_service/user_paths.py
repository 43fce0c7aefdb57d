"""Reading a file system path a user gave in a setting (a flag, an environment variable, a
config field): ``~`` expanded as a shell would, made absolute, and refused with a ``ValueError``
naming the setting when it is no path at all or names a home directory that does not exist.

A value from an environment variable (``ROLLOUT_CHECKPOINT_PATH='~/ckpt'``) or a config field
reaches the program with its ``~`` unexpanded: every setting that takes a path reads it here, so
``serve``, the sidecar and the trainer agree on where ``~/ckpt`` is.
"""

from __future__ import annotations

import os
from pathlib import Path

from .shown_values import shown


def setting_path(value: object, name: str) -> Path:
    """``value`` (a ``str`` or ``os.PathLike``) as an absolute path with ``~`` expanded; a
    ``ValueError`` naming the setting ``name`` when it is another type or its ``~`` names no home."""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a path (a str or pathlib.Path), got {type(value).__name__} {shown(value)}")
    try:
        return Path(text).expanduser().absolute()
    except RuntimeError:  # ~user of no such user, or ~ with HOME unset and no passwd entry
        user = text[1:].split("/", 1)[0]
        whose = f"the user {user!r} has no home directory here" if user else "this process has no home directory"
        raise ValueError(f"{name} {text!r} starts with ~, but {whose}: write the path out in full") from None


def new_folder_path(value: str | os.PathLike[str], name: str) -> Path:
    """``value`` as the path of a new folder to make: it must end with the folder's own name
    (``.``, ``..`` or ``/`` name a folder that exists, whose parent would be written instead);
    a ``ValueError`` naming the setting ``name`` otherwise."""
    path = Path(value)
    if path.name in ("", ".", ".."):
        raise ValueError(f"{name} {value}: end it with the name of the new directory (not '..' or '.')")
    return path
