"""File-system watching of the checkpoint root with watchdog.

Only the completion signals matter: a ``step-*`` directory appearing (the
writer's atomic rename, the one completion signal) or disappearing. Everything else a writer
does happens inside hidden ``.tmp-*`` directories and is ignored. inotify by
default; a polling observer for NFS and other shared file systems whose changes
made on another machine raise no inotify events.

The polling observer keeps a snapshot of what it lists and stats every entry it keeps, at every
poll. Watchdog's default lists the whole root, so a stray process that drops a million files
there would cost the sidecar a stat per file per poll and a snapshot of them all (about 0.8 GB).
It is given :func:`step_entries` instead: only ``step-*`` names, read no further than
:data:`~rollout_service.checkpoint_reader.MAX_ROOT_ENTRIES` entries (past which the sync
loop's own listing turns the replica unready, ``too_many_entries``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver
from watchdog.observers.polling import PollingObserverVFS

from ..checkpoint_format import parse_step_dir_name
from ..checkpoint_reader import MAX_ROOT_ENTRIES

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
"""How long stopping the watcher may take before the sidecar exits without it."""
INOTIFY_EXHAUSTED = (errno.EMFILE, errno.ENOSPC)
"""inotify's "instance limit reached" and "watch limit reached" (a busy Kubernetes node's usual
state: 128 instances per user by default), after which the watcher polls instead."""
INOTIFY_FALLBACK_POLL_S = 1.0
"""The polling period when inotify is out of instances or watches."""
WATCH_CHECK_S = 5.0
"""How often the watcher checks that it still watches the root: a root removed and made again
(a reused root, a volume remounted) ends watchdog's watch of it without a word."""


def is_completion_event(event: FileSystemEvent) -> bool:
    """True for events that can mean "a checkpoint was published"."""
    for path in (event.src_path, getattr(event, "dest_path", "")):
        if not path:
            continue
        name = os.path.basename(os.fsdecode(path))
        if parse_step_dir_name(name) is not None:
            # "deleted": a served step that disappears (a reused root) must be noticed too.
            return event.event_type in ("created", "moved", "modified", "deleted")
    return False


def step_entries(path: str | None) -> Iterator[os.DirEntry[str]]:
    """The ``step-*`` entries of a directory, for the polling observer's snapshot: the rest of
    it is never stat'ed nor kept, and no more than ``MAX_ROOT_ENTRIES`` entries are read."""
    with os.scandir(path) as entries:
        for i, entry in enumerate(entries):
            if i >= MAX_ROOT_ENTRIES:
                return
            if parse_step_dir_name(entry.name) is not None:
                yield entry


def _stat_root_or_entry(path: str) -> os.stat_result:
    """The root as configured (it may be a link); an entry itself, never what a link named like
    a step points to (which may be a file system that does not answer)."""
    return os.lstat(path) if parse_step_dir_name(os.path.basename(path)) is not None else os.stat(path)


class _Handler(FileSystemEventHandler):
    def __init__(self, on_change: Callable[[str], None]):
        self._on_change = on_change

    def on_any_event(self, event: FileSystemEvent) -> None:
        if is_completion_event(event):
            self._on_change(f"{event.event_type}:{os.path.basename(os.fsdecode(event.dest_path or event.src_path))}")


class CheckpointWatcher:
    """Calls ``on_change(description)`` from a watchdog thread when a publication may have landed."""

    def __init__(
        self,
        root: Path,
        on_change: Callable[[str], None],
        poll_interval_s: float | None = None,
        on_mode: Callable[[str], None] | None = None,
    ):
        self.root = Path(root)
        self.mode = "inotify" if poll_interval_s is None else "polling"
        self._on_change = on_change
        self._on_mode = on_mode or (lambda mode: None)
        self._poll_interval_s = poll_interval_s
        self._observer: BaseObserver | None = None
        self._watched: tuple[int, int] | None = None
        """The root's (device, inode) when its watch started."""
        self._start_error: BaseException | None = None
        self._lock = threading.Lock()
        self._halt = threading.Event()
        """Set by :meth:`stop` (under ``_lock``): an observer whose start was still blocked then
        never starts, and the guard ends."""

    def start(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Start watching, waiting at most ``timeout_s``: watchdog looks at the root when a watch
        is scheduled, and the polling observer lists it before it starts, which a hung network
        file system never answers. It goes on starting in the background meanwhile; the sync loop
        looks at the root at every pass anyway."""
        starter = threading.Thread(target=self._start, name="watcher-start", daemon=True)
        starter.start()
        starter.join(timeout_s)
        if self._start_error is not None:
            raise self._start_error
        guard = threading.Thread(target=self._guard, args=(starter,), name="watcher-guard", daemon=True)
        guard.start()
        if starter.is_alive():
            log.warning(
                "the %s watcher of %s has not started within %g s (its file system does not answer);"
                " new checkpoints are found by the sync loop's own look at every pass meanwhile",
                self.mode,
                self.root,
                timeout_s,
            )
        else:
            log.info("watching %s with %s", self.root, self.mode)

    def _start(self) -> None:
        try:
            self._start_watching()
        except Exception as exc:  # raised by start() when it comes in time, else logged here
            self._start_error = exc
            log.error("cannot watch %s: %s (the sync loop still looks at every pass)", self.root, exc)

    def _start_watching(self) -> bool:
        """Start an observer of the mode asked for, or polling when inotify is out of instances;
        False when :meth:`stop` came first (nothing started)."""
        try:
            if not self._start_observer(self._poll_interval_s):
                return False
            mode = "inotify" if self._poll_interval_s is None else "polling"
        except OSError as exc:
            if self._poll_interval_s is not None or exc.errno not in INOTIFY_EXHAUSTED:
                raise
            log.warning(
                "inotify cannot watch %s (%s: raise the fs.inotify.max_user_instances or"
                " max_user_watches sysctl, or pass --poll); polling it every %g s instead",
                self.root,
                exc.strerror or exc,
                INOTIFY_FALLBACK_POLL_S,
            )
            mode = f"polling (inotify: {exc.strerror or exc})"
            if not self._start_observer(INOTIFY_FALLBACK_POLL_S):
                return False
        if mode != self.mode:
            self.mode = mode
            self._on_mode(mode)
        return True

    def _guard(self, starter: threading.Thread) -> None:
        """(Its own thread.) Every :data:`WATCH_CHECK_S`: when the watch ended (the root removed,
        or replaced by another folder), say so and watch the root anew once it is there again.
        Meanwhile the sync loop's own look at every pass still finds new checkpoints."""
        while not self._halt.wait(WATCH_CHECK_S):
            if starter.is_alive():  # the first start still waits on the root
                continue
            with self._lock:
                observer = self._observer
            if observer is not None:
                lost = self._watch_lost(observer)
                if lost is None:
                    continue
                log.warning(
                    "the %s watcher of %s stopped watching it (%s); watching it anew", self.mode, self.root, lost
                )
                with self._lock:
                    self._observer = None
                threading.Thread(target=_stop_observer, args=(observer,), name="watcher-stop", daemon=True).start()
            try:
                if not self._start_watching():
                    return  # stopped meanwhile
            except OSError as exc:
                log.debug("cannot watch %s again yet: %s", self.root, exc)
                continue
            log.info("watching %s again with %s", self.root, self.mode)
            self._on_change("watch:anew")  # a step published while nothing watched: the loop looks

    def _watch_lost(self, observer: BaseObserver) -> str | None:
        """Why ``observer`` no longer watches the root; None while it does."""
        if not observer.is_alive() or not all(emitter.is_alive() for emitter in list(observer.emitters)):
            return "its watch ended: the root was removed or unmounted"
        try:
            st = os.stat(self.root)
        except OSError:
            return None  # gone, or not answering: nothing else to watch now (its watch ends, or ended)
        if (st.st_dev, st.st_ino) != self._watched:
            return "the root was replaced by another folder"
        return None

    def _start_observer(self, poll_interval_s: float | None) -> bool:
        observer = (
            Observer()
            if poll_interval_s is None
            else PollingObserverVFS(_stat_root_or_entry, step_entries, polling_interval=poll_interval_s)
        )
        try:
            st = os.stat(self.root)
            observer.schedule(_Handler(self._on_change), str(self.root), recursive=False)
            with self._lock:
                if self._halt.is_set():  # stopped while the root kept this start waiting
                    observer.stop()
                    return False
                observer.start()
                self._observer, self._watched = observer, (st.st_dev, st.st_ino)
        except BaseException:
            # inotify's reader thread and descriptor come with the observer (out of watches, it
            # fails only here): stopped, or the fallback would keep one of the scarce instances.
            with contextlib.suppress(Exception):
                observer.stop()
            raise
        return True

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop watching, giving up after ``timeout_s``: watchdog's stop joins its polling thread
        without a bound, and that thread never returns from a listing of a hung network file
        system. It is a daemon, so it does not hold up the process's exit."""
        stopper = threading.Thread(target=self._stop_and_join, name="watcher-stop", daemon=True)
        stopper.start()
        stopper.join(timeout_s)
        if stopper.is_alive():
            log.warning(
                "the %s watcher of %s did not stop within %g s (its file system does not answer); leaving it",
                self.mode,
                self.root,
                timeout_s,
            )

    def _stop_and_join(self) -> None:
        with self._lock:
            self._halt.set()
            observer = self._observer
        if observer is None:  # never started (the root did not answer)
            return
        _stop_observer(observer)


def _stop_observer(observer: BaseObserver) -> None:
    """Stop ``observer`` and wait for its thread (unbounded: call it where that may hang)."""
    observer.stop()
    try:
        observer.join()
    except RuntimeError:  # it never started (its first listing is still blocked)
        pass
