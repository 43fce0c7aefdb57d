"""The stage's folder: which entries are the stage's own, its marker and lock, and reclaiming
the folders of stages nobody runs any more.

A stage touches only the names it makes: its copies (``step-XXXXXXXX-<fingerprint>``), its
hidden ``.tmp-*`` work, ``reference.json``, ``.lock`` and the marker ``.rollout-stage``. The
marker says a folder is a stage: a folder that holds anything else and no marker (``$HOME``,
``/dev/shm`` itself, the folder around the checkpoint root) is refused, never cleaned; one an
older version staged into (only such names) is adopted. The stage's own files are opened without
blocking and must be regular files (a FIFO left at ``.lock`` cannot hang the sidecar). A sidecar
killed (SIGKILL, OOM) leaves its stage in ``/dev/shm``, which is RAM: :func:`reclaim_shm_leftovers`
removes the marked ``/dev/shm/rollout-stage-*`` folders of this user's whose lock nobody holds,
each opened once without following a link and emptied through that descriptor.

``/dev/shm`` is every user's: another user may make the stage's (predictable) name first, as a
folder or as a link, or put folders named like staged copies where the stage works. A stage
folder must be this user's (or root's); a link at its name is followed only when this user (or
root) made it and the folder it points to passes the same check, and the stage then works in that
folder, resolved once (:func:`resolve_stage_path`). A staged copy is adopted only when it and every
file in it are this user's, regular, and writable by nobody else (:func:`foreign_copy`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..checkpoint_format import TEMP_PREFIX
from ..full_writes import write_all
from ..tree_removal import remove_tree, remove_tree_at
from ..untrusted_files import _kind

log = logging.getLogger(__name__)

REFERENCE_NAME = "reference.json"
LOCK_NAME = ".lock"
MARKER_NAME = ".rollout-stage"
"""A regular file in every stage folder: the stage works only in a folder that has it (or that
it may adopt, see :func:`check_is_stage`)."""
MARKER_TEXT = b"rollout-service stage folder: the sidecar removes only the entries it made here\n"
COPY_NAME_RE = re.compile(r"^step-[0-9]{8}-[0-9a-f]{12}$", re.ASCII)
"""A staged copy's name (:meth:`Stage._name_for`): ``step-XXXXXXXX-<12 hex digits of its fingerprint>``."""
LEFT_ALONE_NAMES = frozenset({"lost+found"})
"""Names a file system's root holds: a stage at a volume's root may adopt it, never touches them."""
SHM_DIR = Path("/dev/shm")
SHM_STAGE_PREFIX = "rollout-stage-"
"""Default stages are ``SHM_DIR / (SHM_STAGE_PREFIX + replica id)``."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
WORK_FOLDER_MODE = 0o755
"""The mode the stage's hidden work folders are made with (the umask may only take bits away):
SGLang, another user maybe, reads the copies; nobody but this user writes into them."""


class StageError(RuntimeError):
    """The stage itself failed (no room, not writable, not a stage folder): not the checkpoint's fault."""


def is_work_name(name: str) -> bool:
    """A name the stage gives its copies and its hidden work (what pruning may remove)."""
    return bool(COPY_NAME_RE.match(name)) or name.startswith(TEMP_PREFIX)


def _is_stage_name(name: str) -> bool:
    """A name the stage makes (or a file system's own): all a folder may hold to be adopted."""
    return is_work_name(name) or name in (LOCK_NAME, REFERENCE_NAME, MARKER_NAME) or name in LEFT_ALONE_NAMES


def _is_marked(folder: Path, dir_fd: int | None = None) -> bool:
    """Whether ``folder`` (or the folder open as ``dir_fd``) carries the stage marker (a regular
    file, not followed if a link)."""
    try:
        return stat.S_ISREG(
            os.lstat(MARKER_NAME if dir_fd is not None else folder / MARKER_NAME, dir_fd=dir_fd).st_mode
        )
    except OSError:
        return False


def check_is_stage(folder: Path) -> None:
    """``StageError`` unless ``folder`` is a stage: marked, or holding only names a stage makes
    (empty, or staged into by a version without the marker: adopted, :func:`mark_as_stage`)."""
    if _is_marked(folder):
        return
    try:
        foreign = sorted(e.name for e in os.scandir(folder) if not _is_stage_name(e.name))
    except OSError as exc:
        raise StageError(
            f"cannot list the stage directory {folder}: {exc.strerror}; pass another --stage-dir"
        ) from None
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise StageError(
            f"--stage-dir {folder} holds entries the stage did not make ({shown}) and no {MARKER_NAME} marker:"
            " it is not a stage folder, and a stage removes what it does not keep. Pass a new or empty folder of"
            f" its own as --stage-dir (e.g. {folder / 'rollout-stage'})"
        )


def check_owner(folder: Path, *, link: Path | None = None) -> None:
    """``StageError`` unless ``folder`` is a folder (not a link: see :func:`resolve_stage_path`)
    that belongs to this user (or to root, as a Kubernetes emptyDir does). In a folder every user
    may write to (``/dev/shm``), another user could make the stage folder first, under its
    predictable name, and then swap the verified copies SGLang loads. ``link``: the link
    ``folder`` was reached by, named in the message."""
    via = f" (where the link {link} points)" if link is not None else ""
    st = _lstat_stage(folder, via)
    if not stat.S_ISDIR(st.st_mode):
        raise StageError(
            f"the stage directory {folder}{via} is {_kind(st.st_mode)}, not a folder (changed while the"
            " sidecar looked at it?); pass a --stage-dir of this user's"
        )
    if st.st_uid not in (os.geteuid(), 0):
        raise StageError(
            f"the stage directory {folder}{via} belongs to user id {st.st_uid}, not to this sidecar's"
            f" ({os.geteuid()}): whoever owns it could replace the verified copies SGLang loads. Remove it (if"
            " nobody should have made it) or pass a --stage-dir of this user's"
        )


def close_to_others(folder: Path) -> None:
    """Make the stage folder ``folder`` (checked by :func:`check_owner`) writable by nobody but
    this user when it is this user's: made under a umask of 002, the group could rename a verified
    copy away between its check and SGLang's load, and put its own folder under that name. A
    folder of another user's (root's: a Kubernetes emptyDir, private to its pod) or one with the
    sticky bit (every user's, as ``/dev/shm``, given as the stage itself) is left as it is.
    ``StageError`` when that fails."""
    try:
        fd = os.open(folder, _DIR_FLAGS)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX:
                _drop_others_write(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StageError(
            f"cannot make the stage directory {folder} writable by this user only: {exc.strerror or exc};"
            " pass a --stage-dir of this user's"
        ) from None


def _lstat_stage(path: Path, via: str = "") -> os.stat_result:
    """``os.lstat`` of the stage directory ``path`` (``via``: how it was reached, for the
    message); ``StageError`` naming it when it cannot be looked at."""
    try:
        return os.lstat(path)
    except OSError as exc:
        raise StageError(
            f"cannot look at the stage directory {path}{via}: {exc.strerror}; pass another --stage-dir"
        ) from None


def resolve_stage_path(path: Path) -> Path:
    """The folder a stage at ``path`` works in: ``path`` itself, or, when ``path`` is a symbolic
    link, the folder it points to, resolved here once (the stage then works there, whatever the
    link is later changed to). ``StageError`` when the link was made by another user than this
    one or root (another user can make ``/dev/shm/rollout-stage-<replica>`` first, as a link to a
    folder that passes the owner check, and point it elsewhere later), or when its target does
    not pass :func:`check_owner`."""
    st = _lstat_stage(path)
    if not stat.S_ISLNK(st.st_mode):
        return path
    if st.st_uid not in (os.geteuid(), 0):
        raise StageError(
            f"the stage directory {path} is a symbolic link made by user id {st.st_uid}, not by this sidecar's"
            f" user ({os.geteuid()}) or root: whoever made it could point it at a folder of theirs and replace"
            " the verified copies SGLang loads. Remove it (if nobody should have made it) or pass a --stage-dir"
            " of this user's"
        )
    target = Path(os.path.realpath(path))
    check_owner(target, link=path)
    log.info("the stage directory %s is a link to %s: the stage works in %s", path, target, target)
    return target


def foreign_copy(path: Path) -> str | None:
    """Why the staged copy ``path`` may not be adopted (None when it may): it must be a folder
    (not a link) of this user's, writable by nobody else, holding only regular files (no links,
    no folders) of this user's, writable by nobody else. Anything else may have been put there,
    or may be changed after it was verified, by someone else than this sidecar (a stage in
    ``/dev/shm`` or in a folder root owns may hold other users' entries). ``FileNotFoundError``
    when there is nothing at ``path``."""
    euid = os.geteuid()
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return f"it {_not_own(st, euid, is_dir=True)}"
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        return f"it cannot be looked at ({exc.strerror or exc})"
    try:
        why = _not_own(os.fstat(fd), euid, is_dir=True)
        if why is not None:
            return f"it {why}"
        with os.scandir(fd) as entries:
            for entry in entries:
                why = _not_own(entry.stat(follow_symlinks=False), euid, is_dir=False)
                if why is not None:
                    return f"its entry {entry.name!r} {why}"
        return None
    except OSError as exc:
        return f"it cannot be looked at ({exc.strerror or exc})"
    finally:
        os.close(fd)


def _not_own(st: os.stat_result, euid: int, *, is_dir: bool) -> str | None:
    """Why an entry of a staged copy with this ``lstat`` is not this user's alone, or None."""
    if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
        return f"is {kind}, not {'a folder' if is_dir else 'a regular file'}"
    if st.st_uid != euid:
        return f"belongs to user id {st.st_uid}, not to this sidecar's ({euid})"
    if st.st_mode & _OTHERS_WRITE:
        return f"may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def seal_copy(folder: Path) -> None:
    """Make the copy being made in ``folder`` (this process's own hidden work, before it is
    renamed into place) and its files writable by nobody but this user, as :func:`foreign_copy`
    wants of a copy it adopts (a umask of 002 would leave them group-writable: another user of the
    group could change them after they were verified). ``StageError`` when that fails."""
    try:
        fd = os.open(folder, _DIR_FLAGS)
        try:
            _drop_others_write(fd)
            with os.scandir(fd) as entries:
                names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
            for name in names:
                file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
                try:
                    _drop_others_write(file_fd)
                finally:
                    os.close(file_fd)
        finally:
            os.close(fd)
        why = foreign_copy(folder)
    except OSError as exc:
        raise StageError(
            f"cannot make the copy {folder} writable by this user only: {exc.strerror or exc}; check the stage"
            " directory"
        ) from None
    if why is not None:  # someone else wrote into this sidecar's work folder: nothing in it is trusted
        raise StageError(
            f"the copy being made in {folder} is not this user's alone: {why}; another user wrote into the"
            " stage directory: pass a --stage-dir only this user may write to"
        )


def _drop_others_write(fd: int) -> None:
    mode = os.fstat(fd).st_mode
    if mode & _OTHERS_WRITE:
        os.fchmod(fd, stat.S_IMODE(mode) & ~_OTHERS_WRITE)


def reusable_file(path: Path) -> bool:
    """Whether a file of the stage's spare copy may be written over for a new copy: a regular
    file of this user's, writable by nobody else, with no other name (a hard link made from
    outside the stage would get the new copy's bytes written outside it, and could change them
    after they were verified). Anything else is left to be removed with the spare."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def mark_as_stage(folder: Path) -> None:
    """Put the marker into ``folder`` (which :func:`check_is_stage` accepted) unless it is there."""
    if _is_marked(folder):
        return
    path = folder / MARKER_NAME
    try:
        fd = open_own_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "marker")
        try:
            write_all(fd, MARKER_TEXT)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StageError(f"cannot write {path}: {exc.strerror}; pass a writable node-local --stage-dir") from None


def open_own_file(path: Path, flags: int, what: str, *, dir_fd: int | None = None) -> int:
    """A descriptor of the stage's own file ``path`` (its lock, its marker), opened with
    ``O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC`` so that a FIFO or a device left at its name cannot
    block the sidecar. ``StageError`` naming it unless it is a regular file; other open errors
    stay ``OSError`` (``FileNotFoundError``: the folder is gone). ``dir_fd``: the folder open
    there, in which ``path.name`` is opened (``path`` names it in messages)."""
    name = path if dir_fd is None else path.name
    try:
        fd = os.open(name, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        try:
            mode = os.lstat(name, dir_fd=dir_fd).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISREG(mode):
            raise
        raise StageError(_not_regular(path, mode, what, exc.strerror)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise StageError(_not_regular(path, mode, what, None))
    return fd


def _not_regular(path: Path, mode: int, what: str, strerror: str | None) -> str:
    return (
        f"cannot open {path}: {strerror + ' ' if strerror else ''}({_kind(mode)}, not a regular file):"
        f" something other than a sidecar put it where the stage keeps its {what}; remove it, or pass"
        " another --stage-dir"
    )


def take_lock(folder: Path) -> int:
    """The stage's lock, held (``StageError`` when another sidecar holds it or it cannot be opened)."""
    path = folder / LOCK_NAME
    try:
        fd = open_own_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "lock")
    except OSError as exc:
        raise StageError(
            f"cannot open {path}: {exc.strerror} (left by a sidecar run as another user?);"
            " pass a node-local --stage-dir this sidecar owns, or remove that one"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StageError(
            f"another sidecar uses the stage directory {folder}: give each"
            " replica its own --stage-dir (or --replica-id)"
        ) from None
    return fd


def empty_stage(folder: Path) -> int:
    """(Lock held.) Remove what a stage made in ``folder``, its lock last (while still held:
    nobody locks a file about to vanish), then the folder if nothing else is left. Returns the
    bytes freed. ``folder`` is opened once, without following a link, and emptied through that
    descriptor (:func:`_empty_stage_at`)."""
    parent = os.open(folder.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = os.open(folder.name, _DIR_FLAGS, dir_fd=parent)
        try:
            freed = _empty_stage_at(fd, folder)
            _remove_folder_if_empty(parent, folder.name, os.fstat(fd))
        finally:
            os.close(fd)
    finally:
        os.close(parent)
    return freed


def _empty_stage_at(dir_fd: int, folder: Path) -> int:
    """(Lock held.) Remove the stage's entries from the folder open as ``dir_fd`` (``folder``
    names it in messages), its lock last; each is looked up in, and removed from, that very
    folder (never through a path someone could have changed into a link since). The bytes freed."""
    with os.scandir(dir_fd) as entries:
        names = [e.name for e in entries]
    freed = 0
    for name in names:
        if is_work_name(name) or name in (REFERENCE_NAME, MARKER_NAME):
            freed += _remove_entry_at(dir_fd, name, folder)
    os.unlink(LOCK_NAME, dir_fd=dir_fd)
    return freed


def _remove_entry_at(dir_fd: int, name: str, folder: Path) -> int:
    """:func:`remove_entry` of the entry ``name`` of the folder open as ``dir_fd``; the bytes freed."""
    try:
        if not stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode):
            return remove_tree_at(dir_fd, name, folder / name)
        if not name.startswith(TEMP_PREFIX):
            hidden = f"{TEMP_PREFIX}deleting-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(name, hidden, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            name = hidden
        return remove_tree_at(dir_fd, name, folder / name)
    except FileNotFoundError:
        return 0


def _remove_folder_if_empty(parent_fd: int, name: str, emptied: os.stat_result) -> None:
    """Remove the folder ``name`` of ``parent_fd`` if it is still the one emptied (and empty)."""
    with contextlib.suppress(OSError):  # not empty (someone else's entries), or replaced: leave it
        there = os.lstat(name, dir_fd=parent_fd)
        if (there.st_dev, there.st_ino) == (emptied.st_dev, emptied.st_ino):
            os.rmdir(name, dir_fd=parent_fd)


RECLAIM_LOCK_NAME = ".rollout-stage-reclaim.lock"
"""In ``SHM_DIR``: held while a default stage is opened or its siblings reclaimed, so that a
sidecar never reclaims a sibling's stage while that sibling is opening it."""
RECLAIM_LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def shm_stages_held(folder: Path) -> Iterator[None]:
    """For a default ``/dev/shm`` stage ``folder``: hold the node's reclaim lock (waiting up to
    :data:`RECLAIM_LOCK_WAIT_S`; a sibling reclaiming leftovers holds it for about as long as
    removing them takes). Opening a stage and reclaiming leftovers both happen under it, so a
    sidecar restarting under its old replica id either finds its folder whole, or gone (and makes
    it again), never taken by another sidecar's reclaim. Without it (it cannot be opened, or is
    held too long) the stage opens anyway, logged."""
    if not is_default_shm_stage(folder):
        yield
        return
    path = SHM_DIR / RECLAIM_LOCK_NAME
    try:
        fd = open_own_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "reclaim lock")
    except (OSError, StageError) as exc:
        log.warning("cannot open %s (%s): opening the stage without it", path, exc)
        yield
        return
    try:
        deadline = time.monotonic() + RECLAIM_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("%s held for over %.0f s: opening the stage without it", path, RECLAIM_LOCK_WAIT_S)
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def is_default_shm_stage(path: Path) -> bool:
    """Whether ``path`` is named as :func:`default_stage_dir` names a stage in /dev/shm."""
    absolute = Path(os.path.abspath(path))
    return absolute.parent == SHM_DIR and absolute.name.startswith(SHM_STAGE_PREFIX)


def reclaim_shm_leftovers(own: Path) -> None:
    """Remove the stages in /dev/shm (``rollout-stage-*``) other than ``own`` that are this
    user's, carry the marker and whose lock nobody holds: left by a sidecar killed (SIGKILL, OOM)
    and restarted under another replica id, they would hold RAM for good. Each removal is logged;
    a folder without the marker, another user's, a link, or locked, is never touched."""
    try:
        shm = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        try:
            with os.scandir(shm) as entries:
                siblings = [e.name for e in entries if e.name.startswith(SHM_STAGE_PREFIX) and e.name != own.name]
        except OSError:
            return
        for name in siblings:
            folder = SHM_DIR / name
            try:
                freed = _remove_if_unheld(shm, folder)
            except (OSError, StageError) as exc:
                log.debug("left %s in place: %s", folder, exc)
                continue
            if freed is not None:
                log.warning(
                    "removed %s (%.1f MB of /dev/shm): the stage of a sidecar that is gone (nobody holds its lock)",
                    folder,
                    freed / 1e6,
                )
    finally:
        os.close(shm)


def _remove_if_unheld(parent_fd: int, folder: Path) -> int | None:
    """Empty and remove the marked stage ``folder`` (the entry ``folder.name`` of the folder open
    as ``parent_fd``) if it is this user's and its lock can be taken; the bytes freed, or None
    when it is not a marked stage of this user's or another sidecar holds it.

    The folder is opened once, without following a link, and everything after (its owner, its
    marker, its lock, what is removed) goes through that descriptor: a folder swapped for a link
    after it was looked at (its owner may rename it) cannot turn the removal on another folder."""
    try:
        fd = os.open(folder.name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:  # a link (ELOOP), not a folder (ENOTDIR), gone, unreadable: not a stage to reclaim
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            log.debug("left %s in place: it belongs to user id %d, not to this sidecar's", folder, st.st_uid)
            return None
        if not _is_marked(folder, fd):
            return None
        lock = open_own_file(folder / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "lock", dir_fd=fd)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            freed = _empty_stage_at(fd, folder)
            _remove_folder_if_empty(parent_fd, folder.name, st)
            return freed
        finally:
            os.close(lock)
    finally:
        os.close(fd)


def bytes_under(path: Path) -> int:
    """Bytes of the files at or under ``path`` (links not followed; what vanishes meanwhile: 0)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total


def remove_entry(path: Path) -> None:
    """Remove a staged entry so that no half-deleted copy is ever seen under its own name: a
    directory is first renamed to a hidden ``.tmp-`` name (which the next start removes if this
    process dies mid-way), then deleted."""
    try:
        if path.is_dir() and not path.is_symlink():
            if not path.name.startswith(TEMP_PREFIX):
                hidden = path.with_name(f"{TEMP_PREFIX}deleting-{path.name}-{uuid.uuid4().hex[:8]}")
                os.rename(path, hidden)
                path = hidden
            remove_tree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
