"""Naming hidden work folders after the process that writes them, to find those a dead one left.

A publisher's ``.tmp-step-*`` folder in the checkpoint root and ``materialize``'s
``.tmp-materialize-*`` folder end in ``-<owner_tag()>-<12 hex digits>``: the host (with its boot
and PID namespace, so that containers sharing a host name do not mistake each other's processes)
and the PID. :func:`left_by_dead_writer` tells a folder whose writer is gone, which may be removed
however young it is, from one a live process is still filling.

A work folder lies in a root that other processes may write into, so it is made its writer's
alone (:data:`WORK_FOLDER_MODE`) until it is renamed into place, and every file in it is made new
by :func:`new_file` (never through a link or over a file someone planted there).
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import socket
import stat
from pathlib import Path

from .tree_removal import remove_tree

log = logging.getLogger(__name__)

_TAG_RE = re.compile(r"-h([0-9a-f]{8})p([0-9]+)-[0-9a-f]{12}$", re.ASCII)

WORK_FOLDER_MODE = 0o700
"""A work folder's mode while it is written: its writer's alone, so that no other user of a
shared root can plant a file or a link in it (a link written through would make the writer
overwrite a file outside the root). :func:`open_work_folder` makes it; :func:`release_work_folder`
gives it back the mode ``mkdir`` gave it (the umask's or the root's default ACL's: what published
steps always had) just before it is renamed into place, so that readers running as other users
can read it."""
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def open_work_folder(path: Path) -> tuple[int, int]:
    """Make the work folder ``path`` and return ``(a descriptor of it, the mode it is to have once
    published)``; close the descriptor. The folder is made as ``mkdir`` makes any (the umask, or
    the root's default ACL, decide its mode: that is the published mode, what steps always had),
    then set to :data:`WORK_FOLDER_MODE` until :func:`release_work_folder` puts that mode back on
    the folder made here, not on whatever someone may have put at its name since."""
    os.mkdir(path, 0o777)
    try:
        dir_fd = os.open(path, _DIR_FLAGS)
    except BaseException:
        os.rmdir(path)
        raise
    try:
        mode = stat.S_IMODE(os.fstat(dir_fd).st_mode)
        os.fchmod(dir_fd, (mode & ~0o777) | WORK_FOLDER_MODE)
    except BaseException:
        os.close(dir_fd)
        os.rmdir(path)
        raise
    return dir_fd, mode


def release_work_folder(dir_fd: int, mode: int) -> None:
    """Give the work folder open as ``dir_fd`` its published ``mode`` (from :func:`open_work_folder`):
    done once nothing more is written in it, before it is synced and renamed into place. With a
    default ACL on the root, ``fchmod`` sets the ACL's mask: putting the mode back restores it."""
    os.fchmod(dir_fd, mode)


def new_file(path: Path) -> io.FileIO:
    """``path`` in a work folder, made new and open for writing (unbuffered: write with
    :func:`~rollout_service.full_writes.write_all`). The one way writers create files there.

    Made with ``O_EXCL | O_NOFOLLOW`` in the folder opened with ``O_NOFOLLOW``: a link planted at
    the file's name or at the folder's is never written through, and a file planted there is
    never written over; ``FileExistsError`` then says what happened (nothing of the step is
    published). The mode is what ``open(path, "wb")`` gives (``0o666`` less the umask)."""
    dir_fd = os.open(path.parent, _DIR_FLAGS)
    try:
        fd = os.open(path.name, _NEW_FILE_FLAGS, 0o666, dir_fd=dir_fd)
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST,
            f"{path.name} exists already in the work folder {path.parent}, which only this writer writes"
            " into: another process put it there (a file or a link); nothing of the step is published."
            " Check who else writes into the checkpoint root",
        ) from None
    finally:
        os.close(dir_fd)
    return io.FileIO(fd, "wb", closefd=True)


def owner_tag(pid: int | None = None) -> str:
    """``h<host hash>p<pid>``: which process writes a work folder, so that one left by a writer
    that died on this host is removed at the next start, however young it is (``pid``: another
    process of this host, default this one)."""
    return f"h{_host_hash()}p{os.getpid() if pid is None else pid}"


def _host_hash() -> str:
    """This host, boot and PID namespace: where a PID names one process (containers sharing a
    host name, or a host rebooted, get another hash, and their folders age out instead)."""
    parts = [socket.gethostname()]
    for where in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(where) if where.endswith("/pid") else Path(where).read_text().strip())
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def left_by_dead_writer(name: str) -> bool:
    """A work folder named ``...-<owner_tag()>-<12 hex>`` by a process of this host (same boot,
    same PID namespace) that no longer runs."""
    match = _TAG_RE.search(name)
    if match is None or match.group(1) != _host_hash():
        return False
    pid = int(match.group(2))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def remove_left_by_dead_writers(parent: Path, prefix: str, what: str) -> None:
    """Remove the folders of ``parent`` named ``<prefix>...-<owner_tag()>-<12 hex>`` whose writer
    died on this host (SIGKILL, a power cut): ``what`` names them in the log."""
    with os.scandir(parent) as entries:
        names = [e.name for e in entries if e.name.startswith(prefix)]
    for name in names:
        if left_by_dead_writer(name):
            log.info("removing %s, left by %s that was killed", parent / name, what)
            try:
                remove_tree(parent / name)
            except OSError as exc:
                log.warning("could not remove %s: %s; remove it by hand", parent / name, exc)
