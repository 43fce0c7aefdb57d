"""Acknowledgement files: ``<root>/acks/<replica-id>.json``, replaced atomically.

A trainer can wait for N replicas through shared storage alone by reading these
files (see :func:`read_acks`); ``heartbeat`` tells a live replica from a dead one.

``acks`` lives in the untrusted root, so the writer never follows a symlink there (a
symlinked ``acks`` would redirect the sidecar's writes outside the root): the directory
and the files are opened relative to directory descriptors with ``O_NOFOLLOW``. A writer
killed between writing its temporary file and renaming it leaves ``.tmp-<replica>-*``,
which that replica's next start removes (and anyone's such files once they are old).
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from ..checkpoint_format import ACKS_DIR, TEMP_PREFIX
from ..protocol import MAX_ACK_BYTES, ReplicaReport, atomic_replace, is_owned_temp, read_acks  # noqa: F401 (read_acks: re-export)
from ..shown_values import shown_text

STALE_TEMP_S = 3600.0
MAX_CLEANUP_ENTRIES = 10_000
"""Entries of the acks folder a start-up clean-up looks at."""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class AckWriter:
    """Writes one replica's ack file under ``<root>/acks`` without following symlinks."""

    def __init__(self, root: Path, replica_id: str):
        self.root = Path(root)
        self.replica_id = replica_id

    def _open_dir(self) -> int:
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                os.mkdir(ACKS_DIR, 0o755, dir_fd=root_fd)
            except FileExistsError:
                pass
            try:
                return os.open(ACKS_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | _NOFOLLOW, dir_fd=root_fd)
            except OSError as exc:
                st = os.lstat(ACKS_DIR, dir_fd=root_fd)
                if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                    raise OSError(
                        exc.errno,
                        f"{self.root / ACKS_DIR} is not a plain directory (a"
                        " symlink or a file); remove it so acks stay inside the root",
                    ) from None
                raise
        finally:
            os.close(root_fd)

    def write(self, report: ReplicaReport) -> None:
        """Atomically replace this replica's ack file with ``report`` and a fresh heartbeat.

        A report that would not fit what readers read (:data:`MAX_ACK_BYTES`) is written with its
        ``last_error`` and ``fatal`` messages cut short: an ack readers skip counts the replica as dead."""
        fields = report.to_dict()
        if len(json.dumps(fields)) > MAX_ACK_BYTES - 256:
            for name in ("last_error", "fatal"):
                error = fields.get(name)
                if isinstance(error, dict):
                    fields[name] = {**error, "message": shown_text(error.get("message"))}
        self.write_fields(fields)

    def write_fields(self, fields: dict[str, Any]) -> None:
        """Write report fields as they are (tools and tests may leave some out)."""
        data = json.dumps(dict(fields, replica_id=self.replica_id, heartbeat=time.time()), sort_keys=True).encode()
        dir_fd = self._open_dir()
        try:
            atomic_replace(dir_fd, f"{self.replica_id}.json", data, owner=self.replica_id)
        finally:
            os.close(dir_fd)

    def clean_up_leftovers(self, budget_s: float = 1.0) -> int:
        """Remove this replica's temporary files (and anyone's older than an hour), for at most
        ``budget_s`` and :data:`MAX_CLEANUP_ENTRIES` entries: a folder flooded with names must not
        hold the root's looks (the rest waits for the next start, or anyone's an hour later)."""
        try:
            dir_fd = self._open_dir()
        except OSError:
            return 0
        removed = 0
        now = time.time()
        stop_at = time.monotonic() + budget_s
        try:
            with os.scandir(dir_fd) as entries:
                names = [e.name for _, e in zip(range(MAX_CLEANUP_ENTRIES), entries)]
            for name in names:
                if time.monotonic() > stop_at:
                    break
                if not name.startswith(TEMP_PREFIX):
                    continue
                try:
                    st = os.lstat(name, dir_fd=dir_fd)
                    if is_owned_temp(name, self.replica_id) or now - st.st_mtime > STALE_TEMP_S:
                        os.unlink(name, dir_fd=dir_fd)
                        removed += 1
                except OSError:
                    continue
        finally:
            os.close(dir_fd)
        return removed


def write_ack(root: Path, replica_id: str, payload: dict[str, Any]) -> Path:
    """Write one ack file from a dict of report fields (for tools and tests)."""
    AckWriter(Path(root), replica_id).write_fields(payload)
    return Path(root) / ACKS_DIR / f"{replica_id}.json"
