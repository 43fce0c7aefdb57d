"""File-system watching of the checkpoint root with watchdog.

Only the completion signals matter: a ``step-*`` directory appearing (the
writer's atomic rename, the one completion signal) or disappearing. Everything else a writer
does happens inside hidden ``.tmp-*`` directories and is ignored. inotify by
default; a polling observer for NFS and other shared file systems whose changes
made on another machine raise no inotify events.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.polling import PollingObserver

from ..checkpoint_format import parse_step_dir_name

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
"""How long stopping the watcher may take before the sidecar exits without it."""


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


class _Handler(FileSystemEventHandler):
    def __init__(self, on_change: Callable[[str], None]):
        self._on_change = on_change

    def on_any_event(self, event: FileSystemEvent) -> None:
        if is_completion_event(event):
            self._on_change(f"{event.event_type}:{os.path.basename(os.fsdecode(event.dest_path or event.src_path))}")


class CheckpointWatcher:
    """Calls ``on_change(description)`` from a watchdog thread when a publication may have landed."""

    def __init__(self, root: Path, on_change: Callable[[str], None], poll_interval_s: float | None = None):
        self.root = Path(root)
        self.mode = "inotify" if poll_interval_s is None else "polling"
        self._observer = Observer() if poll_interval_s is None else PollingObserver(timeout=poll_interval_s)
        self._observer.schedule(_Handler(on_change), str(self.root), recursive=False)

    def start(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Start watching, waiting at most ``timeout_s``: the polling observer lists the root
        before it starts, which a hung network file system never answers. It goes on starting in
        the background meanwhile; the sync loop looks at the root at every pass anyway."""
        starter = threading.Thread(target=self._observer.start, name="watcher-start", daemon=True)
        starter.start()
        starter.join(timeout_s)
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
        self._observer.stop()
        try:
            self._observer.join()
        except RuntimeError:  # it never started (its first listing is still blocked)
            pass
