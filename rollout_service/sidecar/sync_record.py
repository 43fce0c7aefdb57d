"""What one finished sync reports (``/status`` ``last_sync``), shared by full, delta and adapter loads."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    load_started_at: float | None = None
    """When the load began, by this host's clock (Unix seconds): for a full or delta step the
    ``/update_weights_from_disk`` call; for an adapter, its load with the looks around it that
    ``load_s`` times too (settling, the adapters SGLang lists, the confirmation)."""
    load_ended_at: float | None = None
    """``load_started_at`` + ``load_s``: for a full or delta step, when SGLang answered the load
    call, so the interval in which SGLang loaded (what a pause measurement reads probes against)."""

    @classmethod
    def ended_now(
        cls,
        *,
        published: float | None,
        created_at: float | None = None,
        detected: float,
        validate_s: float,
        load_s: float,
        load_started_at: float | None = None,
        **fields: Any,
    ) -> SyncRecord:
        """The record of a sync that ends now; its publish-time latencies from ``published`` (the
        step's rename, :func:`published_at`; None when they mean nothing: a step loaded before),
        made exact with the manifest's ``created_at`` (see :func:`rename_time`), and ``detected``;
        the load's interval from ``load_started_at`` (``time.time()`` as the load was sent) and
        ``load_s``."""
        finished = time.time()
        if published is not None and created_at is not None:
            published = rename_time(published, created_at)
        if published is not None:  # a file server's clock ahead of this host's: not published after it was seen
            published = min(published, detected)
        return cls(
            detect_s=None if published is None else max(0.0, detected - published),
            validate_s=validate_s,
            load_s=load_s,
            load_started_at=load_started_at,
            load_ended_at=None if load_started_at is None else load_started_at + load_s,
            total_s=None if published is None else finished - published,
            finished_at=finished,
            **fields,
        )


def published_at(path: Path) -> float | None:
    """When the step directory was renamed into place (its ctime changes on rename); a link
    named like a step is not followed."""
    try:
        return os.lstat(path).st_ctime
    except OSError:
        return None


def rename_time(ctime: float, created_at: float) -> float:
    """The rename's time from the step directory's ``ctime`` and its manifest's ``created_at``.

    File systems that keep whole seconds only (sshfs: SFTP carries no sub-second times) would
    make every latency up to a second too long; there ``created_at`` (the writer's clock, just
    before its rename) is taken when it falls within that second."""
    if ctime != int(ctime):
        return ctime
    return created_at if ctime <= created_at < ctime + 1 else ctime
