"""The stage's folder: which entries are the stage's own, its marker and lock, and reclaiming
the folders of stages nobody runs any more.

A stage touches only the names it makes: its copies (``step-XXXXXXXX-<fingerprint>``), its
hidden ``.tmp-*`` work, ``reference.json``, ``.lock`` and the marker ``.rollout-stage``. The
marker says a folder is a stage: a folder that holds anything else and no marker (``$HOME``,
``/dev/shm`` itself, the folder around the checkpoint root) is refused, never cleaned; one an
older version staged into (only such names) is adopted. The stage's own files are opened without
blocking and must be regular files (a FIFO left at ``.lock`` cannot hang the sidecar). A sidecar
killed (SIGKILL, OOM) leaves its stage in ``/dev/shm``, which is RAM: :func:`reclaim_shm_leftovers`
removes the marked ``/dev/shm/rollout-stage-*`` folders whose lock nobody holds.
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
from ..tree_removal import remove_tree
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


class StageError(RuntimeError):
    """The stage itself failed (no room, not writable, not a stage folder): not the checkpoint's fault."""


def is_work_name(name: str) -> bool:
    """A name the stage gives its copies and its hidden work (what pruning may remove)."""
    return bool(COPY_NAME_RE.match(name)) or name.startswith(TEMP_PREFIX)


def _is_stage_name(name: str) -> bool:
    """A name the stage makes (or a file system's own): all a folder may hold to be adopted."""
    return is_work_name(name) or name in (LOCK_NAME, REFERENCE_NAME, MARKER_NAME) or name in LEFT_ALONE_NAMES


def _is_marked(folder: Path) -> bool:
    """Whether ``folder`` carries the stage marker (a regular file, not followed if a link)."""
    try:
        return stat.S_ISREG(os.lstat(folder / MARKER_NAME).st_mode)
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


def check_owner(folder: Path) -> None:
    """``StageError`` unless ``folder`` belongs to this user (or to root, as a Kubernetes emptyDir
    does). In a folder every user may write to (``/dev/shm``), another user could make the stage
    folder first, under its predictable name, and then swap the verified copies SGLang loads."""
    try:
        owner = os.stat(folder).st_uid
    except OSError as exc:
        raise StageError(
            f"cannot look at the stage directory {folder}: {exc.strerror}; pass another --stage-dir"
        ) from None
    if owner not in (os.geteuid(), 0):
        raise StageError(
            f"the stage directory {folder} belongs to user id {owner}, not to this sidecar's ({os.geteuid()}):"
            " whoever owns it could replace the verified copies SGLang loads. Remove it (if nobody should"
            " have made it) or pass a --stage-dir of this user's"
        )


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


def open_own_file(path: Path, flags: int, what: str) -> int:
    """A descriptor of the stage's own file ``path`` (its lock, its marker), opened with
    ``O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC`` so that a FIFO or a device left at its name cannot
    block the sidecar. ``StageError`` naming it unless it is a regular file; other open errors
    stay ``OSError`` (``FileNotFoundError``: the folder is gone)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        raise
    except OSError as exc:
        try:
            mode = os.lstat(path).st_mode
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
    bytes freed."""
    freed = 0
    for entry in list(folder.iterdir()):
        if is_work_name(entry.name) or entry.name in (REFERENCE_NAME, MARKER_NAME):
            freed += bytes_under(entry)
            remove_entry(entry)
    (folder / LOCK_NAME).unlink()
    with contextlib.suppress(OSError):  # not empty: someone else's entries; leave them
        folder.rmdir()
    return freed


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
    """Remove the stages in /dev/shm (``rollout-stage-*``) other than ``own`` that carry the
    marker and whose lock nobody holds: left by a sidecar killed (SIGKILL, OOM) and restarted
    under another replica id, they would hold RAM for good. Each removal is logged; a folder
    without the marker, or locked, is never touched."""
    try:
        siblings = [p for p in SHM_DIR.iterdir() if p.name.startswith(SHM_STAGE_PREFIX) and p.name != own.name]
    except OSError:
        return
    for folder in siblings:
        try:
            freed = _remove_if_unheld(folder)
        except (OSError, StageError) as exc:
            log.debug("left %s in place: %s", folder, exc)
            continue
        if freed is not None:
            log.warning(
                "removed %s (%.1f MB of /dev/shm): the stage of a sidecar that is gone (nobody holds its lock)",
                folder,
                freed / 1e6,
            )


def _remove_if_unheld(folder: Path) -> int | None:
    """Empty and remove the marked stage ``folder`` if its lock can be taken; the bytes freed,
    or None when it is not a marked stage or another sidecar holds it."""
    if folder.is_symlink() or not folder.is_dir() or not _is_marked(folder):
        return None
    lock = open_own_file(folder / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "lock")
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        return empty_stage(folder)
    finally:
        os.close(lock)


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
