"""Confinement of paths to the configured checkpoint root.

Every path that comes from a request, a manifest or a directory listing goes
through :func:`resolve_inside` before it is opened or handed to SGLang.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .checkpoint_format import CheckpointError

MAX_LINK_HOPS = 40
"""Symbolic links followed in one resolution (the kernel's own limit, ELOOP)."""


def resolve_inside(root: Path | str, candidate: Path | str) -> Path:
    """Resolve ``candidate`` (absolute, or relative to ``root``) and require it inside root.

    Symlinks are followed, but only while they stay in the root: each link's target is checked
    before anything at it is looked at, so a link to another file system (a hung mount) is
    refused without a look there. A path whose real location is outside the root's real
    location raises ``CheckpointError('path_escape')``.
    """
    real = _confined_realpath(root, candidate)
    if real is None:
        raise CheckpointError(
            "path_escape",
            f"{candidate} resolves to a place outside the checkpoint root {os.path.realpath(root)};"
            " only paths inside the root are accepted",
        )
    return real


def is_inside(path: Path | str, root: Path | str) -> bool:
    """Whether ``path`` really lies in ``root`` (or is it), symlinks resolved on both sides; a
    link out of ``root`` is not followed (see :func:`resolve_inside`)."""
    return _confined_realpath(root, os.path.join(os.getcwd(), path)) is not None  # relative: to the working directory


def _confined_realpath(root: Path | str, candidate: Path | str) -> Path | None:
    """``os.path.realpath(candidate)`` (relative to ``root`` when not absolute) when it lies in
    the real ``root``, else None; nothing outside the root is looked at on the way.

    The root itself is trusted (configured): its real path and its parents are taken as they
    are, and so are the components of ``candidate`` on the way to the root (a caller's path,
    not the root's contents). Once in the root, each component is looked at with ``lstat``
    and a link's target is followed only while the path stays in the root or on the root's own
    parents (a ``..`` back into it). A component that cannot be looked at (absent, EACCES...)
    ends the walk, the rest joined as written (as ``realpath`` does)."""
    real_root = os.path.realpath(root)
    given_root = os.path.abspath(root).split("/")
    # Not normalised: "link/.." is where the link leads, then up (as the kernel reads it).
    pending = os.path.join(os.getcwd(), os.fspath(root), os.fspath(candidate)).split("/")
    pending = [part for part in pending if part not in ("", ".")]
    if pending[: len(given_root) - 1] == given_root[1:]:  # written under the root as configured
        pending = real_root.split("/") + pending[len(given_root) - 1 :]
    cur = "/"
    hops = 0
    entered = False
    """Whether the walk reached the root: from then on, only the root and its parents are walked."""
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, part)
        if _within(real_root, nxt):  # the root or one of its parents: real folders
            cur = nxt
            continue
        inside = _within(nxt, real_root)
        if entered and not inside:
            return None  # a link (or "..") in the root that leads out of it: not looked at
        entered |= inside
        try:
            st = os.lstat(nxt)
        except OSError:
            cur = os.path.normpath(os.path.join(nxt, *pending))
            break
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_LINK_HOPS:
                return None
            target = os.readlink(nxt)
            if os.path.isabs(target):
                cur = "/"
            pending = target.split("/") + pending
            continue
        cur = nxt
    return Path(cur) if _within(cur, real_root) else None


def _within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or below it, as written (both absolute and normalised)."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


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
