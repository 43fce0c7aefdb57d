"""Removing a folder tree that someone else may have made: never following a link, never recursing.

Work folders, staged copies and stale leftovers live where other processes write (the checkpoint
root, ``$TMPDIR``, a stage dir). ``shutil.rmtree`` recurses once per level, so a tree 1000 levels
deep, which any process writing there can make, raises ``RecursionError`` in whoever cleans up;
and it stops at the first entry it cannot remove. :func:`remove_tree` is the one removal every
module uses instead.
"""

from __future__ import annotations

import itertools
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def remove_tree(path: Path | str) -> int:
    """Remove ``path`` and everything in it, never following a link, never recursing; return
    the bytes of the files removed.

    ``shutil.rmtree`` recurses once per level (a tree 1000 levels deep, which any process
    writing under the root can make, raises ``RecursionError``) and stops at the first entry
    it cannot remove. Here every folder found inside is first moved up into ``path`` itself by
    one rename, so the walk stays one level deep and holds two descriptors whatever the depth;
    everything that can be removed is, and what cannot is reported at the end in one
    ``OSError`` naming ``path``, how many entries failed and the first failure. A link or a
    file at ``path`` is unlinked (never what it points to).
    """
    return _remove(None, Path(path), str(path))


def remove_tree_at(dir_fd: int, name: str, shown: Path | str | None = None) -> int:
    """:func:`remove_tree` of the entry ``name`` of the folder open as ``dir_fd``: the folder
    it is looked up in stays the one opened, whatever is renamed or linked at its path meanwhile
    (``shown``: the path messages name, default ``name``). Returns the bytes of the files removed."""
    return _remove(dir_fd, name, str(name if shown is None else shown))


def _remove(dir_fd: int | None, name: Path | str, shown: str) -> int:
    st = os.lstat(name, dir_fd=dir_fd)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return st.st_size
    failures: list[tuple[str, OSError]] = []
    freed = [0]
    moved_prefix = f".rm-{uuid.uuid4().hex[:12]}-"
    counter = itertools.count()
    top = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        pending = _empty_folder(top, None, moved_prefix, counter, failures, freed)
        while pending:
            moved, was = pending.pop()
            try:
                pending.extend(_empty_folder(top, moved, moved_prefix, counter, failures, freed))
                os.rmdir(moved, dir_fd=top)
            except FileNotFoundError:
                continue
            except OSError as exc:
                failures.append((was, exc))
    finally:
        os.close(top)
    if failures:
        where, first = failures[0]
        raise OSError(
            first.errno,
            f"{len(failures)} entr{'y' if len(failures) == 1 else 'ies'} under {shown} could not be removed"
            f" (first: {where!r}: {first.strerror or first})",
        )
    os.rmdir(name, dir_fd=dir_fd)
    return freed[0]


def _empty_folder(
    top: int,
    name: str | None,
    moved_prefix: str,
    counter: Iterator[int],
    failures: list[tuple[str, OSError]],
    freed: list[int],
) -> list[tuple[str, str]]:
    """Unlink the non-folders in ``name`` (a folder in ``top``; None: ``top`` itself), adding their
    bytes to ``freed[0]``, and move its folders up into ``top`` under fresh names; return the
    folders left to empty, as (their name in ``top``, the name they had, for messages)."""
    fd = top if name is None else os.open(name, _DIR_FLAGS, dir_fd=top)
    folders: list[tuple[str, str]] = []
    try:
        with os.scandir(fd) as entries:
            children = [(e.name, e.is_dir(follow_symlinks=False), _size(e)) for e in entries]
        for child, is_dir, size in children:
            try:
                if not is_dir:
                    os.unlink(child, dir_fd=fd)
                    freed[0] += size
                elif name is None:
                    folders.append((child, child))
                else:
                    moved = f"{moved_prefix}{next(counter)}"
                    os.rename(child, moved, src_dir_fd=fd, dst_dir_fd=top)
                    folders.append((moved, child))
            except FileNotFoundError:
                continue
            except OSError as exc:
                failures.append((child, exc))
    finally:
        if fd != top:
            os.close(fd)
    return folders


def _size(entry: os.DirEntry[str]) -> int:
    """The bytes of a non-folder ``entry`` (0 for a folder, or one gone meanwhile)."""
    try:
        return 0 if entry.is_dir(follow_symlinks=False) else entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
