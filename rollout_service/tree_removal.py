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


def remove_tree(path: Path | str) -> None:
    """Remove ``path`` and everything in it, never following a link, never recursing.

    ``shutil.rmtree`` recurses once per level (a tree 1000 levels deep, which any process
    writing under the root can make, raises ``RecursionError``) and stops at the first entry
    it cannot remove. Here every folder found inside is first moved up into ``path`` itself by
    one rename, so the walk stays one level deep and holds two descriptors whatever the depth;
    everything that can be removed is, and what cannot is reported at the end in one
    ``OSError`` naming ``path``, how many entries failed and the first failure. A link or a
    file at ``path`` is unlinked (never what it points to).
    """
    path = Path(path)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        os.unlink(path)
        return
    failures: list[tuple[str, OSError]] = []
    moved_prefix = f".rm-{uuid.uuid4().hex[:12]}-"
    counter = itertools.count()
    top = os.open(path, _DIR_FLAGS)
    try:
        pending = _empty_folder(top, None, moved_prefix, counter, failures)
        while pending:
            name, was = pending.pop()
            try:
                pending.extend(_empty_folder(top, name, moved_prefix, counter, failures))
                os.rmdir(name, dir_fd=top)
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
            f"{len(failures)} entr{'y' if len(failures) == 1 else 'ies'} under {path} could not be removed"
            f" (first: {where!r}: {first.strerror or first})",
        )
    os.rmdir(path)


def _empty_folder(
    top: int, name: str | None, moved_prefix: str, counter: Iterator[int], failures: list[tuple[str, OSError]]
) -> list[tuple[str, str]]:
    """Unlink the non-folders in ``name`` (a folder in ``top``; None: ``top`` itself) and move its
    folders up into ``top`` under fresh names; return the folders left to empty, as (their name in
    ``top``, the name they had, for messages)."""
    fd = top if name is None else os.open(name, _DIR_FLAGS, dir_fd=top)
    folders: list[tuple[str, str]] = []
    try:
        with os.scandir(fd) as entries:
            children = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for child, is_dir in children:
            try:
                if not is_dir:
                    os.unlink(child, dir_fd=fd)
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
