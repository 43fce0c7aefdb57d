"""What one finished sync reports (``/status`` ``last_sync``), shared by full, delta and adapter loads."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint_format import CheckpointError, Manifest


@dataclass
class SyncRecord:
    """One finished sync, with its phase times in seconds."""

    step: int
    weight_version: str
    path: str
    detect_s: float | None
    validate_s: float
    load_s: float
    total_s: float | None
    finished_at: float
    run_id: str | None = None
    staged: bool = False
    kind: str = "full"
    """The published step's kind: full, delta (rebuilt in the stage) or adapter."""
    bytes_read: int | None = None
    """Bytes read from shared storage for this sync (None without a stage: SGLang read them)."""
    apply_s: float | None = None
    """Seconds spent copying or rebuilding the step in the stage (part of validate_s)."""
    chain_length: int = 0
    """Deltas applied for this sync (more than 1: a chain was replayed)."""

    @classmethod
    def ended_now(
        cls, *, published: float | None, detected: float, validate_s: float, load_s: float, **fields: Any
    ) -> SyncRecord:
        """The record of a sync that ends now; its publish-time latencies from ``published`` (the
        step's rename, None when they mean nothing: a step loaded before) and ``detected``."""
        finished = time.time()
        return cls(
            detect_s=None if published is None else max(0.0, detected - published),
            validate_s=validate_s,
            load_s=load_s,
            total_s=None if published is None else finished - published,
            finished_at=finished,
            **fields,
        )


def published_at(path: Path, root: Path) -> float | None:
    """When the step directory was renamed into place (its ctime changes on rename).

    File systems that keep whole seconds only (sshfs: SFTP carries no sub-second times) would
    make every latency up to a second too long; there the manifest's ``created_at`` (the
    writer's clock, just before its rename) is taken when it falls within that second."""
    try:
        st = path.stat()
    except OSError:
        return None
    if st.st_ctime_ns % 1_000_000_000:
        return st.st_ctime
    try:
        created = Manifest.load(path, root=root).created_at
    except CheckpointError:
        return st.st_ctime
    return created if st.st_ctime <= created < st.st_ctime + 1 else st.st_ctime
