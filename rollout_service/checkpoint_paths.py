"""Confinement of paths to the configured checkpoint root.

Every path that comes from a request, a manifest or a directory listing goes
through :func:`resolve_inside` before it is opened or handed to SGLang.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .checkpoint_format import CheckpointError
from .shown_values import escape_controls

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
    """Whether ``path`` really lies in ``root`` (or is it), symlinks resolved on both sides
    (``os.path.realpath``: for paths a caller or SGLang gives, e.g. where to write, never for
    names found under the root, which :func:`resolve_inside` resolves without leaving it)."""
    real, real_root = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    return real == real_root or real_root in real.parents


def _confined_realpath(root: Path | str, candidate: Path | str) -> Path | None:
    """``os.path.realpath(candidate)`` (relative to ``root`` when not absolute) when it lies in
    the real ``root``, else None; nothing outside the root is looked at on the way.

    The root itself is trusted (configured): its real path and its parents are taken as they
    are, and a path written through the root as configured (a link to it) is read as its real
    path, in ``candidate`` and in a link's absolute target alike. Each component in the root is
    looked at with ``lstat``, and a link's target is followed only while the path stays in the
    root or on the root's own parents (a ``..`` back into it): a link out and back in is refused
    (None), as is a loop of links. A component that cannot be looked at (absent, EACCES...) ends
    the walk: the rest is joined as written, or, when a ``..`` follows (the kernel would fail
    there), the path is refused."""
    real_root = os.path.realpath(root)
    given_root = _parts(os.path.abspath(root))
    real_parts = _parts(real_root)

    def from_root(parts: list[str]) -> list[str]:
        # Not normalised: "link/.." is where the link leads, then up (as the kernel reads it).
        if parts[: len(given_root)] == given_root:  # written through the root as configured
            return real_parts + parts[len(given_root) :]
        return parts

    pending = from_root(_parts(os.path.join(os.getcwd(), os.fspath(root), os.fspath(candidate))))
    cur = "/"
    hops = 0
    entered = False
    """Whether the walk reached the root: from then on, only the root and its parents are walked."""
    while pending:
        part = pending.pop(0)
        if part == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, part)
        if path_within(real_root, nxt):  # the root or one of its parents: real folders
            cur = nxt
            continue
        inside = path_within(nxt, real_root)
        if entered and not inside:
            return None  # a link (or "..") in the root that leads out of it: not looked at
        entered |= inside
        try:
            st = os.lstat(nxt)
        except OSError:
            if ".." in pending:
                return None
            cur = os.path.join(nxt, *pending)
            break
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > MAX_LINK_HOPS:
                return None
            link = os.readlink(nxt)
            target = _parts(link)
            if os.path.isabs(link):
                cur, target = "/", from_root(target)
            pending = target + pending
            continue
        cur = nxt
    return Path(cur) if path_within(cur, real_root) else None


def _parts(path: str) -> list[str]:
    """The components of ``path``, without empty ones and ``.`` (``..`` kept)."""
    return [part for part in path.split("/") if part not in ("", ".")]


def path_within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or below it, as written (both absolute and normalised)."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def check_plain_file_name(name: str, where: str) -> None:
    """A manifest file name must be a bare name: no directories, no '..', no hidden names,
    no NUL byte, no control character (:func:`~rollout_service.shown_values.escape_controls`),
    at most 255 bytes (what one directory entry can hold), and text a file system can name
    (JSON's ``"\ud800"`` is a lone surrogate, which no UTF-8 name holds)."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise CheckpointError(
            "bad_manifest", f"{where} lists the file name {name!r}, which holds a lone surrogate (no UTF-8 text)"
        ) from None
    if not name or name != os.path.basename(name) or name.startswith(".") or "\x00" in name or size > 255:
        raise CheckpointError("path_escape", f"{where} lists the file name {name!r}; only bare file names are allowed")
    if escape_controls(name) != name:  # no writer makes one; shown anywhere, it would need escaping
        raise CheckpointError(
            "bad_manifest", f"{where} lists the file name {name!r}, which holds control characters (a newline, ESC...)"
        )
