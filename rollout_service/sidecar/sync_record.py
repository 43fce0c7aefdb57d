"""What one finished sync reports (``/status`` ``last_sync``), shared by full, delta and adapter loads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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


def published_at(path: Path) -> float | None:
    """When the step directory was renamed into place (its ctime changes on rename)."""
    try:
        return path.stat().st_ctime
    except OSError:
        return None
