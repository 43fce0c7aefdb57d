"""Confinement of paths to the configured checkpoint root.

Every path that comes from a request, a manifest or a directory listing goes
through :func:`resolve_inside` before it is opened or handed to SGLang.
"""

from __future__ import annotations

import os
from pathlib import Path

from .checkpoint_format import CheckpointError


def resolve_inside(root: Path | str, candidate: Path | str) -> Path:
    """Resolve ``candidate`` (absolute, or relative to ``root``) and require it inside root.

    Symlinks are followed; a path whose real location is outside the root's real
    location raises ``CheckpointError('path_escape')``.
    """
    path = Path(candidate)
    if not path.is_absolute():
        path = Path(root) / path
    real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if not is_inside(real, real_root):
        raise CheckpointError(
            "path_escape",
            f"{candidate} resolves to a place outside the checkpoint root {real_root};"
            " only paths inside the root are accepted",
        )
    return real


def is_inside(path: Path | str, root: Path | str) -> bool:
    """Whether ``path`` really lies in ``root`` (or is it), symlinks resolved on both sides."""
    real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return real == real_root or real_root in real.parents


def check_plain_file_name(name: str, where: str) -> None:
    """A manifest file name must be a bare name: no directories, no '..', no hidden names,
    no NUL byte, at most 255 bytes (what one directory entry can hold)."""
    if (
        not name
        or name != os.path.basename(name)
        or name.startswith(".")
        or "\x00" in name
        or len(name.encode("utf-8", "surrogatepass")) > 255
    ):
        raise CheckpointError("path_escape", f"{where} lists the file name {name!r}; only bare file names are allowed")
