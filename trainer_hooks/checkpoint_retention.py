"""Deleting old checkpoints from the shared root without pulling one out from under a replica.

:func:`prune_checkpoints` keeps the newest ``keep`` published checkpoints plus every step in
``protected`` (what live replicas serve or are loading). A deleted step first disappears by an
atomic rename into a hidden ``.tmp-`` name, so a sidecar never sees a half-deleted checkpoint;
the hidden copy is then removed (or, if that fails, left to ``cleanup_stale_temp_dirs``).

A ``delta`` step needs every step of its chain back to its full step (a late joiner replays
them): those are kept as long as a kept step needs them (:func:`chain_dependencies`).

Anything may appear under the root, so only *published* checkpoints count
(:func:`list_step_entries`): a real folder named ``step-XXXXXXXX`` that holds a
``manifest.json`` file. A file, a link or a folder without a manifest under such a name is
logged once and otherwise ignored: it takes no ``keep`` slot, steers no version number, and is
never deleted (it is not ours to delete). A folder whose manifest is not its step's
(:func:`newest_checkpoints`) takes no slot and steers no number either.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout_service.checkpoint_format import (
    MANIFEST_NAME,
    TEMP_PREFIX,
    CheckpointError,
    Manifest,
    step_dir_name,
)
from rollout_service.checkpoint_reader import PublishedCheckpoint, list_checkpoints
from rollout_service.checkpoint_writer import is_published_dir
from rollout_service.tree_removal import remove_tree

log = logging.getLogger(__name__)

UNREADABLE_NOW = frozenset({"unreadable", "validation_timeout", "too_large"})
"""Why a manifest could not be read that does not show it is no manifest: the storage failed
(EIO, a stale NFS handle), it took too long, or it is larger than readers read (a delta of a
model with very many tensors, written before the writer refused those). Such a step may be a
real checkpoint, maybe a delta whose chain is needed: it counts as its step's, and nothing its
chain might need is deleted."""


@dataclass(frozen=True)
class StepEntries:
    """The ``step-*`` names under a root, sorted into checkpoints and the rest (step order)."""

    published: list[PublishedCheckpoint]
    """Real folders (not links) holding a ``manifest.json`` file: what retention and numbering count."""
    odd: list[PublishedCheckpoint]
    """Files, links and folders without a manifest that only carry a step's name."""


def list_step_entries(root: Path | str) -> StepEntries:
    """The ``step-*`` entries under ``root``, published checkpoints apart from odd entries.

    Looked at with ``lstat`` only (a link is never followed out of the root). Odd entries are
    logged once per root while they stay the same, not at every publish.
    """
    root = Path(root).absolute()  # (a relative step path would be read relative to the root again)
    published: list[PublishedCheckpoint] = []
    odd: list[PublishedCheckpoint] = []
    for ckpt in list_checkpoints(root):
        is_published = is_published_dir(ckpt.path)
        if is_published is not None:
            (published if is_published else odd).append(ckpt)
    warn_once(
        root,
        "odd",
        [c.path.name for c in odd],
        "entries named like checkpoints under %s are not published checkpoints (a file, a link, or a"
        " folder without manifest.json): %s; retention and version numbering ignore them and never"
        " delete them: remove them if nothing needs them",
    )
    return StepEntries(published=published, odd=odd)


_warned: dict[tuple[str, str], frozenset[str]] = {}
_warned_lock = threading.Lock()
MAX_NAMED = 5
"""Odd entries named in one warning (the rest are counted)."""


def warn_once(root: Path, what: str, names: list[str], message: str) -> None:
    """Log ``message % (root, names)`` when the ``what`` names under ``root`` differ from those last
    logged (a stray entry is reported once, not at every publish); nothing when there are none."""
    key, now = (str(root), what), frozenset(names)
    with _warned_lock:
        if _warned.get(key, frozenset()) == now:
            return
        _warned[key] = now
    if names:
        shown = ", ".join(sorted(names)[:MAX_NAMED])
        more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
        log.warning(message, root, shown + more)


Remover = Callable[[Path, str], None]
"""Removes the hidden copy (first argument) of a deleted step (named by the second)."""


def prune_checkpoints(
    root: Path | str,
    keep: int,
    protected: set[int] | frozenset[int] = frozenset(),
    *,
    remove: Remover | None = None,
) -> list[int]:
    """Delete all but the newest ``keep`` checkpoints under ``root``, sparing ``protected`` steps.

    Each deleted step leaves the root's view at once (renamed to a hidden name); its files are
    then removed by ``remove`` (default: here and now). A trainer hands them to a thread of their
    own (:class:`HiddenRemover`): removing a tree of a million stray files on NFS can take longer
    than the sync's bound, which must not count as a root that does not answer.

    Returns the deleted steps, oldest first.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest checkpoint is what replicas load), got {keep}")
    root = Path(root).absolute()
    found = list_step_entries(root).published
    newest = newest_checkpoints(root, found, keep)
    if len(newest) < keep:
        return []  # not more than ``keep`` checkpoints yet
    kept = {c.step for c in newest} | set(protected)
    try:
        needed = kept | chain_dependencies(root, kept)
    except CheckpointError as exc:
        log.warning(
            "not deleting old checkpoints under %s this time: %s (retention deletes nothing it cannot"
            " prove unneeded; it tries again at the next publish)",
            root,
            exc,
        )
        return []
    doomed = [c for c in found if c.step < newest[-1].step and c.step not in needed]
    removed: list[int] = []
    for ckpt in doomed:
        hidden = root / f"{TEMP_PREFIX}deleting-{ckpt.path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(ckpt.path, hidden)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("could not delete old checkpoint %s: %s", ckpt.path, exc)
            continue
        removed.append(ckpt.step)  # gone from the root's view, whatever happens to its files
        (remove or remove_hidden)(hidden, ckpt.path.name)
    if removed:
        log.info(
            "deleted old checkpoint step(s) %s under %s (keeping %d, protected %s)",
            removed,
            root,
            keep,
            sorted(needed - {c.step for c in newest}),
        )
    return removed


def newest_checkpoints(root: Path, published: list[PublishedCheckpoint], count: int) -> list[PublishedCheckpoint]:
    """The ``count`` newest of ``published`` whose manifest is their step's (of any run), newest first.

    One whose manifest cannot be read now (EIO, a stale NFS handle, larger than readers read:
    :data:`UNREADABLE_NOW`) counts too: it may be a real checkpoint. A manifest that is no
    manifest, or names another step, was never published there: passed over (logged once), so
    that it takes no ``keep`` slot and steers no numbering.
    """
    root = Path(root).absolute()
    newest: list[PublishedCheckpoint] = []
    passed: list[str] = []
    for ckpt in reversed(published):
        if len(newest) >= count:
            break
        if _names_its_step(root, ckpt):
            newest.append(ckpt)
        else:
            passed.append(ckpt.path.name)
    warn_once(
        root,
        "not a manifest of its step",
        passed,
        "folders under %s hold a manifest.json that is not the manifest of their step: %s; retention"
        " and version numbering pass over them (remove them if nothing needs them)",
    )
    return newest


MAX_PASSED_OVER = 100_000
"""Folders remembered as not holding their step's manifest (past it the memory starts afresh)."""
_passed_over: dict[tuple[str, str], tuple[int, ...]] = {}
_passed_over_lock = threading.Lock()


def _names_its_step(root: Path, ckpt: PublishedCheckpoint) -> bool:
    """Whether ``ckpt``'s manifest is its step's, or cannot be read now (it may be).

    A folder found not to be is remembered with its manifest's identity (``lstat``: inode, size,
    times), so the next publish spends one ``lstat`` on it, not a read and a parse: a stray
    process that left thousands of such folders above the newest step must not turn every
    sync's numbering into thousands of manifest reads on shared storage."""
    key = (str(root), ckpt.path.name)
    identity = _identity(ckpt.path / MANIFEST_NAME)
    with _passed_over_lock:
        if identity is not None and _passed_over.get(key) == identity:
            return False
    try:
        if Manifest.load(ckpt.path, root=root).step == ckpt.step:
            return True
    except CheckpointError as exc:
        if exc.reason in UNREADABLE_NOW:
            return True
    except ValueError:
        pass
    if identity is not None:
        with _passed_over_lock:
            if len(_passed_over) >= MAX_PASSED_OVER:
                _passed_over.clear()
            _passed_over[key] = identity
    return False


def _identity(path: Path) -> tuple[int, ...] | None:
    """What changes when the file at ``path`` is replaced or rewritten (None: not a file now)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


MAX_ASKED = 10_000
"""Paths a :class:`HiddenRemover` keeps track of (past it, more are not taken: a root flooded
with leftovers is not held in memory)."""
REMOVER_IDLE_S = 5.0
"""A :class:`HiddenRemover`'s thread ends after this long with nothing to remove."""


class HiddenRemover:
    """Removes deleted steps' hidden copies on a thread of its own, one at a time, in order.

    A removal that hangs (a hung mount) holds only this thread; the copies queued behind it stay
    under their hidden names, which a later trainer removes once they are an hour old."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Path, str]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._left = 0
        """Copies queued or being removed."""
        self._asked: set[Path] = set()
        """Paths queued, being removed, or whose removal failed (logged once: not asked again)."""

    def __call__(self, hidden: Path, name: str) -> None:
        with self._lock:
            if hidden in self._asked or len(self._asked) >= MAX_ASKED:
                return
            self._asked.add(hidden)
            self._left += 1
            self._queue.put((hidden, name))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-remover", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                hidden, name = self._queue.get(timeout=REMOVER_IDLE_S)
            except queue.Empty:
                with self._lock:  # (a copy put meanwhile finds no thread, and starts one)
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            removed = False
            try:
                removed = remove_hidden(hidden, name)
            finally:
                with self._lock:
                    self._left -= 1
                    if removed:
                        self._asked.discard(hidden)
                    self._lock.notify_all()

    def join(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the removals asked for so far; the number still left."""
        with self._lock:
            self._lock.wait_for(lambda: self._left == 0, timeout_s)
            return self._left


def remove_hidden(hidden: Path, name: str) -> bool:
    """Remove the hidden copy of a deleted step (or a killed writer's leftover); a failure (a
    folder someone made read-only, a tree too deep to walk) is logged with what to do, and
    retention goes on with the next step. False when it failed."""
    try:
        remove_tree(hidden)
    except FileNotFoundError:
        pass
    except Exception as exc:  # any error from a tree a stray process shaped: never the trainer's end
        log.warning(
            "removing the files of %s failed: %s: %s; %s takes space until removed: remove it by hand"
            " (give yourself write permission inside it first if needed); a trainer started after it is"
            " an hour old removes it too",
            name,
            type(exc).__name__,
            exc,
            hidden,
        )
        return False
    return True


def chain_dependencies(root: Path, steps: set[int]) -> set[int]:
    """Every step the delta steps among ``steps`` are built on, back to their full steps.

    A step that is gone, that is not a published checkpoint (a file, a link, a folder without
    manifest), or whose manifest is not a manifest (no one can apply it), protects nothing more.
    A manifest that cannot be read now (EIO, EACCES, a stale NFS handle, larger than readers read:
    :data:`UNREADABLE_NOW`) might be a delta: that raises its ``CheckpointError``, so that nothing
    its chain needs is deleted on a guess.
    """
    root = Path(root).absolute()
    needed: set[int] = set()
    todo = sorted(steps)
    seen: set[int] = set()
    while todo:
        step = todo.pop()
        if step in seen:
            continue
        seen.add(step)
        try:
            path = root / step_dir_name(step)
            if not is_published_dir(path):
                continue
            manifest = Manifest.load(path, root=root)
        except CheckpointError as exc:
            if exc.reason in UNREADABLE_NOW:
                raise
            continue
        except ValueError:
            continue
        if manifest.kind == "delta" and manifest.delta is not None:
            needed.add(manifest.delta.base_step)
            todo.append(manifest.delta.base_step)
    return needed
